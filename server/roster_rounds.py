"""The rounds of a server's periodic look at the swarm (link probes, next-server pings): every
`period` seconds, the span it serves now and the servers' records, skipping a round while it serves
nothing or the DHT does not answer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from llm_swarm.swarm.server_info import ServerInfo

logger = logging.getLogger(__name__)


async def roster_rounds(
    period: float,
    fetch: Callable[[], Awaitable[dict[str, ServerInfo]]],
    span: Callable[[], tuple[int, int] | None],
    what: str,
    first_delay: float | None = None,
) -> AsyncIterator[tuple[tuple[int, int], dict[str, ServerInfo]]]:
    """`(span, servers)` once per round, the first after `first_delay` (default: `period`); `what`
    names the work in the log line of a skipped round."""
    delay = period if first_delay is None else first_delay
    while True:
        await asyncio.sleep(delay)
        delay = period
        blocks = span()
        if blocks is None:
            continue
        try:
            servers = await fetch()
        except Exception as error:  # the DHT is slow or restarting: try next period
            logger.info("%s skipped: could not read the servers: %s", what, error)
            continue
        yield blocks, servers
