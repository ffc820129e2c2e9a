"""The one line to the scheduler service that clients and managed servers share.

Only a scheduler whose DHT record (`{prefix}._scheduler`) is signed by the key the user or operator
gave is used: anyone can announce a scheduler. Every call returns None when no trusted scheduler
answers in time, and the caller then decides locally (clients route, servers choose their blocks):
the swarm never depends on the scheduler for liveness (docs/reference.md section 1). The scheduler may restart
at a new address or be gone, so the link

- looks the scheduler up in the DHT when it has none, and re-reads its record every
  `refresh_period` seconds while it works (reconnecting when the address changed);
- after a failed call forgets the channel and asks nobody for `retry_after` seconds (instead of
  stalling every caller on a dead address), then looks it up again;
- after an impossible answer (`distrust`), asks nobody for `distrust_for` seconds;
- bounds every DHT lookup and every call by `timeout`.

Only the contract in `swarm/scheduler_api/scheduler.proto` is assumed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
from hivemind.dht import DHT

from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.dht_records import fetch_scheduler_async
from llm_swarm.swarm.route_request import RouteRequest
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class SchedulerRejected(ValueError):
    """The scheduler refused a request as malformed (INVALID_ARGUMENT): a bug on our side, not an outage."""


class SchedulerLink:
    """One gRPC channel to the trusted scheduler currently announced in the DHT (or none)."""

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        trusted_key: str | None,
        *,
        timeout: float = 3.0,
        retry_after: float = 5.0,
        refresh_period: float = math.inf,
        distrust_for: float = 60.0,
        swarm_secret: SwarmSecret | None = None,
        log_outages: bool = True,
    ):
        self.dht, self.prefix, self.trusted_key = dht, prefix, trusted_key
        self.timeout, self.retry_after, self.refresh_period = timeout, retry_after, refresh_period
        self.distrust_for, self.swarm_secret = distrust_for, swarm_secret
        self.log_outages = log_outages  # clients say so once per outage; servers log it themselves
        self.address: str | None = None
        self.last_error = "no scheduler announced in the DHT"  # why the last call got no answer
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerStub | None = None
        self._checked_at = -math.inf
        self._quiet_until = -math.inf
        self._outage_said = False

    # --- the API ----------------------------------------------------------------------------------
    async def get_assignment(self, peer_id: str) -> pb.Assignment | None:
        """A managed server's span as the scheduler places it."""
        try:
            return await self._call("GetAssignment", pb.AssignmentRequest(peer_id=peer_id))
        except SchedulerRejected as error:  # a server keeps serving: same as no answer
            self.last_error = str(error)
            return None

    async def route(self, request: RouteRequest) -> pb.RouteReply | None:
        return await self._call("Route", request.to_proto())

    async def await_admission(self, session_id: str, timeout: float) -> pb.RouteReply | None:
        request = pb.AwaitRequest(session_id=session_id, timeout=timeout)
        return await self._call("AwaitAdmission", request, timeout=timeout + self.timeout)

    async def keep_alive(self, session_id: str) -> bool:
        reply = await self._call("KeepAlive", pb.SessionRef(session_id=session_id))
        return bool(reply and reply.known)

    async def end_session(
        self, session_id: str, ttft: float = 0.0, tpot: float = 0.0, tokens: int = 0
    ) -> None:
        """End the session; TTFT/TPOT (seconds) and the token count feed the operators' metrics."""
        await self._call(
            "EndSession", pb.SessionRef(session_id=session_id, ttft=ttft, tpot=tpot, tokens=tokens)
        )

    def distrust(self, reason: str) -> None:
        """The scheduler said something impossible: ask nobody for `distrust_for` seconds."""
        self.last_error = f"scheduler at {self.address} distrusted: {reason}"
        logger.warning("%s; deciding locally for %.0f s", self.last_error, self.distrust_for)
        self._outage_said = True  # said just now
        self._forget_channel()
        self._quiet_until = time.monotonic() + self.distrust_for

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    # --- the link ---------------------------------------------------------------------------------
    async def _call(self, method: str, request, timeout: float | None = None):
        """The reply, or None when no trusted scheduler answered (`last_error` says why)."""
        stub = await self._current_stub()
        if stub is None:
            return None
        metadata = self.swarm_secret.scheduler_metadata() if self.swarm_secret else None
        try:
            reply = await getattr(stub, method)(request, timeout=timeout or self.timeout, metadata=metadata)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # not our cancellation: another call's failure closed the channel this call was on
            self.last_error = f"scheduler at {self.address}: the call's channel closed under it"
            return None
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise SchedulerRejected(f"the scheduler rejected {method}: {error.details()}") from error
            self.last_error = (
                f"scheduler at {self.address}: {error.code().name} {error.details() or ''}".strip()
            )
            self._outage(f"scheduler at {self.address} unreachable ({self.last_error})", logging.WARNING)
            return None
        if self._outage_said:
            self._outage_said = False
            if self.log_outages:
                logger.info("scheduler at %s answers again", self.address)
        return reply

    async def _current_stub(self) -> pb_grpc.SchedulerStub | None:
        if self.trusted_key is None:
            self.last_error = "no scheduler key given"
            return None
        now = time.monotonic()
        if now < self._quiet_until:
            return None
        if self._stub is not None and now - self._checked_at < self.refresh_period:
            return self._stub
        try:
            record = await asyncio.wait_for(
                fetch_scheduler_async(self.dht, self.prefix, self.trusted_key), self.timeout
            )
        except Exception as error:  # a slow or broken DHT: keep the channel we have, if any
            self.last_error = f"scheduler lookup in the DHT failed: {error or type(error).__name__}"
            if self._stub is None:
                self._outage(self.last_error)
            return self._stub
        self._checked_at = now
        if record is None:
            self.last_error = "no scheduler with the trusted key announced in the DHT"
            self._outage(f"{self.last_error} for {self.prefix}")
            return None
        if record.address != self.address or self._stub is None:
            self._forget_channel()
            self.address = record.address
            self._channel = grpc.aio.insecure_channel(record.address)
            self._stub = pb_grpc.SchedulerStub(self._channel)
            logger.info("scheduler announced at %s", record.address)
        return self._stub

    def _outage(self, why: str, level: int = logging.INFO) -> None:
        """Forget the channel and ask nobody for `retry_after` seconds; say so once per outage."""
        self._forget_channel()
        self._quiet_until = time.monotonic() + self.retry_after
        if not self._outage_said:
            self._outage_said = True
            if self.log_outages:
                logger.log(level, "%s: deciding locally", why)

    def _forget_channel(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:  # closed without waiting: we may be inside a failing call on it
            asyncio.ensure_future(channel.close())
