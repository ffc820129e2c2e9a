"""Goodput planning and SLO admission.

The search (`scheduler.sim.goodput_plan`) on pure predicates and on a tiny simulated swarm, the
`swarm-plan goodput` command (in this process for its error paths, once as the installed command),
the scheduler's SLO verdict on a route (`SchedulerCore`, `SchedulerApi.Route` without sockets) and
what the client does with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llm_swarm.scheduler.algorithms.cgbp import cg_bp
from llm_swarm.scheduler.algorithms.placing import PlanInputError
from llm_swarm.scheduler.plan.problem_io import parse_problem
from llm_swarm.scheduler.service.core import CoreSettings, SchedulerCore
from llm_swarm.scheduler.service.grpc_api import SchedulerApi
from llm_swarm.scheduler.service.planner import PlanSettings
from llm_swarm.scheduler.service.slo_admission import SloTargets, predict
from llm_swarm.scheduler.sim.discrete_events import simulate
from llm_swarm.scheduler.sim.goodput_plan import (
    plan_goodput,
    search_goodput,
    servers_to_add,
    smallest_count,
)
from llm_swarm.scheduler.sim.metrics import GOODPUT_ATTAINMENT, Slo, per_request, slo_attainment
from llm_swarm.scheduler.sim.plan_runs import (
    Candidate,
    Evaluator,
    SearchSettings,
    dispatcher_for,
    idle_latency,
)
from llm_swarm.scheduler.sim.planning_swarm import choose_client, problem_swarm, with_added_servers
from llm_swarm.scheduler.sim.policies import NONE, build_dispatcher
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.route_request import RouteRequest, SessionShape
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from tests.test_plan_cli import run, server
from tests.test_scheduler_core import BLOCK, SERVERS, SHAPE, SLOT, L, core_with, info, serving

pytestmark = pytest.mark.version_neutral  # scheduler and simulator code: no transformers

_SCRIPT = Path(sys.executable).with_name("swarm-plan")
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "llm_swarm.scheduler.plan.cli"]


# Eight blocks on one fast server, one medium and two small ones; short answers keep runs cheap.
TINY = {
    "model": {"num_blocks": 8, "block_bytes": 1e9, "cache_bytes": 5e7, "hidden_size": 64},
    "servers": [
        server(name, memory, tau, rtt, prefill_ratio=4)
        for name, memory, tau, rtt in (
            ("big", 12e9, 0.01, 0.05),
            ("mid", 8e9, 0.02, 0.03),
            ("small1", 5e9, 0.03, 0.02),
            ("small2", 5e9, 0.03, 0.02),
        )
    ],
    "l_out": 16,
    "arrival_rate": 0.5,
}
FAST = SearchSettings(seeds=1, min_requests=40, horizon_s=40, doublings=5, bisections=2, refine_rounds=1)
QUICK = ["--seeds", "1", "--bisections", "2", "--refine-rounds", "0"]  # the command, coarse and fast


@pytest.fixture(scope="module")
def tiny():
    scenario = problem_swarm(parse_problem(json.dumps(TINY)))
    idle = idle_latency(scenario)
    return scenario, Slo(5 * idle.ttft, 1.5 * idle.tpot)


@pytest.fixture(scope="module")
def tiny_plan(tiny):
    scenario, slo = tiny
    return plan_goodput(scenario, slo, 0.5, FAST)


# --- the searches, on pure predicates ---------------------------------------------------------------


def step_at(crossing: float):
    return lambda rate: 1.0 if rate <= crossing else 0.5


def test_search_goodput_doubles_then_bisects_to_the_crossing():
    found = search_goodput(step_at(3.0), 0.5, doublings=6, bisections=5)
    assert 3.0 - 2.0 / 32 <= found.goodput <= 3.0  # bracket [2, 4] halved 5 times
    assert [rate for rate, _ in found.probes[:4]] == [0.5, 1.0, 2.0, 4.0]
    assert not found.capped and not found.pruned


def test_search_goodput_halves_below_a_failing_start_and_reports_caps():
    found = search_goodput(step_at(3.0), 10.0, halvings=6, bisections=5)
    assert [rate for rate, _ in found.probes[:3]] == [10.0, 5.0, 2.5]
    assert 3.0 - 2.5 / 32 <= found.goodput <= 3.0
    assert search_goodput(step_at(3.0), 10.0, halvings=1).goodput == 0.0  # 10 and 5 miss
    capped = search_goodput(lambda rate: 1.0, 1.0, doublings=3)
    assert capped.capped and capped.goodput == 8.0


def test_search_goodput_stops_once_it_cannot_beat_the_best():
    full = search_goodput(step_at(3.0), 0.5, bisections=5)
    pruned = search_goodput(step_at(3.0), 0.5, bisections=5, beat=6.0)
    assert pruned.pruned and pruned.goodput == 2.0 < 3.0 <= 4.0 <= 6.0  # failed at 4: below 6 anyway
    assert len(pruned.probes) < len(full.probes)


def test_smallest_count_is_a_monotone_search_with_a_cap():
    calls = []

    def at_least(k):
        def meets(n):
            calls.append(n)
            return n >= k

        return meets

    assert smallest_count(at_least(5), cap=32) == 5
    assert len(calls) <= 8 and 4 in calls  # 0, 1, 2, 4, 8, then bisection
    assert smallest_count(at_least(0), cap=32) == 0
    assert smallest_count(at_least(32), cap=32) == 32
    assert smallest_count(at_least(33), cap=32) is None
    assert smallest_count(at_least(1), cap=0) is None


# --- the plan search on a simulated swarm -----------------------------------------------------------


def test_default_candidates_are_the_simulators_policies(tiny):
    scenario, _ = tiny
    for policy in ("cg-bp", "chains"):
        ours = dispatcher_for(Candidate(policy), scenario, 0.7, np.random.default_rng(0), NONE)
        theirs = build_dispatcher(policy, scenario, 0.7, np.random.default_rng(0), NONE)
        assert ours.spans == theirs.spans
    fixed = dispatcher_for(Candidate("cg-bp", 3), scenario, 0.7, np.random.default_rng(0), NONE)
    assert tuple(fixed.spans) == cg_bp(list(scenario.servers), scenario.model, 3).spans


def test_the_chosen_plan_has_at_least_every_candidates_goodput(tiny, tiny_plan):
    scenario, slo = tiny
    best = tiny_plan.best
    defaults = [r for r in tiny_plan.results if r.candidate.default and r.search is not None]
    assert {r.candidate.policy for r in defaults} >= {"cg-bp", "chains"}
    assert not any(r.search.pruned for r in defaults)  # searched to the end
    # every candidate searched again without pruning, on fresh runs: none beats the chosen plan
    fresh = Evaluator(scenario, slo, FAST, tiny_plan.idle)
    for result in tiny_plan.results:
        if result.search is None:
            continue
        alone = search_goodput(
            lambda rate, c=result.candidate: fresh.attainment(c, rate),
            tiny_plan.start_rate,
            doublings=FAST.doublings,
            bisections=FAST.bisections,
        )
        assert alone.goodput <= best.goodput, result.candidate.label
    assert best.goodput > 0 and len(tiny_plan.placement) == len(scenario.servers)


def full_run_attainment(scenario, slo, candidate, rate, requests) -> float:
    """The run `Evaluator` makes for seed 0, to the end."""
    dispatcher = dispatcher_for(candidate, scenario, rate, np.random.default_rng([0, 1]), NONE)
    records = simulate(scenario.servers, scenario.model, dispatcher, requests, scenario.prefill).records
    metrics = per_request(records)
    return slo_attainment(metrics["ttft"], metrics["tpot"], slo)


def test_a_stopped_run_decides_its_probe_as_the_full_run(tiny, tiny_plan):
    scenario, slo = tiny
    evaluator = Evaluator(scenario, slo, FAST, tiny_plan.idle)
    candidate = Candidate("cg-bp")
    heavy = 2 * max(tiny_plan.best.goodput, tiny_plan.start_rate)
    stopped = evaluator.attainment(candidate, heavy)
    assert evaluator.stopped_early(candidate, heavy)
    full = full_run_attainment(scenario, slo, candidate, heavy, evaluator.requests(heavy, 0))
    assert full <= stopped < GOODPUT_ATTAINMENT  # an upper bound, on the same side of the target
    light = tiny_plan.start_rate
    attained = evaluator.attainment(candidate, light)
    assert not evaluator.stopped_early(candidate, light)
    assert attained == full_run_attainment(scenario, slo, candidate, light, evaluator.requests(light, 0))


def test_servers_to_add_finds_the_fewest(tiny, tiny_plan):
    scenario, slo = tiny
    rate = 1.5 * tiny_plan.best.goodput
    found = servers_to_add(scenario, "big", rate, slo, FAST, cap=8)
    assert found.count is not None and found.count >= 1 and found.attainment >= GOODPUT_ATTAINMENT
    assert (found.count - 1, False) in found.tried  # one fewer was tried and missed
    assert len(found.scenario.servers) == len(scenario.servers) + found.count
    assert len(found.placement) == len(found.scenario.servers)
    # servers that cannot carry a chain fast enough for the TPOT target never help
    assert servers_to_add(scenario, "small1", rate, slo, FAST, cap=1).count is None


def test_the_swarm_from_a_problem_document_and_its_copies(tiny):
    scenario, _ = tiny
    grown = with_added_servers(scenario, "big", 2)
    copies = grown.servers[-2:]
    assert [s.name for s in copies] == ["added0-big", "added1-big"]
    assert all(dataclasses.replace(s, name="big") == scenario.servers[0] for s in copies)
    assert grown.prefill.tau_base[-1] == scenario.prefill.tau_base[0]
    with pytest.raises(PlanInputError, match="unknown kind 'gpu'; choose .*big, mid"):
        with_added_servers(scenario, "gpu", 1)
    two_clients = json.loads(json.dumps(TINY))
    two_clients["servers"][0]["rtt"]["far"] = 1.0
    problem = parse_problem(json.dumps(two_clients))
    assert choose_client(problem) == "far"  # the worst placed client
    with pytest.raises(PlanInputError, match=r"servers\[1\] \(mid\)\.rtt: no round trip to client 'far'"):
        problem_swarm(problem)
    assert problem_swarm(problem, client="c1").servers[0].rtt == {"client": 0.05}
    with pytest.raises(PlanInputError, match="--client: no server has an rtt to 'c2'; known: c1, far"):
        problem_swarm(problem, client="c2")


# --- swarm-plan goodput ------------------------------------------------------------------------------


def run_plan(args: list[str], document: object | None = None) -> tuple[int, str, str]:
    """`swarm-plan ARGS < document` in this process: status, stdout, stderr."""
    done = run(args, document or {})
    return done.returncode, done.stdout, done.stderr


@pytest.mark.swarm
def test_the_command_plans_a_tiny_problem_as_a_subprocess():
    args = ["goodput", "--slo-ttft", "5x", "--slo-tpot", "1.5x", *QUICK]
    done = subprocess.run(
        [*COMMAND, *args], input=json.dumps(TINY), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout)
    best = output["best"]
    assert output["rate"] == 0.5  # the problem's arrival_rate is the measured rate
    assert best["goodput"] >= max(output["default_policies"].values()) > 0
    assert best["goodput"] >= max(c["goodput"] or 0 for c in output["candidates"])
    assert best["scheduler_flags"].startswith(f"--policy {best['policy']}")
    assert output["slo"]["ttft"] == pytest.approx(5 * output["idle"]["ttft"])
    assert output["search_s"] > 0 and output["simulations"] > 0


def test_the_command_plans_the_schedulers_own_problem():
    core = core_with()
    core.update_roster(SERVERS, now=0.0)
    assert core.review(now=1.2)
    args = ["goodput", "--slo-ttft", "0.2", "--slo-tpot", "0.02", "--rate", "2", *QUICK]
    code, out, err = run_plan(args, core.plan.plan_input)
    assert code == 0, err
    output = json.loads(out)
    assert output["swarm"] == "problem:any" and output["slo"] == {"ttft": 0.2, "tpot": 0.02}
    assert {entry["name"] for entry in output["best"]["placement"]} == set(SERVERS)


@pytest.mark.parametrize(
    "args, message",
    [
        (["goodput"], "give --slo-ttft and/or --slo-tpot"),
        (["goodput", "--slo-ttft", "1", "--rate", "-1"], "--rate must be a positive"),
        (["goodput", "--slo-ttft", "1", "--at-rate", "2"], "--servers-to-add and --at-rate go together"),
        (["goodput", "--slo-ttft", "1", "--servers-to-add", "tpu", "--at-rate", "2"], "unknown kind 'tpu'"),
        (["goodput", "--slo-ttft", "1", "--scenario", "clustered", "--client", "c1"], "--client is for"),
    ],
)
def test_the_command_refuses_bad_input_with_status_2(args, message):
    code, _, err = run_plan(args, TINY)
    assert code == 2 and message in err, err


def test_slo_values_must_be_seconds_or_multiples():
    code, _, err = run_plan(["goodput", "--slo-ttft", "fast"], TINY)
    assert code == 2 and "positive multiple like 5x" in err
    code, _, err = run_plan(["goodput", "--slo-tpot", "1"], {"model": {"num_blocks": 1}})
    assert code == 2 and "model.block_bytes: missing" in err


# --- admission by SLO in the scheduler ---------------------------------------------------------------


def one_server_core(**slo) -> SchedulerCore:
    """One server with room for exactly two sessions (tau 1 ms per block, prefill 4 ms per block for
    the 4-token prompt): alone, a session's first token takes 1 + 8 x 4 = 33 ms, its run 78 ms."""
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0, **slo)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {"peer-a": info(L * BLOCK + 2 * SLOT * L, 0.001)}
    core.update_roster(servers, 0.0)
    core.review(0.1)
    core.update_roster(serving(core.assignment, servers), 0.2)
    return core


