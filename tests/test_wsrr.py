"""WS-RR (docs/reference.md 3.2, Sun et al., eq. 20-21): waits, session book-keeping, and brute force
agreement."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_swarm.scheduler.algorithms.feasibility import blocks_processed, can_follow
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span, cache_slots
from llm_swarm.scheduler.algorithms.wsrr import RoutingState, link_request_time
from llm_swarm.swarm.cost import HopCost, link_time_all_tokens

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

MODEL = ModelSpec(num_blocks=4, block_bytes=10.0, cache_bytes=1.0)


def server(name: str, memory: float, tau: float = 0.01, rtt: float = 0.05) -> ServerSpec:
    return ServerSpec(
        name, memory, tau=tau, tau_prefill=2 * tau, rtt={"c1": rtt}, rtt_prefill={"c1": 3 * rtt}
    )


def test_link_time_is_eq1_of_the_cost_model():
    """The vectorized link time is swarm.cost's eq. 1 for one hop, to the last bit."""
    rtt_prefill, tau_prefill, rtt, tau = 0.0612, 0.0512, 0.0551, 0.0162488
    for blocks, l_out in [(1, 1), (4, 64), (42, 128)]:
        expected = link_time_all_tokens(HopCost(rtt, rtt_prefill, tau, tau_prefill, blocks), l_out)
        vectorized = link_request_time(
            np.array([rtt_prefill]),
            np.array([tau_prefill]),
            np.array([rtt]),
            np.array([tau]),
            np.array([blocks]),
            l_out,
        )
        assert vectorized[0] == expected


def test_a_long_session_is_routed_where_its_cache_fits():
    """A request of `units` slots per block waits for that much room (eq. 20 with q = blocks x units),
    so a faster server too full for a long session is passed over for one with room; a nominal
    request still takes the faster one."""
    fast, slow = server("fast", 52.0, tau=0.01), server("slow", 52.0, tau=0.02)  # 12 slots each
    state = RoutingState([fast, slow], MODEL, [Span(0, 4), Span(0, 4)])
    state.add_session("long", {0: 6}, ends_at=9.0)  # 6 of the fast server's 12 slots
    nominal = state.route("c1", l_out=4)
    assert nominal.chain.hops[0].server == 0 and nominal.wait == 0.0
    long = state.route("c1", l_out=4, units=2.0)  # 8 slots: only the slow server has them now
    assert long.chain.hops[0].server == 1 and long.wait == 0.0
    longer = state.route("c1", l_out=4, units=2.5)  # 10 slots
    assert longer.chain.hops[0].server == 1
    state.add_session("other", {1: 12}, ends_at=3.0)  # the slow server full until t = 3
    waits = state.route("c1", l_out=4, units=2.0)
    assert waits.chain.hops[0].server == 1 and waits.wait == 3.0  # before the fast one's t = 9
    with pytest.raises(ValueError, match="units must be positive"):
        state.route("c1", l_out=4, units=0.0)


def test_eq20_waits_release_sessions_in_order_of_remaining_time():
    # One server holding all 4 blocks (40 bytes) with 6 bytes to spare: 6 cache slots.
    servers = [server("a", 46.0)]
    state = RoutingState(servers, MODEL, [Span(0, 4)])
    assert state.cache_slots(0) == 6
    assert state.route("c1", l_out=1).wait == 0.0
    state.add_session("x", {0: 3}, ends_at=7.0)
    state.add_session("y", {0: 2}, ends_at=2.0)
    # 1 slot free, 4 needed: release y (t=2, 3 free), then x (t=7, 6 free) -> wait 7.
    assert state.route("c1", l_out=1, now=0.0).wait == 7.0
    assert state.route("c1", l_out=1, now=5.0).wait == 2.0  # remaining times shrink with the clock
    state.end_session("x")
    assert state.route("c1", l_out=1, now=0.0).wait == 0.0  # 4 free now
    state.add_session("z", {0: 1}, ends_at=3.0)
    # 3 free, 1 short: y (t=2) is released first and frees 2, enough.
    assert state.route("c1", l_out=1, now=0.0).wait == 2.0
    state.add_session("w", {0: 3}, ends_at=1.0)
    # 0 free: w (t=1) frees 3, then y (t=2) makes 5 >= 4 -> wait 2.
    assert state.route("c1", l_out=1, now=0.0).wait == 2.0
    state.end_session("y")
    # 2 free: w (t=1) alone frees 3 -> 5 >= 4.
    assert state.route("c1", l_out=1, now=0.0).wait == 1.0
    assert state.route("c1", l_out=1, now=9.0).wait == 0.0  # overdue sessions are due now


