"""A consecutive range of transformer blocks `[start, end)`, loaded alone from a checkpoint.

`load_span` builds the blocks on the meta device (no memory), then fills them with only their own
tensors, read from only the shards that hold them. `TransformerSpan.forward` runs a prefill or a
decode step of any number of tokens at an explicit position against a session's `SpanCache`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import PretrainedConfig

from llm_swarm.swarm.cost import cache_bytes_per_block, dtype_bytes, module_parameter_bytes, ring_capacity
from llm_swarm.swarm.dtypes import parse_dtype
from llm_swarm.swarm.errors import CheckpointError, SpanError
from llm_swarm.swarm.hardware import prepare_attention_kernels
from llm_swarm.swarm.models import bloom as _bloom  # noqa: F401  (registers the family)
from llm_swarm.swarm.models import deepseek as _deepseek  # noqa: F401  (registers the families)
from llm_swarm.swarm.models import falcon as _falcon  # noqa: F401  (registers the family)
from llm_swarm.swarm.models import gemma as _gemma  # noqa: F401  (registers the families)
from llm_swarm.swarm.models import gpt_oss as _gpt_oss  # noqa: F401  (registers the family)
from llm_swarm.swarm.models import llama as _llama  # noqa: F401  (registers the family)
from llm_swarm.swarm.models import llama_like as _llama_like  # noqa: F401  (registers the families)
from llm_swarm.swarm.models.cache import BatchedStepCache, SpanCache
from llm_swarm.swarm.models.checkpoint import CheckpointReader, load_config
from llm_swarm.swarm.models.decode_graphs import MAX_TOKENS as MAX_GRAPH_TOKENS
from llm_swarm.swarm.models.decode_graphs import DecodeGraphs
from llm_swarm.swarm.models.family import ModelFamily, attention_bias, family_for
from llm_swarm.swarm.models.fp8_weights import dequantize_fp8, fp8_block_size
from llm_swarm.swarm.quantization import check_quant_device, quantize_block

# one session's single-token step, as `TransformerSpan.forward` takes it: (hidden, cache, position, mask)
BatchedStep = tuple[torch.Tensor, SpanCache, int, torch.Tensor | None]


def prepare_config(config: PretrainedConfig) -> PretrainedConfig:
    """Fix the attention kernel choice that `from_pretrained` would otherwise make implicitly: the
    family's kernel (SDPA, or the model's own eager attention where SDPA cannot compute it), read
    each session's cache in place in batched steps."""
    config._attn_implementation = family_for(config).attention_implementation
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
    float32_names: Sequence[str] = (),
) -> None:
    """Move a meta-device module's parameters to `device`, filled from `tensors` (local names), and
    its persistent buffers the checkpoint holds (DeepSeek's router score correction). Tensors whose
    name contains one of `float32_names` stay in float32, as transformers keeps them."""
    expected = {name for name, _ in module.named_parameters()}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise CheckpointError(f"{what} is missing tensors in the checkpoint: {', '.join(missing[:5])}")
    buffers = dict(module.named_buffers())
    for name, tensor in tensors.items():
        current = module.get_parameter(name) if name in expected else buffers.get(name)
        if current is None:
            continue  # e.g. a bias the checkpoint keeps but this transformers version does not use
        if tuple(current.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{what}: tensor {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                f"the config implies {tuple(current.shape)}"
            )
        kept = any(part in name for part in float32_names)
        target = torch.float32 if kept else (dtype if name in expected else current.dtype)
        set_module_tensor_to_device(module, name, device, value=tensor, dtype=target)


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
        quant: str = "none",
    ):
        super().__init__()
        self.family, self.config = family, config
        self.start, self.end = start, end
        self.blocks, self.helpers = blocks, helpers
        self.dtype, self.device = dtype, device  # dtype: of activations and caches (compute dtype)
        self.quant = quant  # "none", "int8" or "nf4": how the blocks' linear layers are stored
        self.hidden_size = family.hidden_size(config)
        self.cache_layout = family.cache_layout(config)
        self.num_kv_heads = self.cache_layout.heads
        self.head_dim = self.cache_layout.key_dim
        # each block's sliding attention window (None: the whole prefix), by local index
        self.windows = [family.layer_window(config, index) for index in range(start, end)]
        self.adapters = None  # LoRA adapters injected into the blocks (swarm.models.adapters), if any
        # captured single-token decode steps (swarm.models.decode_graphs), once `use_decode_graphs` ran
        self.decode_graphs = None

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def use_decode_graphs(self, enabled: bool = True) -> bool:
        """Run single-token decode steps from CUDA graphs where this span can (a CUDA device, a family
        whose blocks capture, no adapters); returns whether it will."""
        usable = enabled and self.device.type == "cuda" and DecodeGraphs.supported(self)
        self.decode_graphs = DecodeGraphs(self) if usable else None
        return usable

    def forget_cache(self, cache: SpanCache) -> None:
        """A session's cache is gone: drop what was captured over its tensors."""
        if self.decode_graphs is not None:
            self.decode_graphs.forget(cache)

    @property
    def block_bytes(self) -> int:
        """`s_m`: bytes of one block's parameters, without adapters (counted apart:
        `adapters.total_bytes`); the largest of the span's blocks where their kinds differ."""
        adapter_bytes = self.adapters.bytes_by_block if self.adapters is not None else [0] * len(self.blocks)
        return max(
            module_parameter_bytes(block) - adapters
            for block, adapters in zip(self.blocks, adapter_bytes, strict=True)
        )

    def cache_bytes(self, num_tokens: int, batch_size: int = 1) -> int:
        """`s_c` for a session of `num_tokens` positions and `batch_size` sequences, per block of
        full attention."""
        d_kv = self.cache_layout.kv_dim
        return batch_size * cache_bytes_per_block(d_kv, num_tokens, dtype_bytes(self.dtype))

    def session_cache_bytes(self, batch_size: int, max_length: int, first: int, last: int) -> int:
        """What `new_cache(batch_size, max_length, first, last)` allocates: a block of sliding attention
        keeps only its ring (`ring_capacity`), the others `max_length` positions."""
        first, last = self._check_range(first, last)
        return sum(
            self.cache_bytes(ring_capacity(self.windows[index - self.start], max_length), batch_size)
            for index in range(first, last)
        )

    def new_cache(self, batch_size: int, max_length: int, first: int | None = None, last: int | None = None):
        """A session cache for absolute blocks `[first, last)` (default: the whole span)."""
        first, last = self._check_range(first, last)
        return SpanCache(
            num_blocks=last - first,
            batch_size=batch_size,
            num_kv_heads=self.cache_layout.heads,
            head_dim=self.cache_layout.key_dim,
            max_length=max_length,
            dtype=self.dtype,
            device=self.device,
            block_offset=first - self.start,
            value_dim=self.cache_layout.value_dim,
            windows=self.windows[first - self.start : last - self.start],
        )

    def _check_range(self, first: int | None, last: int | None) -> tuple[int, int]:
        first = self.start if first is None else first
        last = self.end if last is None else last
        if not self.start <= first < last <= self.end:
            raise SpanError(f"blocks [{first}, {last}) are not inside this span [{self.start}, {self.end})")
        return first, last

    def training_bytes(self, batch_size: int, num_tokens: int, num_blocks: int) -> int:
        """Activation memory of a forward kept for backward over `num_blocks` blocks: s*b*h*(34 +
        5*a*s/h) bytes per block at 16-bit (Korthikanti et al., 2022, "Reducing Activation Recomputation
        in Large Transformer Models", eq. 1), scaled to this span's dtype."""
        per_block = batch_size * num_tokens * (34 * self.hidden_size + 5 * self.num_heads * num_tokens)
        return num_blocks * per_block * dtype_bytes(self.dtype) // 2

    @property
    def num_heads(self) -> int:
        return self.family.num_heads(self.config)

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        cache: SpanCache,
        position: int,
        padding_mask: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the cache's blocks on `hidden` (`[batch, new, hidden]`) placed at absolute `position`.
        `prompts` (deep prompt tuning, `[cache's blocks, batch or 1, prefix, hidden]`): block i's
        input at positions below `prefix` gets `prompts[i]` added."""
        cache.begin_step(position, hidden.shape[1])
        if self.decode_graphs is not None and prompts is None and _graphable(hidden, padding_mask):
            outputs = self.decode_graphs.run([(hidden, cache, position, padding_mask)])
            if outputs is not None:
                return outputs[0]
        blocks = range(cache.block_offset, cache.block_offset + cache.num_blocks)
        hidden = self._run_blocks(blocks, hidden, cache, position, padding_mask, prompts)
        cache.end_step()
        return hidden

    def forward_sequence(
        self,
        hidden: torch.Tensor,
        first: int,
        last: int,
        padding_mask: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Blocks `[first, last)` (absolute) on whole sequences `[batch, tokens, hidden]`, without a
        cache and in the caller's autograd mode: the forward and backward RPCs of training. The blocks'
        weights are frozen, so a graph built here reaches only `hidden` and `prompts`."""
        first, last = self._check_range(first, last)
        blocks = range(first - self.start, last - self.start)
        return self._run_blocks(blocks, hidden, None, 0, padding_mask, prompts)

    def _run_blocks(
        self,
        blocks: range,
        hidden: torch.Tensor,
        cache: SpanCache | None,
        position: int,
        padding_mask: torch.Tensor | None,
        prompts: torch.Tensor | None,
    ) -> torch.Tensor:
        """This span's `blocks` (local indices, in order) on `hidden` placed at absolute `position`,
        the i-th of them with `prompts[i]` added to its input; `cache`: the session's attention cache
        the blocks read and extend, or None (whole sequences, no cache)."""
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if padding_mask is not None:
            padding_mask = padding_mask.to(self.device)
        inputs = self._inputs_by_window(blocks, hidden, position, padding_mask, cache)
        for index, local in enumerate(blocks):
            if prompts is not None:
                hidden = add_prompt(hidden, prompts[index].to(hidden), position)
            hidden = self.family.run_block(self.blocks[local], hidden, cache, inputs[self.windows[local]])
        return hidden

    def _inputs_by_window(
        self,
        blocks: range,
        hidden: torch.Tensor,
        position: int,
        padding_mask: torch.Tensor | None,
        cache: SpanCache | None = None,
    ) -> dict[int | None, dict]:
        """The family's per-step inputs for each attention window among `blocks` (local indices), the
        masks over the key columns `cache` (None: whole sequences) gives the blocks of each window."""
        inputs = {}
        for window in {self.windows[local] for local in blocks}:
            key_positions = cache.key_positions(window) if cache is not None else None
            inputs[window] = self.family.step_inputs(
                self.config, self.helpers, hidden, position, padding_mask, window, key_positions
            )
        return inputs

    @torch.inference_mode()
    def forward_batch(self, steps: Sequence[BatchedStep]) -> list[torch.Tensor]:
        """Single-token steps of several sessions, run as ONE forward over their (shared) blocks.

        Each step is `(hidden [batch_i, 1, hidden], cache, position, padding_mask or None)`, exactly
        the arguments `forward` takes; the caches may hold different lengths and positions but must
        cover the same blocks. A busy server would otherwise do one tiny matrix product per session
        per block; here every block's weights are read once per batch. Every session keeps its own
        cache: `BatchedStepCache` writes each row's new keys/values at its own position, and attention
        reads each session's cache in place (`swarm.models.inplace_attention`: no per-session copies).
        Per-step inputs are computed for the batch right-aligned to the longest prefix, so that the
        family's usual padding-mask path (queried at the common last position) gives each session its
        own positions, rotary angles and ALiBi offsets, and each session's attention takes its last
        `position + 1` columns. A session past the ring of a sliding-window block (its keys out of
        position order) reads every slot of that block's ring under a mask of its own, built from the
        positions the slots hold (`SpanCache.key_positions`), as its step alone would. Returns one
        output per step, equal to what `forward` returns for it (up to float summation order in the
        batched matrix products).
        """
        if not steps:
            return []
        if any(hidden.ndim != 3 or hidden.shape[1] != 1 for hidden, *_ in steps):
            raise ValueError("a batched step carries exactly one new token per session")
        caches = [cache for _, cache, _, _ in steps]
        positions = [position for _, _, position, _ in steps]
        if len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("a session can take part in a batched step only once")
        for cache, position in zip(caches, positions, strict=True):
            cache.begin_step(position, 1)  # validates each position against its own cache
        # sessions past a sliding-window ring (families that gather keys have no windows: see
        # `BatchedStepCache`)
        wrapped = [index for index, (_, cache, position, _) in enumerate(steps) if cache.wraps(position, 1)]
        graphable = not wrapped and all(_graphable(hidden, mask) for hidden, _, _, mask in steps)
        if self.decode_graphs is not None and graphable:
            outputs = self.decode_graphs.run(steps)
            if outputs is not None:
                return outputs
        total = max(positions) + 1
        # a session past a sliding window masks its keys like a padded one (the window is in the mask)
        blocks = range(caches[0].block_offset, caches[0].block_offset + caches[0].num_blocks)
        window = min((self.windows[local] for local in blocks if self.windows[local]), default=None)
        past_window = [window is not None and position + 1 > window for position in positions]
        masked = [mask is not None or past for (*_, mask), past in zip(steps, past_window, strict=True)]
        gathered = not self.family.reads_cache_in_place
        if gathered:  # every session's keys are its columns of one padded batch: all masked
            masked = [True] * len(steps)
        view = BatchedStepCache(caches, positions, total, masked, gathered, self._ring_masks(steps, wrapped))
        # keys of row r are the last `position + 1` columns (1 = a real key, 0 = padding)
        first_key = [
            total - 1 - position
            for cache, position in zip(caches, positions, strict=True)
            for _ in range(cache.batch_size)
        ]
        columns = torch.arange(total, device=self.device)
        key_mask = (columns >= torch.tensor(first_key, device=self.device)[:, None]).float()
        for (_, _, position, padding_mask), (first, last) in zip(steps, view.row_bounds, strict=True):
            if padding_mask is not None:  # a padded batch: its own padding stays masked too
                real = padding_mask[:, : position + 1].to(self.device, key_mask.dtype)
                key_mask[first:last, total - 1 - position :] = real
        hidden = torch.cat([hidden.to(device=self.device, dtype=self.dtype) for hidden, *_ in steps])
        inputs = self._inputs_by_window(blocks, hidden, total - 1, key_mask, None)
        for local in blocks:
            hidden = self.family.run_block(self.blocks[local], hidden, view, inputs[self.windows[local]])
        for cache in caches:
            cache.end_step()
        return list(hidden.split([cache.batch_size for cache in caches]))

    def _ring_masks(
        self, steps: Sequence[BatchedStep], wrapped: Sequence[int]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """For each step of `wrapped` and each window whose ring it is past: the step's own mask over
        that ring's slots (what `forward` gives the step alone)."""
        masks = {}
        for index in wrapped:
            hidden, cache, position, padding_mask = steps[index]
            if padding_mask is not None:
                padding_mask = padding_mask.to(self.device)
            query = hidden.to(device=self.device, dtype=self.dtype)
            for window in {window for window in cache.windows if window is not None}:
                key_positions = cache.key_positions(window)
                if key_positions is not None:
                    masks[index, window] = attention_bias(
                        query, position, padding_mask, window, key_positions
                    )
        return masks


def _graphable(hidden: torch.Tensor, padding_mask: torch.Tensor | None) -> bool:
    """A step a captured graph can run: a few new tokens (a decode step, a draft to verify), none of
    them padding (a masked-out query has no key to see; eager's finite mask gives it a defined, if
    meaningless, output)."""
    tokens = hidden.shape[1]
    return tokens <= MAX_GRAPH_TOKENS and (padding_mask is None or bool(padding_mask[:, -tokens:].all()))


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor, position: int) -> torch.Tensor:
    """`hidden` (tokens at absolute positions `position...`) with `prompt` (`[batch or 1, prefix,
    hidden]`) added where positions fall below `prefix`; a new tensor, so autograd sees the sum."""
    overlap = min(prompt.shape[1] - position, hidden.shape[1])
    if overlap <= 0:
        return hidden
    prompted = hidden[:, :overlap] + prompt[:, position : position + overlap]
    return torch.cat([prompted, hidden[:, overlap:]], dim=1)


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
    quant: str = "none",
) -> tuple[TransformerSpan, list[str]]:
    """Load blocks `[start, end)`; returns the span and the checkpoint files that were opened.
    `quant` ("int8", "nf4") stores the blocks' linear layers quantized (CUDA only)."""
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    check_quant_device(quant, device)
    prepare_attention_kernels(device)
    config = prepare_config(load_config(model_dir))
    family = family_for(config)
    validate_span(start, end, family.num_blocks(config))
    loaded, opened_files = _load_blocks(
        model_dir, family, config, range(start, end), start, dtype, device, on_block_loaded, quant
    )
    blocks = nn.ModuleList(loaded[index] for index in range(start, end))
    helpers = family.make_span_helpers(config, device)
    span = TransformerSpan(family, config, start, end, blocks, helpers, dtype, device, quant).eval()
    span.requires_grad_(False)  # served weights are frozen: training RPCs differentiate inputs only
    return span, opened_files


