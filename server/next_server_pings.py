"""Round trips to the servers a chain session may push to next (docs/architecture.md, "Chain sessions").

A chain session's token goes from this server's last block straight to a server holding the block
after it (`server/step_pusher.py`), so what a route costs depends on the round trip between the two,
which no client can measure. Every `next_ping_period` seconds this server pings (an info call, as
clients ping servers) up to `PINGS_PER_ROUND` servers that hold the block after its span, least
recently pinged first, and announces the lowest of each one's last `SAMPLES` round trips
(`ServerInfo.next_rtts`, at most `MAX_NEXT_RTTS`). Clients and the scheduler price chains with them
(`scheduler.algorithms.chain_cost`); a server missing from the record is priced through the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

from llm_swarm.server.roster_rounds import roster_rounds
from llm_swarm.swarm.server_info import MAX_PING_SECONDS, ServerInfo

logger = logging.getLogger(__name__)

PINGS_PER_ROUND = 8
MAX_NEXT_RTTS = 16  # what `ServerInfo.next_rtts` holds at most
SAMPLES = 3  # round trips kept per server: the lowest is announced, so one slow ping does not count
PING_TIMEOUT = 5.0


class NextServerRtts:
    """The round trips measured to the servers after our span, newest first to be kept, and the
    direct addresses those servers announce (where our pushes to a near one go); also the address
    every server announced in the last round, which bulk transfers dial (`announced_address`)."""

    def __init__(self) -> None:
        self._samples: OrderedDict[str, deque[float]] = OrderedDict()
        self._announced: dict[str, str] = {}

    def record(self, peer: str, rtt: float) -> None:
        samples = self._samples.pop(peer, None) or deque(maxlen=SAMPLES)
        samples.append(rtt)
        self._samples[peer] = samples  # most recently measured last
        while len(self._samples) > MAX_NEXT_RTTS:
            self._samples.popitem(last=False)

    def forget_all_but(self, peers: set[str]) -> None:
        """Keep only `peers` (those holding the block after our span now: a move changes which)."""
        for peer in [peer for peer in self._samples if peer not in peers]:
            del self._samples[peer]

    def learn_addresses(self, servers: dict[str, ServerInfo]) -> None:
        """The direct addresses `servers` announce now (servers move and restart: read every round)."""
        self._announced = {peer: info.direct_address for peer, info in servers.items() if info.direct_address}

    def announced_address(self, peer: str) -> str | None:
        """Where `peer` takes direct streams, near or far: for cache hand-offs and link probes, whose
        megabytes outweigh the two round trips a direct stream costs to open more than libp2p's."""
        return self._announced.get(peer)

    def direct_address(self, peer: str, max_rtt: float) -> str | None:
        """Where to push to `peer` directly: it announces an address and answered within `max_rtt`
        (only the next servers have round trips)."""
        samples = self._samples.get(peer)
        address = self._announced.get(peer)
        return address if address and samples and min(samples) <= max_rtt else None

    def announced(self) -> dict[str, float]:
        return {peer: min(samples) for peer, samples in self._samples.items()}


def next_servers(servers: dict[str, ServerInfo], me: str, end: int) -> list[str]:
    """Online servers that hold block `end` (the one after our span) and take chain pushes."""
    return sorted(
        peer
        for peer, info in servers.items()
        if peer != me
        and info.routable
        and info.chain_push
        and info.has_blocks
        and info.start <= end < info.end
    )


def ping_targets(candidates: list[str], last_pinged: dict[str, float]) -> list[str]:
    """At most `PINGS_PER_ROUND` of `candidates`, least recently pinged first."""
    return sorted(candidates, key=lambda peer: last_pinged.get(peer, float("-inf")))[:PINGS_PER_ROUND]


async def ping_next_servers_forever(
    ping: Callable[[str], Awaitable[object]],
    period: float,
    fetch: Callable[[], Awaitable[dict[str, ServerInfo]]],
    me: str,
    span: Callable[[], tuple[int, int] | None],
    rtts: NextServerRtts,
) -> None:
    """Ping the servers after our span every `period` seconds (the first round soon after start,
    when the records of servers that started with us are in the DHT)."""
    last_pinged: dict[str, float] = {}
    rounds = roster_rounds(period, fetch, span, "next-server pings", first_delay=min(period, 2.0))
    async for blocks, servers in rounds:
        candidates = next_servers(servers, me, blocks[1])
        rtts.forget_all_but(set(candidates))
        rtts.learn_addresses(servers)
        targets = ping_targets(candidates, last_pinged)
        results = await asyncio.gather(*(_timed(ping, peer) for peer in targets))
        now = time.monotonic()
        for peer, rtt in zip(targets, results, strict=True):
            last_pinged[peer] = now
            if rtt is not None and rtt <= MAX_PING_SECONDS:
                rtts.record(peer, max(rtt, 1e-6))
        if targets:
            measured = rtts.announced()
            answered = [f"{peer[-8:]} {measured[peer] * 1e3:.1f} ms" for peer in targets if peer in measured]
            logger.info(
                "next servers after block %d: %d pinged, %s",
                blocks[1],
                len(targets),
                ", ".join(answered) or "none answered",
            )
        for peer in [peer for peer in last_pinged if peer not in servers]:
            del last_pinged[peer]


async def _timed(ping: Callable[[str], Awaitable[object]], peer: str) -> float | None:
    started = time.monotonic()
    try:
        await asyncio.wait_for(ping(peer), PING_TIMEOUT)
    except Exception as error:
        logger.info("ping to next server %s failed: %s", peer[-8:], error or type(error).__name__)
        return None
    return time.monotonic() - started
