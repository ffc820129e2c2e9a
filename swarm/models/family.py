"""What differs between model families, behind one small interface.

A family knows its checkpoint's tensor names, how to build one block from `transformers`' own
module classes, what per-step inputs a block needs besides hidden states (ALiBi for BLOOM, rotary
embeddings for LLaMA), and which modules the client keeps (embeddings, final norm, LM head).
Everything else (loading, caching, stepping) is shared and lives in `span.py` / `client_parts.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llm_swarm.swarm.errors import UnsupportedModelError
from llm_swarm.swarm.models.inplace_attention import ATTENTION_NAME

StepInputs = dict[str, Any]


@dataclass(frozen=True)
class StepTokens:
    """The new tokens of one step of a span, as a family's `position_inputs` sees them."""

    hidden: torch.Tensor  # [batch, new, hidden] at absolute positions position .. position + new - 1
    position: int
    padding_mask: torch.Tensor | None  # [batch, position + new], 1 = real token; only for padded batches
    window: int | None = None  # the sliding window of the blocks these inputs are for (None: full)


@dataclass(frozen=True)
class CacheLayout:
    """What a block caches per position of one sequence: `heads` rows of `key_dim` ("keys") and of
    `value_dim` ("values") elements. Usually attention's key/value heads; DeepSeek's latent attention
    caches its compressed latent as the "keys" and its shared rotary key as the "values", one row
    each."""

    heads: int
    key_dim: int
    value_dim: int

    @property
    def kv_dim(self) -> int:
        """`d_kv` of the cost model (`s_c = 2 * d_kv * tokens * dtype_bytes`): half the elements a
        block caches per position, rounded up."""
        return (self.heads * (self.key_dim + self.value_dim) + 1) // 2


