"""The scheduler's placement of prefill/decode roles: the pure planner, its simulated
scoring, the scheduler handing roles out, and a managed server adopting them."""

from __future__ import annotations

import json
import logging
import math

import pytest

from llm_swarm.scheduler.algorithms.problem import ServerSpec, Span
from llm_swarm.scheduler.algorithms.role_placement import prefill_blocks, prefill_spans
from llm_swarm.scheduler.algorithms.role_split import (
    BOTH,
    PREFILL,
    RoleInputs,
    RoleWorkload,
    candidates,
    check_role,
    decode_covered,
    hand_off_targets,
    plan_roles,
)
from llm_swarm.scheduler.service.core import CoreSettings, SchedulerCore
from llm_swarm.scheduler.service.planner import PlanSettings, compute_plan
from llm_swarm.scheduler.service.view import ModelShape
from llm_swarm.scheduler.sim.metrics import Slo
from llm_swarm.scheduler.sim.role_planning import plan_scenario_roles, roles_text, split_swarm
from llm_swarm.server.assigned_role import AssignedRole
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.server_info import ServerInfo, ServerRole, ServerState

pytestmark = pytest.mark.version_neutral  # scheduler and simulator code: no transformers

KV = 4096.0  # cache bytes per token per block
L_IN = 2048


def spec(name: str, tau: float, tau_prefill: float) -> ServerSpec:
    return ServerSpec(name=name, memory_bytes=1e11, tau=tau, tau_prefill=tau_prefill)


# two servers fast at prompts for their decode speed (p0, p1), two the other way round (d0, d1)
SERVERS = [spec("p0", 1e-3, 0.01), spec("p1", 1e-3, 0.01), spec("d0", 2e-4, 0.15), spec("d1", 2e-4, 0.15)]
WHOLE = [Span(0, 8)] * 4


def links(rate: float | None) -> dict[str, dict[str, float]]:
    if rate is None:
        return {}
    names = [s.name for s in SERVERS]
    return {a: {b: rate for b in names if b != a} for a in names}


def inputs(rate: float | None, placement=WHOLE) -> RoleInputs:
    return RoleInputs(SERVERS, list(placement), 8, links(rate), KV, RoleWorkload(L_IN, 64, 1.0))


def never(roles):
    raise AssertionError(f"nothing should be simulated, got {roles}")


def test_unknown_or_slow_links_keep_colocated_without_simulating():
    for rate in (None, 2.5e6):  # not measured; 20 Mbit/s: 8 blocks of 2048 tokens take 26 s there
        plan = plan_roles(inputs(rate), never)
        assert plan.colocated and plan.roles == (BOTH,) * 4 and not plan.evaluated
        assert "no server's prompts can move" in plan.reason


def test_roles_are_chosen_when_they_score_higher_and_pair_over_the_fastest_links():
    fast = inputs(1.25e9)
    fast.links["p0"]["d1"] = 2.5e9  # p0's best link: d1 first among its targets
    assert candidates(fast) == [(PREFILL, BOTH, BOTH, BOTH), (PREFILL, PREFILL, BOTH, BOTH)]
    scores = {(BOTH,) * 4: 1.0, (PREFILL, BOTH, BOTH, BOTH): 0.9, (PREFILL, PREFILL, BOTH, BOTH): 2.0}
    plan = plan_roles(fast, scores.__getitem__)
    assert plan.roles == (PREFILL, PREFILL, BOTH, BOTH)  # a worse first prefix does not stop the search
    assert plan.score == 2.0 and plan.colocated_score == 1.0
    assert plan.targets["p0"] == ("d1", "d0") and plan.targets["p1"] == ("d0", "d1")
    assert "prefill: p0 -> d1,d0" in plan.describe([s.name for s in SERVERS])
    # roles that do not score higher leave every server both (ties included), as does min_gain
    assert plan_roles(fast, lambda roles: 1.0).colocated
    assert plan_roles(fast, scores.__getitem__, min_gain=1.5).colocated
    assert plan_roles(fast, lambda r: {(BOTH,) * 4: 1.0}.get(r, 0.5), patience=1).evaluated[-1][1] == 0.5


