"""Sun, He and Hou: GBP-CR, GCA, JFFC and the Theorem 3.7 bounds (docs/reference.md 3.4), on its worked
examples."""

from __future__ import annotations

import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_swarm.scheduler.algorithms.chains import gbp_cr, gca
from llm_swarm.scheduler.algorithms.feasibility import can_follow
from llm_swarm.scheduler.algorithms.jffc import JffcDispatcher
from llm_swarm.scheduler.algorithms.problem import (
    ModelSpec,
    ServerSpec,
    Span,
    cache_slots,
    placement_cache_slots,
)
from llm_swarm.scheduler.algorithms.queueing import response_time_bounds
from llm_swarm.scheduler.algorithms.tuning import compose, tune_capacity

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

EPS = 1e-3


def fig2_servers() -> list[ServerSpec]:
    """Sun, He and Hou, Fig. 2: M = 3 for j2 and 2 otherwise, tau_c = 2 for j2 and 1 otherwise,
    tau_p = l*eps."""
    return [
        ServerSpec(f"j{i}", 3.0 if i == 2 else 2.0, tau_c=2.0 if i == 2 else 1.0, tau_p=i * EPS)
        for i in range(1, 6)
    ]


FIG2_MODEL = ModelSpec(num_blocks=3, block_bytes=1.0, cache_bytes=0.1)


def test_fig2_gbp_cr_forms_two_disjoint_chains():
    placement = gbp_cr(fig2_servers(), FIG2_MODEL, capacity=1)
    assert placement.chains == ((0, 1), (2, 3, 4))
    # j2 holds 2 blocks and, closing the first chain, is shifted back to end at L.
    assert placement.spans == (Span(0, 1), Span(1, 3), Span(0, 1), Span(1, 2), Span(2, 3))
    # eq. 15: each chain has capacity c = 1
    servers = fig2_servers()
    times = [
        sum(servers[j].tau_c + servers[j].tau_p * placement.spans[j].length for j in c)
        for c in placement.chains
    ]
    assert math.isclose(sum(1 / t for t in times), 1 / (3 + 5 * EPS) + 1 / (3 + 12 * EPS))


def test_fig2_gca_finds_three_chains_of_capacity_five():
    servers = fig2_servers()
    placement = gbp_cr(servers, FIG2_MODEL, capacity=1).spans
    assert placement_cache_slots(servers, FIG2_MODEL, placement) == [10] * 5  # floor(1 / 0.1) each
    chains = gca(servers, FIG2_MODEL, placement)
    assert [(c.servers, c.blocks, c.capacity) for c in chains] == [
        ((0, 1), (1, 2), 5),  # j1 -> j2
        ((0, 3, 4), (1, 1, 1), 5),  # j1 -> j4 -> j5
        ((2, 3, 4), (1, 1, 1), 5),  # j3 -> j4 -> j5
    ]
    for chain, expected in zip(chains, [3 + 5 * EPS, 3 + 10 * EPS, 3 + 12 * EPS], strict=True):
        assert math.isclose(chain.service_time, expected)
    total_rate = compose(servers, FIG2_MODEL, 1).service_rate
    assert math.isclose(total_rate, 5 / (3 + 5 * EPS) + 5 / (3 + 10 * EPS) + 5 / (3 + 12 * EPS))  # eq. 16


def fig1(num_blocks: int) -> tuple[list[ServerSpec], ModelSpec]:
    """Sun, He and Hou, Fig. 1: L servers of memory (L+1)s_m, s_m = L*s_c, equal tau_c and tau_p."""
    model = ModelSpec(num_blocks, block_bytes=float(num_blocks), cache_bytes=1.0)
    return [
        ServerSpec(f"j{j}", (num_blocks + 1) * model.block_bytes, tau_c=1.0, tau_p=0.1)
        for j in range(num_blocks)
    ], model


