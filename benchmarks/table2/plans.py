"""The experiment's `--policies` entries and SLO attainment of a run (pure).

An entry is a policy as the scheduler runs it by default (`petals`, `cg-bp`: R from the rate,
`chains`: c tuned for the rate) or a plan with its parameter fixed, written as `swarm-plan goodput`
prints it (`cg-bp R=128`) or, shell-friendly, `cg-bp:R=128` / `chains:c=16`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from llm_swarm.scheduler.sim.plan_runs import PARAMETER, Candidate

POLICIES = ("petals", "cg-bp", "chains")  # the scheduler's policy names, also the simulator's

_ENTRY = re.compile(r"^\s*([a-z-]+)\s*(?:[:\s]\s*([A-Za-z]+)\s*=\s*([^\s]+))?\s*$")


@dataclass(frozen=True)
class PlanSpec(Candidate):
    """One policy of a run: its name and, for a fixed plan, R (cg-bp) or c (chains); `label` is
    swarm-plan goodput's (`cg-bp`, `cg-bp R=128`)."""

    @property
    def slug(self) -> str:
        """For file names: `cg-bp`, `cg-bp-R128`."""
        if self.parameter is None:
            return self.policy
        return f"{self.policy}-{PARAMETER[self.policy]}{self.parameter}"


def parse_plan(text: str) -> PlanSpec:
    """`"chains"` -> PlanSpec("chains"); `"cg-bp:R=128"` or `"cg-bp R=128"` -> PlanSpec("cg-bp", 128)."""
    match = _ENTRY.match(text)
    if match is None:
        raise ValueError(f"policy {text!r}: expected POLICY or POLICY:NAME=VALUE, e.g. cg-bp:R=128")
    policy, name, value = match.groups()
    if policy not in POLICIES:
        raise ValueError(f"policy {text!r}: unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    if name is None:
        return PlanSpec(policy)
    expected = PARAMETER.get(policy)
    if expected is None:
        raise ValueError(f"policy {text!r}: {policy} takes no parameter")
    if name != expected:
        raise ValueError(f"policy {text!r}: {policy}'s parameter is {expected}, not {name}")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"policy {text!r}: {expected} must be a positive integer, got {value!r}")
    return PlanSpec(policy, int(value))


def parse_plans(text: str) -> list[PlanSpec]:
    """A comma-separated `--policies` value; every entry once."""
    plans = [parse_plan(item) for item in text.split(",") if item.strip()]
    if not plans:
        raise ValueError("--policies: give at least one policy")
    labels = [p.label for p in plans]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"--policies: {', '.join(repeated)} given more than once")
    return plans


def attainment(
    ttft: Sequence[float], tpot: Sequence[float], failed: int, ttft_s: float | None, tpot_s: float | None
) -> float:
    """Fraction of all requests, `failed` ones (no answer) counted as misses, whose TTFT and TPOT both
    meet the targets (bounds inclusive, as `scheduler.sim.metrics.slo_attainment`)."""
    if len(ttft) != len(tpot):
        raise ValueError("need one TTFT and one TPOT per completed request")
    if failed < 0:
        raise ValueError("failed requests cannot be negative")
    total = len(ttft) + failed
    if total == 0:
        raise ValueError("no requests")
    met = sum(
        1
        for first, per_token in zip(ttft, tpot, strict=True)
        if (ttft_s is None or first <= ttft_s) and (tpot_s is None or per_token <= tpot_s)
    )
    return met / total


def check_slo(value: float | None, flag: str) -> None:
    """A boundary check for `--slo-ttft` / `--slo-tpot` (seconds, at the emulation's scale)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a positive number of seconds, got {value}")


def measured_times(per_request: Sequence[dict]) -> tuple[list[float], list[float], int]:
    """TTFT and TPOT of the load generator's answered requests (docs/reference.md 6: TPOT over the
    tokens after the first), and how many failed (an error, or no first token)."""
    ttft, tpot, failed = [], [], 0
    for request in per_request:
        if "error" in request or "first_token" not in request:
            failed += 1
            continue
        ttft.append(request["first_token"] - request["arrival"])
        decode = max(request["l_out"] - 1, 1)
        tpot.append((request["finish"] - request["first_token"]) / decode if request["l_out"] > 1 else 0.0)
    return ttft, tpot, failed


def run_attainment(run: dict, ttft_s: float | None, tpot_s: float | None) -> tuple[float, float]:
    """(measured, simulated) SLO attainment of one experiment run at these targets, from its
    per-request times: any targets, not only the ones it ran with."""
    ttft, tpot, failed = measured_times(run["per_request"])
    simulated = run["simulated_per_request"]
    return (
        attainment(ttft, tpot, failed, ttft_s, tpot_s),
        attainment(simulated["ttft"], simulated["tpot"], 0, ttft_s, tpot_s),
    )
