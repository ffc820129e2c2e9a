"""A managed server's line to the scheduler service: find it in the DHT, ask for its span.

Only a scheduler whose record is signed by the key the operator gave (`--scheduler-key`) is
followed: anyone can announce a scheduler. After it assigned something impossible (`distrust`) it
is ignored for a while, and the server chooses its blocks itself meanwhile.

The scheduler publishes its gRPC address under `{prefix}._scheduler`; it may restart or move, and
it may be gone. So the link re-reads that record periodically (and right after any failed call),
reconnects when the address changes, bounds every call by a short timeout, and reports "no
answer" as None instead of raising: the server then keeps doing what it does (serving its span, or
choosing one itself) and asks again later. The swarm never depends on the scheduler for liveness.

Only the proto contract (`scheduler/service/proto/scheduler.proto`) is assumed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
from hivemind.dht import DHT

from scheduler.service.proto import scheduler_pb2, scheduler_pb2_grpc
from swarm.closed_swarm import SwarmSecret
from swarm.dht_records import fetch_scheduler_async

logger = logging.getLogger(__name__)

Assignment = scheduler_pb2.Assignment


class SchedulerLink:
    """One gRPC channel to the scheduler currently announced in the DHT (or none)."""

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        trusted_key: str | None,
        timeout: float = 3.0,
        refresh_period: float = 10.0,
        swarm_secret: SwarmSecret | None = None,
        distrust_for: float = 120.0,
    ):
        self.dht, self.prefix, self.trusted_key = dht, prefix, trusted_key
        self.swarm_secret, self.distrust_for = swarm_secret, distrust_for
        self._distrusted_until = -math.inf
        self.timeout = timeout  # per DHT lookup and per RPC: a dead scheduler must not stall the server
        self.refresh_period = refresh_period  # how often a working link re-reads the address anyway
        self.address: str | None = None
        self.last_error = "no scheduler announced in the DHT"  # why the last call got no answer
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._checked_at = -math.inf

    async def get_assignment(self, peer_id: str) -> Assignment | None:
        """The scheduler's answer for this server, or None when no (trusted) scheduler answers."""
        if self.trusted_key is None:
            self.last_error = "no scheduler key given (--scheduler-key)"
            return None
        if time.monotonic() < self._distrusted_until:
            return None
        address = await self._discover()
        if self._stub is None:
            return None
        metadata = self.swarm_secret.scheduler_metadata() if self.swarm_secret else None
        try:
            return await self._stub.GetAssignment(
                scheduler_pb2.AssignmentRequest(peer_id=peer_id), timeout=self.timeout, metadata=metadata
            )
        except grpc.aio.AioRpcError as error:
            self.last_error = f"scheduler at {address}: {error.code().name} {error.details() or ''}".strip()
            self._checked_at = -math.inf  # it may have moved: read its record again before the next call
            return None

    async def _discover(self) -> str | None:
        """The announced address, re-read when stale; (re)connects when it changed."""
        now = time.monotonic()
        # with no scheduler known, look every call: one that appears should be used at once
        if self.address is not None and now - self._checked_at < self.refresh_period:
            return self.address
        try:
            record = await asyncio.wait_for(
                fetch_scheduler_async(self.dht, self.prefix, self.trusted_key), self.timeout
            )
        except Exception as error:  # a slow or broken DHT: keep the channel we have, try again next call
            self.last_error = f"scheduler lookup in the DHT failed: {error or type(error).__name__}"
            return self.address
        self._checked_at = now
        address = record.address if record else None
        if address is None:
            self.last_error = "no scheduler announced in the DHT"
        if address != self.address:
            await self._connect(address)
        return self.address

    def distrust(self, reason: str) -> None:
        """The scheduler assigned something impossible: ignore it for `distrust_for` seconds."""
        self._distrusted_until = time.monotonic() + self.distrust_for
        self.last_error = f"scheduler at {self.address} distrusted: {reason}"
        logger.warning("%s; ignoring it for %.0f s", self.last_error, self.distrust_for)

    async def _connect(self, address: str | None) -> None:
        await self._close_channel()
        if address is not None:
            self._channel = grpc.aio.insecure_channel(address)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
            logger.info("scheduler announced at %s", address)
        self.address = address

    async def _close_channel(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            try:
                await channel.close(grace=None)
            except Exception as error:  # closing a broken channel must not break the caller
                logger.debug("closing the scheduler channel failed: %s", error)

    async def close(self) -> None:
        await self._close_channel()
        self.address = None
