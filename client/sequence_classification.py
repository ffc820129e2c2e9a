"""`AutoDistributedModelForSequenceClassification`: transformers' `AutoModelForSequenceClassification`
with its blocks on the swarm. The client keeps the embeddings and final norm (frozen) and the
classification head `score` (trainable); with `tuning_mode`, trainable prompts too. Training the head
and prompts sends the gradient back through the servers' backward RPC, as for the causal LM.

The head, pooling and loss are transformers' (4.57, `GenericForSequenceClassification` and
`BloomForSequenceClassification`, alike for every family served here): `score` is
`nn.Linear(hidden_size, num_labels, bias=False)`, saved as `score.weight`; a sequence's logits are
those of its last token that is not `config.pad_token_id` (left or right padding alike); the loss
follows `config.problem_type` (regression, single- or multi-label), set from the labels when unset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.loss.loss_utils import ForSequenceClassificationLoss
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.utils import logging

from llm_swarm.client.backend import BlockBackend
from llm_swarm.client.swarm_model import (
    SwarmModelBase,
    batch_size,
    check_unsupported_arguments,
    override_config,
)
from llm_swarm.swarm.errors import CheckpointError, SwarmUserError
from llm_swarm.swarm.models.checkpoint import CheckpointReader
from llm_swarm.swarm.models.client_parts import ClientParts

logger = logging.get_logger(__name__)

SCORE_WEIGHT = "score.weight"  # the head's name in checkpoints of every family's *ForSequenceClassification


def new_score_head(parts: ClientParts) -> nn.Linear:
    """An untrained head, initialised as transformers initialises it (normal, `initializer_range`).
    Float32 whatever the client parts' dtype: it is trained, and small."""
    hidden_size = parts.family.hidden_size(parts.config)
    head = nn.Linear(hidden_size, parts.config.num_labels, bias=False, device=parts.lm_head.weight.device)
    nn.init.normal_(head.weight, std=float(getattr(parts.config, "initializer_range", 0.02)))
    return head


def load_score_head(model_dir: str | Path, parts: ClientParts, ignore_mismatched_sizes: bool) -> nn.Linear:
    """The checkpoint's trained head when it has one (a `*ForSequenceClassification` checkpoint), else a
    new one (a causal LM's or base model's checkpoint: the head is the client's to train)."""
    head = new_score_head(parts)
    with CheckpointReader(model_dir) as reader:
        if not reader.has(SCORE_WEIGHT):
            return head
        weight = reader.read([SCORE_WEIGHT])[SCORE_WEIGHT]
    num_labels, hidden_size = head.weight.shape
    if weight.ndim != 2 or weight.shape[1] != hidden_size:
        raise CheckpointError(
            f"{model_dir}: {SCORE_WEIGHT} has shape {tuple(weight.shape)}, the config implies "
            f"({num_labels}, {hidden_size})"
        )
    if weight.shape[0] != num_labels:
        if ignore_mismatched_sizes:  # transformers' option: a new head of the requested size
            logger.warning(f"{model_dir}: {SCORE_WEIGHT} has {weight.shape[0]} labels; using a new head")
            return head
        raise SwarmUserError(
            f"{model_dir}'s classification head ({SCORE_WEIGHT}) has {weight.shape[0]} labels, but "
            f"num_labels is {num_labels}: leave num_labels out to use it, or pass "
            "ignore_mismatched_sizes=True to train a new head"
        )
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


def last_token_indices(
    input_ids: torch.Tensor | None, batch_size: int, pad_token_id: int | None, device: torch.device
) -> torch.Tensor | int:
    """Which position each sequence's logits are read at: its rightmost token that is not padding
    (transformers' rule, for left and right padding alike), or the last position when padding cannot
    be seen (no pad token, or `inputs_embeds`)."""
    if pad_token_id is None:
        if batch_size != 1:
            raise ValueError(
                "Cannot handle batch sizes > 1 if no padding token is defined: pass pad_token_id= to "
                "from_pretrained (e.g. the tokenizer's) to classify padded batches"
            )
        return -1
    if input_ids is None:
        logger.warning_once(
            "the sequence classification model will not detect padding tokens in `inputs_embeds`: "
            "every sequence is read at its last position"
        )
        return -1
    non_pad = (input_ids != pad_token_id).to(device, torch.int32)
    positions = torch.arange(input_ids.shape[-1], device=device, dtype=torch.int32)
    return (positions * non_pad).argmax(-1)


class DistributedModelForSequenceClassification(SwarmModelBase):
    def _add_own_parts(self) -> None:
        self.num_labels = self.client_parts.config.num_labels
        self.use_score_head(new_score_head(self.client_parts))

    def use_score_head(self, score: nn.Linear) -> None:
        """Classify with `score` (`[num_labels, hidden]`), the client's to train (the client parts
        stay frozen)."""
        self.score = score.requires_grad_(True)

    @classmethod
    def _from_parts(
        cls,
        model_dir: str | Path,
        parts: ClientParts,
        backend: BlockBackend,
        tuning_mode: str | None,
        pre_seq_len: int,
        ignore_mismatched_sizes: bool = False,
        **config_overrides: Any,
    ) -> DistributedModelForSequenceClassification:
        """`config_overrides`: e.g. `num_labels=3`, `pad_token_id=0`, `problem_type=...` (transformers'
        `from_pretrained` kwargs); the head is the checkpoint's `score.weight` when it has one."""
        override_config(parts, config_overrides)
        model = cls(parts, backend, tuning_mode, pre_seq_len)
        model.use_score_head(load_score_head(model_dir, parts, ignore_mismatched_sizes))
        return model

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput:
        """Logits `[batch, num_labels]` (float32) of whole sequences, and the loss when `labels` are
        given (long `[batch]` for single-label, float `[batch, num_labels]` for multi-label or
        regression). Differentiable in the head, the prompts and `inputs_embeds`."""
        check_unsupported_arguments(kwargs)
        rows = batch_size(input_ids, inputs_embeds)
        device = self.score.weight.device
        # before any RPC: a batch that cannot be pooled is refused without running the blocks
        last = last_token_indices(input_ids, rows, self.config.pad_token_id, device)
        hidden = self._normed_hidden_states(input_ids, attention_mask, inputs_embeds)
        pooled = hidden.to(device)[torch.arange(rows, device=device), last]
        logits = self.score(pooled.float())
        loss = None
        if labels is not None:
            loss = ForSequenceClassificationLoss(labels=labels, pooled_logits=logits, config=self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)


AutoDistributedModelForSequenceClassification = DistributedModelForSequenceClassification  # PETALS' name
