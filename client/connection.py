"""The client's view of the swarm: a client-mode DHT peer, server records, RTT probes and bans.

All network work runs as coroutines on hivemind's background event loop (`RemoteExpertWorker`);
`run_sync` lets synchronous code (such as `transformers`' `generate()`) wait for them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import math
import re
import time
import uuid

from hivemind.dht import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID

from llm_swarm.client.options import ClientOptions
from llm_swarm.client.routing import Candidate, choose_chain, probe_shortlist, uncovered_blocks
from llm_swarm.swarm.block_rpc import BlockRpc
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.dht_peer import start_dht
from llm_swarm.swarm.dht_records import (
    answered_peers_async,
    fetch_servers_async,
    fetch_servers_covering,
    finish_covering_read,
)
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.scheduler_link import SchedulerLink
from llm_swarm.swarm.server_info import ServerInfo
from llm_swarm.swarm.wire import PEER_LIMIT_PREFIX, InfoRequest, Report, encode

logger = logging.getLogger(__name__)

__all__ = ["ClientOptions", "SwarmConnection", "SwarmUnavailable", "run_sync"]  # ClientOptions: its old home


PROBE_WIDEN_AFTER = 1.0  # seconds without a chain before routing pings 4x more servers per block
PROBE_GRACE = 0.15  # once a chain exists, seconds the pings still out get to answer
STALE_LIMIT = 10  # server records older than this many refresh periods are re-read before use
# a swarm named after a Hub commit (`swarm.dht_keys.default_prefix`): its servers run that commit only
COMMIT_SUFFIX = re.compile(r"\.[0-9a-f]{12}$")
REVISION_HINT = " (this swarm serves one commit of the model: servers of other revisions are in other swarms)"


class SwarmUnavailable(SwarmUserError):
    """The swarm cannot serve the request (blocks not served, or no room for too long)."""


def run_sync(coroutine):
    """Run a coroutine on hivemind's background loop and wait for its result."""
    return RemoteExpertWorker.run_coroutine(coroutine)


def start_client_dht(initial_peers: list[str], swarm_secret: SwarmSecret | None = None) -> DHT:
    """A client-mode DHT peer that validates what it reads, ready (bounded, retried)."""
    return start_dht(initial_peers, secret=swarm_secret)


