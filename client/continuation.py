"""How a `generate()` call in a session that already generated relates to what came before (pure).

Two conventions meet here, and both work:

- **transformers' (ours since the start)**: pass the whole sequence again, the last output plus
  any new tokens; the call returns the whole sequence. A call is this kind when its `input_ids`
  start with every token of the session's last output (all rows).
- **PETALS'**: `generate(None, ...)` goes on from the last output, and `generate(new_ids, ...)`
  appends `new_ids` to it (a chat turn); either returns only what this call added (`new_ids`, then
  the generated tokens), so concatenating the outputs of successive calls gives the sequence, as
  PETALS' own `make_generate_calls` test does. Any `input_ids` that do not start with the last
  output are this kind.

The first `generate()` in a session returns the whole sequence under both conventions. Attention
masks follow the sequence: when a call passes none, the session's last mask is extended with
ones for the tokens appended since (a left-padded batch stays padded), and a mask given for just
the appended tokens of a PETALS-style call is put after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Continuation:
    input_ids: torch.Tensor  # what generate() runs on: the whole sequence
    attention_mask: torch.Tensor | None  # for the whole sequence (None: transformers decides)
    returned_from: int  # the call returns output[:, returned_from:]


def continuation(
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    last_output: torch.Tensor | None,
    last_mask: torch.Tensor | None,
) -> Continuation:
    """The whole input of this call and what part of its output to return (module docstring)."""
    if last_output is None:  # the session's first generate(): the caller's input, returned whole
        if input_ids is None:
            raise ValueError(
                "generate(None) continues an inference session that generate() already produced "
                "tokens in; otherwise pass input_ids"
            )
        return Continuation(input_ids, attention_mask, 0)
    known = last_output.shape[1]
    if input_ids is not None and _starts_with(input_ids, last_output):  # transformers' convention
        if attention_mask is None and last_mask is not None:
            attention_mask = _extended(last_mask, input_ids.shape[1] - known)
        return Continuation(input_ids, attention_mask, 0)
    appended = input_ids if input_ids is not None else last_output[:, :0]  # PETALS' convention
    if appended.shape[0] != last_output.shape[0]:
        raise ValueError(
            f"generate() continues a session of {last_output.shape[0]} sequences: the new tokens must "
            f"have {last_output.shape[0]} rows, got {appended.shape[0]}"
        )
    whole = torch.cat([last_output, appended.to(last_output.device)], dim=1)
    if attention_mask is not None and attention_mask.shape[1] == appended.shape[1]:
        before = last_mask if last_mask is not None else torch.ones_like(last_output)
        attention_mask = torch.cat([before.to(attention_mask.device), attention_mask], dim=1)
    elif attention_mask is None and last_mask is not None:
        attention_mask = _extended(last_mask, appended.shape[1])
    elif attention_mask is not None and attention_mask.shape[1] != whole.shape[1]:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} positions: give it for the new tokens "
            f"({appended.shape[1]}) or for the whole sequence ({whole.shape[1]})"
        )
    return Continuation(whole, attention_mask, known)


def mask_after(
    output: torch.Tensor, attention_mask: torch.Tensor | None, input_length: int
) -> torch.Tensor | None:
    """The mask of a generate() output: the input's, then ones for the generated tokens (None if the
    input had none: transformers then treated every position as real)."""
    if attention_mask is None:
        return None
    return _extended(attention_mask, output.shape[1] - input_length)


def _starts_with(input_ids: torch.Tensor, prefix: torch.Tensor) -> bool:
    return (
        input_ids.shape[0] == prefix.shape[0]
        and input_ids.shape[1] >= prefix.shape[1]
        and torch.equal(input_ids[:, : prefix.shape[1]].cpu(), prefix.cpu())
    )


def _extended(mask: torch.Tensor, extra: int) -> torch.Tensor:
    if extra <= 0:
        return mask
    return torch.cat([mask, torch.ones(mask.shape[0], extra, dtype=mask.dtype, device=mask.device)], dim=1)