def test_fig1_capacity_trades_service_time_for_service_rate():
    blocks = 4
    servers, model = fig1(blocks)
    short = compose(servers, model, capacity=1)  # L single-server chains of capacity 1
    assert [(c.servers, c.capacity) for c in short.chains] == [((j,), 1) for j in range(blocks)]
    long = compose(servers, model, capacity=blocks**2)  # one L-server chain of capacity L^2
    assert [(c.servers, c.capacity) for c in long.chains] == [(tuple(range(blocks)), blocks**2)]

    assert math.isclose(short.chains[0].service_time, 1.0 + blocks * 0.1)  # T(1) = tau_c + L tau_p
    assert math.isclose(long.chains[0].service_time, blocks * (1.0 + 0.1))  # T(2) = L (tau_c + tau_p)
    assert math.isclose(short.service_rate, blocks / (1.0 + blocks * 0.1))  # nu(1)
    assert math.isclose(long.service_rate, blocks / (1.0 + 0.1))  # nu(2)
    assert short.chains[0].service_time < long.chains[0].service_time
    assert short.service_rate < long.service_rate

    # So the best c depends on the demand: c = 1 when light, a larger c beyond nu(1).
    assert tune_capacity(servers, model, arrival_rate=0.1).capacity == 1
    busy = tune_capacity(servers, model, arrival_rate=1.1 * short.service_rate)
    assert busy.capacity > 1 and busy.service_rate > 1.1 * short.service_rate
    assert tune_capacity(servers, model, arrival_rate=0.1, objective="surrogate").capacity == 1
    assert tune_capacity(servers, model, arrival_rate=1000.0) is None  # nothing is stable


def test_gbp_cr_stops_once_the_required_rate_is_met():
    servers, model = fig1(4)
    # c = 1, lambda/(rho_bar c) = 0.5: the first chain (rate 1/1.4) already suffices.
    placement = gbp_cr(servers, model, capacity=1, arrival_rate=0.35, rho_bar=0.7)
    assert placement.rate_met and placement.chains == ((0,),)
    assert placement.spans == (Span(0, 4), None, None, None)
    # An unfinished last chain keeps its servers.
    servers = [ServerSpec("a", 5.0, tau_c=1.0, tau_p=0.1), ServerSpec("b", 5.0, tau_c=1.0, tau_p=0.1)]
    partial = gbp_cr(servers, ModelSpec(3, 1.0, 1.0), capacity=1)  # m = 2 each: one chain of both
    assert partial.chains == ((0, 1),) and partial.spans == (Span(0, 2), Span(1, 3))
    alone = gbp_cr(servers[:1], ModelSpec(3, 1.0, 1.0), capacity=1)
    assert alone.chains == () and alone.spans == (Span(0, 2),)


@st.composite
def placements(draw):
    num_blocks = draw(st.integers(1, 5))
    model = ModelSpec(num_blocks, block_bytes=3.0, cache_bytes=1.0)
    servers, spans = [], []
    for j in range(draw(st.integers(1, 7))):
        start = draw(st.integers(0, num_blocks - 1))
        span = Span(start, draw(st.integers(start + 1, num_blocks)))
        memory = model.block_bytes * span.length + draw(st.integers(0, 12))
        servers.append(
            ServerSpec(f"s{j}", memory, tau_c=draw(st.sampled_from([0.1, 1.0])), tau_p=0.01 * (j + 1))
        )
        spans.append(span if draw(st.booleans()) or j == 0 else None)
    return model, servers, spans


def all_chains(spans, num_blocks, prev_end=0, prefix=()):
    """Every feasible chain (Lemma 3.1) as a tuple of (server, blocks processed)."""
    if prev_end == num_blocks:
        yield prefix
        return
    for j, span in enumerate(spans):
        if span is not None and can_follow(prev_end, span):
            yield from all_chains(spans, num_blocks, span.end, prefix + ((j, span.end - prev_end),))


@settings(max_examples=80, deadline=None)
@given(placements())
def test_gca_never_exceeds_memory_and_leaves_no_usable_chain(case):
    model, servers, spans = case
    chains = gca(servers, model, spans)
    used = [0] * len(servers)
    for chain in chains:
        assert chain.capacity >= 1
        assert (tuple(zip(chain.servers, chain.blocks, strict=True))) in set(
            all_chains(spans, model.num_blocks)
        )
        for server, blocks in zip(chain.servers, chain.blocks, strict=True):
            used[server] += blocks * chain.capacity
    for j, span in enumerate(spans):  # Sun, He and Hou, eq. 3: s_m*m_j + s_c*(slots used) <= M_j
        blocks = span.length if span else 0
        assert model.block_bytes * blocks + model.cache_bytes * used[j] <= servers[j].memory_bytes
    # Each round takes the shortest chain of a shrinking graph, so service times never decrease,
    times = [chain.service_time for chain in chains]
    assert times == sorted(times)
    # and GCA stops only when no chain could take one more job.
    for chain in all_chains(spans, model.num_blocks):
        assert any(cache_slots(servers[j], model, spans[j].length) - used[j] < q for j, q in chain)