def test_waiting_penalty_steers_to_a_free_but_slower_chain():
    servers = [server("fast", 46.0, tau=0.01), server("slow", 46.0, tau=0.02)]
    state = RoutingState(servers, MODEL, [Span(0, 4), Span(0, 4)])
    route = state.route("c1", l_out=10)
    assert [hop.server for hop in route.chain.hops] == [0]
    state.admit("first", route, now=0.0)  # 4 of fast's 6 slots: the next request would wait
    second = state.route("c1", l_out=10, now=0.0)
    assert [hop.server for hop in second.chain.hops] == [1] and second.wait == 0.0
    expected = link_time_all_tokens(HopCost(0.05, 0.15, 0.02, 0.04, 4), 10)
    assert math.isclose(second.completion, expected) and math.isclose(second.cost, expected)
    # Once `first` ends (reported or lease expired), the fast chain is free again.
    state.admit("second", second, now=0.0, lease_s=30.0)
    assert state.num_sessions == 2 and state.used_slots(1) == 4
    assert state.end_session("first") and not state.end_session("first")
    assert state.expire(now=29.0) == [] and state.expire(now=30.0) == ["second"]
    assert state.num_sessions == 0 and state.used_slots(1) == 0


def test_the_prompts_real_length_decides_between_fast_prefill_and_fast_decoding():
    """Routing on real lengths: `prefill_scale` scales the servers' measured prefill time
    to the request's own prompt, so a long prompt goes to the server that prefills fast and a short
    one to the server that decodes fast."""
    decoder = ServerSpec(
        "decoder", 100.0, tau=0.001, tau_prefill=0.05, rtt={"c1": 0.05}, rtt_prefill={"c1": 0.05}
    )
    prefiller = ServerSpec(
        "prefiller", 100.0, tau=0.003, tau_prefill=0.01, rtt={"c1": 0.05}, rtt_prefill={"c1": 0.05}
    )
    state = RoutingState([decoder, prefiller], MODEL, [Span(0, 4), Span(0, 4)])
    long_prompt = state.route("c1", l_out=10, prefill_scale=1.0)
    short_prompt = state.route("c1", l_out=10, prefill_scale=0.1)
    assert [hop.server for hop in long_prompt.chain.hops] == [1]
    assert [hop.server for hop in short_prompt.chain.hops] == [0]
    expected = link_time_all_tokens(HopCost(0.05, 0.05, 0.001, 0.05 * 0.1, 4), 10)
    assert math.isclose(short_prompt.completion, expected)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="prefill_scale"):
            state.route("c1", l_out=10, prefill_scale=bad)


def test_ties_go_to_the_lowest_server_index():
    servers = [server(name, 100.0) for name in ["a", "b", "c", "d"]]
    placement = [Span(0, 2), Span(0, 2), Span(2, 4), Span(2, 4)]
    route = RoutingState(servers, MODEL, placement).route("c1", l_out=5)
    assert [(hop.server, hop.start, hop.end) for hop in route.chain.hops] == [(0, 0, 2), (2, 2, 4)]


