"""scripts/experiment.py's pure parts (`scripts/table2`): paper 001's chain times, the report table,
the commands."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from table2.placement import with_chain_times  # noqa: E402
from table2.report import command_of, markdown  # noqa: E402


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


def test_commands_name_the_policies_and_the_merge():
    config = {
        "policies": "chains",
        "rates": "0.1",
        "l_out": "64",
        "requests": "100",
        "time_scale": 0.5,
        "client_cluster": 0,
        "seed": 0,
        "gpu_model": "overlap",
        "merge": True,
    }
    command = command_of(config)
    assert "--policies chains" in command and command.endswith("--merge --write-benchmarks")
    default = {**config, "policies": "petals,cg-bp", "merge": False}
    assert "--policies" not in command_of(default)
