"""What `swarm-batch` prints before and after running, and the summary it can write as JSON. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llm_swarm.client.batch.chains import BatchChain, ChainSpeed
from llm_swarm.client.batch.plan import LowerBound, Plan


@dataclass(frozen=True)
class PlanReport:
    chains: Sequence[BatchChain]
    speeds: Sequence[ChainSpeed]
    slots: Sequence[int]
    probed: bool
    plan: Plan  # the plan that runs (LPT, or FCFS's estimate when assigning first come first served)
    lpt_makespan: float
    fcfs_makespan: float
    bound: LowerBound
    assign: str  # "lpt" or "fcfs"
    steal: bool


def _ratio(value: float, bound: float) -> str:
    return f"{value / bound:.3f}x" if bound > 0 and math.isfinite(value) else "-"


def plan_lines(report: PlanReport, typical_prompt: int) -> list[str]:
    """The chains, the plan's makespan estimate beside the lower bound, and FCFS's estimate."""
    lines = []
    source = "probed" if report.probed else "announced"
    for k, (chain, speed, slots) in enumerate(zip(report.chains, report.speeds, report.slots, strict=True)):
        lines.append(
            f"  chain {k}: {chain.describe()}: {slots} session(s) at once, {speed.decode_step * 1e3:.1f} ms "
            f"per token, a {typical_prompt}-token prompt {speed.first_step(typical_prompt) * 1e3:.1f} ms "
            f"({source})"
        )
    bound = report.bound
    how = (
        "LPT" + (" + work stealing" if report.steal else "")
        if report.assign == "lpt"
        else "first come first served"
    )
    estimate = report.plan.makespan
    lines.append(
        f"plan ({how}): makespan {estimate:.1f} s estimated; lower bound {bound.value:.1f} s (longest job "
        f"{bound.longest_job:.1f} s, all work over all lanes {bound.fractional:.1f} s): "
        f"{_ratio(estimate, bound.value)}"
    )
    lines.append(
        f"  beside it: LPT {report.lpt_makespan:.1f} s ({_ratio(report.lpt_makespan, bound.value)}), "
        f"first come first served {report.fcfs_makespan:.1f} s ({_ratio(report.fcfs_makespan, bound.value)})"
    )
    if report.plan.unplaceable:
        lines.append(
            f"  {len(report.plan.unplaceable)} prompt(s) longer than any chain's servers accept: "
            "written as errors"
        )
    return lines


def summary_line(
    done: int, errors: int, tokens: int, makespan: float, report: PlanReport, steals: int
) -> str:
    rate = tokens / makespan if makespan > 0 else 0.0
    return (
        f"done: {done} prompts ({errors} errors), {tokens} tokens in {makespan:.1f} s ({rate:.1f} tokens/s); "
        f"makespan {_ratio(makespan, report.bound.value)} the lower bound {report.bound.value:.1f} s "
        f"(estimated {report.plan.makespan:.1f} s); {steals} job(s) stolen"
    )


def summary_json(
    report: PlanReport,
    prompts: int,
    skipped: int,
    done: int,
    errors: int,
    tokens: int,
    makespan: float,
    steals: int,
    corrections: Sequence[float],
    probe_seconds: float,
    timeline: list[dict] | None = None,
) -> dict:
    return {
        "prompts": prompts,
        "skipped": skipped,
        "done": done,
        "errors": errors,
        "tokens": tokens,
        "assign": report.assign,
        "steal": report.steal,
        "chains": [
            {
                "hops": chain.describe(),
                "sessions": slots,
                "decode_step": speed.decode_step,
                "first_step_fixed": speed.first_fixed,
                "first_step_per_token": speed.first_per_token,
                "session_overhead": speed.session_overhead,
                "measured_over_estimated": correction,
            }
            for chain, speed, slots, correction in zip(
                report.chains, report.speeds, report.slots, corrections, strict=True
            )
        ],
        "estimate": report.plan.makespan,
        "lpt_estimate": report.lpt_makespan,
        "fcfs_estimate": report.fcfs_makespan,
        "lower_bound": report.bound.value,
        "lower_bound_longest_job": report.bound.longest_job,
        "lower_bound_fractional": report.bound.fractional,
        "makespan": makespan,
        "steals": steals,
        "probe_seconds": probe_seconds,
        "jobs": timeline or [],
    }