def test_every_block_stays_decode_covered():
    # p0 alone holds blocks 0-1 and p1 alone holds 6-7: neither may stop decoding
    placement = [Span(0, 4), Span(4, 8), Span(2, 6), Span(2, 6)]
    found = candidates(inputs(1.25e9, placement))
    assert found == []
    placement = [Span(0, 8), Span(0, 8), Span(0, 4), Span(4, 8)]
    found = candidates(inputs(1.25e9, placement))
    assert found and all(decode_covered(inputs(1.25e9, placement), roles) for roles in found)
    # d0 and d1 together cover p0's span: its targets are both, each holding part of it
    assert hand_off_targets(inputs(1.25e9, placement), found[0], 0) == ("d0", "d1")
    # a server whose span has a block no decode server reaches over a paying link stays both
    one_way = inputs(1.25e9, placement)
    del one_way.links["p0"]["d1"], one_way.links["p1"]["d1"]
    assert candidates(one_way) == []


def test_prefill_servers_pair_with_the_decode_spans_they_reach_fastest():
    """Whole model where it fits; else the start containing the most decode spans no earlier
    prefill server contains, then the most link rate to them; without decode spans, laid around."""
    decode = {"d0": Span(0, 4), "d1": Span(4, 8), "d2": Span(0, 4), "d3": Span(4, 8)}
    fast_to_back = {"p0": {"d1": 1e9, "d3": 1e9, "d0": 1e6}, "p1": {"d0": 1e9, "d2": 1e9}}
    assert prefill_spans(["p0", "p1"], [4, 4], 8, decode, fast_to_back) == [Span(4, 8), Span(0, 4)]
    # unmeasured links: the decode servers served least first, then the first start
    halves = [Span(0, 4), Span(4, 8)]
    assert prefill_spans(["p0", "p1", "p2", "p3"], [4] * 4, 8, decode, {}) == halves * 2
    # a span that fits the whole model holds it, and then serves every decode server
    assert prefill_spans(["p0", "p1"], [8, 4], 8, decode, fast_to_back) == [Span(0, 8), Span(0, 4)]
    # 5 blocks: a start where decode spans start or end, here ending with the ones reached fastest
    assert prefill_spans(["p0"], [5], 8, decode, fast_to_back) == [Span(3, 8)]
    assert prefill_spans(["p0", "p1", "p2"], [3, 3, 3], 8) == [Span(0, 3), Span(3, 6), Span(5, 8)]
    assert prefill_blocks(10e9, 8, 1e9, 0.25e9) == 8 and prefill_blocks(5e9, 8, 1e9, 0.25e9) == 4
    with pytest.raises(ValueError, match="cannot hold a block"):
        prefill_spans(["p0"], [0], 8)


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="spans for"):
        RoleInputs(SERVERS, WHOLE[:3], 8, {}, KV, RoleWorkload(L_IN, 64))
    with pytest.raises(ValueError, match="rate must be >= 0"):
        RoleInputs(SERVERS, WHOLE, 8, {"p0": {"d0": math.nan}}, KV, RoleWorkload(L_IN, 64))
    with pytest.raises(ValueError, match="l_in, l_out"):
        RoleWorkload(0, 64)
    assert check_role(" Prefill ") == "prefill" and check_role("fast") is None
    with pytest.raises(SwarmUserError, match="--roles"):
        PlanSettings(roles="always")


def test_the_simulated_planner_takes_roles_where_they_pay_and_not_over_slow_links():
    slo = Slo(10.0, 0.2)
    plan, evaluate = plan_scenario_roles(split_swarm(2048, 64, 10_000.0), slo)
    assert roles_text(plan.roles) == "prefill*4,both*4"
    assert plan.score >= 1.3 * plan.colocated_score  # the target, on the swarm built for it
    plan, evaluate = plan_scenario_roles(split_swarm(2048, 64, 20.0), slo)
    assert plan.colocated and evaluate.simulations == 0


# -- the scheduler hands roles out ---------------------------------------------------------------

GIB = 1 << 30
SHAPE = ModelShape(num_blocks=80, hidden_size=8192, kv_dim=1024)