def route(core: SchedulerCore, client: str, now: float = 1.0):
    return core.route(RouteRequest(client, {"peer-a": 0.001}, SessionShape(1, 10, 4, 6)), now)


def test_a_route_that_cannot_meet_the_ttft_target_says_so_with_its_wait():
    core = one_server_core(slo_ttft=0.05)
    first, second, third = (route(core, f"c{k}") for k in range(3))
    assert first.slo.ttft == pytest.approx(0.033) and not first.slo.miss
    assert not second.slo.miss
    assert not third.session.admitted and third.wait == pytest.approx(0.078)
    assert third.slo.ttft == pytest.approx(0.078 + 0.033)
    assert "expected time to first token 0.11 s (wait 0.08 s + prefill 0.03 s)" in third.slo.miss
    assert third.session.session_id in core.book.sessions  # still queued: the client decides


def test_the_route_reply_carries_the_slo_miss_at_once():
    core = one_server_core(slo_ttft=0.05, slo_tpot=0.005)
    api = SchedulerApi(core, clock=lambda: 1.0)
    request = pb.RouteRequest(
        client_id="c1",
        rtts=[pb.ServerRtt(peer_id="peer-a", rtt=0.001)],
        l_in=4,
        l_out=6,
        batch_size=1,
        max_length=10,
    )
    reply = asyncio.run(api.Route(request, None))
    assert reply.admitted and reply.slo_miss and reply.expected_ttft == pytest.approx(0.033)
    assert "expected time per token 0.009 s exceeds the 0.005 s target" in reply.slo_reason
    assert "first token" not in reply.slo_reason
    plain = SchedulerApi(one_server_core(), clock=lambda: 1.0)
    reply = asyncio.run(plain.Route(request, None))
    assert reply.admitted and not reply.slo_miss and reply.slo_reason == "" and reply.expected_ttft == 0.0


