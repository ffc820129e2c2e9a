"""The swarm's server records as a client reads them from the DHT: a first read that ends as soon as
the servers found can route the whole model (the rest follows in the background), then reads in the
background whenever the last one expired, so routing never waits on the DHT."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from hivemind.dht import DHT

from llm_swarm.client.options import ClientOptions
from llm_swarm.swarm.dht_records import (
    answered_peers_async,
    fetch_servers_async,
    fetch_servers_covering,
    finish_covering_read,
)
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.server_info import ServerInfo

logger = logging.getLogger(__name__)

# seconds after which a read is re-read before use: about a server record's lifetime in the DHT (61 s
# at the servers' default announce period), after which many of the servers it names may be gone.
# Younger reads are used as they are (a new one follows in the background): a failover after a long
# generation must not wait for a DHT read (4 round trips) to route to a server it already knows
STALE_AFTER = 60.0


class ServerRoster:
    def __init__(self, dht: DHT, prefix: str, limits: ModelLimits, options: ClientOptions, read_id: str):
        self.dht, self.prefix, self.limits, self.options = dht, prefix, limits, options
        self.read_id = read_id  # how the first read's searches are told apart (the client's id)
        self._servers: dict[str, ServerInfo] = {}
        self._fetched_at = -math.inf
        self._reading: asyncio.Future | None = None  # a background read of the server records
        self._rest_of_first_read: asyncio.Future | None = None  # what the first read left to the background
        self._first_read: asyncio.Future | None = None  # begun at start-up (`begin`)
        self._live_at_start: set[str] = set()  # peers the first read knew alive (see `live_peers`)

    def begin(self) -> asyncio.Future:
        """Start the first read (on the running loop); returns it."""
        self._first_read = asyncio.ensure_future(self._read())
        return self._first_read

    @property
    def known(self) -> dict[str, ServerInfo]:
        """The server records of the last read (no DHT access)."""
        return self._servers

    async def servers(self, refresh: bool = False) -> dict[str, ServerInfo]:
        """The swarm's server records. The first read, an explicit `refresh` (after a failure) and a
        read older than `STALE_AFTER` seconds are waited for; otherwise an expired list is
        returned as it is while a new one is read in the background, so routing never waits on the
        DHT (reading and checking a large swarm's records takes longer than choosing a chain)."""
        if self._fetched_at == -math.inf and self._first_read is not None and not self._first_read.done():
            await asyncio.wait([self._first_read])  # begun at start-up (if it fails, read again below)
        age = time.monotonic() - self._fetched_at
        if refresh or age > max(STALE_AFTER, self.options.refresh_period):
            await self._read()
        elif age > self.options.refresh_period and (self._reading is None or self._reading.done()):
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(log_failed_read)
        return self._servers

    async def live_peers(self) -> set[str]:
        """Peers that answered our DHT node, or that its p2p daemon was connected to at the first read
        (a hint that they are alive; only the first read's if asking fails). While the rest of the
        first read goes on, our DHT node is busy checking what it receives (a large swarm's records):
        the first read's set, fresh anyway, is used without asking."""
        if self._reading is not None and not self._reading.done():
            return self._live_at_start
        try:
            return await answered_peers_async(self.dht) | self._live_at_start
        except Exception as error:  # only a hint: routing works without it
            logger.debug("could not ask our DHT node which peers answered it: %s", error)
            return self._live_at_start

    async def _read(self) -> None:
        if self._fetched_at > -math.inf:
            self._servers = await fetch_servers_async(self.dht, self.prefix, self.limits)
            self._fetched_at = time.monotonic()
            return
        # the first read: nothing cached in our DHT node yet, so the first value found is as new as any;
        # it ends once the servers found can route the whole model, and the rest follows in the background
        self._servers, complete, self._live_at_start = await fetch_servers_covering(
            self.dht, self.prefix, self.limits, self.options.probe_per_block, read_id=self.read_id
        )
        self._fetched_at = time.monotonic()
        if not complete:
            self._reading = self._rest_of_first_read = asyncio.ensure_future(self._read_rest())
            self._reading.add_done_callback(log_failed_read)

    async def _read_rest(self) -> None:
        """The whole roster of the first read, once its searches still under way ended."""
        self._servers = await finish_covering_read(self.dht, self.prefix, self.limits, self.read_id)

    async def finish_first_read(self) -> bool:
        """Wait (at most `request_timeout`) for the rest of the first read when it is still under way:
        that read returned as soon as every block had a server (`fetch_servers_covering`), while a
        caller looking for a server besides its route's (a replica, an arbiter) needs the whole roster.
        True if there was a rest to wait for."""
        first = self._first_read
        if first is not None and not first.done():  # begun at start-up: the rest is known after it
            await asyncio.wait([first], timeout=self.options.request_timeout)
        rest = self._rest_of_first_read
        if rest is None or rest.done():
            return False
        await asyncio.wait([rest], timeout=self.options.request_timeout)
        return True

    def cancel(self) -> None:
        """Stop the reads in flight (the connection is closing)."""
        for task in (self._first_read, self._reading):
            if task is not None:
                task.cancel()


def log_failed_read(reading: asyncio.Future) -> None:
    if not reading.cancelled() and reading.exception() is not None:
        logger.warning("reading the swarm's server records failed: %s", reading.exception())
