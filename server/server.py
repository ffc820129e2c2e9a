"""A volunteer server's life: join the DHT, get a span, measure it, serve, announce, leave cleanly.

A *pinned* server (`--blocks A:B`) loads and serves that span. A *managed* server (no `--blocks`)
gets its span from the scheduler, or chooses one itself without a scheduler, and moves when the
placement changes: those decisions live in `server.managed.SpanManager`; the server carries them
out. What is served right now is one `server.active_span.ActiveSpan`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import ipaddress
import logging
import time
from functools import partial
from importlib.metadata import PackageNotFoundError, version

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from tqdm import tqdm

from llm_swarm.server.active_span import ActiveSpan, run_bounded
from llm_swarm.server.assigned_role import AssignedRole
from llm_swarm.server.config import ServerConfig
from llm_swarm.server.emulated_delay import emulated_seconds_per_block
from llm_swarm.server.handler import BlockServicer, PeerLimits
from llm_swarm.server.joining import JoinOptions, current_relay_state, join_dht
from llm_swarm.server.link_probes import start_link_probes
from llm_swarm.server.managed import SpanManager, stop_follower
from llm_swarm.server.memory import CacheBudget
from llm_swarm.server.metrics import ServerMetrics
from llm_swarm.server.next_server_pings import PING_TIMEOUT, NextServerRtts, ping_next_servers_forever
from llm_swarm.server.throughput import BlockTimings, cached_block_timings
from llm_swarm.swarm.block_rpc import BlockRpc
from llm_swarm.swarm.cli.signals import stop_on_signals
from llm_swarm.swarm.dht_peer import PeerIdentity, forget_identity, open_identity
from llm_swarm.swarm.dht_records import announce, fetch_servers_async
from llm_swarm.swarm.direct_dialer import DirectDialer
from llm_swarm.swarm.direct_listener import DirectListener
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.models.adapters import attach_adapters
from llm_swarm.swarm.models.checkpoint import load_config
from llm_swarm.swarm.models.family import family_for
from llm_swarm.swarm.models.span import TransformerSpan, load_span, rebuild_span
from llm_swarm.swarm.reachability import DialBackService
from llm_swarm.swarm.server_info import Reachability, ServerInfo, ServerState
from llm_swarm.swarm.stop_deadline import STOP_DEADLINE
from llm_swarm.swarm.stream_opener import StreamOpener
from llm_swarm.swarm.wire import InfoRequest, encode

logger = logging.getLogger(__name__)

# sessions unchanged this long (s) make their count worth announcing (`SwarmServer._sessions_settled`)
SESSIONS_SETTLE = 1.0

try:
    PACKAGE_VERSION = version("llm-swarm")
except PackageNotFoundError:  # running from a source tree without installing
    PACKAGE_VERSION = "0+unknown"


class SwarmServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = ServerState.JOINING
        self.dht: DHT | None = None
        self.served: ActiveSpan | None = None  # the blocks loaded (and, once installed, served) now
        self.timings: BlockTimings | None = None
        # the same for every block and span of the model, so they stay valid across moves
        self.block_bytes = 0
        self.cache_token_bytes = 0
        self.manager: SpanManager | None = None  # managed servers: where to serve, from the scheduler
        self._probe: TransformerSpan | None = None  # managed: one block, measured, until a span is loaded
        self._failure: BaseException | None = None
        self.metrics = ServerMetrics()  # one per server: counters survive moves between spans
        self.metrics.watch_cache(
            free_slots=lambda: self._budget.slots_left(self.slot_bytes) if self._budget else 0,
            total_slots=lambda: self._budget.total_bytes // self.slot_bytes if self._budget else 0,
            free_bytes=lambda: self._budget.bytes_left if self._budget else 0,
        )
        self.metrics.watch_streams(
            opened=lambda path: sum(
                opener.opened[path] for opener in (self.streams, self.bulk_streams) if opener is not None
            ),
            served_directly=lambda: self.direct.served if self.direct is not None else 0,
        )
        self.metrics.tau_per_session.set_function(
            lambda: (self.served.tau_per_session or 0.0) if self.served is not None else 0.0
        )
        self.stopped = asyncio.Event()
        self._sessions_changed = asyncio.Event()
        self.identity: PeerIdentity | None = None
        self.reachability = Reachability.DIRECT  # decided when joining (server.joining)
        self.model_config = load_config(config.model_dir)
        self.limits = ModelLimits.from_config(self.model_config)
        self.role = AssignedRole(config.role)  # managed: the scheduler may assign one (--roles auto)
        self.next_rtts = NextServerRtts()  # round trips to the servers after our span, announced
        self.direct: DirectListener | None = None  # our streams over TLS without the p2p daemons
        self.direct_address = ""  # where peers dial `direct` (announced); "" when not served
        self.streams: StreamOpener | None = None  # how our pushes reach the next servers
        self.bulk_streams: StreamOpener | None = None  # how our cache hand-offs and link probes go

    # --- what we announce -----------------------------------------------------------------------
    @property
    def _budget(self) -> CacheBudget | None:
        return self.served.budget if self.served is not None else None

    @property
    def slot_bytes(self) -> int:
        """Cache bytes of one slot: a session of `slot_tokens` on one block (at least 1), on average
        over the served blocks, since a block of sliding attention keeps only its ring."""
        served, tokens = self.served, self.config.slot_tokens
        if served is None:
            return max(self.cache_token_bytes * tokens, 1)
        total = served.span.session_cache_bytes(1, tokens, served.start, served.end)
        return max(-(-total // (served.end - served.start)), 1)

    def info(self) -> ServerInfo:
        config, timings, served, budget = self.config, self.timings, self.served, self._budget
        num_blocks = served.end - served.start if served is not None else 0
        slot_bytes = self.slot_bytes
        return ServerInfo(
            state=self.state,
            start=served.start if served is not None else None,
            end=served.end if served is not None else None,
            managed=config.managed,
            public_name=config.public_name,
            dtype=config.quant if config.quant != "none" else config.dtype,
            version=PACKAGE_VERSION,
            memory_bytes=config.memory_bytes,
            block_bytes=self.block_bytes,
            cache_token_bytes=self.cache_token_bytes,
            cache_bytes_left=budget.bytes_left if budget else 0,
            cache_slots_left=budget.slots_left(slot_bytes) if budget else 0,
            slot_tokens=config.slot_tokens,
            max_length=self.session_limit(self.model_span()),
            tau=timings.tau if timings else None,
            tau_prefill=timings.tau_prefill if timings else None,
            tau_per_session=served.tau_per_session if served is not None else None,
            prefill_tokens=timings.prefill_tokens if timings else 0,
            # a server that runs prompts whole streams each prompt's cache as one chunk
            prefill_chunk=config.prefill_chunk or config.max_length,
            throughput=1.0 / (timings.tau * num_blocks)
            if timings and num_blocks and timings.tau > 0
            else None,
            active_sessions=served.open_sessions if served is not None else 0,
            reachability=self.reachability,
            adapters=served.adapter_names if served is not None else (),
            role=self.role.role,
            chain_push=True,
            step_frames=True,
            links=served.link_rates if served is not None else {},
            next_rtts=self.next_rtts.announced(),
            direct_address=self.direct_address,
        )

    def _announce(self, wait: bool = True, legacy: bool = True):
        """Store our record; `legacy=False` leaves out the keys only older readers look under (a store
        per block of the span), for announcements whose news is only the free cache."""
        ttl = 2 * self.config.announce_period * self.config.idle_announce_factor + 1
        return announce(
            self.dht,
            self.config.dht_prefix,
            self.identity.owner,
            self.info(),
            ttl=ttl,
            wait=wait,
            legacy=self.config.legacy_records and legacy,
        )

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def span_text(self) -> str:
        return self.served.text if self.served is not None else "none"

    @property
    def model_blocks(self) -> int:
        """`L`, the model's number of blocks."""
        span = self.model_span()
        return span.family.num_blocks(span.config)

    def session_limit(self, span: TransformerSpan | None) -> int:
        """The longest session served: `--max-length`, or less where the model's blocks compute what
        it defines only up to some length (the family's `longest_session`)."""
        longest = span.family.longest_session(span.config) if span is not None else None
        return min(self.config.max_length, longest) if longest else self.config.max_length

    def model_span(self) -> TransformerSpan:
        """Whatever blocks we hold (the probe until a span is loaded): they know the model's shape."""
        return self.served.span if self.served is not None else self._probe

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
            self._load_probe()
        else:
            self._load_pinned_span()

    def _load_probe(self) -> None:
        """Managed: measure on one block alone what the scheduler needs to place us (tau,
        tau_prefill, s_m, cache bytes per token): a block of the model's largest kind, which prices
        any span (blocks are alike but for DeepSeek's first, dense ones)."""
        config = self.config
        started = time.perf_counter()
        block = family_for(self.model_config).representative_block(self.model_config)
        self._probe, _files = load_span(
            config.model_dir, block, block + 1, dtype=config.dtype, device=config.device, quant=config.quant
        )
        self.block_bytes = self._probe.block_bytes
        self.cache_token_bytes = self._probe.cache_bytes(num_tokens=1)
        self._probe.use_decode_graphs(not config.no_cuda_graphs)  # timings as sessions will see them
        self.timings = self._measure_timings(self._probe)
        self._announce()  # JOINING without blocks: the scheduler can place us from now on
        logger.info(
            "managed: probe on block %d in %.0f ms: %d bytes per block, tau %.2f ms/block/token, "
            "tau_prefill(%d) %.2f ms/block, memory %d bytes; waiting for a span",
            block,
            (time.perf_counter() - started) * 1e3,
            self.block_bytes,
            self.timings.tau * 1e3,
            self.timings.prefill_tokens,
            self.timings.tau_prefill * 1e3,
            config.memory_bytes,
        )

    async def _load_assigned_span(self, start: int, end: int) -> None:
        """Managed: load the span, keeping the probe's block if the span holds it (timings stay the
        probe's: it is of the largest kind)."""
        started = time.perf_counter()
        model_dir = self.config.model_dir
        span, reused, loaded = await asyncio.to_thread(rebuild_span, self._probe, model_dir, start, end)
        self._probe = None
        self.served = self._activate(span, start, end)
        logger.info(
            "blocks %d:%d loaded in %.0f ms (%d reused from the probe, %d read); %d cache bytes for sessions",
            start,
            end,
            (time.perf_counter() - started) * 1e3,
            len(reused),
            len(loaded),
            self.served.budget.total_bytes,
        )

    def _activate(self, span: TransformerSpan, start: int, end: int) -> ActiveSpan:
        """The loaded span with its LoRA adapters (`--adapters`) and its memory budget: what is left
        of `--memory` after the blocks and the adapters is what sessions' caches may use."""
        adapters = attach_adapters(span, self.config.adapters)
        adapter_bytes = adapters.total_bytes if adapters is not None else 0
        if adapters is not None:
            logger.info(
                "adapters %s loaded for blocks %d:%d: %d bytes",
                ", ".join(adapters.names),
                start,
                end,
                adapter_bytes,
            )
        if span.use_decode_graphs(not self.config.no_cuda_graphs):
            logger.info("decode steps of blocks %d:%d replay CUDA graphs once captured", start, end)
        budget = CacheBudget(self.config.memory_bytes, self.block_bytes * span.num_blocks + adapter_bytes)
        return ActiveSpan(span, start, end, budget)

    def _load_pinned_span(self) -> None:
        config = self.config
        with tqdm(
            total=config.end - config.start, desc=f"loading blocks {config.start}:{config.end}", unit="block"
        ) as progress:
            span, _files = load_span(
                config.model_dir,
                config.start,
                config.end,
                dtype=config.dtype,
                device=config.device,
                on_block_loaded=lambda _index: progress.update(),
                quant=config.quant,
            )
        self.block_bytes, self.cache_token_bytes = span.block_bytes, span.cache_bytes(num_tokens=1)
        self.served = self._activate(span, config.start, config.end)
        self._announce()  # JOINING: visible while measuring
        self.timings = self._measure_timings(span)
        logger.info(
            "blocks %d:%d loaded (%d bytes each); tau %.2f ms/block/token, tau_prefill(%d) %.2f ms/block; "
            "%d cache bytes for sessions",
            config.start,
            config.end,
            span.block_bytes,
            self.timings.tau * 1e3,
            self.timings.prefill_tokens,
            self.timings.tau_prefill * 1e3,
            self.served.budget.total_bytes,
        )

    # --- serving --------------------------------------------------------------------------------
    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        # the deadline leaves the drain its whole time, then the usual bound for leaving
        stop_on_signals(loop, self.stopped.set, STOP_DEADLINE + self.config.drain_timeout)
        if self.config.managed:
            self.manager = SpanManager(self)
        try:
            if self.manager is not None:
                span = await self.manager.wait_for_span()
                if span is None:  # stopped while waiting: nothing to drain
                    self.state = ServerState.OFFLINE
                    await run_bounded("announcing OFFLINE", self._announce(wait=False), 5.0)
                    return
                await self._load_assigned_span(*span)
            await self._serve_span()
        finally:
            if self.manager is not None:
                await self.manager.close()
        if self._failure is not None:
            raise self._failure

    def fail(self, error: BaseException) -> None:
        """Stop serving because of `error`; `serve` raises it once the server has left."""
        self._failure = error
        self.stopped.set()

    async def _serve_span(self) -> None:
        p2p = await self.dht.replicate_p2p()
        await self._start_direct_streams()
        dialer = DirectDialer(self.identity.private_key) if self.direct is not None else None
        self.streams = StreamOpener(
            p2p, dialer, lambda peer: self.next_rtts.direct_address(peer, self.config.direct_max_rtt)
        )
        self.bulk_streams = StreamOpener(p2p, dialer, self.next_rtts.announced_address)
        await self.served.install(p2p, self.config.dht_prefix, self._new_servicer)
        freeze_start_up_objects()
        if self.reachability == Reachability.DIRECT:
            await DialBackService(p2p).add_p2p_handlers(p2p)  # check other servers' reachability too
        self.state = ServerState.ONLINE
        await self._announce(wait=False)
        logger.info("online: serving blocks %s as %s", self.span_text, self.peer_id)
        follower = asyncio.create_task(self.manager.follow(p2p)) if self.manager is not None else None
        prober = start_link_probes(self, self.bulk_streams)
        pinger = self._start_next_server_pings(p2p)
        try:
            await self._announce_until_stopped()
        finally:
            self.stopped.set()  # also when announcing failed: the follower must not outlive serving
            for task in (prober, pinger):
                if task is not None:
                    task.cancel()
            if follower is not None:
                await stop_follower(follower)
            await self._leave(p2p)

    async def _start_direct_streams(self) -> None:
        """Listen for direct streams, unless turned off or there is no address to announce for them."""
        config = self.config
        if config.no_direct_streams or self.direct is not None:
            return
        announced = config.announce_host or config.host
        try:
            unspecified = ipaddress.ip_address(announced).is_unspecified
        except ValueError:  # a host name: peers resolve it
            unspecified = False
        if unspecified:
            logger.info("direct streams off: --host %s needs an --announce-host peers can dial", announced)
            return
        self.direct = DirectListener(self.identity.private_key, self.peer_id, config.host, config.direct_port)
        try:
            await self.direct.start()
        except OSError as error:  # a taken --direct-port: libp2p still serves every stream
            logger.warning(
                "direct streams off: cannot listen on %s:%d: %s", config.host, config.direct_port, error
            )
            self.direct = None
            return
        host = f"[{announced}]" if ":" in announced else announced
        self.direct_address = f"{host}:{self.direct.port}"

    def _start_next_server_pings(self, p2p: P2P) -> asyncio.Task | None:
        """The task that measures our round trips to the servers after our span (None when
        `--next-ping-period 0`), for whatever span is served now."""
        config = self.config
        if config.next_ping_period <= 0:
            return None
        secret = config.swarm_secret

        async def ping(peer: str) -> None:
            proof = secret.session_proof(self.peer_id, peer) if secret is not None else ""
            stub = BlockRpc.get_stub(p2p, PeerID.from_base58(peer), namespace=config.dht_prefix)
            await stub.rpc_info(encode(InfoRequest(swarm_proof=proof)), timeout=PING_TIMEOUT)

        def span() -> tuple[int, int] | None:
            served = self.served
            return (served.start, served.end) if served is not None and served.servicer is not None else None

        fetch = partial(fetch_servers_async, self.dht, config.dht_prefix, self.limits)
        pings = ping_next_servers_forever(
            ping, config.next_ping_period, fetch, self.peer_id, span, self.next_rtts
        )
        return asyncio.create_task(pings)

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

    def _measure_timings(self, span: TransformerSpan) -> BlockTimings:
        """`tau` and `tau_prefill` of `span`'s blocks as announced: measured (cached on disk), plus
        the emulated delay of a one-token step and of a `prefill_tokens` prefill (`emulated_delay`)."""
        config = self.config
        timings = cached_block_timings(span, config.prefill_tokens)
        delay, per_token = config.compute_delay, config.compute_delay_per_token
        return dataclasses.replace(
            timings,
            tau=timings.tau + emulated_seconds_per_block(delay, per_token, 1),
            tau_prefill=timings.tau_prefill
            + emulated_seconds_per_block(delay, per_token, config.prefill_tokens),
        )

    def _new_servicer(self, span: TransformerSpan, budget: CacheBudget) -> BlockServicer:
        if self.session_limit(span) < self.config.max_length:
            logger.info(
                "sessions capped at %d positions (the model's sliding attention window; --max-length %d)",
                self.session_limit(span),
                self.config.max_length,
            )
        return BlockServicer(
            span,
            budget,
            max_length=self.session_limit(span),
            max_batch_size=self.config.max_batch_size,
            session_idle_timeout=self.config.session_idle_timeout,
            compute_delay=self.config.compute_delay,
            compute_delay_per_token=self.config.compute_delay_per_token,
            compute_delay_overlap=self.config.compute_delay_overlap,
            batch_wait_ms=self.config.batch_wait_ms,
            prefill_chunk=self.config.prefill_chunk,
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
            direct=self.direct,
            streams=self.streams,
            bulk_streams=self.bulk_streams,
        )

    async def _announce_until_stopped(self) -> None:
        """Re-announce every period while sessions are open, every `idle_announce_factor` periods while
        none is (an idle server costs the swarm little: each announcement is a DHT store that other
        servers check), and once the open sessions settle after a change (`_sessions_settled`)."""
        loop = asyncio.get_running_loop()
        next_periodic = loop.time() + self._heartbeat_period()
        while not self.stopped.is_set():
            timeout = max(next_periodic - loop.time(), 0)
            await self._sessions_change_or_stop(timeout)
            if self.stopped.is_set():
                return
            periodic = not self._sessions_changed.is_set()
            if not periodic:
                await self._sessions_settled()
                if self.stopped.is_set():
                    return
                next_periodic = min(next_periodic, loop.time() + self._heartbeat_period())
            else:
                next_periodic = loop.time() + self._heartbeat_period()
                await self._follow_relay_state()
            await self.announce_quietly(legacy=periodic)

    async def _sessions_settled(self) -> None:
        """Wait until the open sessions stayed the same for `SESSIONS_SETTLE` s, at most one heartbeat
        period after the first unannounced change; 0.2 s when the cache is full (clients must stop
        choosing us soon). Every announcement is a signed DHT store that the swarm's DHT peers handle:
        one per opened and closed session would put that work next to each generation's first and
        last tokens, while the settled count costs one store per burst of clients."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._heartbeat_period()
        while not self.stopped.is_set():
            self._sessions_changed.clear()
            full = self._budget is not None and self._budget.slots_left(self.slot_bytes) == 0
            wait = min(0.2 if full else SESSIONS_SETTLE, give_up - loop.time())
            if wait <= 0:
                return
            await self._sessions_change_or_stop(wait)  # a stop does not wait for the settling
            if not self._sessions_changed.is_set():
                return

    async def _sessions_change_or_stop(self, timeout: float) -> None:
        """Return once the open sessions change or the server stops, at most after `timeout` s."""
        changed = asyncio.ensure_future(self._sessions_changed.wait())
        stop = asyncio.ensure_future(self.stopped.wait())
        await asyncio.wait([changed, stop], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()
        stop.cancel()

    def _heartbeat_period(self) -> float:
        """Seconds until the next periodic announcement: shorter while sessions are open (their free
        cache changes as they grow), longer while idle; the record's TTL covers the longer one."""
        busy = self.served is not None and self.served.open_sessions > 0
        return self.config.announce_period * (1 if busy else self.config.idle_announce_factor)

    async def announce_quietly(self, legacy: bool = True) -> None:
        try:
            await self._announce(wait=False, legacy=legacy)
        except Exception as error:  # a flaky DHT must not take the server down; retry next period
            logger.warning("announcement failed: %s", error)

    async def sleep_unless_stopped(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stopped.wait(), timeout=max(seconds, 0.0))
        except TimeoutError:
            pass

    async def _leave(self, p2p) -> None:
        """Drain, then stop serving: announce OFFLINE (no new sessions), let open sessions finish for up
        to `drain_timeout`, then close. Every step is bounded: when the whole process group got the
        signal, the DHT process and p2pd may already be gone, and leaving must not hang on them."""
        served = self.served
        self.state = ServerState.OFFLINE
        served.stop_accepting()
        await run_bounded("announcing OFFLINE", self._announce(wait=False), 5.0)
        if served.open_sessions:
            timeout = self.config.drain_timeout
            logger.info("draining: %d sessions open, waiting up to %.0f s", served.open_sessions, timeout)
        if await served.drain(self.config.drain_timeout):
            logger.info("drain time is over: closing %d sessions", served.open_sessions)
        await served.uninstall(p2p, self.config.dht_prefix)
        if self.direct is not None:
            await self.direct.close()

    async def move_to(self, p2p, start: int, end: int, why: str) -> bool:
        """Serve blocks `start:end` instead: refuse new sessions (MOVING), drain open ones for up to
        `drain_timeout`, stop the old servicer, keep the shared blocks and load the missing ones, then
        serve them with a fresh servicer and cache budget. False if stopped while draining (leaving
        then drains what is left)."""
        config, loop, old = self.config, asyncio.get_running_loop(), self.served
        began = loop.time()
        self.state = ServerState.MOVING
        old.stop_accepting()
        await run_bounded("announcing MOVING", self._announce(wait=False), 5.0)
        logger.info(
            "moving from blocks %s to %d:%d (%s): draining %d sessions for up to %.0f s",
            old.text,
            start,
            end,
            why,
            old.open_sessions,
            config.drain_timeout,
        )
        unfinished = await old.drain(config.drain_timeout, self.stopped)
        if self.stopped.is_set():
            logger.info("stopping while moving: the move to %d:%d is abandoned", start, end)
            return False
        switch_began = loop.time()
        await old.uninstall(p2p, config.dht_prefix)
        gc.unfreeze()  # the blocks this move drops must be collectable again
        span, reused, loaded = await asyncio.to_thread(rebuild_span, old.span, config.model_dir, start, end)
        self.served = self._activate(span, start, end)
        await self.served.install(p2p, config.dht_prefix, self._new_servicer)
        freeze_start_up_objects()
        self.state = ServerState.ONLINE
        self.metrics.span_changes.inc()
        # logged before announcing: whoever sees the new span online finds the move already recorded
        logger.info(
            "moved blocks %s -> %d:%d (%s): %d blocks reused, %d loaded; drain %.0f ms "
            "(%d sessions cut), switch %.0f ms",
            old.text,
            start,
            end,
            why,
            len(reused),
            len(loaded),
            (switch_began - began) * 1e3,
            unfinished,
            (loop.time() - switch_began) * 1e3,
        )
        await self.announce_quietly()
        return True

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.identity is not None and self.config.identity_path is None:
            forget_identity(self.identity)  # a per-run key: nobody needs it after us


def freeze_start_up_objects() -> None:
    """Leave what loading made (torch, transformers, the blocks' modules: about 400,000 objects) out
    of garbage collection until the next move (which unfreezes them first). A full collection walks
    every tracked object: 80-200 ms with them, in the middle of whatever step is running; without
    them, what serving allocates. (No collection first: one costs those same 80-200 ms at every
    start, and loading leaves little garbage in cycles.)"""
    gc.freeze()
