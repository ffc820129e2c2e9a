"""Online least-squares fits of `seconds = fixed + per_unit * units`, from measured run times.

Shared by the server's step scheduler (decode rows, prefill tokens) and the client's draft-length
choice for speculative decoding (tokens per verification step, tokens per draft): both need a cost
that follows the machine (and the network) as it changes, from a handful of noisy measurements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearCost:
    """`seconds = fixed + per_unit * units`: the shape Pang et al. measured for both stages."""

    fixed: float
    per_unit: float

    def __call__(self, units: float) -> float:
        return self.fixed + self.per_unit * units


class LinearFit:
    """Online least-squares fit of `seconds = fixed + per_unit * units` from measured runs.

    Recent runs weigh more (each new run multiplies older weights by `decay`), so the fit follows a
    machine whose speed changes (other load, thermal limits). The prior enters as two fixed
    pseudo-runs of small weight, at 1 unit and at `prior_span` units: they keep the fit defined
    while every real run had the same size (e.g. always 16 decode rows), and are soon outweighed.
    """

    def __init__(
        self, prior: LinearCost, decay: float = 0.98, prior_weight: float = 0.01, prior_span: float = 64.0
    ):
        if not 0 < decay <= 1:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self._prior = [(1.0, prior(1.0), prior_weight), (prior_span, prior(prior_span), prior_weight)]
        self._w = self._wx = self._wy = self._wxx = self._wxy = 0.0
        self.observations = 0

    def observe(self, units: float, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._wx = self._wx * d + units
        self._wy = self._wy * d + seconds
        self._wxx = self._wxx * d + units * units
        self._wxy = self._wxy * d + units * seconds
        self.observations += 1

    def cost(self) -> LinearCost:
        w, wx, wy, wxx, wxy = self._w, self._wx, self._wy, self._wxx, self._wxy
        for x, y, weight in self._prior:
            w, wx, wy, wxx, wxy = (
                w + weight,
                wx + weight * x,
                wy + weight * y,
                wxx + weight * x * x,
                wxy + weight * x * y,
            )
        denominator = w * wxx - wx * wx
        per_unit = max((w * wxy - wx * wy) / denominator, 0.0) if denominator > 0 else 0.0
        fixed = (wy - per_unit * wx) / w
        if fixed < 0:  # a negative overhead is noise: fit a line through the origin instead
            return LinearCost(fixed=0.0, per_unit=max(wxy / wxx, 0.0) if wxx > 0 else 0.0)
        return LinearCost(fixed=fixed, per_unit=per_unit)
