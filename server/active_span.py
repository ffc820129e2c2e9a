"""The blocks a server serves right now: the loaded span, its cache budget and the servicer that answers
for them on the p2p daemon.

A server holds one `ActiveSpan` at a time. Leaving and moving to another span both end one the same
way: stop accepting sessions, `drain` the open ones for a bounded time, `uninstall` (handlers off the
daemon, compute thread idle). Moving then installs a new one over the rebuilt blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from llm_swarm.server.handler import BlockServicer
from llm_swarm.server.memory import CacheBudget
from llm_swarm.swarm.models.span import TransformerSpan

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1  # how often a drain looks whether the last session has ended
REMOVE_HANDLERS_TIMEOUT_S = 2.0  # the daemon may already be gone when the whole process group stops


@dataclass
class ActiveSpan:
    span: TransformerSpan
    start: int
    end: int
    budget: CacheBudget
    servicer: BlockServicer | None = field(default=None)  # set by `install`

    @property
    def text(self) -> str:
        return f"{self.start}:{self.end}"

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters sessions may ask for here (announced)."""
        return self.span.adapters.names if self.span.adapters is not None else ()

    @property
    def link_rates(self) -> dict[str, float]:
        """Bytes/s of this server's recent cache hand-offs, by receiving peer (announced)."""
        return dict(getattr(self.servicer, "link_rates", {}))

    @property
    def tau_per_session(self) -> float | None:
        """What each other session decoding here adds to the per-block decode time (announced)."""
        if self.servicer is None:
            return None
        return self.servicer.decode_load.tau_per_session(self.end - self.start)

    @property
    def open_sessions(self) -> int:
        return len(self.servicer.sessions) if self.servicer is not None else 0

    async def install(
        self, p2p, namespace: str, new_servicer: Callable[[TransformerSpan, CacheBudget], BlockServicer]
    ) -> None:
        """Serve the blocks: a fresh servicer (its own compute thread) registered on the daemon."""
        self.servicer = new_servicer(self.span, self.budget)
        await self.servicer.add_p2p_handlers(p2p, namespace=namespace)

    def stop_accepting(self) -> None:
        """New sessions are refused from now on (open ones continue)."""
        if self.servicer is not None:
            self.servicer.accepting = False

    async def drain(self, timeout: float, stop: asyncio.Event | None = None) -> int:
        """Refuse new sessions and wait up to `timeout` seconds (or until `stop` is set) for the open ones
        to end; returns how many are still open."""
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.open_sessions and loop.time() < deadline and not (stop is not None and stop.is_set()):
            await asyncio.sleep(DRAIN_POLL_S)
        return self.open_sessions

    async def uninstall(self, p2p, namespace: str) -> None:
        """Stop serving: handlers off the daemon (bounded), then wait until the compute thread is idle, so
        a step still running on these blocks finishes before anyone renumbers them (a move)."""
        servicer = self.servicer
        if servicer is None:
            return
        await run_bounded(
            "removing the block handlers",
            servicer.remove_p2p_handlers(p2p, namespace=namespace),
            REMOVE_HANDLERS_TIMEOUT_S,
        )
        servicer.shutdown()
        await asyncio.to_thread(servicer.executor.shutdown, True)
        if servicer.engine is not None:  # the batching engine's own thread, when batching
            await asyncio.to_thread(servicer.engine.shutdown, True)


async def run_bounded(what: str, step: Awaitable, timeout: float) -> None:
    """Run a step of leaving or moving for at most `timeout` seconds; a failure is logged, not raised
    (leaving must not fail because the DHT process or p2p daemon is already gone)."""
    try:
        await asyncio.wait_for(step, timeout=timeout)
    except Exception as error:
        logger.warning("%s failed: %s", what, error or type(error).__name__)
