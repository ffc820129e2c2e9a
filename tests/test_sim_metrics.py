"""SLO attainment and goodput (docs/reference.md 6) on hand-computed inputs; the goodput search; sweep
outputs."""

from __future__ import annotations

import csv

import pytest

from llm_swarm.scheduler.sim import sweeps
from llm_swarm.scheduler.sim.cli import main
from llm_swarm.scheduler.sim.discrete_events import RequestRecord
from llm_swarm.scheduler.sim.goodput import search_rates
from llm_swarm.scheduler.sim.metrics import Slo, goodput, slo_attainment, summarize
from llm_swarm.scheduler.sim.monte_carlo import CellConfig

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def test_slo_attainment_counts_requests_meeting_both_bounds():
    ttft = [1.0, 2.0, 3.0, 4.0]
    tpot = [0.1, 0.5, 0.1, 0.1]
    # TTFT <= 3 keeps requests 0-2; TPOT <= 0.2 drops request 1: 2 of 4 meet both (bounds inclusive).
    assert slo_attainment(ttft, tpot, Slo(ttft_s=3.0, tpot_s=0.2)) == 0.5
    assert slo_attainment(ttft, tpot, Slo(ttft_s=3.0)) == 0.75
    assert slo_attainment(ttft, tpot, Slo(tpot_s=0.2)) == 0.75
    with pytest.raises(ValueError):
        Slo(ttft_s=-1.0)


def test_summary_reports_attainment_only_when_asked():
    # arrival 0, first token at 2 s, finish at 5 s with 4 tokens: TTFT 2 s, TPOT (5 - 2) / 3 = 1 s.
    records = [RequestRecord(0, 0.0, 0.0, 0.5, 2.0, 5.0, 4, 1, 0)]
    assert "slo_attainment" not in summarize(records)
    assert summarize(records, Slo(ttft_s=2.0, tpot_s=1.0))["slo_attainment"] == 1.0
    assert summarize(records, Slo(ttft_s=2.0, tpot_s=0.99))["slo_attainment"] == 0.0


def test_goodput_is_highest_rate_of_a_passing_prefix():
    rates = [0.5, 0.1, 1.0, 2.0]
    attained = [0.95, 1.0, 0.85, 0.92]  # 1.0 misses, so 2.0's lucky pass does not count
    assert goodput(rates, attained) == 0.5
    assert goodput([0.1], [0.5]) == 0.0
    assert goodput([0.1, 0.2], [0.9, 0.9]) == 0.2  # the 90% bound is inclusive


def test_search_doubles_then_bisects_to_the_crossing():
    probes = []

    def attainment(rate: float) -> float:  # meets the SLOs exactly up to 3 req/s
        probes.append(rate)
        return 1.0 if rate <= 3.0 else 0.0

    result = search_rates(attainment, start=1.0, doublings=5, bisections=3)
    # 1, 2 pass, 4 fails; bisection: 3 passes, 3.5 fails, 3.25 fails.
    assert probes == [1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    assert result.goodput == 3.0
    assert search_rates(lambda r: 0.0, start=1.0).goodput == 0.0


def test_cli_rate_sweep_with_slos_reports_goodput(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweeps, "FIG8_RATES", sweeps.FIG8_RATES[:2])  # the two light points show it
    argv = ["--scenario", "abovenet", "--sweep", "rate", "--seeds", "1", "--out", str(tmp_path)]
    argv += ["--setup", "none", "--slo-ttft", "30", "--slo-tpot", "2", "--json"]
    assert main(argv) == 0
    assert '"goodput"' in capsys.readouterr().out
    with (tmp_path / "abovenet_rate.csv").open() as handle:
        assert "slo_attainment" in next(csv.reader(handle))


def test_cli_goodput_needs_an_slo(capsys):
    assert main(["--goodput"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_config_defaults_have_no_slo():
    assert CellConfig().slo_ttft is None and CellConfig().slo_tpot is None