def _load_blocks(
    model_dir: str | Path,
    family: ModelFamily,
    config: PretrainedConfig,
    indices: Iterable[int],
    span_start: int,
    dtype: torch.dtype,
    device: torch.device,
    on_block_loaded: Callable[[int], None] | None,
    quant: str = "none",
) -> tuple[dict[int, nn.Module], list[str]]:
    """Build and fill the blocks `indices` (absolute) of a span starting at `span_start`."""
    blocks: dict[int, nn.Module] = {}
    fp8_block = fp8_block_size(config)  # a block-quantized FP8 checkpoint's tile, if it is one
    float32_names = family.float32_tensors(dtype)  # what transformers keeps in float32 at this dtype
    with CheckpointReader(model_dir) as reader:
        base = find_base_prefix(family, reader)
        for index in indices:
            with init_empty_weights():
                block = family.build_block(config, index)
            set_block_local_index(block, index - span_start)
            prefix = f"{base}{family.blocks_attribute}{index}."
            names = reader.names_with_prefix(prefix)
            if not names:
                raise CheckpointError(f"checkpoint {reader.model_dir} has no tensors for block {index}")
            tensors = {name[len(prefix) :]: tensor for name, tensor in reader.read(names).items()}
            if fp8_block is not None:
                tensors = dequantize_fp8(tensors, fp8_block)
            tensors = family.block_tensors(block, tensors)
            if quant == "none":
                materialize(block, tensors, dtype, device, f"block {index}", float32_names)
            else:  # fill on the CPU, then bitsandbytes quantizes while moving to the GPU
                materialize(block, tensors, dtype, torch.device("cpu"), f"block {index}", float32_names)
                quantize_block(block, quant, dtype, device)
            blocks[index] = block.eval()
            if on_block_loaded is not None:
                on_block_loaded(index)
    return blocks, list(reader.opened_files)