def simulate_jffc(chain_times: list[float], capacities: list[int], arrivals: list[float]) -> list[float]:
    """A small discrete-event run with deterministic service times; returns each job's response time."""
    dispatcher = JffcDispatcher([(1 / t, c) for t, c in zip(chain_times, capacities, strict=True)])
    events = [(t, 1, job) for job, t in enumerate(arrivals)]  # (time, 0 = finish before 1 = arrival, job)
    heapq.heapify(events)
    chain_of: dict[int, int] = {}
    response: dict[int, float] = {}

    def start(job: int, chain: int, now: float) -> None:
        chain_of[job] = chain
        heapq.heappush(events, (now + chain_times[chain], 0, job))

    while events:
        now, kind, job = heapq.heappop(events)
        if kind == 1:
            chain = dispatcher.arrive(job)
            if chain is not None:
                start(job, chain, now)
            continue
        response[job] = now - arrivals[job]
        successor = dispatcher.finish(chain_of[job])
        if successor is not None:
            start(successor, chain_of[job], now)
    return [response[job] for job in range(len(arrivals))]


def test_jffc_response_times_match_a_hand_computed_run():
    """Chain 0 takes 2 s, chain 1 takes 5 s, one job each; jobs arrive at 0, 0.5, 1, 1.5.

    Job 0 -> chain 0 (fastest, free), done at 2. Job 1 -> chain 1 (chain 0 busy), done at 5.5.
    Jobs 2 and 3 queue; job 2 takes over chain 0 at 2 (done 4), job 3 at 4 (done 6).
    """
    assert simulate_jffc([2.0, 5.0], [1, 1], [0.0, 0.5, 1.0, 1.5]) == [2.0, 5.0, 3.0, 4.5]
    # Listing the slow chain first changes nothing: JFFC ranks by service rate.
    assert simulate_jffc([5.0, 2.0], [1, 1], [0.0, 0.5, 1.0, 1.5]) == [2.0, 5.0, 3.0, 4.5]
    # Capacity 2 on the fast chain: jobs 0 and 1 both run there, job 2 goes to the slow chain.
    assert simulate_jffc([2.0, 5.0], [2, 1], [0.0, 0.5, 1.0, 1.5]) == [2.0, 2.0, 5.0, 2.5]


def test_jffc_ties_go_to_the_lowest_chain_index_and_the_queue_is_fifo():
    dispatcher = JffcDispatcher([(1.0, 1), (2.0, 1), (2.0, 1)])
    assert [dispatcher.arrive(job) for job in "abcde"] == [1, 2, 0, None, None]
    assert dispatcher.queue_length == 2
    assert dispatcher.finish(2) == "d" and dispatcher.finish(0) == "e"
    assert dispatcher.finish(1) is None and dispatcher.busy(1) == 0
    assert dispatcher.arrive("f") == 1


def test_theorem_37_is_exact_for_a_single_chain():
    mu, arrival = 2.0, 1.5
    lower, upper = response_time_bounds([(mu, 1)], arrival)  # M/M/1: 1/(mu - lambda)
    assert math.isclose(lower, 1 / (mu - arrival)) and math.isclose(upper, 1 / (mu - arrival))

    servers, mu, arrival = 3, 1.0, 2.0  # M/M/c: Erlang C
    load, rho = arrival / mu, arrival / (servers * mu)
    tail = load**servers / math.factorial(servers) / (1 - rho)
    p_wait = tail / (sum(load**k / math.factorial(k) for k in range(servers)) + tail)
    erlang_c = p_wait / (servers * mu - arrival) + 1 / mu
    lower, upper = response_time_bounds([(mu, servers)], arrival)
    assert math.isclose(lower, erlang_c) and math.isclose(upper, erlang_c)
    assert math.isclose(erlang_c, 13 / 9)


def test_theorem_37_brackets_heterogeneous_chains():
    chains = [(1 / 3.005, 5), (1 / 3.01, 5), (1 / 3.012, 5), (1 / 9.0, 4)]
    lower, upper = response_time_bounds(chains, arrival_rate=2.0)
    assert 3.005 < lower < upper
    assert response_time_bounds(chains, arrival_rate=10.0) == (math.inf, math.inf)  # beyond nu
    # Thousands of job servers near saturation: no overflow in the stationary weights.
    lower, upper = response_time_bounds([(0.01, 5000), (0.005, 5000)], arrival_rate=74.0)
    assert math.isfinite(lower) and math.isfinite(upper) and lower <= upper
