"""LoRA adapters (the `peft` library's) on a server's span, chosen per session.

A server started with `--adapters DIR...` loads each PEFT LoRA adapter for the blocks it serves,
injects it with peft (`inject_adapter_in_model`), and announces the adapters' names. Every forward
then tells peft, per row of the batch, which adapter that row uses ("__base__": none): peft's mixed
batch path (`adapter_names=`) computes each row with its own adapter, so sessions with different
adapters (or none) still share one batched decode iteration, and the output of a row is what a local
`PeftModel` with that adapter computes.

An adapter directory is whatever someone handed the operator, so it is checked before anything is
loaded, and refused at start-up with a message naming the problem: only `adapter_config.json` and
`adapter_model.safetensors` are read (never pickles), both regular files inside the directory (no link
out of it), the config bounded in size and in what it asks (LoRA only, rank at most MAX_RANK, no
modules kept in full, no DoRA or trained biases), every tensor named after a linear layer inside a
transformer block with the shape that layer needs (checked from the file's header before reading
data), of a float dtype, and finite.
"""

from __future__ import annotations

import json
import math
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from llm_swarm.swarm.adapter_names import BASE, AdapterError, check_adapter_name
from llm_swarm.swarm.models.checkpoint import load_config
from llm_swarm.swarm.models.family import ModelFamily, family_for
from llm_swarm.swarm.models.span import prepare_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 64 * 1024
MAX_RANK = 256  # LoRA ranks in use are 4-128; a larger one is a memory attack or a mistake
MAX_ADAPTERS = 16  # per server: its record lists them
# a peft LoRA state dict names the original module, after PeftModel's "base_model.model."
_KEY = re.compile(r"base_model\.model\.(?:.*\.)?{blocks}(\d+)\.(.+)\.lora_(A|B)\.weight")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
_SUPPORTED_FALSE = ("use_dora", "fan_in_fan_out", "lora_bias")
# which adapter each row of the forward running on this thread uses: one per process, because a block
# reused by a move keeps the hooks it was given when its adapters were first injected
_SELECTION = threading.local()


@dataclass(frozen=True)
class AdapterSource:
    """`--adapters` entry: NAME=DIR, or DIR (named after its last path component)."""

    name: str
    path: Path

    @classmethod
    def parse(cls, text: str) -> AdapterSource:
        name, separator, path = text.partition("=")
        if not separator:
            name, path = Path(text).name, text
        check_adapter_name(name)
        return cls(name, Path(path))


@dataclass
class _Module:
    """One adapted linear layer of one block: its LoRA factors and scaling inputs."""

    block: int  # index inside the span
    path: str  # inside the block, e.g. "self_attn.q_proj"
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    alpha: float


@dataclass
class SpanAdapters:
    """The adapters injected into a span, and which one each row of the current forward uses."""

    names: tuple[str, ...]
    bytes_by_block: list[int]  # adapter parameter bytes in each block of the span

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_block)

    @contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within this block, forwards on this thread apply `adapters[r]` to row r (None: no adapter)."""
        unknown = sorted({name for name in adapters if name is not None and name not in self.names})
        if unknown:
            raise AdapterError(f"this server has no adapter {unknown[0]!r} (it has: {', '.join(self.names)})")
        previous = getattr(_SELECTION, "rows", None)
        _SELECTION.rows = [name if name is not None else BASE for name in adapters]
        try:
            yield
        finally:
            _SELECTION.rows = previous


def _inject_rows(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of every LoRA layer: peft's per-row adapter names for this call (no
    selection: every row without adapter)."""
    rows = getattr(_SELECTION, "rows", None)
    kwargs["adapter_names"] = rows if rows is not None else [BASE] * args[0].shape[0]
    return args, kwargs


@contextmanager
def adapter_rows(span: nn.Module, adapters: Sequence[str | None]) -> Iterator[None]:
    """`span.adapters.rows(adapters)`, and for a span without adapters: fine if every row asks none."""
    loaded: SpanAdapters | None = getattr(span, "adapters", None)
    if loaded is None:
        asked = next((name for name in adapters if name is not None), None)
        if asked is not None:
            raise AdapterError(f"this server has no adapter {asked!r} (it serves none)")
        yield
        return
    with loaded.rows(adapters):
        yield


