"""Measure `tau` (per-block decode time per token) and `tau_prefill` on this server's own blocks.

Timings are cached on disk per model shape, device, dtype, quantization and thread count, because they take a
few seconds and do not change between restarts of the same server.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_swarm.swarm.dtypes import dtype_name
from llm_swarm.swarm.models.span import TransformerSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockTimings:
    tau: float  # seconds per block per decoded token
    tau_prefill: float  # seconds per block for a prefill of `prefill_tokens` tokens
    prefill_tokens: int


def default_cache_path() -> Path:
    root = os.environ.get("SWARM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llm-swarm"
    )
    return Path(root) / "block_timings.json"


def timings_cache_key(span: TransformerSpan, prefill_tokens: int, compute_delay: float) -> str:
    config = span.config.to_json_string(use_diff=False)
    shape = hashlib.sha256(config.encode()).hexdigest()[:16]
    threads = torch.get_num_threads()
    device = span.device.type if span.device.type == "cpu" else _device_name(span.device)
    quant = "" if span.quant == "none" else f":{span.quant}"  # unquantized keys as before
    graphs = ":graphs" if span.decode_graphs is not None else ""  # eager keys as before
    kind = f"{device}:{dtype_name(span.dtype)}{quant}{graphs}"
    return f"{shape}:{kind}:{threads}t:{prefill_tokens}:{compute_delay}"


def _device_name(device: torch.device) -> str:
    """A GPU is keyed by its model too: timings of an A100 do not hold for the T4 swapped in later."""
    return f"{device}[{torch.cuda.get_device_name(device)}]"


def measure_block_timings(
    span: TransformerSpan, prefill_tokens: int = 20, decode_steps: int = 16, compute_delay: float = 0.0
) -> BlockTimings:
    """Median per-block times of a prefill and of single-token decode steps on random inputs."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, prefill_tokens, span.hidden_size, generator=generator).to(span.dtype)
    step = torch.randn(1, 1, span.hidden_size, generator=generator).to(span.dtype)
    prefill_times, decode_times = [], []
    for _ in range(3):
        cache = span.new_cache(1, prefill_tokens + decode_steps)
        started = time.perf_counter()
        span(hidden, cache, 0)
        _synchronize(span.device)
        prefill_times.append(time.perf_counter() - started)
        for position in range(prefill_tokens, prefill_tokens + decode_steps):
            started = time.perf_counter()
            span(step, cache, position)
            _synchronize(span.device)
            decode_times.append(time.perf_counter() - started)
        span.forget_cache(cache)
    blocks = span.num_blocks
    return BlockTimings(
        tau=statistics.median(decode_times) / blocks + compute_delay,
        tau_prefill=statistics.median(prefill_times) / blocks + compute_delay,
        prefill_tokens=prefill_tokens,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_block_timings(
    span: TransformerSpan,
    prefill_tokens: int = 20,
    compute_delay: float = 0.0,
    cache_path: Path | None = None,
) -> BlockTimings:
    path = cache_path or default_cache_path()
    key = timings_cache_key(span, prefill_tokens, compute_delay)
    try:
        entries = json.loads(path.read_text())
        return BlockTimings(**entries[key])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = measure_block_timings(span, prefill_tokens, compute_delay=compute_delay)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entries = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):  # none yet, or damaged: start afresh
            entries = {}
        entries[key] = timings.__dict__
        # servers started together on one machine all write here: each writes its own file and
        # renames it over the cache, so a reader never sees half of another's write
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            try:
                file.write(json.dumps(entries, indent=1))
                file.close()
                os.replace(file.name, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(file.name)  # left only if the write or the rename failed
    except OSError as error:
        logger.warning("could not save block timings to %s: %s", path, error)
    return timings
