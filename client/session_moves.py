"""Moving a session off a server that leaves (it drains on SIGTERM, or moves to another span): its
cache is handed to a replacement server, or rebuilt there by replay, whichever is expected to be
faster (client/handoff_cost.py); any failure of the hand-off falls back to a replay.

`SessionMoves` is a part of `RemoteBlockSession` (client/remote.py): it uses its streams, shape,
connection and its `_open_chain`, `_catch_up` and `_replace`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from client.handoff_cost import MoveCosts, move_costs
from client.stream import ServerStream
from swarm.server_info import ServerInfo

logger = logging.getLogger(__name__)

MOVE_RETRY = 5.0  # seconds a session stays on a leaving server after no replacement was found
ALWAYS_LIMIT = 600.0  # seconds a hand-off may take when the caller asked for one whatever it costs


class SessionMoves:
    async def _move_leavers(self) -> None:
        """Every stream whose server said it is leaving goes to a replacement now, between steps."""
        index = 0
        while index < len(self.streams):
            stream = self.streams[index]
            if not (stream.leaving and stream.healthy) or time.monotonic() < stream.stay_until:
                index += 1
                continue
            try:
                replacement = await self._move_off(stream)
            except Exception as error:  # it stays there while it serves; a failover follows if it stops
                stream.stay_until = time.monotonic() + MOVE_RETRY
                logger.info(
                    "session %s: no move off leaving %s now (%s): staying, trying again in %.0f s",
                    self.session_id[:8],
                    stream.hop.peer_id[-8:],
                    error,
                    MOVE_RETRY,
                )
                index += 1
                continue
            self.streams[index : index + 1] = replacement
            index += len(replacement)

    async def _move_off(self, leaving: ServerStream) -> list[ServerStream]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        hop = leaving.hop
        source = self.connection.known_servers.get(hop.peer_id)  # its record may go once it is OFFLINE
        self.connection.ban(hop.peer_id)  # it refuses new sessions: route around it, even on stale records
        # only worth it now: where no server has room at once, the session stays a while (patient=False)
        replacement = await self._open_chain(hop.start, hop.end, cache_from=hop.peer_id, patient=False)
        how, costs = "replay", None
        policy = self.connection.options.handoff
        if len(replacement) == 1 and leaving.length > 0 and leaving.history and policy != "never":
            target = replacement[0]
            costs = self._move_costs(leaving, target, source)
            if policy == "always" or costs is None or costs.try_handoff:
                timeout = self.connection.options.request_timeout
                auto = policy == "auto" and costs is not None
                allowed = costs.replay_seconds if auto else ALWAYS_LIMIT
                try:
                    reply = await leaving.hand_off(target, target.cache_token, allowed, timeout)
                    rate = reply.bytes / max(reply.seconds, 1e-6)
                    self.connection.link_rates[(hop.peer_id, target.hop.peer_id)] = rate
                    how = "hand-off"
                except Exception as error:
                    logger.info("session %s: hand-off not done (%s): replaying", self.session_id[:8], error)
        if how == "replay":
            try:
                hop_inputs = leaving.history
                for index, stream in enumerate(replacement):
                    hop_inputs = await self._catch_up(stream, hop_inputs, last=index == len(replacement) - 1)
                for stream in replacement:
                    stream.rewind(leaving.position)
            except Exception as error:
                logger.info("session %s: replay after a leave failed (%s)", self.session_id[:8], error)
                for stream in replacement:
                    stream.close()
                return await self._replace(leaving)
        leaving.close()
        logger.info(
            "session %s: moved blocks %d:%d off leaving %s to %s by %s in %.0f ms (%d positions; "
            "estimated replay %s, hand-off %s)",
            self.session_id[:8],
            hop.start,
            hop.end,
            hop.peer_id[-8:],
            ", ".join(stream.hop.peer_id[-8:] for stream in replacement),
            how,
            (loop.time() - started) * 1e3,
            leaving.length,
            _seconds(costs.replay_seconds if costs else None),
            _seconds(costs.handoff_seconds if costs else None),
        )
        return replacement

    def _move_costs(
        self, leaving: ServerStream, target: ServerStream, source: ServerInfo | None
    ) -> MoveCosts | None:
        """None: the target's record is missing: try the hand-off. Without the leaving server's
        record, its cache is assumed as large per token as the target's (same model)."""
        connection = self.connection
        servers, rtts = connection.known_servers, connection.measured_rtts()
        source_peer, target_peer = leaving.hop.peer_id, target.hop.peer_id
        if target_peer not in servers:
            return None
        return move_costs(
            tokens=leaving.length,
            batch_size=self.shape.batch_size,
            hidden_size=leaving.history[0].hidden.shape[-1],
            blocks=leaving.hop.end - leaving.hop.start,
            source=source if source is not None else servers[target_peer],
            target=servers[target_peer],
            rtt_source=rtts.get(source_peer, 0.0),
            rtt_target=rtts.get(target_peer, 0.0),
            uplink_bytes_per_s=connection.options.uplink_mbps * 1e6 / 8,
            link_bytes_per_s=connection.link_rates.get((source_peer, target_peer)),
        )


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value * 1e3:.0f} ms"