def test_sessions_spread_over_alike_servers_by_what_each_session_adds():
    """With the measured slowdown per decoding session (`tau_per_session`), a server's per-token time
    is `tau + tau_per_session x sessions it holds`: the second session goes to the alike server
    whose idle `tau` was measured 5% higher, where Sun et al.'s model (no slowdown) sends both to the
    first; a server twice as fast keeps taking sessions until the load evens them out."""
    low, high = server("low", 100.0, tau=0.0100), server("high", 100.0, tau=0.0105)
    both = [Span(0, 4), Span(0, 4)]
    idle = RoutingState([low, high], MODEL, both)
    idle.admit("s1", idle.route("c1", l_out=8), now=0.0)
    assert idle.route("c1", l_out=8).chain.hops[0].server == 0  # unloaded model: the lower tau again
    loaded = [dataclasses.replace(spec, tau_per_session=0.002) for spec in (low, high)]
    state = RoutingState(loaded, MODEL, both)
    first = state.route("c1", l_out=8)
    state.admit("s1", first, now=0.0)
    second = state.route("c1", l_out=8)
    assert first.chain.hops[0].server == 0 and second.chain.hops[0].server == 1
    # hop time = rtt_prefill + 4 x tau_prefill + 7 x (rtt + 4 x (tau + 0.002 x 1 session))
    assert second.hop_times == (pytest.approx(0.15 + 4 * 0.021 + 7 * (0.05 + 4 * 0.0105)),)
    state.admit("s2", second, now=0.0)
    assert state.route("c1", l_out=8).chain.hops[0].server == 0  # one session each: the lower tau
    fast = [dataclasses.replace(low, tau=0.005, tau_per_session=0.002), loaded[1]]
    state = RoutingState(fast, MODEL, both)
    for k in range(3):  # 0.005 + 0.002 k < 0.0105 for k = 0, 1, 2
        route = state.route("c1", l_out=8)
        assert route.chain.hops[0].server == 0
        state.admit(f"s{k}", route, now=0.0)
    assert state.route("c1", l_out=8).chain.hops[0].server == 1  # 0.011 > 0.0105
    state.set_load_costs([None, None])  # measured no more: the idle model again
    assert state.route("c1", l_out=8).chain.hops[0].server == 0
    with pytest.raises(ValueError, match="finite"):
        state.set_load_costs([math.nan, 0.0])
    with pytest.raises(ValueError, match="one tau_per_session per server"):
        state.set_load_costs([0.0])


def test_unreachable_or_uncovered_gives_no_route():
    servers = [server("a", 100.0), server("b", 100.0)]
    assert RoutingState(servers, MODEL, [Span(0, 2), None]).route("c1", l_out=5) is None
    assert RoutingState(servers, MODEL, [Span(0, 2), Span(2, 4)]).route("elsewhere", l_out=5) is None
    assert RoutingState([server("a", 41.0)], MODEL, [Span(0, 4)]).route("c1", l_out=5) is None  # 1 slot < 4


# -- brute force ---------------------------------------------------------------------------------


def room_wait(servers, model, placement, sessions, now, j, needed):
    """Eq. 20 by hand: how long until server j has `needed` free slots."""
    free = cache_slots(servers[j], model, placement[j].length) - sum(s for _, s in sessions.get(j, []))
    if free >= needed:
        return 0.0
    for ends_at, slots in sorted(sessions.get(j, [])):
        free += slots
        if free >= needed:
            return max(ends_at - now, 0.0)
    return math.inf


def feasible_chains(model, placement, prev_end=0, used=frozenset()):
    """Every chain of Lemma 3.1 from boundary `prev_end` on, as lists of (server, blocks it processes)."""
    if prev_end == model.num_blocks:
        yield []
        return
    for j, span in enumerate(placement):
        if span is None or j in used or not can_follow(prev_end, span):
            continue
        for rest in feasible_chains(model, placement, span.end, used | {j}):
            yield [(j, blocks_processed(prev_end, span)), *rest]


