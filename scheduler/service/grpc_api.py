"""The scheduler's gRPC API: validates requests, asks `SchedulerCore`, translates its answers.

Everything runs on one asyncio loop (the runner's), so the core needs no locks. A session waiting
for admission parks in `AwaitAdmission` on an event the runner sets when the core admits it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import grpc

from llm_swarm.scheduler.service.core import RouteRefused, SchedulerCore
from llm_swarm.scheduler.service.metrics import SchedulerMetrics
from llm_swarm.scheduler.service.request_stats import SUMMARY_KEYS
from llm_swarm.scheduler.service.slo_admission import SloPrediction
from llm_swarm.swarm.route_request import RouteRequest
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc
from llm_swarm.swarm.task_label import check_label

MAX_AWAIT_S = 30.0  # one AwaitAdmission blocks at most this long; clients call again
MAX_TOKENS = 1 << 20
MAX_RTTS = 4096  # round trips one route request may report (a client pings at most this many servers)
ID_LIMIT = 128


class SchedulerApi(pb_grpc.SchedulerServicer):
    def __init__(self, core: SchedulerCore, clock=time.monotonic, metrics: SchedulerMetrics | None = None):
        self.core, self.clock = core, clock
        self.metrics = metrics or SchedulerMetrics()
        self.status_url = ""  # set by the runner when it serves the web page
        self._admitted: dict[str, asyncio.Event] = {}

    # --- called by the runner when the core admitted sessions ---------------------------------
    def notify_admitted(self, session_ids: list[str]) -> None:
        for session_id in session_ids:
            session = self.core.session(session_id)
            if session is not None and session.admitted_at is not None:
                self.metrics.wait.observe(session.admitted_at - session.routed_at)
            event = self._admitted.get(session_id)
            if event is not None:
                event.set()

    def pump(self) -> None:
        """Expire leases and admit whoever fits now, waking their AwaitAdmission calls."""
        self.notify_admitted(self.core.tick(self.clock()))

    # --- servers ------------------------------------------------------------------------------------
    async def GetAssignment(self, request: pb.AssignmentRequest, context) -> pb.Assignment:
        await _check_id(context, request.peer_id, "peer_id")
        assignment = self.core.assignment_for(request.peer_id)
        span = assignment.span
        return pb.Assignment(
            assigned=assignment.assigned,
            start=span.start if span else -1,
            end=span.end if span else -1,
            epoch=assignment.epoch,
            policy=self.core.settings.plan.policy,
            retry_after=0.0 if assignment.assigned else 1.0,
            reason=assignment.reason,
            role=assignment.role,
        )

    # --- clients ------------------------------------------------------------------------------------
    async def Route(self, request: pb.RouteRequest, context) -> pb.RouteReply:
        await _check_id(context, request.client_id, "client_id")
        for name in ("l_in", "l_out", "batch_size", "max_length"):
            value = getattr(request, name)
            if not 1 <= value <= MAX_TOKENS:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be in 1..{MAX_TOKENS}")
        try:
            check_label(request.task)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"task: {error}")
        if len(request.rtts) > MAX_RTTS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_RTTS} rtts")
        for entry in request.rtts:
            if not (math.isfinite(entry.rtt) and entry.rtt >= 0) or len(entry.peer_id) > ID_LIMIT:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rtts must be finite, >= 0 seconds")
        now = self.clock()
        try:
            decision = self.core.route(RouteRequest.from_proto(request), now)
        except RouteRefused as refusal:
            self.metrics.routes.labels(outcome="refused").inc()
            return pb.RouteReply(error=str(refusal))
        if decision is None:
            self.metrics.routes.labels(outcome="no_route").inc()
            return pb.RouteReply(error="no chain of servers reachable from this client covers the model")
        session = decision.session
        self._admitted[session.session_id] = asyncio.Event()
        if session.admitted:  # admitted on the spot by core.route
            self.metrics.wait.observe(0.0)
        self.pump()
        self.metrics.routes.labels(outcome="admitted" if session.admitted else "waiting").inc()
        if decision.slo is not None and decision.slo.miss:
            self.metrics.slo_misses.inc()
        return self._reply(session.session_id, now, decision.completion, decision.cost, decision.slo)

    async def AwaitAdmission(self, request: pb.AwaitRequest, context) -> pb.RouteReply:
        await _check_id(context, request.session_id, "session_id")
        if not math.isfinite(request.timeout) or request.timeout < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout must be finite and >= 0")
        core = self.core
        if not core.renew_lease(request.session_id, self.clock()):
            return pb.RouteReply(session_id=request.session_id, error="unknown session: route again")
        event = self._admitted.setdefault(request.session_id, asyncio.Event())
        if not core.session(request.session_id).admitted:
            try:
                await asyncio.wait_for(event.wait(), timeout=min(request.timeout, MAX_AWAIT_S))
            except TimeoutError:
                pass
        if core.session(request.session_id) is None:
            return pb.RouteReply(session_id=request.session_id, error="the session expired: route again")
        if core.end_if_unroutable(request.session_id):
            self._admitted.pop(request.session_id, None)
            return pb.RouteReply(
                session_id=request.session_id, error="a server of the chain left: route again"
            )
        return self._reply(request.session_id, self.clock())

    async def KeepAlive(self, request: pb.SessionRef, context) -> pb.LeaseReply:
        await _check_id(context, request.session_id, "session_id")
        known = self.core.renew_lease(request.session_id, self.clock())
        return pb.LeaseReply(known=known, lease=self.core.settings.lease)

    async def EndSession(self, request: pb.SessionRef, context) -> pb.EndReply:
        await _check_id(context, request.session_id, "session_id")
        known = self.core.end_session(
            request.session_id, request.ttft, request.tpot, request.tokens, now=self.clock()
        )
        if known:
            self.metrics.ended.inc()
            if request.ttft > 0:
                self.metrics.ttft.observe(request.ttft)
            if request.tokens > 0 and request.tpot > 0:
                self.metrics.tpot.observe(request.tpot)
        self._admitted.pop(request.session_id, None)
        self.pump()
        return pb.EndReply(known=known)

    def _reply(
        self,
        session_id: str,
        now: float,
        completion: float | None = None,
        cost: float = 0.0,
        slo: SloPrediction | None = None,
    ) -> pb.RouteReply:
        session = self.core.session(session_id)
        wait = self.core.expected_wait(session_id, now)
        if session.admitted:
            self._admitted.pop(session_id, None)
        return pb.RouteReply(
            session_id=session_id,
            chain=[hop.to_proto() for hop in session.hops],
            admitted=session.admitted,
            expected_wait=wait,
            expected_completion=completion if completion is not None else max(session.ends_at - now, 0.0),
            cost=cost,
            lease=self.core.settings.lease,
            epoch=self.core.epoch,
            slo_miss=bool(slo and slo.miss),
            slo_reason=slo.miss if slo else "",
            expected_ttft=slo.ttft if slo else 0.0,
            prefill=[hop.to_proto() for hop in session.prefill],
            prefill_planned=session.prefill_planned,
        )

    # --- operators ----------------------------------------------------------------------------------
    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.Status:
        return status_message({**self.core.status(self.clock()), "status_url": self.status_url})


STATUS_SCALARS = (*SUMMARY_KEYS, "status_url")


def status_message(status: dict) -> pb.Status:
    return pb.Status(
        **{name: status[name] for name in STATUS_SCALARS if name in status},
        policy=status["policy"],
        epoch=status["epoch"],
        num_blocks=status["num_blocks"],
        num_requests=status["num_requests"],
        bound=status["bound"],
        arrival_rate=status["arrival_rate"],
        servers=[pb.ServerStatus(**server) for server in status["servers"]],
        coverage=status["coverage"],
        active_sessions=status["active_sessions"],
        waiting_sessions=status["waiting_sessions"],
        uncovered_blocks=status["uncovered_blocks"],
        plan_input=json.dumps(status["plan_input"]) if status["plan_input"] is not None else "",
        plan_output=json.dumps(status["plan_output"]) if status["plan_output"] is not None else "",
        uptime=status["uptime"],
    )


async def _check_id(context, value: str, name: str) -> None:
    if not value or len(value) > ID_LIMIT:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be 1-{ID_LIMIT} characters")
