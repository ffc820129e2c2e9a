"""Whole sequences through every block, outside inference sessions: the differentiable path that
training takes (the servers' forward and backward RPCs, or local spans' autograd).

Shared by every client model (causal LM, base model, sequence classification): the token
embeddings, the trained prompt before them, the padding mask with the prompt's positions, and the
prompt's positions dropped again from the last block's output.
"""

from __future__ import annotations

import torch

from llm_swarm.client.backend import BlockBackend
from llm_swarm.client.prompt_tuning import PromptTuning
from llm_swarm.swarm.models.client_parts import ClientParts


def with_prompt_positions(attention_mask: torch.Tensor, prompts: PromptTuning | None) -> torch.Tensor:
    """The mask with the trained prompt's positions (always real) in front."""
    if prompts is None:
        return attention_mask
    ones = torch.ones(attention_mask.shape[0], prompts.length, dtype=attention_mask.dtype)
    return torch.cat([ones.to(attention_mask.device), attention_mask], dim=1)


def last_block_output(
    parts: ClientParts,
    backend: BlockBackend,
    prompts: PromptTuning | None,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
) -> torch.Tensor:
    """The last block's output `[batch, tokens, hidden]` at the input's own positions (before the final
    norm), differentiable in the prompts and in `inputs_embeds`."""
    embeds = inputs_embeds if inputs_embeds is not None else parts.token_embedding(input_ids)
    prefix = prompts.prefix(embeds.shape[0]) if prompts is not None else None
    if prefix is not None:
        embeds = torch.cat([prefix.to(embeds), embeds], dim=1)
    hidden = parts.from_embeddings(embeds)
    padding_mask = None
    if attention_mask is not None and not bool(attention_mask.all()):
        padding_mask = with_prompt_positions(attention_mask, prompts).long()
    deep = prompts.deep() if prompts is not None else None
    output = backend.forward_sequence(hidden, padding_mask, deep)
    if prefix is not None:
        output = output[:, prefix.shape[1] :]
    return output
