"""Finding a chain of servers for a session: which servers may serve it now, which of them to ping,
and the fastest chain over the ones that answered (`client.routing.choose_chain`), widening the
search while none forms and waiting with backoff while no chain has cache room."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Sequence

from llm_swarm.client.options import ClientOptions
from llm_swarm.client.routing import Candidate, choose_chain, probe_shortlist, uncovered_blocks
from llm_swarm.client.server_bans import ServerBans
from llm_swarm.client.server_probes import ServerProbes
from llm_swarm.client.server_roster import ServerRoster
from llm_swarm.swarm.errors import SwarmUnavailable
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.server_info import ServerInfo

PROBE_WIDEN_AFTER = 1.0  # seconds without a chain before routing pings 4x more servers per block
PROBE_GRACE = 0.15  # once a chain exists, seconds the pings still out get to answer
# a swarm named after a Hub commit (`swarm.dht_keys.default_prefix`): its servers run that commit only
COMMIT_SUFFIX = re.compile(r"\.[0-9a-f]{12}$")
REVISION_HINT = " (this swarm serves one commit of the model: servers of other revisions are in other swarms)"


class ChainSearch:
    def __init__(
        self,
        roster: ServerRoster,
        probes: ServerProbes,
        bans: ServerBans,
        options: ClientOptions,
        num_blocks: int,
        block_windows: Sequence[int | None] = (),
    ):
        self.roster, self.probes, self.bans, self.options = roster, probes, bans, options
        self.num_blocks = num_blocks
        # each block's sliding window (None: full attention): a sliding block's cache room is its ring
        self.block_windows = block_windows

    def routable_among(self, servers: dict[str, ServerInfo], phase: str = "decode") -> dict[str, ServerInfo]:
        """The servers of `servers` a session may use now for `phase` (which servers' roles fit,
        `ServerRole.serves`: sessions route to "decode" servers (decode and both), a disaggregated
        prompt to "prefill" ones)."""
        # only servers that say they serve are worth a ping: a JOINING one has no handlers yet, an
        # UNREACHABLE one (behind NAT without a relay) cannot be dialed at all, and one that just
        # failed to answer is skipped until `failed_ping_ttl` has passed
        adapter = self.options.active_adapter
        return {
            peer: info
            for peer, info in servers.items()
            if info.routable
            and not self.bans.is_banned(peer)
            and not self.probes.recently_unanswered(peer)
            and (adapter is None or adapter in info.adapters)
            and info.role.serves(phase)
        }

    async def _routable(self, refresh: bool, phase: str = "decode") -> dict[str, ServerInfo]:
        return self.routable_among(await self.roster.servers(refresh), phase)

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
            self.probes.answered(),
            start,
            end,
            breadth if breadth is not None else self.options.probe_per_block,
            await self.roster.live_peers(),
        )
        servers = {peer: routable[peer] for peer in shortlist}
        rtts = await asyncio.gather(*(self.probes.rtt(peer) for peer in servers))
        return [
            Candidate(peer, info, rtt)
            for (peer, info), rtt in zip(servers.items(), rtts, strict=True)
            if rtt < math.inf
        ]

    async def _probe_for_chain(
        self,
        refresh: bool,
        start: int,
        end: int,
        shape: SessionShape,
        phase: str = "decode",
        pushed: bool = False,
    ) -> tuple[list[Candidate], list[RouteHop] | None]:
        """Ping a shortlist and widen it 4x every `PROBE_WIDEN_AFTER` seconds in which no chain formed,
        without waiting for the pings still out: in a swarm full of dead records, each of which takes
        a slow failed lookup, the rounds overlap instead of adding up. Once a chain exists, pings
        still out get `PROBE_GRACE` to answer (a faster server may be among them), then the best
        chain among those that answered is returned; pings left running fill the RTT cache."""
        servers = await self._routable(refresh, phase)
        known = self.roster.known  # a read landing meanwhile (the rest of the first one) adds candidates
        # where the prompts of a session may run instead (`client/remote.py`)
        disaggregating = phase == "decode" and self.options.disaggregate != "never"
        prefill = self.routable_among(known, "prefill") if disaggregating else {}
        live = await self.roster.live_peers()
        loop = asyncio.get_running_loop()
        breadth, widened_at, chain_since = self.options.probe_per_block, loop.time(), None
        pings: dict[str, asyncio.Future] = {}

        def ping_shortlist() -> None:
            for peer in probe_shortlist(servers, self.probes.answered(), start, end, breadth, live):
                if peer not in pings:
                    pings[peer] = asyncio.ensure_future(self.probes.rtt(peer))

        ping_shortlist()
        while True:
            if self.roster.known is not known:
                known, servers = self.roster.known, self.routable_among(self.roster.known, phase)
                prefill = self.routable_among(known, "prefill") if disaggregating else {}
                live = await self.roster.live_peers()
                ping_shortlist()
            answered = [
                Candidate(peer, servers[peer], ping.result())
                for peer, ping in pings.items()
                if ping.done() and not ping.cancelled() and ping.result() < math.inf  # rtt() never raises
            ]
            chain = choose_chain(
                answered,
                start,
                end,
                shape,
                prefill_servers=prefill,
                block_windows=self.block_windows,
                pushed=pushed,
            )
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
        self,
        start: int,
        end: int,
        shape: SessionShape,
        phase: str = "decode",
        patient: bool = True,
        pushed: bool = False,
    ) -> list[RouteHop]:
        """The fastest chain over `[start, end)` with cache room; waits with backoff while none has room
        (not `patient`: one more try on fresh records, then raises: for a move only worth doing now).
        `pushed`: for a chain session, whose servers push to each other (`routing.choose_chain`)."""
        deadline = time.monotonic() + (self.options.wait_for_room if patient else 0.0)
        missing_deadline = time.monotonic() + (self.options.wait_for_servers if patient else 0.0)
        delay = 0.1
        refresh = False
        while True:
            candidates, chain = await self._probe_for_chain(refresh, start, end, shape, phase, pushed)
            if chain is not None:
                return chain
            if not patient and not refresh:  # the records may predate the server that would take it
                refresh = True
                continue
            missing = uncovered_blocks(candidates, start, end)
            if missing:
                if time.monotonic() > missing_deadline:
                    adapter = self.options.active_adapter
                    prefix = self.roster.prefix
                    raise SwarmUnavailable(
                        f"no online server holds blocks {_ranges(missing)} of {prefix}"
                        + (f" with adapter {adapter!r}" if adapter else "")
                        + (REVISION_HINT if COMMIT_SUFFIX.search(prefix) else "")
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


def _ranges(blocks: list[int]) -> str:
    runs, first = [], blocks[0]
    for previous, block in zip(blocks, blocks[1:] + [None], strict=True):
        if block != previous + 1:
            runs.append(f"{first}:{previous + 1}")
            first = block
    return ", ".join(runs)
