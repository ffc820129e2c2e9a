"""The `chains` policy (Sun, He and Hou: GBP-CR placement, GCA chains, JFFC queue), without sockets."""

from __future__ import annotations

import json

import pytest

from llm_swarm.scheduler.algorithms.problem import ServerSpec
from llm_swarm.scheduler.plan.commands import place
from llm_swarm.scheduler.plan.problem_io import parse_problem
from llm_swarm.scheduler.service.chain_routing import queue_start_times, timings_moved
from llm_swarm.scheduler.service.core import CoreSettings, SchedulerCore
from llm_swarm.scheduler.service.planner import PlanSettings
from llm_swarm.swarm.route_request import RouteRequest, SessionShape
from llm_swarm.swarm.server_info import ServerState
from tests.test_scheduler_core import BLOCK, SERVERS, SHAPE, SLOT, L, info

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def _request(
    client_id: str, rtts: dict, l_in: int, l_out: int, batch_size: int, max_length: int
) -> RouteRequest:
    return RouteRequest(client_id, rtts, SessionShape(batch_size, max_length, l_in, l_out))


def chains_core(**plan) -> SchedulerCore:
    settings = CoreSettings(plan=PlanSettings(policy="chains", **plan), l_in=4, l_out=6, settle=0.0)
    return SchedulerCore(SHAPE, settings, 0.0)


def pinned(sessions: int, tau: float):
    """A server outside the scheduler's placement holding every block, with room for `sessions`."""
    return info(L * (BLOCK + sessions * SLOT), tau, span=(0, L), state=ServerState.ONLINE, managed=False)


def test_placement_equals_swarm_plan_gbp_cr_with_tuned_c():
    core = chains_core(arrival_rate=0.5)
    core.update_roster(SERVERS, now=0.0)
    assert core.review(now=0.1)
    assert core.plan.plan_input["c"] == "auto" and core.plan.plan_input["arrival_rate"] == 0.5
    output = place(parse_problem(json.dumps(core.plan.plan_input)), "gbp-cr")
    expected = {entry["name"]: (entry["start"], entry["end"]) for entry in output["placement"]}
    got = {peer: (span.start, span.end) if span else (None, None) for peer, span in core.assignment.items()}
    assert got == expected


def test_jffc_takes_the_fastest_free_chain_and_queues_first_come_first_served():
    core = chains_core(num_requests=1)
    core.update_roster({"fast": pinned(1, 0.001), "slow": pinned(2, 0.004)}, 0.0)
    chains = core.book.chains
    assert [(c.hops[0].peer_id, c.capacity) for c in chains] == [("fast", 1), ("slow", 2)]
    rtts = {"fast": 0.001, "slow": 0.001}
    decisions = [core.route(_request("c", rtts, 4, 6, 1, 10), now=1.0) for _ in range(5)]
    sessions = [core.book.sessions[d.session.session_id] for d in decisions]
    assert [s.admitted for s in sessions] == [True, True, True, False, False]
    assert [s.hops[0].peer_id for s in sessions[:3]] == ["fast", "slow", "slow"]
    assert sessions[3].hops == () and 0 < decisions[3].wait <= decisions[4].wait
    assert core.book.granted("slow") == 2 * L and core.book.granted("fast") == L  # never over capacity
    # a slot frees on the slow chain: the queue's head takes it, even though the fast one is faster
    core.end_session(sessions[1].session_id)
    assert core.tick(2.0) == [sessions[3].session_id]
    assert sessions[3].hops == chains[1].hops
    # the fast chain frees: the next in line runs there
    core.end_session(sessions[0].session_id)
    assert core.tick(3.0) == [sessions[4].session_id]
    assert sessions[4].hops == chains[0].hops
    for session in list(core.book.sessions):
        core.end_session(session)
    assert core.book.granted("fast") == core.book.granted("slow") == 0


def test_a_server_leaving_recomposes_the_chains_and_waiting_sessions_keep_their_place():
    core = chains_core(num_requests=1)
    records = {"fast": pinned(1, 0.001), "slow": pinned(1, 0.004)}
    core.update_roster(records, 0.0)
    rtts = {"fast": 0.001, "slow": 0.001}
    first, second, third = (core.route(_request("c", rtts, 4, 6, 1, 10), now=1.0) for _ in range(3))
    assert not core.book.sessions[third.session.session_id].admitted
    del records["fast"]
    core.update_roster(records, 2.0)
    assert [c.hops[0].peer_id for c in core.book.chains] == ["slow"]
    assert not core.book.routable(first.session.session_id)  # its client re-routes
    core.end_session(first.session.session_id)
    core.end_session(second.session.session_id)
    assert core.tick(3.0) == [third.session.session_id]
    assert core.book.sessions[third.session.session_id].hops[0].peer_id == "slow"


def test_no_chain_means_no_route():
    core = chains_core(num_requests=1)
    core.update_roster({"half": info(L * BLOCK, 0.001, span=(0, L // 2), state=ServerState.ONLINE)}, 0.0)
    assert (
        core.route(_request("c", {"half": 0.001}, 4, 6, 1, 10), now=1.0) is None
    )  # the client routes locally


def test_a_session_no_chain_can_hold_is_not_queued():
    core = chains_core(num_requests=1)
    core.update_roster({"one": pinned(1, 0.001)}, 0.0)  # one chain of capacity 1
    assert core.route(_request("c", {"one": 0.001}, 4, 6, 2, 10), now=1.0) is None  # 2 slots: never fits
    assert not core.book.sessions
    assert core.route(_request("c", {"one": 0.001}, 4, 6, 1, 10), now=1.0) is not None


def test_a_new_clients_round_trips_recompose_the_chains():
    core = chains_core(num_requests=1)
    core.update_roster({"near": pinned(1, 0.004), "far": pinned(1, 0.001)}, 0.0)
    assert core.book.chains[0].hops[0].peer_id == "far"  # no client known yet: compute time only
    core.route(_request("c", {"near": 0.001, "far": 0.5}, 4, 6, 1, 10), now=1.0)
    assert core.book.chains[0].hops[0].peer_id == "near"  # 0.5 s per token to `far` outweighs its speed


def test_queue_start_times_and_timing_hysteresis():
    assert queue_start_times(10.0, [12.0, 11.0], 5.0, 3) == [11.0, 12.0, 16.0]
    assert queue_start_times(10.0, [], 5.0, 1) == [float("inf")]
    base = [ServerSpec("a", 1.0, tau_c=1.0, tau_p=2.0)]
    assert not timings_moved(base, [ServerSpec("a", 1.0, tau_c=1.05, tau_p=2.0)])
    assert timings_moved(base, [ServerSpec("a", 1.0, tau_c=1.2, tau_p=2.0)])
