"""A volunteer server's life: join the DHT, get a span, measure it, serve, announce, leave cleanly.

A *pinned* server (`--blocks A:B`) loads and serves that span. A *managed* server (no `--blocks`)
gets its span from the scheduler, or chooses one itself without a scheduler, and moves when the
placement changes: that part lives in `server.managed`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

import torch
from hivemind.dht import DHT
from tqdm import tqdm

from server.handler import BlockServicer, PeerLimits
from server.joining import RELAY_MODES, JoinOptions, current_relay_state, join_dht
from server.managed import ManagedSpan
from server.memory import CacheBudget
from server.metrics import ServerMetrics
from server.throughput import BlockTimings, cached_block_timings
from swarm.closed_swarm import SwarmSecret
from swarm.dht_peer import PeerIdentity, forget_identity, open_identity
from swarm.dht_records import announce
from swarm.errors import SwarmUserError
from swarm.model_limits import ModelLimits
from swarm.models.checkpoint import load_config
from swarm.models.span import TransformerSpan, load_span
from swarm.reachability import DialBackService
from swarm.record_validator import MAX_RECORD_TTL
from swarm.scheduler_link import SchedulerLink
from swarm.server_info import Reachability, ServerInfo, ServerState

logger = logging.getLogger(__name__)

try:
    PACKAGE_VERSION = version("llm-swarm")
except PackageNotFoundError:  # running from a source tree without installing
    PACKAGE_VERSION = "0+unknown"


MAX_ANNOUNCE_PERIOD = (MAX_RECORD_TTL - 1) / 2  # records live 2 periods + 1 s; validators allow no more


@dataclass
class ServerConfig:
    model_dir: str
    initial_peers: list[str]
    start: int | None  # None (with end None): managed, the span comes from the scheduler
    end: int | None
    memory_bytes: int
    dht_prefix: str
    dtype: str = "float32"
    device: str = "cpu"
    quant: str = "none"  # "int8" or "nf4": bitsandbytes blocks (CUDA)
    host: str = "127.0.0.1"
    port: int = 0
    public_name: str = ""
    max_length: int = 2048  # longest session accepted
    slot_tokens: int = 2048  # session length that announced cache slots are counted for
    max_batch_size: int = 64
    announce_period: float = 10.0
    session_idle_timeout: float = 300.0
    compute_delay: float = 0.0
    compute_delay_overlap: bool = False  # emulation: concurrent sessions' delays overlap (see handler)
    batch_wait_ms: float = 2.0  # window for batching concurrent decode steps; 0 = no batching
    drain_timeout: float = 10.0  # on SIGTERM or a move, let open sessions finish for up to this long
    prefill_tokens: int = 20
    scheduler_timeout: float = 10.0  # managed: choose blocks locally if no scheduler answers this long
    assignment_poll: float = 2.0  # managed: seconds between assignment requests while serving
    scheduler_rpc_timeout: float = 3.0  # bound on each DHT lookup / RPC to the scheduler
    metrics_port: int | None = None  # Prometheus endpoint on `host`; None: no endpoint
    identity_path: str | None = None  # RSA key of the peer id and record signatures; None: fresh per run
    scheduler_key: str | None = None  # managed: the only scheduler public key to follow; None: none
    swarm_secret: SwarmSecret | None = None  # closed swarm: only holders of it may talk to us
    max_sessions_per_peer: int = 64
    max_peer_cache_fraction: float = 0.5  # of the session cache one peer may reserve
    max_session_lifetime: float = 24 * 3600.0  # seconds a session may live, however active
    extra_dht_options: dict = field(default_factory=dict)
    relay: str = "auto"  # reachability: check, and serve through a relay when behind NAT (server.joining)
    relay_peers: list[str] = field(default_factory=list)  # circuit relays besides the bootstrap peers
    serve_as_relay: bool = False  # relay for others (needs a public address), within bounded resources
    # also write the legacy roster and per-block records that clients and schedulers before the sharded
    # roster read (they grow with the swarm); turn off once every reader of the swarm is current
    legacy_records: bool = True

    def __post_init__(self) -> None:
        """Every value checked where the config is made, whoever makes it (messages name the CLI flags)."""
        if (self.start is None) != (self.end is None) or (
            self.start is not None and not 0 <= self.start < self.end
        ):
            raise SwarmUserError(f"blocks {self.start}:{self.end} are not a span (start < end, or both None)")
        for name in ("max_length", "slot_tokens", "max_batch_size", "max_sessions_per_peer"):
            if getattr(self, name) < 1:
                raise SwarmUserError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 < self.announce_period <= MAX_ANNOUNCE_PERIOD or not self.session_idle_timeout > 0:
            raise SwarmUserError(
                f"--announce-period must be in (0, {MAX_ANNOUNCE_PERIOD:.0f}] and --session-timeout positive"
            )
        if not 0 < self.max_peer_cache_fraction <= 1:
            fraction = self.max_peer_cache_fraction
            raise SwarmUserError(f"--max-peer-cache-fraction must be in (0, 1], got {fraction}")
        # `not x > 0` and `not x >= 0` also reject nan
        for name in ("max_session_lifetime", "scheduler_timeout", "assignment_poll", "scheduler_rpc_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise SwarmUserError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not self.compute_delay >= 0 or not self.drain_timeout >= 0:
            raise SwarmUserError("--compute-delay and --drain-timeout must be >= 0")
        if not self.batch_wait_ms >= 0:
            raise SwarmUserError(f"--batch-wait-ms must be >= 0, got {self.batch_wait_ms}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise SwarmUserError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if not 0 <= self.port < 65536 or self.memory_bytes <= 0:
            raise SwarmUserError(
                f"--port must be in 0..65535 and --memory positive, got {self.port} and {self.memory_bytes}"
            )
        if self.relay not in RELAY_MODES:
            raise SwarmUserError(f"--relay must be one of {', '.join(RELAY_MODES)}, got {self.relay!r}")

    @property
    def managed(self) -> bool:
        return self.start is None


class SwarmServer(ManagedSpan):
    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = ServerState.JOINING
        self.dht: DHT | None = None
        self.start_block: int | None = None  # the span served now; None while a managed server waits
        self.end_block: int | None = None
        self.span: TransformerSpan | None = None
        self.budget: CacheBudget | None = None
        self.timings: BlockTimings | None = None
        self.servicer: BlockServicer | None = None
        # the same for every block and span of the model, so they stay valid across moves
        self.block_bytes = 0
        self.cache_token_bytes = 0
        self.link: SchedulerLink | None = None
        self.epoch: int | None = None  # placement epoch of the span we serve; None: not the scheduler's
        self._probe: TransformerSpan | None = None  # managed: block 0, measured, until a span is loaded
        self._ignored_epoch: int | None = None  # an assignment we could not follow (logged once)
        self._chose_locally = False  # no scheduler answered at start-up (already logged)
        self._failure: BaseException | None = None
        self.metrics = ServerMetrics()  # one per server: counters survive moves between spans
        self.metrics.watch_cache(
            free_slots=lambda: self.budget.slots_left(self.slot_bytes) if self.budget else 0,
            total_slots=lambda: self.budget.total_bytes // self.slot_bytes if self.budget else 0,
            free_bytes=lambda: self.budget.bytes_left if self.budget else 0,
        )
        self._stop = asyncio.Event()
        self._sessions_changed = asyncio.Event()
        self.identity: PeerIdentity | None = None
        self.reachability = Reachability.DIRECT  # decided when joining (server.joining)
        self.limits = ModelLimits.from_config(load_config(config.model_dir))

    # --- what we announce -----------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Cache bytes of one slot: a session of `slot_tokens` on one block (at least 1)."""
        return max(self.cache_token_bytes * self.config.slot_tokens, 1)

    def info(self) -> ServerInfo:
        config, timings = self.config, self.timings
        num_blocks = self.end_block - self.start_block if self.start_block is not None else 0
        slot_bytes = self.slot_bytes
        return ServerInfo(
            state=self.state,
            start=self.start_block,
            end=self.end_block,
            managed=config.managed,
            public_name=config.public_name,
            dtype=config.quant if config.quant != "none" else config.dtype,
            version=PACKAGE_VERSION,
            memory_bytes=config.memory_bytes,
            block_bytes=self.block_bytes,
            cache_token_bytes=self.cache_token_bytes,
            cache_bytes_left=self.budget.bytes_left if self.budget else 0,
            cache_slots_left=self.budget.slots_left(slot_bytes) if self.budget else 0,
            slot_tokens=config.slot_tokens,
            max_length=config.max_length,
            tau=timings.tau if timings else None,
            tau_prefill=timings.tau_prefill if timings else None,
            prefill_tokens=timings.prefill_tokens if timings else 0,
            throughput=1.0 / (timings.tau * num_blocks)
            if timings and num_blocks and timings.tau > 0
            else None,
            active_sessions=len(self.servicer.sessions) if self.servicer else 0,
            reachability=self.reachability,
        )

    def _announce(self, wait: bool = True):
        ttl = 2 * self.config.announce_period + 1
        return announce(
            self.dht,
            self.config.dht_prefix,
            self.identity.owner,
            self.info(),
            ttl=ttl,
            wait=wait,
            legacy=self.config.legacy_records,
        )

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def span_text(self) -> str:
        return f"{self.start_block}:{self.end_block}" if self.start_block is not None else "none"

    # --- start-up -------------------------------------------------------------------------------
    def start(self) -> None:
        config = self.config
        self.identity = open_identity(config.identity_path)
        self.dht, self.reachability = join_dht(
            JoinOptions(
                initial_peers=config.initial_peers,
                host=config.host,
                port=config.port,
                relay=config.relay,
                relay_peers=config.relay_peers,
                serve_as_relay=config.serve_as_relay,
                extra_dht_options=config.extra_dht_options,
            ),
            self.identity,
            config.swarm_secret,
        )
        logger.info(
            "joined the DHT as %s at %s", self.peer_id, [str(a) for a in self.dht.get_visible_maddrs()]
        )
        logger.info(
            "device %s, dtype %s, quantization %s, memory budget %.2f GiB",
            config.device,
            config.dtype,
            config.quant,
            config.memory_bytes / 2**30,
        )
        if config.metrics_port is not None:
            self.metrics.serve(config.host, config.metrics_port)
        if config.managed:
            self._measure_probe()
        else:
            self._load_pinned_span()

    def _load_pinned_span(self) -> None:
        config = self.config
        self.start_block, self.end_block = config.start, config.end
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
                quant=config.quant,
            )
        self.block_bytes, self.cache_token_bytes = self.span.block_bytes, self.span.cache_bytes(num_tokens=1)
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
        if self.config.managed:
            self.link = SchedulerLink(
                self.dht,
                self.config.dht_prefix,
                self.config.scheduler_key,
                timeout=self.config.scheduler_rpc_timeout,
                retry_after=0.0,  # the managed loop paces its own questions
                refresh_period=10.0,  # a scheduler that restarted elsewhere is found within this
                distrust_for=120.0,
                swarm_secret=self.config.swarm_secret,
                log_outages=False,  # the managed loop says what it does without one
            )
        try:
            if self.config.managed:
                span = await self._wait_for_span()
                if span is None:  # stopped while waiting: nothing to drain
                    self.state = ServerState.OFFLINE
                    await self._bounded("announcing OFFLINE", self._announce(wait=False), 5.0)
                    return
                await self._load_managed_span(*span)
            await self._serve_span()
        finally:
            if self.link is not None:
                await self.link.close()
        if self._failure is not None:
            raise self._failure

    async def _serve_span(self) -> None:
        p2p = await self.dht.replicate_p2p()
        self.servicer = self._new_servicer()
        await self.servicer.add_p2p_handlers(p2p, namespace=self.config.dht_prefix)
        if self.reachability == Reachability.DIRECT:
            await DialBackService(p2p).add_p2p_handlers(p2p)  # check other servers' reachability too
        self.state = ServerState.ONLINE
        await self._announce(wait=False)
        logger.info("online: serving blocks %s as %s", self.span_text, self.peer_id)
        follower = asyncio.create_task(self._follow_scheduler(p2p)) if self.config.managed else None
        try:
            await self._announce_until_stopped()
        finally:
            self._stop.set()  # also when announcing failed: the follower must not outlive serving
            if follower is not None:
                await self._stop_follower(follower)
            await self._leave(p2p)

    async def _follow_relay_state(self) -> None:
        """Behind NAT, whether clients can reach us follows the relay reservation (libp2p renews it,
        or finds the relay again after it restarts): announce the change and say it once."""
        if self.reachability == Reachability.DIRECT or self.config.relay == "never":
            return
        try:
            state = await asyncio.wait_for(current_relay_state(self.dht), self.config.scheduler_rpc_timeout)
        except Exception as error:
            logger.warning("could not read our relay addresses: %s", error)
            return
        if state != self.reachability:
            logger.warning("reachability: %s -> %s", self.reachability.value, state.value)
            self.reachability = state

    def _new_servicer(self) -> BlockServicer:
        return BlockServicer(
            self.span,
            self.budget,
            max_length=self.config.max_length,
            max_batch_size=self.config.max_batch_size,
            session_idle_timeout=self.config.session_idle_timeout,
            compute_delay=self.config.compute_delay,
            compute_delay_overlap=self.config.compute_delay_overlap,
            batch_wait_ms=self.config.batch_wait_ms,
            get_info=lambda: self.info().to_wire(),
            on_sessions_changed=self._sessions_changed.set,
            metrics=self.metrics,
            limits=PeerLimits(
                max_sessions=self.config.max_sessions_per_peer,
                max_cache_fraction=self.config.max_peer_cache_fraction,
                max_session_lifetime=self.config.max_session_lifetime,
            ),
            swarm_secret=self.config.swarm_secret,
            local_peer_id=self.peer_id,
        )

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
                await self._follow_relay_state()
            await self._announce_quietly()

    async def _announce_quietly(self) -> None:
        try:
            await self._announce(wait=False)
        except Exception as error:  # a flaky DHT must not take the server down; retry next period
            logger.warning("announcement failed: %s", error)

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=max(seconds, 0.0))
        except TimeoutError:
            pass

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
        if self.identity is not None and self.config.identity_path is None:
            forget_identity(self.identity)  # a per-run key: nobody needs it after us


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