def set_block_local_index(block: nn.Module, local_index: int) -> None:
    """Make `block` address cache layer `local_index`, i.e. sit at that position inside its span.

    `transformers`' attention modules keep the `layer_idx` they were built with and pass it to the
    cache's `update`; `SpanCache` reads it as the span-local block index. A block reused at another
    position of a new span must be renumbered, or it would write (and read) another block's keys
    and values: silently wrong outputs, not an error.
    """
    found = 0
    for module in block.modules():
        if getattr(module, "layer_idx", None) is not None:
            module.layer_idx = local_index
            found += 1
    if not found:
        raise SpanError(
            f"cannot renumber a {type(block).__name__}: none of its modules has a layer_idx "
            "(the transformers version may have changed how attention finds its cache layer)"
        )


def rebuild_span(
    old_span: TransformerSpan,
    model_dir: str | Path,
    start: int,
    end: int,
    on_block_loaded: Callable[[int], None] | None = None,
) -> tuple[TransformerSpan, list[int], list[int]]:
    """Span `[start, end)` of the same model, reusing the blocks `old_span` already holds.

    A server the scheduler moves usually keeps most of its blocks (a shift or a resize); reading
    them again from disk (and, on a GPU, copying them again) would make the move take as long as a
    restart. Blocks in both spans are moved over and renumbered (`set_block_local_index`); only the
    missing ones are read from the checkpoint. The result computes exactly what `load_span(model_dir,
    start, end)` would, in the old span's dtype and device.

    `old_span` is consumed: its blocks move to the new span, and the ones the new span does not
    need are released *before* loading, so peak memory stays near max(old, new) blocks instead of
    old + new. The caller must not run `old_span` afterwards.

    Returns the new span and the absolute indices of the blocks reused and loaded.
    """
    config = prepare_config(load_config(model_dir))
    family = family_for(config)
    validate_span(start, end, family.num_blocks(config))
    old_config = old_span.config
    same_model = (
        family is old_span.family
        and family.num_blocks(config) == family.num_blocks(old_config)
        and family.hidden_size(config) == family.hidden_size(old_config)
        and family.cache_layout(config) == family.cache_layout(old_config)
    )
    if not same_model:
        raise SpanError(f"the span to rebuild does not hold blocks of the model in {model_dir}")
    if len(old_span.blocks) != old_span.num_blocks:
        raise SpanError("the span to rebuild was already consumed by an earlier rebuild")
    kept = {
        index: old_span.blocks[index - old_span.start]
        for index in range(max(start, old_span.start), min(end, old_span.end))
    }
    old_span.blocks = nn.ModuleList()  # release the blocks the new span does not keep
    missing = [index for index in range(start, end) if index not in kept]
    loaded: dict[int, nn.Module] = {}
    if missing:
        loaded, _files = _load_blocks(
            model_dir,
            family,
            config,
            missing,
            start,
            old_span.dtype,
            old_span.device,
            on_block_loaded,
            old_span.quant,
        )
    for index, block in kept.items():
        set_block_local_index(block, index - start)
    blocks = nn.ModuleList({**kept, **loaded}[index] for index in range(start, end))
    span = TransformerSpan(
        family, config, start, end, blocks, old_span.helpers, old_span.dtype, old_span.device, old_span.quant
    ).eval()
    span.requires_grad_(False)
    return span, sorted(kept), missing
