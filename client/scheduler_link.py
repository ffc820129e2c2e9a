"""The client's line to the scheduler service: found through the DHT, optional by design.

Only a scheduler whose DHT record is signed by the key the user gave (`ClientOptions.scheduler_key`)
is used; anyone can announce a scheduler. Every call returns None when the scheduler is absent or
does not answer in time; the caller then routes locally (SPEC section 1: the swarm never depends on
the scheduler for liveness). After a failure the link stays quiet for `retry_after` seconds instead
of stalling every session on a dead address, then looks the scheduler up in the DHT again (a
restarted one has a new address); after an impossible answer (`distrust`) it stays quiet longer.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from hivemind.dht import DHT

from scheduler.service.proto import scheduler_pb2 as pb
from scheduler.service.proto import scheduler_pb2_grpc as pb_grpc
from swarm.closed_swarm import SwarmSecret
from swarm.dht_records import fetch_scheduler_async

logger = logging.getLogger(__name__)


class SchedulerLink:
    def __init__(
        self,
        dht: DHT,
        prefix: str,
        trusted_key: str,
        call_timeout: float = 3.0,
        retry_after: float = 5.0,
        distrust_for: float = 60.0,
        swarm_secret: SwarmSecret | None = None,
    ):
        self.dht, self.prefix, self.trusted_key = dht, prefix, trusted_key
        self.call_timeout, self.retry_after, self.distrust_for = call_timeout, retry_after, distrust_for
        self.swarm_secret = swarm_secret
        self._address: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerStub | None = None
        self._quiet_until = 0.0
        self._announced_absence = False

    async def _get_stub(self) -> pb_grpc.SchedulerStub | None:
        if self._stub is not None:
            return self._stub
        if time.monotonic() < self._quiet_until:
            return None
        try:
            record = await fetch_scheduler_async(self.dht, self.prefix, self.trusted_key)
        except Exception as error:  # the DHT read failed: same as no scheduler, for now
            logger.debug("looking up the scheduler failed: %s", error)
            record = None
        if record is None:
            self._quiet(None)
            return None
        self._address = record.address
        self._channel = grpc.aio.insecure_channel(self._address)
        self._stub = pb_grpc.SchedulerStub(self._channel)
        return self._stub

    def _quiet(self, error: BaseException | None) -> None:
        """Forget the channel and stay quiet for a while; say so once per outage."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            # close without waiting: we may be inside a failing call on this channel
            asyncio.ensure_future(channel.close())
        self._quiet_until = time.monotonic() + self.retry_after
        if not self._announced_absence:
            self._announced_absence = True
            if error is None:
                logger.info(
                    "no scheduler with the trusted key announced for %s: routing locally", self.prefix
                )
            else:
                logger.warning(
                    "scheduler at %s unreachable (%s): routing locally", self._address, _describe(error)
                )

    async def _call(self, method: str, request, timeout: float | None = None):
        stub = await self._get_stub()
        if stub is None:
            return None
        metadata = self.swarm_secret.scheduler_metadata() if self.swarm_secret else None
        try:
            reply = await getattr(stub, method)(
                request, timeout=timeout or self.call_timeout, metadata=metadata
            )
            if self._announced_absence:
                logger.info("scheduler at %s answers again: routing through it", self._address)
                self._announced_absence = False
            return reply
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"the scheduler rejected {method}: {error.details()}") from error
            self._quiet(error)
            return None

    def distrust(self, reason: str) -> None:
        """The scheduler said something impossible: route locally for `distrust_for` seconds."""
        logger.warning(
            "scheduler at %s %s: routing locally for %.0f s", self._address, reason, self.distrust_for
        )
        self._announced_absence = True  # said just now
        self._quiet(None)
        self._quiet_until = time.monotonic() + self.distrust_for

    # --- the API ----------------------------------------------------------------------------------
    async def route(
        self, client_id: str, rtts: dict[str, float], l_in: int, l_out: int, batch_size: int, max_length: int
    ) -> pb.RouteReply | None:
        request = pb.RouteRequest(
            client_id=client_id,
            rtts=[pb.ServerRtt(peer_id=peer, rtt=rtt) for peer, rtt in rtts.items()],
            l_in=l_in,
            l_out=l_out,
            batch_size=batch_size,
            max_length=max_length,
        )
        return await self._call("Route", request)

    async def await_admission(self, session_id: str, timeout: float) -> pb.RouteReply | None:
        request = pb.AwaitRequest(session_id=session_id, timeout=timeout)
        return await self._call("AwaitAdmission", request, timeout=timeout + self.call_timeout)

    async def keep_alive(self, session_id: str) -> bool:
        reply = await self._call("KeepAlive", pb.SessionRef(session_id=session_id))
        return bool(reply and reply.known)

    async def end_session(
        self, session_id: str, ttft: float = 0.0, tpot: float = 0.0, tokens: int = 0
    ) -> None:
        """End the session; TTFT/TPOT (seconds) and the token count feed the operators' metrics."""
        request = pb.SessionRef(session_id=session_id, ttft=ttft, tpot=tpot, tokens=tokens)
        await self._call("EndSession", request)

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