def record(
    tau: float, tau_prefill: float, peers: list[str], me: str, rate: float, memory: int = 79 * GIB
) -> ServerInfo:
    return ServerInfo(
        state=ServerState.JOINING,
        managed=True,
        memory_bytes=memory,
        block_bytes=int(856e6 * 4.25 / 8 * 1.01),
        cache_token_bytes=4096,
        cache_bytes_left=0,
        cache_slots_left=0,
        slot_tokens=2112,
        max_length=4096,
        tau=tau,
        tau_prefill=tau_prefill,
        prefill_tokens=L_IN,
        links={peer: rate for peer in peers if peer != me},
    )


def core_records(
    rate: float, compute_memory: int = 79 * GIB, bandwidth_memory: int = 79 * GIB
) -> dict[str, ServerInfo]:
    """`split_swarm`'s servers as they would announce themselves, with links at `rate` bytes/s."""
    peers = [f"compute-{k}" for k in range(4)] + [f"bandwidth-{k}" for k in range(4)]
    timings = [(9.19e-4, 0.0127, compute_memory)] * 4 + [(2.30e-4, 0.141, bandwidth_memory)] * 4
    return {
        p: record(tau, pre, peers, p, rate, memory)
        for p, (tau, pre, memory) in zip(peers, timings, strict=True)
    }


def core(roles: str) -> SchedulerCore:
    plan = PlanSettings(num_requests=1, roles=roles)
    settings = CoreSettings(plan=plan, l_in=L_IN, l_out=64, settle=0.0, slo_ttft=10.0, slo_tpot=0.2)
    return SchedulerCore(SHAPE, settings, 0.0)


@pytest.mark.parametrize("rate, expected", [(1.25e9, "prefill"), (2.5e6, "")])
def test_the_scheduler_assigns_roles_only_with_roles_auto_and_fast_links(rate, expected):
    auto = core("auto")
    auto.update_roster(core_records(rate), 0.0)
    auto.review(1.0, force=True)
    compute = auto.assignment_for("compute-0")
    assert compute.assigned and compute.role == expected
    assert auto.assignment_for("bandwidth-0").role == ""
    off = core("off")  # the default: assignments carry no role, nothing is planned
    off.update_roster(core_records(rate), 0.0)
    off.review(1.0, force=True)
    assert off.assignment_for("compute-0").assigned and off.assignment_for("compute-0").role == ""
    assert off.roles.plan is None


def test_with_roles_the_scheduler_places_chains_on_the_decode_servers_and_stays_put():
    """Once roles are chosen, the placement is re-made: CG-BP over the servers that decode (a
    prefill server carries no session's tokens: the bandwidth-rich GPUs, each holding part of the
    model, form 2-hop chains among themselves), then each prefill server (68 of 80 blocks fit) at a
    start where it holds whole decode spans, spread over them; a later review keeps it, and links
    too slow for hand-offs restore the colocated placement with every server both."""
    auto = core("auto")
    records = core_records(1.25e9, compute_memory=30 * GIB, bandwidth_memory=24 * GIB)
    auto.update_roster(records, 0.0)
    assert auto.review(1.0, force=True)
    compute = [p for p in records if p.startswith("compute")]
    bandwidth = [p for p in records if p.startswith("bandwidth")]
    assert all(auto.roles.roles.get(p) == "prefill" for p in compute)
    alone = compute_plan(auto.view, bandwidth, auto.settings.plan, auto.num_requests)
    assert {p: auto.assignment[p] for p in bandwidth} == alone.spans
    held = {block for p in bandwidth for block in range(auto.assignment[p].start, auto.assignment[p].end)}
    assert held == set(range(80))  # chains exist without the prefill servers
    decode = {p: auto.assignment[p] for p in bandwidth}
    for p in compute:
        span = auto.assignment[p]
        assert span.length == 68 and any(span.start <= d.start and d.end <= span.end for d in decode.values())
    assert sorted(auto.assignment[p].start for p in compute) == [0, 0, 12, 12]  # spread over both
    epoch, assignment = auto.epoch, dict(auto.assignment)
    assert not auto.review(1000.0, force=True)  # nothing changed: no move, no flapping
    assert auto.epoch == epoch and auto.assignment == assignment
    auto.update_roster(core_records(2.5e6, 30 * GIB, 24 * GIB), 1001.0)  # 20 Mbit/s: none pays
    auto.review(2000.0, force=True)
    colocated = compute_plan(auto.view, sorted(records), auto.settings.plan, auto.num_requests)
    assert auto.roles.roles == {} and auto.assignment == colocated.spans


