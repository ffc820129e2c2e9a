"""WS-RR: Waiting-penalized Shortest-path Request Routing (Sun et al., eq. 20-21, Alg. 2;
docs/reference.md 3.2).

`RoutingState` is the online half of the two-time-scale scheme: it holds one placement and the
sessions currently routed through each server (expected end time, cache slots), answers routing
queries, and is meant to be kept alive by the scheduler service and the simulator alike.

Times are absolute (any clock the caller uses consistently, e.g. seconds since start): a session
ends at `ends_at`, so its remaining time at query time `now` is `ends_at - now` (clamped at 0 for
a session that overran its estimate but was not reported finished yet).

Waits per link (eq. 20) only change when a session starts or ends at that server, so they are kept
per link as the absolute time at which the link has room ("release time"), recomputed for the
touched servers only; a query then costs a few vector operations plus one pass over the
placement's `sum_j m_j` links (see routing_graph).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms.chain_cost import pushed_handover
from llm_swarm.scheduler.algorithms.problem import ModelSpec, Placement, ServerSpec, placement_cache_slots
from llm_swarm.scheduler.algorithms.routing_graph import Chain, RoutingGraph


@dataclass(frozen=True)
class WsRrRoute:
    """A routing decision: the chain, its path cost, the expected wait and the expected completion."""

    chain: Chain  # chain.cost = sum over hops of (t^W_ij + l_out * t^c_ij)
    wait: float  # max t^W_ij over the hops: when every server on the chain has room
    completion: float  # wait + sum of l_out * t^c_ij: expected time until the request is done
    hop_waits: tuple[float, ...]
    hop_times: tuple[float, ...]  # l_out * t^c_ij per hop (eq. 1 restricted to that server)

    @property
    def cost(self) -> float:
        return self.chain.cost

    def slots_by_server(self) -> dict[int, int]:
        """Cache slots the request holds at each server of the chain: the blocks it processes there."""
        return {hop.server: hop.num_blocks for hop in self.chain.hops}


@dataclass
class _Session:
    slots_by_server: dict[int, int]
    ends_at: float
    order: int  # tie-breaker among equal end times in the per-server lists
    lease_expires_at: float | None


# A session still running past its expected end holds its room this share of its predicted run time
# more (at least OVERDUE_MIN_S), re-estimated whenever it is overdue again: counted as gone, its room
# looks free, eq. 20 predicts no wait, and a new session goes to a full server while another has
# room (netem, BENCHMARKS.md "Prefill/decode roles on the emulated swarm").
OVERDUE_SHARE = 0.25
OVERDUE_MIN_S = 0.05


def overdue_end(now: float, run_time: float) -> float:
    """The re-estimated end of a session that is still running at `now`, past its expected end."""
    return now + max(OVERDUE_SHARE * run_time, OVERDUE_MIN_S)


def link_request_time(
    rtt_prefill: np.ndarray,
    tau_prefill: np.ndarray,
    rtt: np.ndarray,
    tau: np.ndarray,
    blocks: np.ndarray,
    l_out: int,
) -> np.ndarray:
    """`l_out * t^c_ij` (eq. 8 times l_out): one hop's share of eq. 1, for many links at once.

    Same formula and operation order as `swarm.cost.link_time_all_tokens` (the tests check they
    agree): `(t_prefill_cj + q*tau_prefill_j) + (l_out - 1) * (t_cj + q*tau_j)`. Vectorized here
    because a query evaluates every link of the placement.
    """
    return (rtt_prefill + blocks * tau_prefill) + (l_out - 1) * (rtt + blocks * tau)


class RoutingState:
    """A placement plus the sessions routed through it; answers WS-RR queries (docs/reference.md 3.2).

    Servers are referred to by their index in `servers`. Servers need
    `tau`, `tau_prefill` and, for every client they serve, `rtt` and `rtt_prefill`.
    """

    def __init__(self, servers: Sequence[ServerSpec], model: ModelSpec, placement: Placement):
        if len(placement) != len(servers):
            raise ValueError("the placement needs one entry per server")
        missing = [s.name for s in servers if s.tau is None or s.tau_prefill is None]
        if missing:
            raise ValueError(f"WS-RR needs tau and tau_prefill for servers {missing}")
        self.servers = tuple(servers)
        self.graph = RoutingGraph(placement, model.num_blocks)
        self._slots = np.array(placement_cache_slots(servers, model, placement), dtype=np.int64)
        self._used = np.zeros(len(servers), dtype=np.int64)
        links = self.graph.link_server
        self._link_tau = np.array([s.tau for s in servers], dtype=float)[links]
        self._link_tau_prefill = np.array([s.tau_prefill for s in servers], dtype=float)[links]
        self._link_load: np.ndarray | None = None
        self.set_load_costs([s.tau_per_session for s in servers])
        self._client_rtts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # Absolute time at which each link has room for one more request (eq. 20); -inf = now.
        self._link_release = np.where(self.graph.link_blocks <= self._slots[links], -math.inf, math.inf)
        self._sessions: dict[Hashable, _Session] = {}
        self._by_server: list[list[tuple[float, int, int]]] = [[] for _ in servers]  # (ends_at, order, slots)
        self._held = np.zeros(len(servers))  # sessions each server holds (`_loaded_tau`)
        self._leases: list[tuple[float, int, Hashable]] = []  # heap of (lease_expires_at, order, id)
        self._counter = itertools.count()

    # -- queries -----------------------------------------------------------------------------

    def cache_slots(self, server: int) -> int:
        """`n_j = floor((M_j - s_m*m_j)/s_c)` for the placement this state was built with."""
        return int(self._slots[server])

    def used_slots(self, server: int) -> int:
        return int(self._used[server])

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def route(
        self,
        client: str,
        l_out: int,
        now: float = 0.0,
        prefill_scale: float = 1.0,
        units: float = 1.0,
        server_rtts: np.ndarray | None = None,
    ) -> WsRrRoute | None:
        """The WS-RR route for a new request of `client` arriving at `now` (None: no chain can ever serve it).

        Link cost `t^W_ij + l_out*t^c_ij`; the final hop to the client costs 0 (docs/reference.md 3.2).
        `prefill_scale` multiplies the servers' `tau_prefill` (measured for the problem's prompt
        length) for a request whose own prompt is that many times as long: prefill time is linear
        in the prompt's tokens. `units`: cache slots per block the request holds (a live session of
        its own lengths: `ceil(blocks x units)` slots per link; 1 is Sun et al.'s nominal request),
        so that eq. 20 waits for the room this request needs and a server too full for a long
        session is passed over for one with room. `server_rtts[i, j]`: for a chain session, the
        round trip server i measured to server j (inf: none, the token goes through the client);
        the chain is then priced with `chain_cost.pushed_handover` instead of a round trip per hop.
        Read-only: call `admit` (or `add_session`) to record the decision.
        """
        if l_out < 1:
            raise ValueError(f"l_out must be >= 1, got {l_out}")
        if not (math.isfinite(prefill_scale) and prefill_scale > 0):
            raise ValueError(f"prefill_scale must be positive, got {prefill_scale}")
        if not (math.isfinite(units) and units > 0):
            raise ValueError(f"units must be positive, got {units}")
        rtt_prefill, rtt = self._rtts_of(client)
        tau_prefill = self._link_tau_prefill * prefill_scale
        blocks = self.graph.link_blocks
        pushed = server_rtts is not None
        hop_rtt_prefill, hop_rtt = (np.zeros_like(rtt), np.zeros_like(rtt)) if pushed else (rtt_prefill, rtt)
        times = link_request_time(hop_rtt_prefill, tau_prefill, hop_rtt, self._loaded_tau(), blocks, l_out)
        times[~np.isfinite(rtt_prefill) | ~np.isfinite(rtt)] = math.inf  # no RTT known: no link
        waits = np.maximum(self._releases(units) - now, 0.0)
        if pushed:
            handover, exit_cost = pushed_handover(self._server_client_rtts(client), server_rtts, l_out)
            chain = self.graph.shortest_pushed_chain(waits + times, handover, exit_cost)
        else:
            chain = self.graph.shortest_chain(waits + times)
        if chain is None:
            return None
        used = [self.graph.link_index(hop.server, hop.start) for hop in chain.hops]
        hop_waits = tuple(float(waits[k]) for k in used)
        hop_times = [float(times[k]) for k in used]
        if pushed:  # each hop also carries the token to it, and the last one back to the client
            previous = [0, *(hop.server + 1 for hop in chain.hops[:-1])]
            for n, hop in enumerate(chain.hops):
                hop_times[n] += float(handover[previous[n], hop.server])
            hop_times[-1] += float(exit_cost[chain.hops[-1].server])
        hop_times = tuple(hop_times)
        wait = max(hop_waits)
        return WsRrRoute(chain, wait, wait + sum(hop_times), hop_waits, hop_times)

    def set_load_costs(self, tau_per_session: Sequence[float | None]) -> None:
        """Per server, what each session it holds adds to its `tau` (None or 0: nothing, Sun et al.'s
        model). A session's per-token time on server j is then `tau_j + tau_per_session_j * n_j`, n_j
        the sessions this state holds there: the contended per-iteration cost (linear in the batch,
        as Aladdin and Vidur fit it) instead of the idle one, so that among alike servers a session
        goes where fewer decode (eq. 1 alone sends every session to the one whose idle `tau` was
        measured lowest until its cache is full)."""
        if len(tau_per_session) != len(self.servers):
            raise ValueError("one tau_per_session per server is needed")
        load = np.array([value or 0.0 for value in tau_per_session], dtype=float)
        if not np.all(np.isfinite(load)) or np.any(load < 0):
            raise ValueError("tau_per_session must be finite and >= 0")
        self._link_load = load[self.graph.link_server] if np.any(load > 0) else None

    def _loaded_tau(self) -> np.ndarray:
        """Each link's per-block per-token time with the sessions its server holds now."""
        if self._link_load is None:
            return self._link_tau
        return self._link_tau + self._link_load * self._held[self.graph.link_server]

    def set_client_rtts(
        self, client: str, rtt: Sequence[float], rtt_prefill: Sequence[float] | None = None
    ) -> None:
        """Use per-server round trips `rtt[j]` (and `rtt_prefill[j]`, default the same) for `client`
        from now on, instead of the ones in the server specs: a live scheduler learns RTTs from
        each query. `inf` means the client cannot reach that server."""
        if len(rtt) != len(self.servers) or (rtt_prefill is not None and len(rtt_prefill) != len(rtt)):
            raise ValueError("one round trip per server is needed")
        links = self.graph.link_server
        per_server = np.asarray(rtt, dtype=float)
        per_server_prefill = per_server if rtt_prefill is None else np.asarray(rtt_prefill, dtype=float)
        self._client_rtts[client] = (per_server_prefill[links], per_server[links])

    # -- session book-keeping ----------------------------------------------------------------

    def admit(self, session_id: Hashable, route: WsRrRoute, now: float, lease_s: float | None = None) -> None:
        """Record a routed request; it holds its slots until ended (expected at `now + completion`)."""
        lease = None if lease_s is None else now + lease_s
        self.add_session(session_id, route.slots_by_server(), now + route.completion, lease)

    def add_session(
        self,
        session_id: Hashable,
        slots_by_server: Mapping[int, int],
        ends_at: float,
        lease_expires_at: float | None = None,
    ) -> None:
        """Record a session holding `slots_by_server` until about `ends_at` (or `lease_expires_at`)."""
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} is already active")
        if any(slots <= 0 for slots in slots_by_server.values()):
            raise ValueError("a session holds at least one slot on each of its servers")
        order = next(self._counter)
        session = _Session(dict(slots_by_server), float(ends_at), order, lease_expires_at)
        self._sessions[session_id] = session
        for server, slots in session.slots_by_server.items():
            bisect.insort(self._by_server[server], (session.ends_at, order, slots))
            self._used[server] += slots
            self._held[server] += 1
            self._refresh_server(server)
        if lease_expires_at is not None:
            heapq.heappush(self._leases, (lease_expires_at, order, session_id))

    def reschedule(self, session_id: Hashable, ends_at: float) -> None:
        """A session now expects to end at `ends_at` (e.g. admitted earlier or later than predicted);
        nothing happens for a session this state does not hold (none of its servers is in it)."""
        session = self._sessions.get(session_id)
        if session is None:
            return
        for server, slots in session.slots_by_server.items():
            entries = self._by_server[server]
            del entries[bisect.bisect_left(entries, (session.ends_at, session.order, slots))]
            bisect.insort(entries, (float(ends_at), session.order, slots))
            self._refresh_server(server)
        session.ends_at = float(ends_at)

    def end_session(self, session_id: Hashable) -> bool:
        """Forget a session (the client reported its end); False if it was not active."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        for server, slots in session.slots_by_server.items():
            entries = self._by_server[server]
            del entries[bisect.bisect_left(entries, (session.ends_at, session.order, slots))]
            self._used[server] -= slots
            self._held[server] -= 1
            self._refresh_server(server)
        return True

    def expire(self, now: float) -> list[Hashable]:
        """Forget every session whose lease expired by `now` (its client vanished); returns their ids."""
        expired = []
        while self._leases and self._leases[0][0] <= now:
            _, order, session_id = heapq.heappop(self._leases)
            session = self._sessions.get(session_id)
            if session is not None and session.order == order:  # not ended (or re-added) meanwhile
                self.end_session(session_id)
                expired.append(session_id)
        return expired

    # -- internals ---------------------------------------------------------------------------

    def _rtts_of(self, client: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-link (t_prefill_cj, t_cj) of a client; inf where the server has no RTT to it."""
        if client not in self._client_rtts:
            rtt_prefill = np.array([s.rtt_prefill.get(client, math.inf) for s in self.servers], dtype=float)
            rtt = np.array([s.rtt.get(client, math.inf) for s in self.servers], dtype=float)
            links = self.graph.link_server
            self._client_rtts[client] = (rtt_prefill[links], rtt[links])
        return self._client_rtts[client]

    def _server_client_rtts(self, client: str) -> np.ndarray:
        """Per server, the client's decode round trip (inf: unknown), from the per-link table."""
        per_server = np.full(len(self.servers), math.inf)
        per_server[self.graph.link_server] = self._rtts_of(client)[1]
        return per_server

    def _refresh_server(self, server: int) -> None:
        """Eq. 20 for every link into `server` (a nominal request), kept up to date."""
        links = self.graph.server_links(server)
        self._link_release[links] = self._release_times(server, self.graph.link_blocks[links])

    def _releases(self, units: float) -> np.ndarray:
        """Each link's eq. 20 release time for a request of `units` slots per block (computed per
        query unless nominal: a live scheduler's swarm is small)."""
        if units == 1.0:
            return self._link_release
        needed = np.ceil(self.graph.link_blocks * units - 1e-9)
        release = np.full(len(needed), math.inf)
        for server in range(len(self.servers)):
            links = self.graph.server_links(server)
            release[links] = self._release_times(server, needed[links])
        return release

    def _release_times(self, server: int, needed: np.ndarray) -> np.ndarray:
        """The absolute times at which `server`'s sessions free `needed` slots (one per link into it).

        Release the sessions in increasing remaining time until enough slots are free: the link's
        release time is the end of the last one released (inf if even all of them are not enough).
        """
        shortfall = needed - (self._slots[server] - self._used[server])
        entries = self._by_server[server]
        release = np.full(len(shortfall), math.inf)
        if entries:
            ends = np.array([entry[0] for entry in entries])
            freed = np.cumsum([entry[2] for entry in entries])
            last_released = np.searchsorted(freed, shortfall, side="left")
            enough = last_released < len(entries)
            release[enough] = ends[last_released[enough]]
        release[shortfall <= 0] = -math.inf
        return release