class SwarmConnection:
    def __init__(
        self,
        initial_peers: list[str],
        prefix: str,
        limits: ModelLimits | int,
        options: ClientOptions | None = None,
    ):
        if not initial_peers:
            raise SwarmUserError("initial_peers is empty: give the multiaddr of at least one DHT peer")
        self.limits = limits if isinstance(limits, ModelLimits) else ModelLimits(num_blocks=limits)
        self.prefix, self.num_blocks = prefix, self.limits.num_blocks
        self.client_id = uuid.uuid4().hex  # how the scheduler tells this client's RTT reports apart
        self.options = options or ClientOptions()
        self.dht = start_client_dht(initial_peers, self.options.swarm_secret)
        self._closed = False
        atexit.register(self._shutdown_at_exit)
        self.p2p = run_sync(self.dht.replicate_p2p())
        self.peer_id = self.dht.peer_id.to_base58()
        self._servers: dict[str, ServerInfo] = {}
        self._fetched_at = -math.inf
        self._reading: asyncio.Future | None = None  # a background read of the server records
        self._rest_of_first_read: asyncio.Future | None = None  # what the first read left to the background
        self._first_read: asyncio.Future | None = None  # begun at start-up: see `_begin_warm_up`
        self._warming: asyncio.Future | None = None
        self._rtts: dict[str, tuple[float, float]] = {}  # peer -> (rtt seconds, measured at)
        self._pinging: dict[str, asyncio.Future] = {}  # peer -> its ping in flight (callers share it)
        self._live_at_start: set[str] = set()  # peers the first read knew alive (see `_live_peers`)
        self._bans: dict[str, tuple[int, float]] = {}  # peer -> (failures so far, banned until)
        self._refusals: dict[str, int] = {}  # peer -> "no cache room" answers while announcing room
        # (server A, server B) -> bytes/s measured by a cache hand-off from A to B (client/remote.py)
        self.link_rates: dict[tuple[str, str], float] = {}
        self.caught: dict[str, int] = {}  # peer -> steps where replicas outvoted it (wrong outputs)
        self.verified_steps = 0  # steps a replica confirmed
        self.unverifiable_steps = 0  # steps whose only replicas were of a kind that cannot check them
        self._reports: set[asyncio.Task] = set()  # reports of wrong outputs on their way
        options = self.options
        self.scheduler = (
            SchedulerLink(
                self.dht,
                prefix,
                options.scheduler_key,
                timeout=options.scheduler_timeout,
                retry_after=options.scheduler_retry,
                distrust_for=options.scheduler_distrust,
                swarm_secret=options.swarm_secret,
            )
            if options.use_scheduler and options.scheduler_key is not None
            else None
        )
        self.no_cache_room_refusals = (
            0  # sessions a server refused for lack of cache (for operators and tests)
        )
        # what the first route needs, begun now (as PETALS' sequence manager does), so that it overlaps
        # with loading the client's modules and the caller's own set-up instead of following them
        run_sync(self._begin_warm_up())

    async def _begin_warm_up(self) -> None:
        self._first_read = asyncio.ensure_future(self._read_servers())
        self._warming = asyncio.ensure_future(self._warm_up())
        self._warming.add_done_callback(_log_failed_read)

    async def _warm_up(self) -> None:
        """The first read of the server records, then pings of the servers that a route over the whole
        model asks first (a route in the meantime shares both instead of repeating them)."""
        await self._first_read
        await self.candidates()

    # --- what the swarm looks like ----------------------------------------------------------------
    async def servers(self, refresh: bool = False) -> dict[str, ServerInfo]:
        """The swarm's server records. The first read, an explicit `refresh` (after a failure) and a
        read older than `STALE_LIMIT` refresh periods are waited for; otherwise an expired list is
        returned as it is while a new one is read in the background, so routing never waits on the
        DHT (reading and checking a large swarm's records takes longer than choosing a chain)."""
        if self._fetched_at == -math.inf and self._first_read is not None and not self._first_read.done():
            await asyncio.wait([self._first_read])  # begun at start-up (if it fails, read again below)
        age = time.monotonic() - self._fetched_at
        if refresh or age > STALE_LIMIT * self.options.refresh_period:
            await self._read_servers()
        elif age > self.options.refresh_period and (self._reading is None or self._reading.done()):
            self._reading = asyncio.ensure_future(self._read_servers())
            self._reading.add_done_callback(_log_failed_read)
        return self._servers

    async def _live_peers(self) -> set[str]:
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

    async def _stop_reading(self) -> None:
        for task in (self._first_read, self._warming, self._reading, *list(self._pinging.values())):
            if task is not None:
                task.cancel()

    async def _read_servers(self) -> None:
        if self._fetched_at > -math.inf:
            self._servers = await fetch_servers_async(self.dht, self.prefix, self.limits)
            self._fetched_at = time.monotonic()
            return
        # the first read: nothing cached in our DHT node yet, so the first value found is as new as any;
        # it ends once the servers found can route the whole model, and the rest follows in the background
        self._servers, complete, self._live_at_start = await fetch_servers_covering(
            self.dht, self.prefix, self.limits, self.options.probe_per_block, read_id=self.client_id
        )
        self._fetched_at = time.monotonic()
        if not complete:
            self._reading = self._rest_of_first_read = asyncio.ensure_future(self._read_rest())
            self._reading.add_done_callback(_log_failed_read)

    async def _read_rest(self) -> None:
        """The whole roster of the first read, once its searches still under way ended."""
        self._servers = await finish_covering_read(self.dht, self.prefix, self.limits, self.client_id)

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

    @property
    def known_servers(self) -> dict[str, ServerInfo]:
        """The server records of the last read (no DHT access)."""
        return self._servers

    def stub(self, peer_id: str):
        return BlockRpc.get_stub(self.p2p, PeerID.from_base58(peer_id), namespace=self.prefix)

    def swarm_proof(self, peer_id: str) -> str:
        """What proves to server `peer_id` that we hold the closed swarm's secret ("" in open swarms)."""
        secret = self.options.swarm_secret
        return secret.session_proof(self.peer_id, peer_id) if secret is not None else ""

    def measured_rtts(self) -> dict[str, float]:
        """Every server this client has pinged and its last round trip (inf: it did not answer)."""
        return {peer: rtt for peer, (rtt, _measured_at) in self._rtts.items()}

    def _answered_rtts(self) -> dict[str, float]:
        return {peer: rtt for peer, (rtt, _measured_at) in self._rtts.items() if rtt < math.inf}

    async def rtt(self, peer_id: str) -> float:
        """Round trip of an info call (includes serialization), cached; inf if the peer does not answer
        within `ping_timeout` (a record may name a peer that does not exist). A failure is cached only
        for `failed_ping_ttl`: a server still starting up answers a moment later."""
        cached = self._rtts.get(peer_id)
        if cached is not None:
            ttl = self.options.rtt_ttl if cached[0] < math.inf else self.options.failed_ping_ttl
            if time.monotonic() - cached[1] < ttl:
                return cached[0]
        if peer_id not in self._pinging:  # the warm-up and a route may want the same server at once
            self._pinging[peer_id] = asyncio.ensure_future(self._ping(peer_id))
            self._pinging[peer_id].add_done_callback(lambda _: self._pinging.pop(peer_id, None))
        return await asyncio.shield(self._pinging[peer_id])

    async def _ping(self, peer_id: str) -> float:
        started = time.perf_counter()
        request = encode(InfoRequest(swarm_proof=self.swarm_proof(peer_id)))
        try:
            await self.stub(peer_id).rpc_info(request, timeout=self.options.ping_timeout)
            rtt = time.perf_counter() - started
        except Exception as error:
            logger.info("server %s does not answer: %s", peer_id[-8:], str(error) or type(error).__name__)
            rtt = math.inf
        self._rtts[peer_id] = (rtt, time.monotonic())
        return rtt

    def ban(self, peer_id: str) -> float:
        """Avoid a failed server for a while, doubling the time at each repeated failure."""
        failures = self._bans.get(peer_id, (0, 0.0))[0] + 1
        duration = min(self.options.ban_base * 2 ** (failures - 1), self.options.ban_max)
        self._avoid(peer_id, duration, failures)
        self._rtts.pop(peer_id, None)
        return duration

    def ban_liar(
        self, peer_id: str, blocks: tuple[int, int], reason: str, relative_difference: float = 0.0
    ) -> None:
        """A server outvoted by two replicas (`reason` "outvoted") or sending what no honest server
        sends ("malformed"): avoided for `liar_ban` seconds, counted, and told (in the background), so
        that an honest operator whose GPU or quantization went bad sees it in the server's metrics."""
        self.caught[peer_id] = self.caught.get(peer_id, 0) + 1
        self._avoid(peer_id, self.options.liar_ban, self._bans.get(peer_id, (0, 0.0))[0] + 1)
        self._rtts.pop(peer_id, None)
        report = Report(
            start=blocks[0],
            end=blocks[1],
            reason=reason,
            relative_difference=min(relative_difference, 1e30) if relative_difference >= 0 else 1e30,
            swarm_proof=self.swarm_proof(peer_id),
        )
        task = asyncio.get_running_loop().create_task(self._report(peer_id, report))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report(self, peer_id: str, report: Report) -> None:
        try:
            await self.stub(peer_id).rpc_report(encode(report), timeout=self.options.ping_timeout)
        except Exception as error:  # a liar need not listen; nothing depends on this
            logger.debug("report to %s not delivered: %s", peer_id[-8:], error)

    def blame(self, peer_id: str, error: BaseException) -> None:
        """A server's request failed: a wrong output bans it for long (`ban_liar`), anything else for
        a while (`ban`)."""
        if not peer_id:
            return
        blocks = getattr(error, "blocks", None)
        if getattr(error, "wrong_output", False) and blocks is not None:
            self.ban_liar(peer_id, blocks, "malformed")
            logger.warning("server %s %s: banned for %.0f s", peer_id[-8:], error, self.options.liar_ban)
        else:
            duration = self.ban(peer_id)
            logger.warning(
                "server %s failed (%s); avoiding it for %.0f s",
                peer_id[-8:],
                str(error) or type(error).__name__,
                duration,
            )

    def _avoid(self, peer_id: str, seconds: float, failures: int) -> None:
        self._bans[peer_id] = (failures, time.monotonic() + seconds)

    def is_banned(self, peer_id: str) -> bool:
        ban = self._bans.get(peer_id)
        return ban is not None and ban[1] > time.monotonic()

    def refused(self, peer_id: str, message: str = "") -> bool:
        """Count a "no cache room" answer from a server whose record announced room; True (and a ban)
        once it keeps refusing: a server that announces room it never grants only wastes our time.
        A refusal for our own per-peer share is no fault of the server's: it is not counted."""
        self.no_cache_room_refusals += 1
        if message.startswith(PEER_LIMIT_PREFIX):  # our own share there is used up: go elsewhere a while
            self._avoid(peer_id, self.options.ban_base, self._bans.get(peer_id, (0, 0.0))[0])
            return False
        self._refusals[peer_id] = self._refusals.get(peer_id, 0) + 1
        if self._refusals[peer_id] < self.options.max_refusals:
            return False
        self._refusals.pop(peer_id)
        duration = self.ban(peer_id)
        logger.warning(
            "server %s refused %d sessions while announcing cache room: avoiding it for %.0f s",
            peer_id[-8:],
            self.options.max_refusals,
            duration,
        )
        return True

    async def _routable(self, refresh: bool, phase: str = "decode") -> dict[str, ServerInfo]:
        return self._routable_among(await self.servers(refresh), phase)

    def _routable_among(self, servers: dict[str, ServerInfo], phase: str = "decode") -> dict[str, ServerInfo]:
        """`phase`: which servers' roles fit (`ServerRole.serves`): sessions route to "decode" servers
        (decode and both), a disaggregated prompt to "prefill" ones."""
        # only servers that say they serve are worth a ping: a JOINING one has no handlers yet, an
        # UNREACHABLE one (behind NAT without a relay) cannot be dialed at all, and one that just
        # failed to answer is skipped until `failed_ping_ttl` has passed
        adapter = self.options.active_adapter
        return {
            peer: info
            for peer, info in servers.items()
            if info.routable
            and not self.is_banned(peer)
            and not self._recently_unanswered(peer)
            and (adapter is None or adapter in info.adapters)
            and info.role.serves(phase)
        }

    def routable_among(self, servers: dict[str, ServerInfo], phase: str = "decode") -> dict[str, ServerInfo]:
        """The servers of `servers` a session may use now for `phase` (see `_routable_among`)."""
        return self._routable_among(servers, phase)

    def _recently_unanswered(self, peer_id: str) -> bool:
        cached = self._rtts.get(peer_id)
        return (
            cached is not None
            and cached[0] == math.inf
            and time.monotonic() - cached[1] < self.options.failed_ping_ttl
        )

    async def candidates(
        self, refresh: bool = False, blocks: tuple[int, int] | None = None, breadth: int | None = None
    ) -> list[Candidate]:
        """Servers to route `blocks` (default: the whole model) through, with measured round trips.

        Only a shortlist is pinged (`routing.probe_shortlist`: `breadth` per block, default
        `options.probe_per_block`), so the work does not grow with the swarm's size."""
        routable = await self._routable(refresh)
        start, end = blocks if blocks is not None else (0, self.num_blocks)
        shortlist = probe_shortlist(
            routable,
            self._answered_rtts(),
            start,
            end,
            breadth if breadth is not None else self.options.probe_per_block,
            await self._live_peers(),
        )
        servers = {peer: routable[peer] for peer in shortlist}
        rtts = await asyncio.gather(*(self.rtt(peer) for peer in servers))
        return [
            Candidate(peer, info, rtt)
            for (peer, info), rtt in zip(servers.items(), rtts, strict=True)
            if rtt < math.inf
        ]

    async def _probe_for_chain(
        self, refresh: bool, start: int, end: int, shape: SessionShape, phase: str = "decode"
    ) -> tuple[list[Candidate], list[RouteHop] | None]:
        """Ping a shortlist and widen it 4x every `PROBE_WIDEN_AFTER` seconds in which no chain formed,
        without waiting for the pings still out: in a swarm full of dead records, each of which takes
        a slow failed lookup, the rounds overlap instead of adding up. Once a chain exists, pings
        still out get `PROBE_GRACE` to answer (a faster server may be among them), then the best
        chain among those that answered is returned; pings left running fill the RTT cache."""
        servers = await self._routable(refresh, phase)
        known = self._servers  # a read landing meanwhile (the rest of the first one) adds candidates
        # where the prompts of a session may run instead (`client/remote.py`)
        disaggregating = phase == "decode" and self.options.disaggregate != "never"
        prefill = self._routable_among(known, "prefill") if disaggregating else {}
        live = await self._live_peers()
        loop = asyncio.get_running_loop()
        breadth, widened_at, chain_since = self.options.probe_per_block, loop.time(), None
        pings: dict[str, asyncio.Future] = {}

        def ping_shortlist() -> None:
            for peer in probe_shortlist(servers, self._answered_rtts(), start, end, breadth, live):
                if peer not in pings:
                    pings[peer] = asyncio.ensure_future(self.rtt(peer))

        ping_shortlist()
        while True:
            if self._servers is not known:
                known, servers = self._servers, self._routable_among(self._servers, phase)
                prefill = self._routable_among(known, "prefill") if disaggregating else {}
                live = await self._live_peers()
                ping_shortlist()
            answered = [
                Candidate(peer, servers[peer], ping.result())
                for peer, ping in pings.items()
                if ping.done() and not ping.cancelled() and ping.result() < math.inf  # rtt() never raises
            ]
            chain = choose_chain(answered, start, end, shape, prefill_servers=prefill)
            out = [ping for ping in pings.values() if not ping.done()]
            now = loop.time()
            if chain is not None:
                chain_since = now if chain_since is None else chain_since
                if not out or now - chain_since >= PROBE_GRACE:
                    return answered, chain
            elif breadth < len(servers) and (not out or now - widened_at >= PROBE_WIDEN_AFTER):
                breadth, widened_at = breadth * 4, now
                ping_shortlist()
                continue
            elif not out:
                return answered, None  # everyone worth asking answered: no chain (yet)
            await asyncio.wait(out, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)

    async def route(
        self, start: int, end: int, shape: SessionShape, phase: str = "decode", patient: bool = True
    ) -> list[RouteHop]:
        """The fastest chain over `[start, end)` with cache room; waits with backoff while none has room
        (not `patient`: one more try on fresh records, then raises: for a move only worth doing now)."""
        deadline = time.monotonic() + (self.options.wait_for_room if patient else 0.0)
        missing_deadline = time.monotonic() + (self.options.wait_for_servers if patient else 0.0)
        delay = 0.1
        refresh = False
        while True:
            candidates, chain = await self._probe_for_chain(refresh, start, end, shape, phase)
            if chain is not None:
                return chain
            if not patient and not refresh:  # the records may predate the server that would take it
                refresh = True
                continue
            missing = uncovered_blocks(candidates, start, end)
            if missing:
                if time.monotonic() > missing_deadline:
                    adapter = self.options.active_adapter
                    raise SwarmUnavailable(
                        f"no online server holds blocks {_ranges(missing)} of {self.prefix}"
                        + (f" with adapter {adapter!r}" if adapter else "")
                        + (REVISION_HINT if COMMIT_SUFFIX.search(self.prefix) else "")
                    )
            elif time.monotonic() > deadline:
                raise SwarmUnavailable(
                    f"no chain over blocks {start}:{end} had cache room for a session of "
                    f"{shape.max_length} tokens "
                    f"x {shape.batch_size} within {self.options.wait_for_room:.0f} s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            refresh = True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._shutdown_at_exit)
        try:
            run_sync(self._stop_reading())
            if self.scheduler is not None:
                run_sync(self.scheduler.close())
            run_sync(self.p2p.shutdown())
        finally:
            self.dht.shutdown()

    def _shutdown_at_exit(self) -> None:
        """A script that never called `shutdown()` still leaves quietly: at exit, while the event loops
        still run (later, hivemind's finalizers would print tracebacks about missing loops)."""
        with contextlib.suppress(Exception):
            self.shutdown()


def _log_failed_read(reading: asyncio.Future) -> None:
    if not reading.cancelled() and reading.exception() is not None:
        logger.warning("reading the swarm's server records failed: %s", reading.exception())


def _ranges(blocks: list[int]) -> str:
    runs, first = [], blocks[0]
    for previous, block in zip(blocks, blocks[1:] + [None], strict=True):
        if block != previous + 1:
            runs.append(f"{first}:{previous + 1}")
            first = block
    return ", ".join(runs)
