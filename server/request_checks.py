"""Validation every RPC of the server shares: the swarm's proof, per-peer shares, blocks, sizes and
adapters a request names, and the largest message a session may send.

`RequestChecks` is a part of `BlockServicer` (server/handler.py): it reads the servicer's span, budget,
sessions and limits.
"""

from __future__ import annotations

from hivemind.p2p import P2PContext

from server.memory import NoCacheRoom
from swarm.wire import PEER_LIMIT_PREFIX, ErrorCode, ProtocolError


class RequestChecks:
    def _message_limit(self, batch_size: int, tokens: int) -> int:
        """The largest legitimate step: float32 hidden states and a padding mask for every position."""
        return batch_size * tokens * (self.span.hidden_size * 4 + 8) + 64 * 1024

    def _check_proof(self, proof: str, context: P2PContext) -> None:
        """In a closed swarm, the caller must prove it holds the swarm secret (bound to both peer ids)."""
        if self.swarm_secret is None:
            return
        if not self.swarm_secret.check_session_proof(proof, str(context.remote_id), self.local_peer_id):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                "this server belongs to a closed swarm: the request does not prove the swarm secret",
            )

    def _check_peer_share(self, peer: str, needed: int) -> None:
        """One peer may hold at most `max_sessions` sessions and `max_cache_fraction` of the cache."""
        held = [session for session in self.sessions.values() if session.peer == peer]
        if len(held) >= self.limits.max_sessions:
            raise NoCacheRoom(
                f"{PEER_LIMIT_PREFIX}: it already holds {len(held)} sessions, the per-peer limit"
            )
        share = int(self.budget.total_bytes * self.limits.max_cache_fraction)
        reserved = sum(session.reserved_bytes for session in held)
        if reserved + needed > share:
            raise NoCacheRoom(
                f"{PEER_LIMIT_PREFIX}: {reserved:,} bytes held + {needed:,} needed exceed the "
                f"per-peer share of {share:,} bytes"
            )

    def _check_blocks(self, start: int, end: int) -> None:
        if not self.span.start <= start < end <= self.span.end:
            raise ProtocolError(
                ErrorCode.NOT_SERVING,
                f"blocks {start}:{end} are not inside this server's span {self.span.start}:{self.span.end}",
            )

    def _check_adapter(self, name: str) -> str | None:
        """The adapter a request names ("": none), if this server holds it."""
        if not name:
            return None
        held = self.span.adapters.names if self.span.adapters is not None else ()
        if name not in held:
            raise ProtocolError(
                ErrorCode.NOT_SERVING,
                f"this server has no adapter {name!r} (it has: {', '.join(held) or 'none'})",
            )
        return name

    def _check_sizes(self, batch_size: int, length: int) -> None:
        if batch_size > self.max_batch_size:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"batch size {batch_size} exceeds the limit {self.max_batch_size}"
            )
        if length > self.max_length:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"max_length {length} exceeds the server's limit {self.max_length}"
            )
