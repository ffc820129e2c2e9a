"""CG-BP (docs/reference.md 3.1, Sun et al., Alg. 1): worked examples, eq. 17/19, and properties on random
swarms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_swarm.scheduler.algorithms.cgbp import (
    cg_bp,
    choose_num_requests,
    conservative_block_count,
    max_requests,
    session_capacity,
)
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.scheduler.algorithms.wsrr import RoutingState

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def server(name: str, memory: float, tau: float, rtt: float, clients=("c1",)) -> ServerSpec:
    """A server whose prefill costs equal its decode costs, so eq. 1 is exactly l_out x per-token time."""
    return ServerSpec(
        name,
        memory,
        tau=tau,
        tau_prefill=tau,
        rtt={c: rtt for c in clients},
        rtt_prefill={c: rtt for c in clients},
    )


def test_fig5_cg_bp_is_suboptimal_by_design():
    """Sun et al., Fig. 5: L^2 servers of memory (L+1)s_m, s_m = L*s_c, R = L^2.

    CG-BP puts one block per server, so every request crosses L servers: L*(t + tau) per token.
    Putting all L blocks on every server and one request per server costs only t + tau*L.
    """
    blocks, rtt, tau, cache = 3, 0.05, 0.01, 1.0
    model = ModelSpec(num_blocks=blocks, block_bytes=blocks * cache, cache_bytes=cache)
    servers = [server(f"s{j}", (blocks + 1) * model.block_bytes, tau, rtt) for j in range(blocks**2)]
    result = cg_bp(servers, model, num_requests=blocks**2)

    assert result.feasible
    assert all(span is not None and span.length == 1 for span in result.spans)
    cg_bp_time = blocks * (rtt + tau)
    assert math.isclose(result.bound, cg_bp_time)
    route = RoutingState(servers, model, result.spans).route("c1", l_out=10)
    assert len(route.chain.hops) == blocks
    assert math.isclose(route.completion / 10, cg_bp_time)

    # The optimum of Fig. 5a: every server holds the whole model and serves one request.
    whole = [Span(0, blocks)] * len(servers)
    state = RoutingState(servers, model, whole)
    assert all(state.cache_slots(j) >= blocks for j in range(len(servers)))  # memory holds 1 session
    optimal_time = state.route("c1", l_out=10).completion / 10
    assert math.isclose(optimal_time, rtt + tau * blocks)
    assert optimal_time < cg_bp_time


def test_clustered_swarm_fast_servers_first_and_eq17_bound():
    """Two A100-like and two MIG-like servers (docs/reference.md 7 constants): A100s cover the model first."""
    model = ModelSpec(num_blocks=70, block_bytes=1323397667, cache_bytes=8486912)
    servers = [
        server("mig1", 9.1e9, 0.0162488, 0.055),
        server("a100a", 79.13e9, 0.00322, 0.1),
        server("mig2", 9.1e9, 0.0162488, 0.055),
        server("a100b", 79.13e9, 0.00322, 0.1),
    ]
    result = cg_bp(servers, model, num_requests=66)
    counts = [conservative_block_count(s, model, 66) for s in servers]
    assert counts == [4, 42, 4, 42]
    assert [servers[j].name for j in result.order] == ["a100a", "a100b", "mig1", "mig2"]
    # Sun et al., section 3.2.3 remark: servers 1..K tile the model, the K-th shifted back to end at L.
    assert result.spans[1] == Span(0, 42) and result.spans[3] == Span(28, 70)
    # The MIGs then go where capacity is lowest: the lowest windows of the smallest C_b.
    assert result.spans[0] == Span(0, 4) and result.spans[2] == Span(4, 8)
    # eq. 17 with K = 2: (tau*42 + t*) + (tau*42 + t*) - tau*(84 - 70)
    assert math.isclose(result.bound, 0.00322 * 70 + 2 * 0.1)
    a100, mig = session_capacity(servers[1], model, 42), session_capacity(servers[0], model, 4)
    assert result.block_capacity[0] == a100 + mig and result.block_capacity[30] == 2 * a100


def test_identical_servers_keep_input_order():
    model = ModelSpec(num_blocks=4, block_bytes=10.0, cache_bytes=1.0)
    servers = [server(name, 24.0, 0.01, 0.02) for name in ["b", "a", "c"]]  # m = 2, f = 2 each at R = 1
    result = cg_bp(servers, model, num_requests=1)
    assert result.order == (0, 1, 2)
    assert result.spans == (Span(0, 2), Span(2, 4), Span(0, 2))  # third: lowest of the tied windows


def test_infeasible_placement_names_the_uncovered_blocks():
    model = ModelSpec(num_blocks=10, block_bytes=10.0, cache_bytes=1.0)
    servers = [server("a", 40.0, 0.01, 0.02), server("b", 40.0, 0.01, 0.02)]  # m = 3 each at R = 1
    result = cg_bp(servers, model, num_requests=1)
    assert not result.feasible
    assert result.uncovered_blocks == (6, 7, 8, 9)
    assert result.bound is None


def test_eq19_request_cap_and_default_r_from_the_arrival_rate():
    model = ModelSpec(num_blocks=4, block_bytes=10.0, cache_bytes=1.0)
    servers = [server("a", 60.0, 0.01, 0.1), server("b", 60.0, 0.02, 0.1)]
    # eq. 19: floor((120 - 10*(4 + 2)) / (1*(4 + 2))) = 10
    assert max_requests(servers, model) == 10
    # R = 1: a holds all 4 blocks (60 // 11 = 5, capped at L). T1 = l_out * (t + 4 tau) = 10 * 0.14
    t1 = 10 * (0.1 + 4 * 0.01)
    mean = 2.0 * t1  # 2.8 arrivals during one request
    assert choose_num_requests(servers, model, arrival_rate=2.0, l_out=10) == round(mean + math.sqrt(mean))
    assert choose_num_requests(servers, model, arrival_rate=1000.0, l_out=10) == 10  # capped by eq. 19
    tiny = [server("a", 5.0, 0.01, 0.1)]
    assert choose_num_requests(tiny, model, arrival_rate=1.0, l_out=10) is None


@st.composite
def swarms(draw):
    num_blocks = draw(st.integers(2, 12))
    cache = 1.0
    block = draw(st.sampled_from([4.0, 10.0, 25.0]))
    clients = ("c1", "c2")
    servers = []
    for j in range(draw(st.integers(1, 8))):
        memory = draw(st.integers(0, 400))
        tau = draw(st.sampled_from([0.001, 0.005, 0.02]))
        rtts = {c: draw(st.sampled_from([0.0, 0.01, 0.05, 0.2])) for c in clients}
        servers.append(ServerSpec(f"s{j}", float(memory), tau, tau, rtts, dict(rtts)))
    requests = draw(st.integers(1, 6))
    return ModelSpec(num_blocks, block, cache), servers, requests


@settings(max_examples=60, deadline=None)
@given(swarms())
def test_random_swarms_capacity_memory_and_guarantee(swarm):
    model, servers, requests = swarm
    result = cg_bp(servers, model, requests)
    counts = [span.length if span else 0 for span in result.spans]

    # eq. 18: CG-BP is feasible exactly when the conservative block counts add up to L.
    assert result.feasible == (sum(counts) >= model.num_blocks)
    for j, span in enumerate(result.spans):
        if span is not None:  # eq. 6b: R sessions using every block still fit
            assert (
                model.block_bytes * span.length + model.cache_bytes * requests * span.length
                <= servers[j].memory_bytes
            )
    if not result.feasible:
        return

    capacity = [0] * model.num_blocks  # recomputed from the placement alone
    for j, span in enumerate(result.spans):
        if span is not None:
            for block in range(span.start, span.end):
                capacity[block] += session_capacity(servers[j], model, span.length)
    assert min(capacity) >= requests

    # Corollary 3.6: with at most R concurrent sessions no one waits, and WS-RR's per-token time
    # (prefill = decode costs here) stays within eq. 17, whichever client asks.
    state = RoutingState(servers, model, result.spans)
    for session in range(requests):
        client = ("c1", "c2")[session % 2]
        route = state.route(client, l_out=8, now=0.0)
        assert route.wait == 0.0
        assert route.completion / 8 <= result.bound + 1e-12
        state.admit(session, route, now=0.0)
