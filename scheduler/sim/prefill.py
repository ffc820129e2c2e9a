"""Per-request prefill terms of eq. 1 (docs/reference.md 2), so trace replay charges each request its
own `l_in`.

A `ServerSpec` carries `tau_prefill_j(l_in)` and `t_prefill_cj(l_in)` evaluated at one nominal
input length: right for the planners (docs/reference.md 3 plans for `l_in`) but wrong for replayed requests,
whose inputs range from a few tokens to ~7,400 in the Azure trace. Both terms are affine in the
input length: prefill compute is `t_o + t^I_j * l_in` (Sun, He and Hou footnote 11, validated by its
Fig. 9e) and the first-token round trip is a fixed latency plus the transfer of `l_in` hidden
states (Sun, He and Hou, Fig. 10b; `scenarios.build_scenario`). `PrefillModel` keeps both lines per server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillModel:
    """Per server j: `tau_prefill_j(l) = tau_base[j] + tau_per_token[j]*l` and
    `t_prefill_cj(l) = rtt_base[j] + rtt_per_token[j]*l`."""

    tau_base: tuple[float, ...]
    tau_per_token: tuple[float, ...]
    rtt_base: tuple[float, ...]
    rtt_per_token: tuple[float, ...]

    def __post_init__(self) -> None:
        sizes = {len(self.tau_base), len(self.tau_per_token), len(self.rtt_base), len(self.rtt_per_token)}
        if len(sizes) != 1:
            raise ValueError("prefill coefficients must have one entry per server")

    def tau_prefill(self, server: int, l_in: int) -> float:
        return self.tau_base[server] + self.tau_per_token[server] * l_in

    def rtt_prefill(self, server: int, l_in: int) -> float:
        return self.rtt_base[server] + self.rtt_per_token[server] * l_in


def affine_prefill(
    tau_lines: Sequence[tuple[float, float]], rtt_lines: Sequence[tuple[float, float]]
) -> PrefillModel:
    """Build from `(base, per_token)` pairs per server for compute and for the round trip."""
    return PrefillModel(
        tuple(b for b, _ in tau_lines),
        tuple(p for _, p in tau_lines),
        tuple(b for b, _ in rtt_lines),
        tuple(p for _, p in rtt_lines),
    )
