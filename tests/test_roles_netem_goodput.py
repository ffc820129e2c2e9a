"""The goodput arithmetic of benchmarks/roles/emulated.py (pure: no processes)."""

from __future__ import annotations

import math

import pytest

from benchmarks.roles.sim import attainment, measured_times, rate_goodput, trace_requests
from llm_swarm.scheduler.sim.metrics import Slo
from llm_swarm.scheduler.sim.workload import TraceRecord

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def test_measured_times_and_failures_count_as_misses() -> None:
    rows = [
        {"arrival": 1.0, "first_token": 2.0, "finish": 2.9, "l_out": 10},  # TTFT 1, TPOT 0.1
        {"arrival": 0.0, "first_token": 6.0, "finish": 6.5, "l_out": 6},  # TTFT 6: misses 5 s
        {"arrival": 0.0, "error": "SwarmUnavailable: no room", "l_out": 4},
        {"arrival": 0.0, "first_token": 0.5, "finish": 0.5, "l_out": 1},  # no TPOT: 0
    ]
    ttft, tpot, failed = measured_times(rows)
    assert ttft == pytest.approx([1.0, 6.0, 0.5])
    assert tpot == pytest.approx([0.1, 0.1, 0.0])
    assert failed == 1
    assert attainment(ttft, tpot, failed, Slo(5.0, 0.2)) == pytest.approx(2 / 4)
    assert attainment(ttft, tpot, failed, Slo(5.0, 0.05)) == pytest.approx(1 / 4)
    assert attainment([], [], 3, Slo(5.0, 0.2)) == 0.0
    assert math.isnan(attainment([], [], 0, Slo(5.0, 0.2)))


def test_goodput_is_the_highest_rate_of_a_passing_prefix_without_interpolation() -> None:
    assert rate_goodput([0.3, 0.6, 0.9, 1.2], [1.0, 0.95, 0.85, 0.92]) == 0.6  # 1.2 alone does not count
    assert rate_goodput([0.6, 0.3], [0.9, 1.0]) == 0.6  # order of probing does not matter; 0.9 passes
    assert rate_goodput([0.3, 0.6], [0.89, 1.0]) == 0.0
    assert rate_goodput([0.3, 0.6], [1.0, math.nan]) == 0.3  # a rate not run ends the prefix


def test_trace_requests_scale_cap_and_floor_lengths() -> None:
    records = [TraceRecord(0.0, 8000, 100), TraceRecord(0.0, 3, 1)]
    requests = trace_requests(records, 2.0, 50, 4, 1024, 32, seed=0)
    assert requests[0].arrival == 0.0
    assert all(b.arrival >= a.arrival for a, b in zip(requests, requests[1:], strict=False))
    assert {(r.l_in, r.l_out) for r in requests} == {(1024, 32), (2, 2)}


def test_the_scheduler_s_announced_roles_become_the_simulated_roles_and_decode_delays_per_server() -> None:
    """`--modes auto`: the roles the servers announced (by peer id) are simulated in the report's server
    order, every server both is colocated; `--rich-compute-delay` slows only the compute-rich servers'
    decoding."""
    from benchmarks.roles.report import announced_roles
    from benchmarks.roles.sim import CpuCosts, EmulatedSwarm

    names = {"AAAArich": "rich0", "BBBBrich": "rich1", "CCCCslow": "slow0", "DDDDslow": "slow1"}
    announced = {"QmAAAArich": "prefill", "QmBBBBrich": "prefill", "QmCCCCslow": "both"}
    assert announced_roles(announced, names) == "prefill,prefill,both,both"
    assert announced_roles(dict.fromkeys(announced, "both"), names) is None
    assert announced_roles(None, names) is None
    cpu = CpuCosts(1e-4, 1e-5, 1e-4, 1000, 10)
    swarm = EmulatedSwarm(0.005, 1e-4, 1e-3, 0.03, 100.0, 0.002, 1000.0, 1e8, 6, 512, cpu, None, 0.01)
    assert [swarm.decode_delay(j) for j in range(4)] == [0.01, 0.01, 0.005, 0.005]