def attach_adapters(span, sources: Sequence[AdapterSource]) -> SpanAdapters | None:
    """Check and load every adapter for `span`'s blocks, inject them, and set `span.adapters`.
    Raises AdapterError (nothing injected) if any adapter is refused."""
    if not sources:
        span.adapters = None
        return None
    if len(sources) > MAX_ADAPTERS:
        raise AdapterError(f"at most {MAX_ADAPTERS} adapters per server, got {len(sources)}")
    names = [source.name for source in sources]
    if len(set(names)) != len(names):
        raise AdapterError(f"adapter names must differ, got {names}")
    blocks = _Blocks.of_span(span)
    loaded = {source.name: _read_adapter(source, blocks) for source in sources}  # all checked first
    adapters = SpanAdapters(tuple(names), [0] * span.num_blocks)
    for name, (config, modules) in loaded.items():
        for module in modules:
            _inject(span.blocks[module.block], name, config, module)
            adapters.bytes_by_block[module.block] += (module.lora_a.numel() + module.lora_b.numel()) * 4
    from peft.tuners.lora import LoraLayer  # imported on use: peft costs every server a second to load

    for block in span.blocks:
        for module in block.modules():
            if isinstance(module, LoraLayer) and not getattr(module, "_swarm_rows_hook", False):
                module.register_forward_pre_hook(_inject_rows, with_kwargs=True)
                module._swarm_rows_hook = True
    span.requires_grad_(False)  # served weights, adapters included, are frozen
    span.adapters = adapters
    return adapters


def _inject(block: nn.Module, name: str, config: dict, module: _Module) -> None:
    """peft's LoRA layer for one linear layer of a block, holding the adapter's factors."""
    from peft import LoraConfig, inject_adapter_in_model

    rank = module.lora_a.shape[0]
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=module.alpha,
        use_rslora=bool(config.get("use_rslora", False)),
        lora_dropout=0.0,  # serving (and gradients of inputs) only: dropout would make outputs random
        target_modules=[module.path],
        bias="none",
    )
    with warnings.catch_warnings():  # peft warns when a block gets a second adapted layer: intended
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        inject_adapter_in_model(lora_config, block, adapter_name=name)
    layer = block.get_submodule(module.path)
    device = layer.base_layer.weight.device
    with torch.no_grad():  # peft keeps adapter weights in float32 (as PeftModel loads them)
        layer.lora_A[name].weight.copy_(module.lora_a.to(device, torch.float32))
        layer.lora_B[name].weight.copy_(module.lora_b.to(device, torch.float32))
        layer.lora_A[name].to(device)
        layer.lora_B[name].to(device)


@dataclass(frozen=True)
class _Blocks:
    """The blocks an adapter is read for: absolute indices `[start, end)`, each one's module by index."""

    family: ModelFamily
    config: PretrainedConfig
    start: int
    end: int
    block: Callable[[int], nn.Module]

    @classmethod
    def of_span(cls, span) -> _Blocks:
        return cls(
            span.family, span.config, span.start, span.end, lambda index: span.blocks[index - span.start]
        )


def check_adapters(model_dir: str | Path, sources: Sequence[AdapterSource]) -> None:
    """Every check `attach_adapters` makes, for every block of the model, before anything is loaded
    (a server refuses a bad adapter before it joins the swarm): blocks are alike, so one block built
    without weights gives every block's layer shapes."""
    config = prepare_config(load_config(model_dir))
    family = family_for(config)
    with init_empty_weights():
        block = family.build_block(config, 0)
    every_block = _Blocks(family, config, 0, family.num_blocks(config), lambda _index: block)
    for source in sources:
        _read_adapter(source, every_block)


def _read_adapter(source: AdapterSource, span: _Blocks) -> tuple[dict, list[_Module]]:
    from peft.utils.other import get_pattern_key

    directory = source.path
    what = f"adapter {source.name!r} ({directory})"
    if not directory.is_dir():
        raise AdapterError(f"{what}: not a directory")
    config_path, weights_path = _inside(directory, CONFIG_FILE, what), _inside(directory, WEIGHTS_FILE, what)
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{what}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise AdapterError(f"{what}: {CONFIG_FILE} is not JSON: {error}") from None
    _check_config(config, what)
    blocks_attribute = re.escape(span.family.blocks_attribute)
    key_pattern = re.compile(_KEY.pattern.format(blocks=blocks_attribute))
    alpha_pattern = config.get("alpha_pattern") or {}
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118  (safe_open has no iterator)
                match = key_pattern.fullmatch(key)
                if match is None:
                    raise AdapterError(
                        f"{what}: tensor {key!r} is not a LoRA factor of a linear layer inside a transformer "
                        "block (adapters of embeddings, heads or biases are not served)"
                    )
                pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = key
            modules = []
            num_blocks = span.family.num_blocks(span.config)
            for (index, path), factors in sorted(pairs.items()):
                if index >= num_blocks or set(factors) != {"A", "B"}:
                    raise AdapterError(
                        f"{what}: block {index} {path}: needs lora_A and lora_B of a real block"
                    )
                if not span.start <= index < span.end:
                    continue  # another server's block: not read
                layer = _linear(span.block(index), path, what)
                lora_a = _read_factor(weights, factors["A"], None, layer.in_features, what)
                lora_b = _read_factor(weights, factors["B"], layer.out_features, lora_a.shape[0], what)
                full_name = f"{span.family.blocks_attribute}{index}.{path}"
                alpha = alpha_pattern.get(
                    get_pattern_key(alpha_pattern.keys(), full_name), config["lora_alpha"]
                )
                modules.append(_Module(index - span.start, path, lora_a, lora_b, float(alpha)))
    except AdapterError:
        raise
    except Exception as error:  # safetensors' own parse errors: a truncated or forged file
        raise AdapterError(f"{what}: {WEIGHTS_FILE} cannot be read: {error}") from None
    if not pairs:
        raise AdapterError(f"{what}: {WEIGHTS_FILE} holds no LoRA factors")
    return config, modules