def brute_force_cost(servers, model, placement, sessions, l_out, now):
    """Enumerate every feasible chain (Lemma 3.1) and price it link by link (eq. 20 + eq. 1)."""

    def price(chain):
        total = 0.0
        for j, q in chain:
            s = servers[j]
            hop = HopCost(s.rtt["c1"], s.rtt_prefill["c1"], s.tau, s.tau_prefill, q)
            wait = room_wait(servers, model, placement, sessions, now, j, q)
            total += wait + link_time_all_tokens(hop, l_out)
        return total

    return min(map(price, feasible_chains(model, placement)), default=math.inf)


@st.composite
def routing_cases(draw):
    num_blocks = draw(st.integers(1, 5))
    model = ModelSpec(num_blocks, 10.0, 1.0)
    servers, placement, sessions = [], [], {}
    for j in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, num_blocks - 1))
        end = draw(st.integers(start + 1, num_blocks))
        slots = draw(st.integers(0, 10))
        tau = draw(st.sampled_from([0.001, 0.01, 0.1]))
        rtt = draw(st.sampled_from([0.0, 0.02, 0.3]))
        servers.append(
            ServerSpec(f"s{j}", 10.0 * (end - start) + slots, tau, 2 * tau, {"c1": rtt}, {"c1": rtt})
        )
        placement.append(Span(start, end) if draw(st.integers(0, 3)) or j == 0 else None)  # mostly placed
        active = draw(
            st.lists(st.tuples(st.sampled_from([0.5, 1.0, 4.0, 9.0]), st.integers(1, 4)), max_size=4)
        )
        if active and placement[-1] is not None:
            sessions[j] = active
    return model, servers, placement, sessions


@settings(max_examples=80, deadline=None)
@given(routing_cases(), st.sampled_from([1, 3, 16]), st.sampled_from([0.0, 2.0]))
def test_ws_rr_cost_equals_brute_force_over_all_chains(case, l_out, now):
    model, servers, placement, sessions = case
    state = RoutingState(servers, model, placement)
    for j, active in sessions.items():
        for k, (ends_at, slots) in enumerate(active):
            state.add_session((j, k), {j: slots}, ends_at)
    expected = brute_force_cost(servers, model, placement, sessions, l_out, now)
    route = state.route("c1", l_out, now)
    if math.isinf(expected):
        assert route is None
        return
    assert math.isclose(route.cost, expected, rel_tol=1e-12)
    # The returned chain is feasible and its cost, completion and wait are consistent.
    prev_end = 0
    for hop in route.chain.hops:
        assert can_follow(prev_end, placement[hop.server]) and hop.start == prev_end
        prev_end = hop.end
    assert prev_end == model.num_blocks
    assert math.isclose(route.cost, sum(route.hop_waits) + sum(route.hop_times))
    assert route.wait == max(route.hop_waits)
    assert math.isclose(route.completion, route.wait + sum(route.hop_times))


def test_a_rescheduled_session_releases_its_room_at_its_new_end():
    servers = [server("a", 46.0)]  # 6 slots
    state = RoutingState(servers, MODEL, [Span(0, 4)])
    state.add_session("x", {0: 4}, ends_at=7.0)
    assert state.route("c1", l_out=1, now=0.0).wait == 7.0
    state.reschedule("x", 3.0)
    assert state.route("c1", l_out=1, now=0.0).wait == 3.0
    assert state.end_session("x") and state.route("c1", l_out=1, now=0.0).wait == 0.0
    state.reschedule("x", 1.0)  # a session the state does not hold (any more): nothing to move


def test_duration_calibration_is_a_bounded_median_of_enough_sessions():
    from llm_swarm.scheduler.service.durations import MIN_SAMPLES, DurationCalibration

    calibration = DurationCalibration()
    for _ in range(MIN_SAMPLES - 1):
        calibration.observe(3.0, 1.0)
    assert calibration.scale == 1.0  # too few to trust
    calibration.observe(3.0, 1.0)
    assert calibration.scale == 3.0
    for bad in ((math.nan, 1.0), (1.0, 0.0), (-1.0, 1.0), (math.inf, 1.0)):
        calibration.observe(*bad)  # ignored
    assert calibration.scale == 3.0
    for _ in range(100):
        calibration.observe(1000.0, 1.0)  # a lying client (or a stuck one) is bounded
    assert calibration.scale == 10.0


