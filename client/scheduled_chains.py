"""Sessions the scheduler routes: ask for a WS-RR route, wait until the scheduler admits the session,
check the chain against the server records, open it (and the prefill servers the scheduler planned),
and keep the scheduler's lease alive. Anything the client cannot trust or act on makes it route
locally instead (docs/security.md, "A hostile scheduler").

`ScheduledChains` is a part of `RemoteBlockSession` (client/remote.py): it uses its connection,
shape, `_open_with_prefill` and the prefill choice of `DisaggregatedPrefill`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass

from client.connection import SwarmUnavailable
from client.routing import chain_problem
from client.stream import FATAL_CODES, ServerStream
from swarm.route_request import RouteHop, RouteRequest
from swarm.wire import ErrorCode, RemoteError

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    """How the scheduler admitted a session (monotonic seconds): what WS-RR predicted, what happened."""

    scheduler_session: str
    routed_at: float
    expected_wait: float
    admitted_at: float | None = None


class ScheduledChains:
    async def _open_scheduled_chain(self, first: bool = False) -> list[ServerStream] | None:
        """The scheduler's route, opened once admitted; None: route locally instead. `first`: the
        session's first chain, whose route an SLO miss stops (`ClientOptions.accept_slo_miss`)."""
        link, options = self.connection.scheduler, self.connection.options
        candidates = await self.connection.candidates()
        rtts = {candidate.peer_id: candidate.rtt for candidate in candidates}
        request = RouteRequest(self.connection.client_id, rtts, self.shape, options.task_label or "")
        reply = await link.route(request)
        if not await _usable_reply(link, reply, "the scheduler has no route (%s): routing locally"):
            return None
        if reply.slo_miss and first:
            if not options.accept_slo_miss:
                await link.end_session(reply.session_id)
                raise SwarmUnavailable(
                    f"the scheduler expects this session to miss its latency targets: {reply.slo_reason} "
                    f"(expected wait {reply.expected_wait:.1f} s; ClientOptions(accept_slo_miss=True) waits)"
                )
            logger.warning(
                "session %s: %s; waiting anyway (accept_slo_miss)", self.session_id[:8], reply.slo_reason
            )
        admission = Admission(reply.session_id, time.monotonic(), reply.expected_wait)
        self.admission = admission
        if not reply.admitted:
            logger.info(
                "session %s waits for cache room: expected %.1f s (WS-RR)",
                self.session_id[:8],
                reply.expected_wait,
            )
        while not reply.admitted:
            if time.monotonic() - admission.routed_at > options.wait_for_room:
                await link.end_session(reply.session_id)
                raise SwarmUnavailable(
                    f"the scheduler did not admit the session within {options.wait_for_room:.0f} s"
                )
            timeout = min(max(reply.expected_wait + 1.0, 1.0), 10.0)
            reply = await link.await_admission(admission.scheduler_session, timeout)
            if not await _usable_reply(
                link, reply, "scheduler: %s; routing locally", admission.scheduler_session
            ):
                return None
        admission.admitted_at = time.monotonic()
        hops = [RouteHop.from_proto(hop) for hop in reply.chain]
        # the records this client routed with back most chains; a fresh read of the DHT (4.25 round
        # trips on netem, BENCHMARKS.md) only when they do not: a server new to it, or one that moved
        servers = self.connection.known_servers
        problem = chain_problem(hops, servers, self.connection.num_blocks)
        if problem is not None:
            servers = await self.connection.servers(refresh=True)
            problem = chain_problem(hops, servers, self.connection.num_blocks)
        if problem is not None:
            await link.end_session(admission.scheduler_session)
            link.distrust(f"routed through an impossible chain ({problem})")
            return None
        if not all(servers[hop.peer_id].role.serves("decode") for hop in hops):
            # a current scheduler never routes through one (an older one might): it takes no session
            await link.end_session(admission.scheduler_session)
            logger.info("the scheduler's route includes a prefill-only server: routing locally")
            return None
        streams = [ServerStream(hop, uuid.uuid4().hex, self.shape) for hop in hops]
        chosen: dict[int, str] = {}
        if first:  # the prompt phase: the scheduler's plan, or the client's own rule without one
            planned = [RouteHop.from_proto(hop) for hop in reply.prefill]
            chosen = (
                self._scheduled_choice(hops, planned) if reply.prefill_planned else self._choose_prefill(hops)
            )
        try:
            plan = await self._open_with_prefill(hops, streams, chosen)
        except Exception as error:
            for stream in streams:
                stream.close()
            await link.end_session(admission.scheduler_session)
            if isinstance(error, RemoteError) and error.code in FATAL_CODES:
                raise
            if isinstance(error, RemoteError) and error.code == ErrorCode.NO_CACHE_ROOM:
                self.connection.refused(error.peer, error.message)
                logger.warning("%s on the scheduler's route; routing locally", error)
            else:
                self.connection.blame(getattr(error, "peer", "") or failed_peer(streams), error)
            return None
        if first:
            self._adopt_prefill(plan, f"scheduler's plan: {'yes' if reply.prefill_planned else 'no'}")
        self._keep_alive = asyncio.ensure_future(self._renew_lease(admission.scheduler_session, reply.lease))
        logger.info(
            "session %s routed by the scheduler through %s (waited %.2f s, predicted %.2f s)",
            self.session_id[:8],
            " -> ".join(f"{s.hop.peer_id[-6:]}[{s.hop.start}:{s.hop.end}]" for s in streams),
            admission.admitted_at - admission.routed_at,
            admission.expected_wait,
        )
        return streams

    async def _renew_lease(self, scheduler_session: str, lease: float) -> None:
        while True:
            await asyncio.sleep(max(lease / 3, 0.5))
            await self.connection.scheduler.keep_alive(scheduler_session)


def failed_peer(streams: list[ServerStream]) -> str:
    """The first stream that did not finish opening or replaying is the one to blame."""
    for stream in streams:
        if not stream.healthy:
            return stream.hop.peer_id
    return streams[-1].hop.peer_id if streams else ""


def _plausible(reply) -> bool:
    """The numbers of a scheduler's route reply that the client acts on are usable."""
    return math.isfinite(reply.expected_wait) and reply.expected_wait >= 0 and 1.0 <= reply.lease <= 86400.0


async def _usable_reply(link, reply, refusal_note: str, session_id: str | None = None) -> bool:
    """Whether the client can act on the scheduler's route `reply` (None: no trusted scheduler
    answered). A refusal (`reply.error`) is logged as `refusal_note % error`; implausible numbers end
    the scheduler's session (`session_id`, by default the reply's own) and make `link` distrust it."""
    if reply is None or reply.error:
        if reply is not None:
            logger.info(refusal_note, reply.error)
        return False
    if not _plausible(reply):
        await link.end_session(reply.session_id if session_id is None else session_id)
        link.distrust(f"answered a wait of {reply.expected_wait} s and a lease of {reply.lease} s")
        return False
    return True