def _inside(directory: Path, name: str, what: str) -> Path:
    """`directory/name`, a regular file that really lies inside `directory` (a link may not lead out)."""
    path = directory / name
    if not path.is_file():
        other = (
            " (pickled .bin adapters are not loaded: convert them to safetensors)"
            if name == WEIGHTS_FILE
            else ""
        )
        raise AdapterError(f"{what}: no {name}{other}")
    resolved, root = path.resolve(), directory.resolve()
    if not resolved.is_relative_to(root):
        raise AdapterError(f"{what}: {name} leads outside the adapter's directory (to {resolved})")
    return resolved


def _check_config(config: object, what: str) -> None:
    if not isinstance(config, dict):
        raise AdapterError(f"{what}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{what}: only LoRA adapters are served, this is {config.get('peft_type')!r}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise AdapterError(f"{what}: rank r={rank!r} must be an integer in 1..{MAX_RANK}")
    if not _finite_positive(alpha):
        raise AdapterError(f"{what}: lora_alpha={alpha!r} must be a positive finite number")
    for name in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict) or len(pattern) > 1024:
            raise AdapterError(f"{what}: {name} must be a mapping of at most 1024 entries")
        limit = MAX_RANK if name == "rank_pattern" else math.inf
        bad = [key for key, value in pattern.items() if not _finite_positive(value) or value > limit]
        if bad:
            raise AdapterError(f"{what}: {name} entry {bad[0]!r} is out of bounds")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{what}: modules_to_save (whole trained modules) are not served, only LoRA factors"
        )
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{what}: trained biases (bias={config.get('bias')!r}) are not served")
    for name in _SUPPORTED_FALSE:
        if config.get(name):
            raise AdapterError(f"{what}: {name} is not supported")


def _finite_positive(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _linear(block: nn.Module, path: str, what: str) -> nn.Linear:
    try:
        layer = block.get_submodule(path)
    except AttributeError:
        layer = None
    from peft.tuners.lora import LoraLayer

    if isinstance(layer, LoraLayer):  # a reused block (a move) may already carry adapters
        layer = layer.get_base_layer()
    if ".experts." in f".{path}":
        # peft picks each row's adapter by batch row, while an expert sees the tokens routed to it
        # gathered across rows; transformers 5 also fuses experts into 3-D weights (no linear layer)
        raise AdapterError(
            f"{what}: {path!r} adapts an expert of a mixture; experts see tokens gathered across the "
            "batch's rows (and transformers 5 keeps them fused in 3-D weights), which per-session "
            "adapters cannot follow: LoRA on attention and dense layers is served, not on experts"
        )
    if not isinstance(layer, nn.Linear):
        raise AdapterError(f"{what}: {path!r} is not a linear layer of this model's blocks")
    return layer


def _read_factor(weights, key: str, rows: int | None, columns: int, what: str) -> torch.Tensor:
    """A factor checked from the header (dtype, shape, rank bound) before its data is read."""
    piece = weights.get_slice(key)
    shape, dtype = piece.get_shape(), piece.get_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(f"{what}: {key} has dtype {dtype}, not a float")
    expected_rows = rows if rows is not None else shape[0] if shape else 0
    if len(shape) != 2 or shape[0] != expected_rows or shape[1] != columns:
        wanted = f"[{rows if rows is not None else 'r'}, {columns}]"
        raise AdapterError(f"{what}: {key} has shape {list(shape)}, the layer needs {wanted}")
    if rows is None and not 1 <= shape[0] <= MAX_RANK:
        raise AdapterError(f"{what}: {key} has rank {shape[0]}, more than {MAX_RANK}")
    tensor = weights.get_tensor(key)
    if not torch.isfinite(tensor).all():
        raise AdapterError(f"{what}: {key} holds NaN or infinite values")
    return tensor