class ModelFamily(ABC):
    model_types: tuple[str, ...]
    base_prefixes: tuple[str, ...]  # candidate name prefixes of the base model in a checkpoint
    blocks_attribute: str  # e.g. "h." for BLOOM: block i's tensors are "{base}{blocks_attribute}{i}."
    embedding_weight: str  # local name of the token embedding matrix in the client modules (tied LM heads)
    # the attention kernel the blocks call through transformers' interface: SDPA, what transformers
    # picks on load for most families (swarm.models.inplace_attention)
    attention_implementation: str = ATTENTION_NAME

    # --- shapes ---------------------------------------------------------------------------------
    @staticmethod
    def num_blocks(config: PretrainedConfig) -> int:
        return int(config.num_hidden_layers)

    @staticmethod
    def hidden_size(config: PretrainedConfig) -> int:
        return int(config.hidden_size)

    @staticmethod
    def num_heads(config: PretrainedConfig) -> int:
        return int(config.num_attention_heads)

    def num_kv_heads(self, config: PretrainedConfig) -> int:
        return self.num_heads(config)

    def head_dim(self, config: PretrainedConfig) -> int:
        return self.hidden_size(config) // self.num_heads(config)

    def cache_layout(self, config: PretrainedConfig) -> CacheLayout:
        """What one block caches per position (default: its key/value heads of `head_dim` each)."""
        head_dim = self.head_dim(config)
        return CacheLayout(self.num_kv_heads(config), head_dim, head_dim)

    def kv_dim(self, config: PretrainedConfig) -> int:
        return self.cache_layout(config).kv_dim

    def representative_block(self, config: PretrainedConfig) -> int:
        """A block of the model's largest kind: what a server measures before it holds a span and
        what a record's block size is checked against (blocks of a span are priced at their largest:
        DeepSeek's first, dense blocks are smaller than its mixture-of-experts ones)."""
        return 0

    def longest_session(self, config: PretrainedConfig) -> int | None:
        """The most positions a session may hold for the blocks to compute what the model defines
        (None: no limit of the family's own)."""
        return None

    def layer_window(self, config: PretrainedConfig, index: int) -> int | None:
        """How many positions back the attention of the model's block `index` sees (a query at cache
        position q sees keys at q - window < k <= q, as transformers masks it), or None for attention
        over the whole prefix. A span's cache keeps only what such a block can still see
        (`swarm.cost.ring_capacity`) and masks the rest, so windows are exact at any length."""
        return None

    # --- blocks ---------------------------------------------------------------------------------
    @abstractmethod
    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        """Block `index` of the model (its kind, window and rotary follow that index); the span
        renumbers its cache layer to the block's place inside the span (`set_block_local_index`)."""

    def make_span_helpers(self, config: PretrainedConfig, device: torch.device) -> nn.ModuleDict:
        """Modules a span needs besides its blocks (e.g. LLaMA's rotary embedding), not in the checkpoint."""
        return nn.ModuleDict()

    def step_inputs(
        self,
        config: PretrainedConfig,
        helpers: nn.ModuleDict,
        hidden: torch.Tensor,
        position: int,
        padding_mask: torch.Tensor | None,
        window: int | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> StepInputs:
        """Per-step inputs shared by the blocks of a span with the same attention `window` (None:
        the whole prefix) for a step of `hidden.shape[1]` tokens: the family's `position_inputs` and
        the causal, padding and window `attention_mask` every family uses.

        `padding_mask` (`[batch, position + new]`, 1 = real token) is given only for padded batches;
        `key_positions`, the absolute position of each key column, only where the cache's columns
        are not positions `[0, position + new)` (`SpanCache.key_positions`).
        """
        step = StepTokens(hidden, position, padding_mask, window)
        inputs = self.position_inputs(config, helpers, step)
        return {**inputs, "attention_mask": self.step_attention_mask(config, step, inputs, key_positions)}

    def step_attention_mask(
        self,
        config: PretrainedConfig,
        step: StepTokens,
        positions: StepInputs,
        key_positions: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The `attention_mask` of `step_inputs`: the causal, padding and window bias every family
        uses; a family whose position inputs (`positions`) go into the mask adds them here."""
        return attention_bias(step.hidden, step.position, step.padding_mask, step.window, key_positions)

    @abstractmethod
    def position_inputs(
        self, config: PretrainedConfig, helpers: nn.ModuleDict, step: StepTokens
    ) -> StepInputs:
        """The inputs that tell a block where the step's tokens stand (ALiBi, rotary embeddings)."""

    # whether the blocks' attention reads each session's cache in place in a batched decode step
    # (swarm.models.inplace_attention); otherwise the step gathers the sessions' caches into one
    # right-aligned batch, which a family whose attention transforms the whole cache needs
    reads_cache_in_place = True

    # whether a single-token decode step of this family's blocks can be captured as a CUDA graph
    # (swarm.models.decode_graphs): no host synchronization inside, attention through `swarm_sdpa`
    decode_graphs = False

    def static_decode_inputs(
        self,
        config: PretrainedConfig,
        helpers: nn.ModuleDict,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> StepInputs:
        """Per-step inputs of a captured decode step, from position ids held in a tensor (`[batch, 1]`);
        attention masks come with the cache view there. Only families with `decode_graphs`."""
        return {**self.positions_from_ids(helpers, hidden, position_ids), "attention_mask": None}

    def positions_from_ids(
        self, helpers: nn.ModuleDict, hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> StepInputs:
        """The position inputs of tokens at `position_ids` (`[batch, tokens]`), as `position_inputs`
        gives them; what a captured decode step needs. Only families with `decode_graphs`."""
        raise NotImplementedError(f"{type(self).__name__} has no captured decode step")

    @abstractmethod
    def run_block(
        self, block: nn.Module, hidden: torch.Tensor, cache: Any, inputs: StepInputs
    ) -> torch.Tensor:
        """One block's forward; `cache` follows the `transformers` cache protocol."""

    # the model class whose `_keep_in_fp32_modules(_strict)` say which tensors stay in float32
    pretrained_class: type | None = None

    def float32_tensors(self, dtype: torch.dtype) -> tuple[str, ...]:
        """Name parts of the block tensors transformers keeps in float32 when the model loads in
        `dtype`: the strict list in any 16-bit dtype, the other one in float16 only."""
        if self.pretrained_class is None or dtype not in (torch.float16, torch.bfloat16):
            return ()
        names = list(getattr(self.pretrained_class, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            names += getattr(self.pretrained_class, "_keep_in_fp32_modules", None) or ()
        return tuple(names)

    def block_tensors(self, block: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A block's checkpoint tensors (block-local names) in the layout of `block`, the module this
        transformers version builds (a family whose layout differs between versions converts here)."""
        return tensors

    # --- client side ----------------------------------------------------------------------------
    @abstractmethod
    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        """`embed` (token ids -> first block's input), `norm` (final norm) and `lm_head`."""

    @abstractmethod
    def client_tensor_names(self, base_prefix: str) -> dict[str, str]:
        """Map from checkpoint tensor name to the name inside `build_client_modules`' ModuleDict."""


def layer_types_window(config: PretrainedConfig, index: int) -> int | None:
    """The window of block `index` when a config's `layer_types` make it "sliding_attention" (Qwen2 and
    Qwen3 with `use_sliding_window`, Gemma 2 and 3, GPT-OSS), else None."""
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    if index < len(layer_types) and layer_types[index] == "sliding_attention" and window:
        return int(window)
    return None


def attention_bias(
    hidden: torch.Tensor,
    position: int,
    padding_mask: torch.Tensor | None,
    window: int | None = None,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Additive mask `[batch, 1, new, keys]` for a step of `new = hidden.shape[1]` tokens, over keys
    at absolute `key_positions` (default: `[0, position + new)`; negative: nothing valid there).

    Query i (absolute position `position + i`) sees keys `<= position + i` that are not padding
    (`padding_mask`: `[batch, position + new]`, 1 = real token, as `transformers` uses it) and, with a
    sliding `window`, only keys `> position + i - window`. A single new token without padding, within
    the window, may see every cached key, so plain decode steps there need no mask at all.
    """
    batch_size, num_new = hidden.shape[:2]
    total = position + num_new
    if key_positions is None:
        if num_new == 1 and padding_mask is None and (window is None or total <= window):
            return None
        key_positions = torch.arange(total, device=hidden.device)
    query_positions = torch.arange(position, total, device=hidden.device)[:, None]
    columns = key_positions.to(hidden.device)[None, :]
    too_new = (columns > query_positions) | (columns < 0)
    if window is not None:
        too_new = too_new | (columns <= query_positions - window)
    blocked = too_new[None].expand(batch_size, num_new, columns.shape[1])
    if padding_mask is not None:
        padding = padding_mask[:, columns[0].clamp(min=0)]
        blocked = blocked | (padding[:, None, :] == 0)
    bias = torch.zeros(blocked.shape, dtype=hidden.dtype, device=hidden.device)
    bias.masked_fill_(blocked, torch.finfo(hidden.dtype).min)
    return bias[:, None]


def token_positions(hidden: torch.Tensor, position: int, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """Position ids `[batch, new]` of the step's tokens; with left padding, real tokens count from 0."""
    batch_size, num_new = hidden.shape[:2]
    if padding_mask is None:
        return torch.arange(position, position + num_new, device=hidden.device)[None].expand(batch_size, -1)
    # same rule as transformers' generate(): cumulative count of real tokens, padding pinned to 1
    positions = padding_mask.long().cumsum(-1) - 1
    positions.masked_fill_(padding_mask == 0, 1)
    return positions[:, position : position + num_new]


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def family_for(config: PretrainedConfig) -> ModelFamily:
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        supported = ", ".join(sorted(_FAMILIES))
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported types: {supported}"
        )
    return _FAMILIES[model_type]
