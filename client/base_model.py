"""`AutoDistributedModel`: the base model (transformers' `AutoModel`), its blocks on the swarm.

It returns the final norm's output, `last_hidden_state`, as transformers' `LlamaModel` or
`BloomModel` do; on it a client puts heads of its own (pooling, retrieval, classification) and
trains them, with prompts if it likes, through the servers' backward RPC.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from llm_swarm.client.swarm_model import SwarmModelBase, check_unsupported_arguments


class DistributedModel(SwarmModelBase):
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """Whole sequences (a padded batch: pass `attention_mask`, left or right padding) through every
        block; `last_hidden_state` is `[batch, tokens, hidden]`, without the trained prompt's positions."""
        check_unsupported_arguments(kwargs)
        hidden = self._normed_hidden_states(input_ids, attention_mask, inputs_embeds)
        return BaseModelOutputWithPast(last_hidden_state=hidden)


AutoDistributedModel = DistributedModel  # the name users know from PETALS
