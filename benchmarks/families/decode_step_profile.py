"""Where a 7B-shaped decode step's GPU time goes, and what a fused step would save.

Loads `--blocks` LLaMA-2-7B-shaped fp16 blocks and times a single-token step at `--context` cached
tokens, per block:
  * the span's eager path and its CUDA-graph path (swarm.models.decode_graphs) over 1 block and over
    all blocks (a server's span amortises its per-step Python work over its blocks);
  * a kernel census of one graph replay (torch.profiler): kernels per block and their GPU time;
  * an experimental fused step in plain torch (one QKV and one gate/up matrix product per block, a
    static cache written with `index_copy_`), captured in a CUDA graph, eager and compiled with
    `torch.compile` (Inductor fuses the norms, rotary embedding and SiLU into a few kernels); its
    output is checked against the span's blocks first.
Prints one JSON line per measurement and a summary against the bandwidth limit (weights read once).

    python -m benchmarks.families.decode_step_profile --blocks 8 --context 512
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llm_swarm.swarm.models.span import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

DEVICE = "cuda"
DTYPE = torch.float16


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copy_bandwidth(size_bytes: int = 1 << 30) -> float:
    source = torch.empty(size_bytes // 2, dtype=DTYPE, device=DEVICE)
    target = torch.empty_like(source)
    best = min(median_seconds(lambda: target.copy_(source), 1) for _ in range(5))
    return 2 * size_bytes / best


def span_timings(model_dir: Path, blocks: int, context: int, repeats: int) -> dict:
    span, _ = load_span(model_dir, 0, blocks, dtype=DTYPE, device=DEVICE)
    cache = span.new_cache(1, context + 4 * repeats + 8)
    prompt = torch.randn(1, context, span.hidden_size, generator=torch.Generator().manual_seed(0))
    span(prompt.to(DTYPE).to(DEVICE), cache, 0)
    step = torch.randn(1, 1, span.hidden_size, device=DEVICE, dtype=DTYPE)
    position = [context]

    def one() -> None:
        span(step, cache, position[0])
        position[0] += 1

    eager = median_seconds(one, repeats)
    span.use_decode_graphs()
    graphs = median_seconds(one, repeats)
    census = None
    if blocks > 1:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                one()
            sync()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total_us = sum(e.device_time for e in kernels) / 3
        by_name: dict[str, float] = {}
        for event in kernels:
            by_name[event.name] = by_name.get(event.name, 0.0) + event.device_time / 3
        top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
        census = {
            "kernels_per_block": len(kernels) / 3 / blocks,
            "gpu_us_per_block": total_us / blocks,
            "top": [(name[:70], round(us / blocks, 2)) for name, us in top],
        }
    replays = span.decode_graphs.replays if span.decode_graphs is not None else 0
    return {"eager_s": eager / blocks, "graphs_s": graphs / blocks, "replays": replays, "census": census}


class FusedBlocks:
    """The same blocks as one plain-torch decode step with fused weights and static caches."""

    def __init__(self, span, max_length: int):
        config = span.config
        self.heads, self.kv_heads = config.num_attention_heads, span.num_kv_heads
        self.head_dim, self.eps = span.head_dim, config.rms_norm_eps
        self.weights = []
        for block in span.blocks:
            attention, mlp = block.self_attn, block.mlp
            self.weights.append(
                {
                    "ln1": block.input_layernorm.weight,
                    "ln2": block.post_attention_layernorm.weight,
                    "qkv": torch.cat(
                        [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]
                    ),
                    "o": attention.o_proj.weight,
                    "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    "down": mlp.down_proj.weight,
                }
            )
        shape = (1, self.kv_heads, max_length, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=DTYPE, device=DEVICE) for _ in span.blocks]
        self.values = [torch.zeros(shape, dtype=DTYPE, device=DEVICE) for _ in span.blocks]

    def block_step(self, x, weights, keys, values, position, cos, sin, width: int):
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        hidden = _rms(x, weights["ln1"], self.eps)
        q, k, v = (hidden @ weights["qkv"].t()).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        q = q.view(1, 1, heads, head_dim).transpose(1, 2)
        k = k.view(1, 1, kv_heads, head_dim).transpose(1, 2)
        v = v.view(1, 1, kv_heads, head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys.index_copy_(2, position, k)
        values.index_copy_(2, position, v)
        visible = torch.arange(width, device=x.device) <= position
        attended = F.scaled_dot_product_attention(
            q,
            keys[:, :, :width],
            values[:, :, :width],
            attn_mask=visible.view(1, 1, 1, width),
            enable_gqa=kv_heads != heads,
        )
        x = x + attended.transpose(1, 2).reshape(1, 1, heads * head_dim) @ weights["o"].t()
        gate, up = (_rms(x, weights["ln2"], self.eps) @ weights["gate_up"].t()).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ weights["down"].t()

    def step(self, step_fn, x, position, cos, sin, width: int):
        for weights, keys, values in zip(self.weights, self.keys, self.values, strict=True):
            x = step_fn(x, weights, keys, values, position, cos, sin, width)
        return x


def _rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fused_error(span, fused: FusedBlocks) -> float:
    """Largest relative difference of the fused step from the span's own blocks over 12 steps from
    position 0 (eager, width 64)."""
    rotary = span.helpers["rotary"]
    # correctness: 12 steps from position 0 through the span (eager) and the fused step
    cache = span.new_cache(1, 64)
    worst = 0.0
    for position in range(12):
        x = torch.randn(1, 1, span.hidden_size, device=DEVICE, dtype=DTYPE)
        expected = span(x, cache, position)
        cos, sin = rotary(x, torch.tensor([[position]], device=DEVICE))
        got = fused.step(
            fused.block_step, x, torch.tensor([position], device=DEVICE), cos[:, None], sin[:, None], 64
        )
        worst = max(
            worst, (got.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
        )
    return worst


def fused_timings(model_dir: Path, blocks: int, context: int, repeats: int, width: int) -> dict:
    span, _ = load_span(model_dir, 0, blocks, dtype=DTYPE, device=DEVICE)
    fused = FusedBlocks(span, max_length=max(width, 64))
    rotary = span.helpers["rotary"]
    worst = fused_error(span, fused)
    static_x = torch.randn(1, 1, span.hidden_size, device=DEVICE, dtype=DTYPE)
    static_position = torch.tensor([context], device=DEVICE)
    cos, sin = rotary(static_x, static_position.view(1, 1))
    cos, sin = cos[:, None].contiguous(), sin[:, None].contiguous()
    results = {"relative_error_vs_span": worst}
    variants = {"fused_eager_graph": fused.block_step}
    try:
        variants["fused_compiled_graph"] = torch.compile(fused.block_step, dynamic=False, fullgraph=True)
    except Exception as error:  # noqa: BLE001 - an experiment: report and go on
        results["compile_error"] = repr(error)[:300]
    for name, step_fn in variants.items():
        try:
            started = time.perf_counter()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fused.step(step_fn, static_x, static_position, cos, sin, width)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fused.step(step_fn, static_x, static_position, cos, sin, width)
            prepared = time.perf_counter() - started
            results[name] = median_seconds(graph.replay, repeats) / blocks
            results[name + "_prepare_s"] = prepared
        except Exception as error:  # noqa: BLE001
            results[name + "_error"] = repr(error)[:300]
    del span, fused
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or Path(scratch) / "model"
        if not (model_dir / "config.json").exists():
            started = time.perf_counter()
            spec = TinyModelSpec(
                family="llama",
                num_layers=args.blocks,
                hidden_size=4096,
                num_heads=32,
                intermediate_size=11008,
                vocab_size=512,
                initializer_range=0.02,
                dtype="float16",
            )
            build_tiny_model(model_dir, spec, max_shard_size="2GB")
            emit(event="checkpoint", seconds=round(time.perf_counter() - started, 1))
        bandwidth = copy_bandwidth()
        block_bytes = 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)
        limit = block_bytes / bandwidth
        emit(
            event="device",
            name=torch.cuda.get_device_name(),
            bandwidth_gbs=round(bandwidth / 1e9),
            limit_ms=limit * 1e3,
        )
        for blocks in (1, args.blocks):
            row = span_timings(model_dir, blocks, args.context, args.repeats)
            gc.collect()  # the span is gone: free its blocks before the next one loads
            torch.cuda.empty_cache()
            emit(
                event="span",
                blocks=blocks,
                eager_ms=row["eager_s"] * 1e3,
                graphs_ms=row["graphs_s"] * 1e3,
                graphs_ratio=row["graphs_s"] / limit,
                replays=row["replays"],
                census=row["census"],
            )
        width = 1 << (args.context).bit_length()
        fused = fused_timings(model_dir, args.blocks, args.context, args.repeats, width)
        for key in ("fused_eager_graph", "fused_compiled_graph"):
            if key in fused:
                fused[key + "_ratio"] = fused[key] / limit
                fused[key] *= 1e3
        emit(event="fused", **fused)


if __name__ == "__main__":
    main()