def test_slo_targets_are_checked():
    with pytest.raises(SwarmUserError, match="--slo-ttft must be a positive number"):
        CoreSettings(slo_ttft=0.0)
    with pytest.raises(SwarmUserError, match="--slo-tpot must be a positive number"):
        SloTargets(tpot=float("nan"))
    assert predict(SloTargets(ttft=1.0), wait=0.5, prefill=0.2, per_token=9.0, scale=2.0).miss == ""


# --- the client ---------------------------------------------------------------------------------------


class _Link:
    def __init__(self, reply):
        self.reply, self.ended = reply, []

    async def route(self, request):
        return self.reply

    async def end_session(self, session_id, *args):
        self.ended.append(session_id)


class _Reached(Exception):
    """The client went on to open the scheduler's chain."""


def _client_session(reply, accept: bool):
    from llm_swarm.client.options import ClientOptions
    from llm_swarm.client.remote import RemoteBlockSession

    class Chains:
        async def candidates(self):
            return []

    class Roster:
        @property
        def known(self):  # the first thing the client reads once its route is admitted
            raise _Reached

        async def servers(self, refresh=False):
            raise _Reached

    class Connection:
        scheduler = _Link(reply)
        options = ClientOptions(accept_slo_miss=accept)
        client_id = "client"
        chains, roster = Chains(), Roster()

    session = RemoteBlockSession.__new__(RemoteBlockSession)
    session.connection, session.shape, session.session_id = Connection(), SessionShape(1, 10, 4, 6), "s" * 8
    return session


