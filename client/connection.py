"""The client's view of the swarm: a client-mode DHT peer and the parts that read it: the server
records (`ServerRoster`), round trips to servers (`ServerProbes`), the servers it avoids
(`ServerBans`) and the search for a chain through them (`ChainSearch`).

All network work runs as coroutines on hivemind's background event loop (`RemoteExpertWorker`);
`run_sync` lets synchronous code (such as `transformers`' `generate()`) wait for them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import uuid

from hivemind.dht import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID

from llm_swarm.client.chain_search import ChainSearch
from llm_swarm.client.options import ClientOptions
from llm_swarm.client.server_bans import ServerBans
from llm_swarm.client.server_probes import ServerProbes
from llm_swarm.client.server_roster import ServerRoster, log_failed_read
from llm_swarm.swarm.block_rpc import BlockRpc
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.dht_peer import PeerIdentity, forget_identity, open_identity, start_dht
from llm_swarm.swarm.direct_dialer import DirectDialer
from llm_swarm.swarm.errors import SwarmUnavailable, SwarmUserError
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.scheduler_link import SchedulerLink
from llm_swarm.swarm.stream_opener import StreamOpener
from llm_swarm.swarm.wire import InfoRequest, Report, encode

logger = logging.getLogger(__name__)

__all__ = ["ClientOptions", "SwarmConnection", "SwarmUnavailable", "run_sync"]


def run_sync(coroutine):
    """Run a coroutine on hivemind's background loop and wait for its result."""
    return RemoteExpertWorker.run_coroutine(coroutine)


def start_client_dht(
    initial_peers: list[str], identity: PeerIdentity, swarm_secret: SwarmSecret | None = None
) -> DHT:
    """A client-mode DHT peer that validates what it reads, ready (bounded, retried). Its key is ours
    (not only its p2p daemon's), so that direct streams can prove the same peer id libp2p does."""
    return start_dht(initial_peers, identity=identity, secret=swarm_secret)


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
        self.options = options = options or ClientOptions()
        self.identity = open_identity(None)  # a key of this run, deleted at shutdown
        try:
            self.dht = start_client_dht(initial_peers, self.identity, options.swarm_secret)
        except BaseException:
            forget_identity(self.identity)
            raise
        self._closed = False
        atexit.register(self._shutdown_at_exit)
        self.p2p = run_sync(self.dht.replicate_p2p())
        self.peer_id = self.dht.peer_id.to_base58()
        self.roster = ServerRoster(self.dht, prefix, self.limits, options, read_id=self.client_id)
        self.probes = ServerProbes(self._ping, options)
        self.bans = ServerBans(options)
        self.streams = StreamOpener(
            self.p2p,
            DirectDialer(self.identity.private_key) if options.direct_streams else None,
            self._direct_address,
        )
        self.chains = ChainSearch(
            self.roster, self.probes, self.bans, options, self.num_blocks, self.limits.block_windows
        )
        self._warming: asyncio.Future | None = None
        # (server A, server B) -> bytes/s measured by a cache hand-off from A to B (client/remote.py)
        self.link_rates: dict[tuple[str, str], float] = {}
        self.verified_steps = 0  # steps a replica confirmed
        self.unverifiable_steps = 0  # steps whose only replicas were of a kind that cannot check them
        self._reports: set[asyncio.Task] = set()  # reports of wrong outputs on their way
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
        # what the first route needs, begun now (as PETALS' sequence manager does), so that it overlaps
        # with loading the client's modules and the caller's own set-up instead of following them
        run_sync(self._begin_warm_up())

    async def _begin_warm_up(self) -> None:
        first_read = self.roster.begin()
        self._warming = asyncio.ensure_future(self._warm_up(first_read))
        self._warming.add_done_callback(log_failed_read)

    async def _warm_up(self, first_read: asyncio.Future) -> None:
        """The first read of the server records, then pings of the servers that a route over the whole
        model asks first (a route in the meantime shares both instead of repeating them)."""
        await first_read
        await self.chains.candidates()

    def _direct_address(self, peer_id: str) -> str | None:
        """Where to open streams to `peer_id` directly: announced, and the server near (its measured
        round trip within `direct_max_rtt`); None: over libp2p."""
        info = self.roster.known.get(peer_id)
        if info is None or not info.direct_address:
            return None
        rtt = self.probes.measured().get(peer_id)
        return info.direct_address if rtt is not None and rtt <= self.options.direct_max_rtt else None

    def stub(self, peer_id: str):
        return BlockRpc.get_stub(self.p2p, PeerID.from_base58(peer_id), namespace=self.prefix)

    def swarm_proof(self, peer_id: str) -> str:
        """What proves to server `peer_id` that we hold the closed swarm's secret ("" in open swarms)."""
        secret = self.options.swarm_secret
        return secret.session_proof(self.peer_id, peer_id) if secret is not None else ""

    async def _ping(self, peer_id: str) -> None:
        """The call whose round trip `ServerProbes` measures: an info request."""
        request = encode(InfoRequest(swarm_proof=self.swarm_proof(peer_id)))
        await self.stub(peer_id).rpc_info(request, timeout=self.options.ping_timeout)

    # --- failures ---------------------------------------------------------------------------------
    def ban(self, peer_id: str) -> float:
        """Avoid a failed server for a while (`ServerBans.ban`) and measure it afresh afterwards."""
        self.probes.forget(peer_id)
        return self.bans.ban(peer_id)

    def ban_liar(
        self, peer_id: str, blocks: tuple[int, int], reason: str, relative_difference: float = 0.0
    ) -> None:
        """A server outvoted by two replicas (`reason` "outvoted") or sending what no honest server
        sends ("malformed"): avoided for `liar_ban` seconds, counted, and told (in the background), so
        that an honest operator whose GPU or quantization went bad sees it in the server's metrics."""
        self.bans.ban_liar(peer_id)
        self.probes.forget(peer_id)
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

    def refused(self, peer_id: str, message: str = "") -> bool:
        """A "no cache room" answer (`ServerBans.refused`); True once the server is banned for it."""
        banned = self.bans.refused(peer_id, message)
        if banned:
            self.probes.forget(peer_id)
        return banned

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
            forget_identity(self.identity)

    async def _stop_reading(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
        self.roster.cancel()
        self.probes.cancel()

    def _shutdown_at_exit(self) -> None:
        """A script that never called `shutdown()` still leaves quietly: at exit, while the event loops
        still run (later, hivemind's finalizers would print tracebacks about missing loops)."""
        with contextlib.suppress(Exception):
            self.shutdown()