# -- chain sessions: servers push to each other ------------------------------------------------


def brute_force_pushed_cost(servers, model, placement, sessions, l_out, now, server_rtts):
    """Every feasible chain priced as a chain session: each hop's wait and compute, half the client's
    round trip into the first hop and back from the last, and between hops the faster of the push
    (half the servers' round trip) and the way through the client."""
    client = [s.rtt["c1"] for s in servers]

    def price(chain):
        total, previous = l_out * client[chain[-1][0]] / 2, None
        for j, q in chain:
            s = servers[j]
            compute = link_time_all_tokens(HopCost(0.0, 0.0, s.tau, s.tau_prefill, q), l_out)
            if previous is None:
                carry = client[j] / 2
            else:
                carry = min(server_rtts[previous][j] / 2, client[previous] / 2 + client[j] / 2)
            total += room_wait(servers, model, placement, sessions, now, j, q) + compute + l_out * carry
            previous = j
        return total

    return min(map(price, feasible_chains(model, placement)), default=math.inf)


@settings(max_examples=80, deadline=None)
@given(
    routing_cases(),
    st.sampled_from([1, 3, 16]),
    st.sampled_from([0.0, 2.0]),
    st.lists(st.sampled_from([math.inf, 0.004, 0.05]), min_size=36, max_size=36),
)
def test_a_chain_sessions_route_costs_what_brute_force_over_all_chains_says(case, l_out, now, pairs):
    model, servers, placement, sessions = case
    n = len(servers)
    server_rtts = np.array(pairs[: n * n]).reshape(n, n)
    state = RoutingState(servers, model, placement)
    for j, active in sessions.items():
        for k, (ends_at, slots) in enumerate(active):
            state.add_session((j, k), {j: slots}, ends_at)
    expected = brute_force_pushed_cost(servers, model, placement, sessions, l_out, now, server_rtts)
    route = state.route("c1", l_out, now, server_rtts=server_rtts)
    if math.isinf(expected):
        assert route is None
        return
    assert math.isclose(route.cost, expected, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(route.cost, sum(route.hop_waits) + sum(route.hop_times), rel_tol=1e-9)
    assert math.isclose(route.completion, route.wait + sum(route.hop_times))


def test_a_chain_session_takes_three_near_servers_that_eq1_would_pass_over():
    """A client 100 ms from everyone; a, b, c hold a third of the model each and sit 4 ms apart; d
    holds it all but decodes slower. Hub-spoke (eq. 1) pays 3 round trips through a, b, c and takes d;
    a chain session pays about one and takes a, b, c."""
    model = ModelSpec(6, 10.0, 1.0)
    servers = [
        ServerSpec(name, 1000.0, tau, tau, {"c1": 0.1}, {"c1": 0.1})
        for name, tau in (("a", 0.001), ("b", 0.001), ("c", 0.001), ("d", 0.01))
    ]
    placement = [Span(0, 2), Span(2, 4), Span(4, 6), Span(0, 6)]
    state = RoutingState(servers, model, placement)
    near = np.full((4, 4), math.inf)
    near[0, 1] = near[1, 2] = 0.004
    assert [hop.server for hop in state.route("c1", l_out=8).chain.hops] == [3]
    route = state.route("c1", l_out=8, server_rtts=near)
    assert [hop.server for hop in route.chain.hops] == [0, 1, 2]
    # per token: 50 ms in, 2 + 2 ms between, 50 ms back, plus compute
    assert math.isclose(route.cost, 8 * (0.05 + 0.002 + 0.002 + 0.05) + 6 * 0.001 * 8, rel_tol=1e-9)
    # unknown server round trips price the chain as eq. 1 does, so d again
    unknown = np.full((4, 4), math.inf)
    assert [hop.server for hop in state.route("c1", l_out=8, server_rtts=unknown).chain.hops] == [3]
