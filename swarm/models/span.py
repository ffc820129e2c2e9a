"""A consecutive range of transformer blocks `[start, end)`, loaded alone from a checkpoint.

`load_span` builds the blocks on the meta device (no memory), then fills them with only their own
tensors, read from only the shards that hold them. `TransformerSpan.forward` runs a prefill or a
decode step of any number of tokens at an explicit position against a session's `SpanCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import PretrainedConfig

from swarm.cost import cache_bytes_per_block, dtype_bytes, module_parameter_bytes
from swarm.dtypes import parse_dtype
from swarm.errors import CheckpointError, SpanError
from swarm.models import bloom as _bloom  # noqa: F401  (registers the family)
from swarm.models import llama as _llama  # noqa: F401  (registers the family)
from swarm.models.cache import SpanCache
from swarm.models.checkpoint import CheckpointReader, load_config
from swarm.models.family import ModelFamily, family_for

ATTENTION_IMPLEMENTATION = "sdpa"  # what transformers picks for these models on load, so results match it


def prepare_config(config: PretrainedConfig) -> PretrainedConfig:
    """Fix the attention kernel choice that `from_pretrained` would otherwise make implicitly."""
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    return config


def find_base_prefix(family: ModelFamily, reader: CheckpointReader) -> str:
    """Which of the family's name prefixes this checkpoint uses (e.g. "transformer." or "")."""
    for prefix in family.base_prefixes:
        if reader.names_with_prefix(f"{prefix}{family.blocks_attribute}0."):
            return prefix
    raise CheckpointError(f"{reader.model_dir} holds no tensors of block 0 under any known name prefix")


def materialize(
    module: nn.Module,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    what: str,
) -> None:
    """Move a meta-device module's parameters to `device`, filled from `tensors` (local names)."""
    expected = {name for name, _ in module.named_parameters()}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise CheckpointError(f"{what} is missing tensors in the checkpoint: {', '.join(missing[:5])}")
    for name, tensor in tensors.items():
        if name not in expected:
            continue  # e.g. a bias the checkpoint keeps but this transformers version does not use
        current = module.get_parameter(name)
        if tuple(current.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{what}: tensor {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                f"the config implies {tuple(current.shape)}"
            )
        set_module_tensor_to_device(module, name, device, value=tensor, dtype=dtype)


class TransformerSpan(nn.Module):
    """Blocks `[start, end)` of a model plus what they need to run (position helpers)."""

    def __init__(
        self,
        family: ModelFamily,
        config: PretrainedConfig,
        start: int,
        end: int,
        blocks: nn.ModuleList,
        helpers: nn.ModuleDict,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.family, self.config = family, config
        self.start, self.end = start, end
        self.blocks, self.helpers = blocks, helpers
        self.dtype, self.device = dtype, device
        self.hidden_size = family.hidden_size(config)
        self.num_kv_heads = family.num_kv_heads(config)
        self.head_dim = family.head_dim(config)

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def block_bytes(self) -> int:
        """`s_m`: bytes of one block's parameters (blocks of a model are identical in size)."""
        return module_parameter_bytes(self.blocks[0])

    def cache_bytes(self, num_tokens: int, batch_size: int = 1) -> int:
        """`s_c` for a session of `num_tokens` positions and `batch_size` sequences, per block."""
        d_kv = self.num_kv_heads * self.head_dim
        return batch_size * cache_bytes_per_block(d_kv, num_tokens, dtype_bytes(self.dtype))

    def new_cache(self, batch_size: int, max_length: int, first: int | None = None, last: int | None = None):
        """A session cache for absolute blocks `[first, last)` (default: the whole span)."""
        first, last = self._check_range(first, last)
        return SpanCache(
            num_blocks=last - first,
            batch_size=batch_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_length=max_length,
            dtype=self.dtype,
            device=self.device,
            block_offset=first - self.start,
        )

    def _check_range(self, first: int | None, last: int | None) -> tuple[int, int]:
        first = self.start if first is None else first
        last = self.end if last is None else last
        if not self.start <= first < last <= self.end:
            raise SpanError(f"blocks [{first}, {last}) are not inside this span [{self.start}, {self.end})")
        return first, last

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        cache: SpanCache,
        position: int,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the cache's blocks on `hidden` (`[batch, new, hidden]`) placed at absolute `position`."""
        num_new = hidden.shape[1]
        cache.begin_step(position, num_new)
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if padding_mask is not None:
            padding_mask = padding_mask.to(self.device)
        inputs = self.family.step_inputs(self.config, self.helpers, hidden, position, padding_mask)
        for local in range(cache.block_offset, cache.block_offset + cache.num_blocks):
            hidden = self.family.run_block(self.blocks[local], hidden, cache, inputs)
        cache.end_step()
        return hidden


def validate_span(start: int, end: int, num_blocks: int) -> None:
    if not (0 <= start < end <= num_blocks):
        raise SpanError(
            f"block span {start}:{end} is not inside the model's {num_blocks} blocks (0:{num_blocks})"
        )


def load_span(
    model_dir: str | Path,
    start: int,
    end: int,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    on_block_loaded: Callable[[int], None] | None = None,
) -> tuple[TransformerSpan, list[str]]:
    """Load blocks `[start, end)`; returns the span and the checkpoint files that were opened."""
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    config = prepare_config(load_config(model_dir))
    family = family_for(config)
    validate_span(start, end, family.num_blocks(config))
    blocks = nn.ModuleList()
    with CheckpointReader(model_dir) as reader:
        base = find_base_prefix(family, reader)
        for index in range(start, end):
            with init_empty_weights():
                block = family.build_block(config, local_index=index - start)
            prefix = f"{base}{family.blocks_attribute}{index}."
            names = reader.names_with_prefix(prefix)
            if not names:
                raise CheckpointError(f"checkpoint {reader.model_dir} has no tensors for block {index}")
            tensors = {name[len(prefix) :]: tensor for name, tensor in reader.read(names).items()}
            materialize(block, tensors, dtype, device, what=f"block {index}")
            blocks.append(block.eval())
            if on_block_loaded is not None:
                on_block_loaded(index)
    helpers = family.make_span_helpers(config, device)
    span = TransformerSpan(family, config, start, end, blocks, helpers, dtype, device).eval()
    return span, list(reader.opened_files)