def test_the_client_gives_up_on_an_slo_miss_unless_it_accepts_them():
    from llm_swarm.client.connection import SwarmUnavailable

    reply = pb.RouteReply(
        session_id="routed",
        admitted=True,
        expected_wait=12.5,
        lease=60.0,
        slo_miss=True,
        slo_reason="too late",
    )
    session = _client_session(reply, accept=False)
    with pytest.raises(SwarmUnavailable, match=r"miss its latency targets: too late \(expected wait 12.5 s"):
        asyncio.run(session._open_scheduled_chain(first=True))
    assert session.connection.scheduler.ended == ["routed"]  # its place in the queue is given back
    accepting = _client_session(reply, accept=True)
    with pytest.raises(_Reached):
        asyncio.run(accepting._open_scheduled_chain(first=True))
    assert accepting.connection.scheduler.ended == []


def test_a_fixed_c_is_what_the_scheduler_places_chains_with():
    """`--policy chains --num-requests K`, as `swarm-plan goodput` prints a `chains c=K` plan, places
    with c = K even where an arrival rate would have c tuned."""
    plan = PlanSettings(policy="chains", arrival_rate=0.5, num_requests=2)
    core = core_with(CoreSettings(plan=plan, l_in=4, l_out=6, settle=1.0))
    core.update_roster(SERVERS, now=0.0)
    assert core.review(now=1.2)
    assert core.plan.plan_input["c"] == 2 and core.plan.placed.capacity == 2
