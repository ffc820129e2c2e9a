"""What one iteration of a server's loop costs, for the contended model (`scheduler.sim.contended`).

A decode iteration runs the single-token steps of `rows` sessions over a block range; a prefill
runs one session's prompt (or a chunk of it). Per block, following the iteration-level cost models
of Vidur and Aladdin (linear in the batch and in the context the attention reads):

    decode(rows, context) = fixed + per_row * rows + per_context * context
    prefill(tokens)       = prefill_fixed + prefill_per_token * tokens

where `context` is the number of cached tokens the batch's rows attend to, summed over the rows.

`from_scenario` derives the coefficients from what a scenario knows about each server, with three
assumptions (docs/simulator.md, "Contended servers"):

- a decode row costs the compute of one prompt token, so `per_row` is the prefill's per-token slope
  (a decode step multiplies one row by every weight, a prefill token does the same);
- decode is bound by reading memory (Sun, He and Hou footnote 11: `tau = s_m / b_j`), so the bandwidth is
  `s_m / tau` and each cached token read costs `per_context = kv_bytes_per_token / bandwidth`;
- `fixed = tau - per_row`: one row at an empty context costs exactly the scenario's `tau`, so a
  lone session decodes as eq. 1 says (plus its context reads).

A server has two parts (`ServerCost`): the `device` (the accelerator, which runs serially or lets
sessions overlap, `AcceleratorModel`) and the `host` (work the server's single compute thread always
does one iteration at a time: for an emulated server, the real CPU forward of its tiny blocks).
A real GPU server has no host part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec
from llm_swarm.scheduler.sim.prefill import PrefillModel

ACCELERATOR_MODELS = ("serial", "overlap")


@dataclass(frozen=True)
class IterationCost:
    """Seconds per block of one iteration (see the module docstring); every coefficient >= 0."""

    fixed: float = 0.0
    per_row: float = 0.0
    per_context: float = 0.0
    prefill_fixed: float = 0.0
    prefill_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed", "per_row", "per_context", "prefill_fixed", "prefill_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"iteration cost {name} must be finite and >= 0, got {value}")

    def decode(self, rows: int, context: int) -> float:
        return self.fixed + self.per_row * rows + self.per_context * context

    def prefill(self, tokens: int) -> float:
        return self.prefill_fixed + self.prefill_per_token * tokens


NO_COST = IterationCost()


@dataclass(frozen=True)
class ServerCost:
    device: IterationCost
    host: IterationCost = NO_COST


def from_scenario(servers: Sequence[ServerSpec], model: ModelSpec, prefill: PrefillModel) -> list[ServerCost]:
    """Each server's device cost from its `tau`, its prefill line and the model (assumptions above)."""
    width = model.kv_dim or model.hidden_size  # None: multi-head attention caches the hidden size
    # keys + values of one token in one block; a model of unknown width reads no context
    kv_bytes = 2 * width * model.dtype_bytes if width else 0
    costs = []
    for j, server in enumerate(servers):
        if server.tau is None or not server.tau > 0:
            raise ValueError(f"server {server.name} needs a positive tau")
        per_row = min(prefill.tau_per_token[j], server.tau)
        costs.append(
            ServerCost(
                IterationCost(
                    fixed=server.tau - per_row,
                    per_row=per_row,
                    per_context=kv_bytes * server.tau / model.block_bytes if model.block_bytes > 0 else 0,
                    prefill_fixed=prefill.tau_base[j],
                    prefill_per_token=prefill.tau_per_token[j],
                )
            )
        )
    return costs


def relative_host_cost(
    per_block: float, prefill_per_block: float, shape: tuple[float, float, float], reference_context: int
) -> IterationCost:
    """A host part of `per_block` seconds per block for one row at `reference_context`, scaled to
    other batches and contexts by a measured `shape = (fixed, per_row, per_context)` (any units:
    only the ratios matter); a prefill costs `prefill_per_block` whatever its length."""
    fixed, per_row, per_context = shape
    unit = fixed + per_row + per_context * reference_context
    if not unit > 0 or min(shape) < 0:
        raise ValueError(f"a host cost shape needs non-negative terms and a positive total, got {shape}")
    scale = max(per_block, 0.0) / unit
    return IterationCost(
        fixed * scale, per_row * scale, per_context * scale, prefill_fixed=max(prefill_per_block, 0.0)
    )
