"""The pure parts of `benchmarks/table2`: Sun, He and Hou's chain times, the report table, the
commands."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from benchmarks.netem.system import busy_cores, host_cpu_ticks
from benchmarks.table2.placement import place, with_chain_times
from benchmarks.table2.plans import attainment, measured_times, parse_plan, parse_plans, run_attainment
from benchmarks.table2.repeatability import compare
from benchmarks.table2.report import command_of, markdown
from llm_swarm.scheduler.algorithms.problem import ModelSpec

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def test_chain_times_make_eq_2_equal_eq_1():
    document = {
        "servers": [
            {"name": "a", "tau": 0.01, "tau_prefill": 0.05, "rtt": {"c": 0.1}, "rtt_prefill": {"c": 0.2}}
        ]
    }
    (server,) = with_chain_times(document, l_out=8)["servers"]
    assert server["tau_c"] == pytest.approx(0.2 + 7 * 0.1)
    assert server["tau_p"] == pytest.approx(0.05 + 7 * 0.01)


def run(policy: str, measured: float, simulated: float) -> dict:
    return {
        "policy": policy,
        "rate": 0.5,
        "l_out": 64,
        "requests": 10,
        "measured": {"per_token_time_mean": measured},
        "simulated": {"per_token_time_mean": simulated, "hops_mean": 2.0},
        "per_request": [{"hops": ["x", "y"]}],
    }


def test_the_table_compares_every_policy_with_petals():
    report = {
        "config": {"time_scale": 1.0},
        "runs": [run("chains", 0.25, 0.2), run("petals", 1.0, 0.8), run("cg-bp", 0.4, 0.4)],
    }
    table = markdown(report)
    rows = [line for line in table.splitlines() if line.startswith("| 0.5, 64 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["petals", "cg-bp", "chains"]
    assert "| 0.5, 64 | petals | - | - | -20% |" in table
    assert "| 0.5, 64 | cg-bp | 60% faster | 50% faster | +0% |" in table
    assert "| 0.5, 64 | chains | 75% faster | 75% faster | -20% |" in table


# what a run's recorded configuration holds apart from the fields each test sets
RUN_CONFIG = {"l_out": "64", "requests": "100", "client_cluster": 0, "seed": 0, "gpu_model": "overlap"}


def test_commands_name_the_policies_and_the_merge():
    config = {**RUN_CONFIG, "policies": "chains", "rates": "0.1", "time_scale": 0.5, "merge": True}
    command = command_of(config)
    assert "--policies chains" in command and command.endswith("--merge --write-benchmarks")
    default = {**config, "policies": "petals,cg-bp", "merge": False}
    assert "--policies" not in command_of(default)


# -- fixed-parameter plans and SLO attainment (a goodput plan on the emulator) ---------------


@pytest.mark.parametrize(
    ("text", "policy", "parameter", "label"),
    [
        ("chains", "chains", None, "chains"),
        ("cg-bp:R=128", "cg-bp", 128, "cg-bp R=128"),
        ("cg-bp R=128", "cg-bp", 128, "cg-bp R=128"),  # as swarm-plan goodput prints it
        (" chains:c=16 ", "chains", 16, "chains c=16"),
        ("petals", "petals", None, "petals"),
    ],
)
def test_plans_parse_as_swarm_plan_goodput_prints_them(text, policy, parameter, label):
    spec = parse_plan(text)
    assert (spec.policy, spec.parameter, spec.label) == (policy, parameter, label)
    assert " " not in spec.slug and ":" not in spec.slug  # file names


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm", "unknown policy"),
        ("petals:R=4", "takes no parameter"),
        ("cg-bp:c=4", "parameter is R"),
        ("chains:c=0", "positive integer"),
        ("chains:c=2.5", "positive integer"),
        ("cg-bp:R=", "expected POLICY"),
    ],
)
def test_bad_plans_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_plan(text)


def test_a_policies_list_keeps_order_and_refuses_repeats():
    assert [p.label for p in parse_plans("chains,cg-bp,cg-bp:R=128")] == ["chains", "cg-bp", "cg-bp R=128"]
    with pytest.raises(ValueError, match="more than once"):
        parse_plans("cg-bp R=8,cg-bp:R=8")
    with pytest.raises(ValueError, match="at least one"):
        parse_plans(" , ")


def test_attainment_needs_both_targets_and_counts_failures_as_misses():
    ttft, tpot = [0.5, 1.0, 2.0, 0.5], [0.3, 0.3, 0.3, 0.6]
    assert attainment(ttft, tpot, 0, 1.0, 0.5) == pytest.approx(2 / 4)  # bounds inclusive
    assert attainment(ttft, tpot, 4, 1.0, 0.5) == pytest.approx(2 / 8)
    assert attainment(ttft, tpot, 0, None, 0.5) == pytest.approx(3 / 4)
    with pytest.raises(ValueError):
        attainment([], [], 0, 1.0, None)


def slo_run(plan: str, parameter: int | None) -> dict:
    """Two answered requests (TTFT 0.5 and 2 s, TPOT 0.2 s) and one failed; the simulator: both fast."""
    per_request = [
        {"id": 0, "arrival": 1.0, "first_token": 1.5, "finish": 1.5 + 3 * 0.2, "l_out": 4, "hops": ["a"]},
        {"id": 1, "arrival": 2.0, "first_token": 4.0, "finish": 4.0 + 3 * 0.2, "l_out": 4, "hops": ["a"]},
        {"id": 2, "arrival": 3.0, "error": "SwarmUnavailable"},
    ]
    return {
        **run("cg-bp", 0.3, 0.25),
        "plan": plan,
        "parameter": parameter,
        "slo": {"ttft_s": 1.0, "tpot_s": 0.25},
        "measured": {"per_token_time_mean": 0.3, "slo_attainment": 1 / 3, "ttft_p50": 1.25},
        "simulated": {"per_token_time_mean": 0.25, "slo_attainment": 1.0, "hops_mean": 1.0},
        "per_request": per_request,
        "simulated_per_request": {"id": [0, 1, 2], "ttft": [0.4, 0.4, 0.6], "tpot": [0.2, 0.2, 0.2]},
    }


def test_measured_times_follow_the_metrics_definitions():
    ttft, tpot, failed = measured_times(slo_run("cg-bp", None)["per_request"])
    assert ttft == pytest.approx([0.5, 2.0]) and tpot == pytest.approx([0.2, 0.2]) and failed == 1


def test_the_report_puts_measured_attainment_beside_the_prediction():
    report = {"config": {"time_scale": 1.0}, "runs": [slo_run("cg-bp R=128", 128), slo_run("cg-bp", None)]}
    table = markdown(report)
    rows = [line for line in table.splitlines() if line.startswith("| 0.5, 64 | cg-bp")]
    assert rows[0].startswith("| 0.5, 64 | cg-bp |")  # the default before the fixed plan
    assert "| 0.5, 64 | cg-bp R=128 | 1, 0.25 | 33.3% | 100.0% | -66.7 |" in table
    # the sweep: TTFT x0.5 (0.5 s) is met by request 0 alone, and by the simulator's 0 and 1
    assert run_attainment(slo_run("cg-bp", None), 0.5, 0.25) == pytest.approx((1 / 3, 2 / 3))
    assert "| 33% / 67% |" in table


def test_commands_carry_the_slos_and_the_results_folder():
    config = {
        **RUN_CONFIG,
        "policies": "chains,cg-bp R=128",
        "rates": "0.5",
        "time_scale": 1.0,
        "slo_ttft": 2.19,
        "slo_tpot": 0.65,
        "out": str(Path(__file__).resolve().parents[1] / "results" / "netem" / "goodput"),
        "write_benchmarks": False,
    }
    command = command_of(config)
    assert "--policies 'chains,cg-bp R=128'" in command
    assert "--slo-ttft 2.19 --slo-tpot 0.65 --out results/netem/goodput" in command
    assert not command.endswith("--write-benchmarks")


def fixed_problem() -> tuple[dict, ModelSpec]:
    """Two servers that each hold the whole (4-block) model with cache room for many sessions."""
    model = ModelSpec(
        num_blocks=4, block_bytes=1e9, cache_bytes=1e7, hidden_size=64, kv_dim=64, dtype_bytes=2
    )
    servers = [
        {
            "name": name,
            "memory_bytes": 6e9,
            "tau": 0.01,
            "tau_prefill": 0.02,
            "rtt": {"client": 0.05},
            "rtt_prefill": {"client": 0.05},
        }
        for name in ("a", "b")
    ]
    return {"model": dataclasses.asdict(model), "servers": servers}, model


def test_a_fixed_parameter_is_placed_as_given():
    document, model = fixed_problem()
    assert place("cg-bp", document, model, 0.5, 16, parameter=7)["num_requests"] == 7
    assert place("chains", document, model, 0.5, 16, parameter=3)["c"] == 3
    with pytest.raises(RuntimeError, match="R=100000"):
        place("cg-bp", document, model, 0.5, 16, parameter=100000)


def test_repeatability_matches_cells_and_reports_the_spread(tmp_path):
    """Two reports of the same cell: the spread per metric, runs from before `plan` existed matched
    by policy, and the host's cores where a run recorded them."""
    first, second = run("cg-bp", 0.5, 0.4), run("cg-bp", 0.75, 0.4)
    second["plan"] = "cg-bp"
    second["host_cpu"] = {"busy_cores": 1.6, "swarm_cores": 1.25, "cores": 2}
    # a cell only one report ran is left out
    (tmp_path / "a.json").write_text(json.dumps({"runs": [first, run("chains", 0.3, 0.3)]}))
    (tmp_path / "b.json").write_text(json.dumps({"runs": [second]}))
    header, _rule, row = compare(tmp_path / "a.json", tmp_path / "b.json")
    assert "second vs first" in header
    assert row.startswith("| cg-bp, 0.5, 64 | 0.500 / ") and "| +50 / " in row
    assert row.endswith("| not recorded; 1.60 of 2 busy, swarm 1.25 |")
    busy = busy_cores((100, 1000), (400, 1600))  # 300 busy ticks of 600, over every core
    assert busy == pytest.approx(os.cpu_count() * 0.5)
    busy, total = host_cpu_ticks()
    assert 0 <= busy <= total
