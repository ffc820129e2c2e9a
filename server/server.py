"""A volunteer server's life: join the DHT, load a span, measure it, serve, announce, leave cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

import torch
from hivemind.dht import DHT
from tqdm import tqdm

from server.handler import BlockServicer
from server.memory import CacheBudget
from server.throughput import BlockTimings, cached_block_timings
from swarm.dht_records import announce
from swarm.models.span import TransformerSpan, load_span
from swarm.server_info import ServerInfo, ServerState

logger = logging.getLogger(__name__)

try:
    PACKAGE_VERSION = version("llm-swarm")
except PackageNotFoundError:  # running from a source tree without installing
    PACKAGE_VERSION = "0+unknown"


@dataclass
class ServerConfig:
    model_dir: str
    initial_peers: list[str]
    start: int
    end: int
    memory_bytes: int
    dht_prefix: str
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 0
    public_name: str = ""
    max_length: int = 2048  # longest session accepted
    slot_tokens: int = 2048  # session length that announced cache slots are counted for
    max_batch_size: int = 64
    announce_period: float = 10.0
    session_idle_timeout: float = 300.0
    compute_delay: float = 0.0
    drain_timeout: float = 10.0  # on SIGTERM, let open sessions finish for up to this long
    prefill_tokens: int = 20
    extra_dht_options: dict = field(default_factory=dict)


class SwarmServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = ServerState.JOINING
        self.dht: DHT | None = None
        self.span: TransformerSpan | None = None
        self.budget: CacheBudget | None = None
        self.timings: BlockTimings | None = None
        self.servicer: BlockServicer | None = None
        self._stop = asyncio.Event()
        self._sessions_changed = asyncio.Event()

    # --- what we announce -----------------------------------------------------------------------
    def info(self) -> ServerInfo:
        config, span = self.config, self.span
        token_bytes = span.cache_bytes(num_tokens=1) if span else 0
        slot_bytes = token_bytes * config.slot_tokens
        return ServerInfo(
            state=self.state,
            start=config.start,
            end=config.end,
            public_name=config.public_name,
            version=PACKAGE_VERSION,
            memory_bytes=config.memory_bytes,
            block_bytes=span.block_bytes if span else 0,
            cache_token_bytes=token_bytes,
            cache_bytes_left=self.budget.bytes_left if self.budget else 0,
            cache_slots_left=self.budget.slots_left(slot_bytes) if self.budget else 0,
            slot_tokens=config.slot_tokens,
            max_length=config.max_length,
            tau=self.timings.tau if self.timings else None,
            tau_prefill=self.timings.tau_prefill if self.timings else None,
            prefill_tokens=self.timings.prefill_tokens if self.timings else 0,
            throughput=1.0 / (self.timings.tau * span.num_blocks) if self.timings and span else None,
            active_sessions=len(self.servicer.sessions) if self.servicer else 0,
        )

    def _announce(self, wait: bool = True):
        ttl = 2 * self.config.announce_period + 1
        return announce(self.dht, self.config.dht_prefix, self.peer_id, self.info(), ttl=ttl, wait=wait)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    # --- start-up -------------------------------------------------------------------------------
    def start(self) -> None:
        config = self.config
        self.dht = DHT(
            initial_peers=config.initial_peers,
            host_maddrs=[f"/ip4/{config.host}/tcp/{config.port}"],
            start=True,
            **config.extra_dht_options,
        )
        logger.info(
            "joined the DHT as %s at %s", self.peer_id, [str(a) for a in self.dht.get_visible_maddrs()]
        )
        with tqdm(
            total=config.end - config.start, desc=f"loading blocks {config.start}:{config.end}", unit="block"
        ) as progress:
            self.span, _files = load_span(
                config.model_dir,
                config.start,
                config.end,
                dtype=config.dtype,
                device=config.device,
                on_block_loaded=lambda _index: progress.update(),
            )
        self.budget = CacheBudget(config.memory_bytes, self.span.block_bytes * self.span.num_blocks)
        self._announce()  # JOINING: visible while measuring
        self.timings = cached_block_timings(self.span, config.prefill_tokens, config.compute_delay)
        logger.info(
            "blocks %d:%d loaded (%d bytes each); tau %.2f ms/block/token, tau_prefill(%d) %.2f ms/block; "
            "%d cache bytes for sessions",
            config.start,
            config.end,
            self.span.block_bytes,
            self.timings.tau * 1e3,
            self.timings.prefill_tokens,
            self.timings.tau_prefill * 1e3,
            self.budget.total_bytes,
        )

    # --- serving --------------------------------------------------------------------------------
    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self.servicer = BlockServicer(
            self.span,
            self.budget,
            max_length=self.config.max_length,
            max_batch_size=self.config.max_batch_size,
            session_idle_timeout=self.config.session_idle_timeout,
            compute_delay=self.config.compute_delay,
            get_info=lambda: self.info().to_wire(),
            on_sessions_changed=self._sessions_changed.set,
        )
        p2p = await self.dht.replicate_p2p()
        await self.servicer.add_p2p_handlers(p2p, namespace=self.config.dht_prefix)
        self.state = ServerState.ONLINE
        await self._announce(wait=False)
        logger.info("online: serving blocks %d:%d as %s", self.config.start, self.config.end, self.peer_id)
        try:
            await self._announce_until_stopped()
        finally:
            await self._leave(p2p)

    async def _announce_until_stopped(self) -> None:
        """Re-announce every period, and soon after sessions open or close (so free slots stay current)."""
        period = self.config.announce_period
        loop = asyncio.get_running_loop()
        next_periodic = loop.time() + period
        while not self._stop.is_set():
            timeout = max(next_periodic - loop.time(), 0)
            stop = asyncio.ensure_future(self._stop.wait())
            changed = asyncio.ensure_future(self._sessions_changed.wait())
            await asyncio.wait([stop, changed], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            changed.cancel()
            if self._stop.is_set():
                return
            if self._sessions_changed.is_set():
                await asyncio.sleep(0.2)  # coalesce bursts of opens/closes into one announcement
                self._sessions_changed.clear()
            else:
                next_periodic = loop.time() + period
            try:
                await self._announce(wait=False)
            except Exception as error:  # a flaky DHT must not take the server down; retry next period
                logger.warning("announcement failed: %s", error)

    async def _leave(self, p2p) -> None:
        """Drain, then stop serving: announce OFFLINE (no new sessions), let open sessions finish for up
        to `drain_timeout`, then close. Every step is bounded: when the whole process group got the
        signal, the DHT process and p2pd may already be gone, and leaving must not hang on them."""
        self.state = ServerState.OFFLINE
        self.servicer.accepting = False
        await self._bounded("announcing OFFLINE", self._announce(wait=False), 5.0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        if self.servicer.sessions:
            logger.info(
                "draining: %d sessions open, waiting up to %.0f s",
                len(self.servicer.sessions),
                self.config.drain_timeout,
            )
        while self.servicer.sessions and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self.servicer.sessions:
            logger.info("drain time is over: closing %d sessions", len(self.servicer.sessions))
        await self._bounded(
            "removing handlers", self.servicer.remove_p2p_handlers(p2p, namespace=self.config.dht_prefix), 2.0
        )
        self.servicer.shutdown()

    @staticmethod
    async def _bounded(what: str, step, timeout: float) -> None:
        try:
            await asyncio.wait_for(step, timeout=timeout)
        except Exception as error:  # leaving must not fail because a peer process is unhappy
            logger.warning("while leaving, %s failed: %s", what, error or type(error).__name__)

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None


def run_server(config: ServerConfig, torch_threads: int | None = None) -> None:
    if torch_threads:
        torch.set_num_threads(torch_threads)
    server = SwarmServer(config)
    try:
        server.start()
        asyncio.run(server.serve())
    finally:
        server.shutdown()
        logger.info("stopped")
