"""How a failover rebuilds a replacement server's cache from what the client sent the failed one.

Two modes (`ClientOptions.replay_mode`), each one round trip per replacement server:

- `exact`: the recorded steps in one `Replay` message (several when the history holds more than the
  session's positions, e.g. after speculative rewinds); the server runs them in their order, so
  its cache is bit-identical to the lost one, as if it had served the session from the start.
- `prefill`: one catch-up step of every valid position (`catch_up_input`), as verification
  replicas catch up: one forward instead of one per step, equal to the lost cache within the
  dtype's rounding (different matrix shapes sum in another order).

- `steps`: the recorded steps one round trip each, as before the `Replay` message existed (for
  servers without it, and to measure what the other two save).

Histories a `Replay` cannot carry (deep prompts, or masks that changed below a step's position in
a way the message's one session mask cannot express) are replayed step by step.
"""

from __future__ import annotations

import torch

from llm_swarm.client.stream import StepInput


def can_prefill(history: list[StepInput]) -> bool:
    """One catch-up prefill rebuilds this history (no beam reorderings or deep prompts in it)."""
    return all(sent.hypo_ids is None and sent.prompts is None for sent in history)


def replay_groups(history: list[StepInput], max_tokens: int) -> list[list[StepInput]] | None:
    """The history cut into consecutive groups of at most `max_tokens` tokens (a step larger than
    that travels alone), each expressible as one `Replay`; None when some step is not."""
    if any(sent.prompts is not None for sent in history):
        return None
    groups: list[list[StepInput]] = []
    tokens = 0
    for sent in history:
        width = sent.hidden.shape[1]
        if not groups or tokens + width > max_tokens:
            groups.append([])
            tokens = 0
        groups[-1].append(sent)
        tokens += width
    for group in groups:
        if session_mask(group) is None and any(sent.padding_mask is not None for sent in group):
            return None
    return groups


def session_mask(group: list[StepInput]) -> torch.Tensor | None:
    """The mask a `Replay` of `group` carries: the last masked step's, which must agree with every
    masked step's own mask below that step's position (None when there is none or they disagree)."""
    masked = [sent for sent in group if sent.padding_mask is not None]
    if not masked:
        return None
    final = masked[-1].padding_mask
    for sent in masked:
        if not torch.equal(sent.padding_mask[:, : sent.position], final[:, : sent.position]):
            return None
    return final


def replay_tensors(group: list[StepInput]) -> tuple[list[torch.Tensor], bool, bool]:
    """The tensors of a `Replay` of `group`, and its `masked` and `reordered` flags."""
    rows = [
        [sent.position, sent.hidden.shape[1], sent.hypo_ids is not None, sent.padding_mask is not None]
        for sent in group
    ]
    layout = torch.tensor(rows, dtype=torch.int64)
    tensors = [layout, torch.cat([sent.hidden for sent in group], dim=1)]
    final = session_mask(group)
    if final is not None:
        batch = group[0].hidden.shape[0]
        new_columns = [
            sent.padding_mask[:, sent.position : sent.end]
            if sent.padding_mask is not None
            else torch.ones(batch, sent.hidden.shape[1], dtype=torch.long)
            for sent in group
        ]
        tensors += [torch.cat(new_columns, dim=1).bool(), final.bool()]
    reorders = [list(sent.hypo_ids) for sent in group if sent.hypo_ids is not None]
    if reorders:
        tensors.append(torch.tensor(reorders, dtype=torch.int64))
    return tensors, final is not None, bool(reorders)
