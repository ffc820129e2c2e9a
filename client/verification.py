"""Replica verification (pure): when two servers' outputs for the same step agree, and who decides.

A verified step runs on the chain's server and, in parallel, on another server holding the same
blocks. Honest servers disagree a little: a bfloat16 server's hidden states differ from a float32
one's, a batched step from an unbatched one, a prefill from step-by-step decoding. So outputs are
compared by their relative difference `|a - b| / max(|a|, |b|)` against a tolerance that depends
on the coarser of the two servers' dtypes (calibrated in BENCHMARKS.md, "Replica verification").
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# relative-difference tolerance by the kind of server (dtype, or quantization) against float32: above
# the largest honest disagreement measured (BENCHMARKS.md, "Replica verification" on the CPU and "on a
# GPU"; over 3 blocks at hidden 512: float16 9.7e-3, bfloat16 7.5e-2, int8 0.20 on an H100; bfloat16
# grows with width and depth). float32 allows for CUDA's TF32 kernels. A liar whose error stays under
# the tolerance is not caught: that is the price of honest servers of different kinds checking each
# other.
TOLERANCE = {"float32": 5e-3, "float16": 5e-2, "bfloat16": 0.2, "int8": 0.3, "nf4": 1.1}
UNKNOWN_TOLERANCE = 0.35  # a server that does not announce its dtype is judged like a loose one
QUANTIZED = ("int8", "nf4")
# Two servers of the same quantization hold the same packed weights and compute in a 16-bit dtype:
# they differ like 16-bit servers do (batching, a replayed prefill), whatever their error against
# float32 (nf4: 0.89 at hidden 512 on an H100, random weights).
SAME_QUANT_TOLERANCE = TOLERANCE["bfloat16"]
# the test liar's noise is half its output's norm (relative difference ~0.5): kinds whose honest
# disagreement may reach this far cannot check each other, and such a step goes unverified
UNVERIFIABLE = 0.5


def tolerance(dtypes: Iterable[str]) -> float | None:
    """The tolerance for comparing servers that compute in these dtypes (or quantizations), or None
    when their honest disagreement is as large as a liar's error (nf4 against any other kind)."""
    kinds = set(dtypes)
    if len(kinds) == 1 and next(iter(kinds)) in QUANTIZED:
        return SAME_QUANT_TOLERANCE
    loosest = max((TOLERANCE.get(kind, UNKNOWN_TOLERANCE) for kind in kinds), default=UNKNOWN_TOLERANCE)
    return loosest if loosest < UNVERIFIABLE else None


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()), 1e-30)
    return float((a - b).norm()) / scale


def agree(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return relative_difference(a, b) <= tol


@dataclass(frozen=True)
class Verdict:
    """Who lied when two replicas disagreed and a third decided (None: no majority)."""

    liar: str | None
    honest: str | None


def decide(outputs: dict[str, torch.Tensor], tol: float) -> Verdict:
    """With three outputs (primary, verifier, arbiter, by peer id) of which two disagree: the one
    that agrees with neither of the others is the liar, the first that agrees with another honest."""
    peers = list(outputs)
    agreeing = {
        peer: [other for other in peers if other != peer and agree(outputs[peer], outputs[other], tol)]
        for peer in peers
    }
    outvoted = [peer for peer in peers if not agreeing[peer]]
    majority = [peer for peer in peers if agreeing[peer]]
    if len(outvoted) == 1 and len(majority) == 2:
        return Verdict(liar=outvoted[0], honest=majority[0])
    return Verdict(liar=None, honest=None)


class VerifyPlan:
    """Which steps of a hop to verify: each independently with probability `fraction`, drawn from the
    OS's entropy, so a server cannot predict which of its answers will be checked."""

    def __init__(self, fraction: float):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify_fraction must be in [0, 1], got {fraction}")
        self.fraction = fraction
        self._random = random.SystemRandom()

    def verify_now(self) -> bool:
        return self.fraction >= 1.0 or (self.fraction > 0.0 and self._random.random() < self.fraction)