def test_roles_whose_decode_servers_cannot_hold_the_model_fall_back_to_colocated(caplog):
    """A role plan the servers that decode cannot be placed for alone (here: every bandwidth-rich
    GPU prefill, the compute-rich ones holding 17 blocks each of 80) is dropped: every server both,
    the colocated placement, and the operator told why."""
    scheduler = core("off")  # the plan is set by hand: the simulated planner would not choose it
    records = core_records(1.25e9, compute_memory=8 * GIB)
    scheduler.update_roster(records, 0.0)
    scheduler.roles.roles = {p: "prefill" for p in records if p.startswith("bandwidth")}
    with caplog.at_level(logging.WARNING, logger="llm_swarm.scheduler.service.live_roles"):
        assert scheduler.review(1.0, force=True)
    assert scheduler.roles.roles == {} and "cannot be placed alone" in caplog.text
    colocated = compute_plan(scheduler.view, sorted(records), scheduler.settings.plan, 1)
    assert scheduler.assignment == colocated.spans


def test_the_proto_role_defaults_to_empty():
    old = pb.Assignment(assigned=True, start=0, end=4, epoch=3).SerializeToString()
    assert pb.Assignment.FromString(old).role == ""  # an older scheduler's reply: both
    assert pb.Assignment.FromString(pb.Assignment(role="prefill").SerializeToString()).role == "prefill"


# -- a managed server adopts them ------------------------------------------------------------------


def test_a_server_follows_assigned_roles_unless_started_with_one(caplog):
    caplog.set_level(logging.INFO, logger="llm_swarm.server.assigned_role")
    managed = AssignedRole("both")
    assert managed.follow("prefill") and managed.role == ServerRole.PREFILL
    assert not managed.follow("prefill")
    assert managed.follow("") and managed.role == ServerRole.BOTH  # empty: both
    assert not managed.follow("fastest") and managed.role == ServerRole.BOTH
    assert not managed.follow("fastest")
    assert sum("unknown role" in r.message for r in caplog.records) == 1
    fixed = AssignedRole("decode")
    assert not fixed.follow("prefill") and fixed.role == ServerRole.DECODE
    assert "started with --role decode: keeping it, ignoring the scheduler's role prefill" in caplog.text


def test_swarm_plan_goodput_reports_the_role_plan_beside_the_policies():
    from tests.test_goodput_plan import QUICK, TINY, run_plan

    code, out, err = run_plan(
        ["goodput", "--slo-ttft", "5x", "--slo-tpot", "1.5x", *QUICK, "--link-mbps", "20"], TINY
    )
    assert code == 0, err
    roles = json.loads(out)["roles"]
    assert roles["chosen"] == "colocated" and roles["scheduler_flags"] == "--roles off"
    assert set(roles["roles"].values()) == {"both"} and roles["link_mbps"] == 20.0
    code, out, _ = run_plan(
        ["goodput", "--slo-ttft", "5x", *QUICK, "--link-mbps", "20", "--roles", "off"], TINY
    )
    assert code == 0 and "roles" not in json.loads(out)
    code, _, err = run_plan(["goodput", "--slo-ttft", "5x", *QUICK, "--link-mbps", "-1"], TINY)
    assert code != 0 and "--link-mbps must be a positive" in err


# -- real processes: managed servers adopt the role a scheduler assigns --------------------------


@pytest.mark.swarm
def test_managed_servers_adopt_an_assigned_role_unless_started_with_one(llama_dir, tmp_path):
    """A scheduler speaking the proto (scripted) assigns `prefill` to both managed servers: the one
    started without --role announces prefill; the one started with --role decode keeps decode and
    says so; a later empty role (both) is followed back; an unknown one is ignored with a warning."""

    from harness.local_swarm import LocalSwarm
    from llm_swarm.swarm.dht_keys import default_prefix
    from tests.conftest import NUM_BLOCKS
    from tests.swarm_processes import dht_started
    from tests.test_server_managed import (
        ScriptedScheduler,
        scripted_scheduler,
        start_managed,
        wait_announced,
        wait_log,
        wait_spans,
    )

    class RoleScheduler(ScriptedScheduler):
        role = "prefill"

        def GetAssignment(self, request, context):  # noqa: N802  (the proto's name)
            answer = super().GetAssignment(request, context)
            answer.role = self.role
            return answer

    prefix = default_prefix(str(llama_dir))
    scheduler = RoleScheduler()
    with dht_started(LocalSwarm(tmp_path)) as swarm, scripted_scheduler(swarm, prefix, scheduler):
        options = ["--scheduler-timeout", "30", "--assignment-poll", "0.3"]
        start_managed(swarm, "free", llama_dir, 10**9, *options)
        start_managed(swarm, "fixed", llama_dir, 10**9, *options, "--role", "decode")
        _roster, peers = wait_announced(swarm, prefix, {"free", "fixed"})
        scheduler.epoch = 1
        scheduler.spans = {peers["free"]: (0, NUM_BLOCKS), peers["fixed"]: (0, NUM_BLOCKS)}
        online = wait_spans(swarm, prefix, {"free": (0, NUM_BLOCKS), "fixed": (0, NUM_BLOCKS)})
        assert (online["free"].role, online["fixed"].role) == (ServerRole.PREFILL, ServerRole.DECODE)
        wait_log(
            swarm,
            "fixed",
            "started with --role decode: keeping it, ignoring the scheduler's role prefill",
        )
        scheduler.role = "fastest"
        wait_log(swarm, "free", "the scheduler assigned an unknown role 'fastest': ignored")
        scheduler.role = ""  # empty: both (what an older scheduler, or --roles off, sends)
        wait_log(swarm, "free", "scheduler assigned role both (was prefill)")
        swarm.wait_for(
            prefix,
            NUM_BLOCKS,
            lambda online: online["free"].role == ServerRole.BOTH,
            30,
            what="role both",
        )


@pytest.mark.swarm
def test_a_live_scheduler_plans_roles_and_generation_through_them_stays_exact(
    swarm, llama_dir, local_reference
):
    """`swarm-scheduler --roles auto` on four managed servers, the netem benchmark's `split` swarm in
    small (two compute-rich servers that decode 2x slower, two that prefill 10x slower; emulated
    delays): once the servers have measured their links, the scheduler makes the compute-rich ones
    `prefill` and places for it; a session's prompt then runs there, its cache streamed to the server
    that decodes, and greedy generation equals local transformers."""
    import torch

    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
    from llm_swarm.swarm.dht_keys import default_prefix
    from tests.conftest import NUM_BLOCKS
    from tests.test_handoff import _wait_for_log
    from tests.test_server_managed import start_managed

    prefix = default_prefix(str(llama_dir))
    swarm.start_scheduler(
        "scheduler", llama_dir, "--roles", "auto", "--slo-ttft", "3", "--slo-tpot", "0.1",
        "--num-requests", "1", "--period", "3", "--l-in", "442", "--l-out", "16",
    )  # fmt: skip
    delays = {"rich": ("0.01", "0.0001"), "slow": ("0.005", "0.001")}
    names = [f"{kind}{k}" for kind in delays for k in range(2)]
    for name in names:
        delay, per_token = delays[name[:4]]
        start_managed(
            swarm, name, llama_dir, 10**9, "--compute-delay", delay, "--compute-delay-per-token", per_token,
            "--prefill-tokens", "512", "--link-probe-period", "1", "--assignment-poll", "0.5",
        )  # fmt: skip
    swarm.wait_for(
        prefix,
        NUM_BLOCKS,
        lambda online: (
            all(name in online for name in names)
            and [online[name].role for name in names] == [ServerRole.PREFILL] * 2 + [ServerRole.BOTH] * 2
        ),
        180,
        what="the compute-rich servers prefill",
    )
    prompt = torch.randint(4, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    expected = local_reference(llama_dir)[0].generate(prompt, max_new_tokens=6)
    options = ClientOptions(
        request_timeout=30.0, scheduler_key=swarm.scheduler_key, use_scheduler=True, accept_slo_miss=True
    )
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=options)
    try:
        assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    finally:
        model.shutdown()
    assert "roles: prefill:" in swarm.log("scheduler")
    for name in ("rich0", "rich1"):
        if "while computing them" in swarm.log(name):
            break
    else:
        _wait_for_log(swarm, "rich0", "while computing them")  # fails with the log's tail
