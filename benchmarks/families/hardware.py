"""Real-size blocks on real hardware: bytes, decode time vs the memory-bandwidth limit,
cache bytes vs the s_c formula, and per-token latency of a swarm that splits the model.

    # on a GPU machine: a LLaMA-2-7B-shaped random checkpoint (32 blocks, hidden 4096, no GQA)
    .venv/bin/python -m benchmarks.families.hardware --device cuda --dtypes float16 --quants none,nf4 --write
    # the same code on this CPU, small enough to finish in a minute
    .venv/bin/python -m benchmarks.families.hardware --device cpu --layers 4 --hidden 512 \\
        --intermediate 1376 --heads 8 --quants none --servers 2 --tokens 16

Per (dtype, quant) it loads block 0 with the servers' own loading code (`load_span`, quantized by
`--quant` exactly as `swarm-server` does), and measures

- `s_m`: the bytes the server announces (packed weights + scales) and, on CUDA, what the allocator
  really gave the block;
- the median decode time of one block at `--context` cached tokens (synchronized), against the
  bandwidth limit `s_m / B`, with `B` this device's measured copy bandwidth (a decode step must
  read every weight once, so no implementation beats that);
- a session cache's real bytes against `s_c` of eq. 2 (docs/reference.md 2);

then starts a DHT and `--servers` servers splitting the blocks on the device and times
`--tokens` greedy tokens through them (p50/p95 per token).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.markdown import write_section
from benchmarks.serving.latency import TokenClock
from harness.local_swarm import LocalSwarm
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.hardware import probe_device, resolve_device
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

HEADER = "## Real-size blocks on real hardware"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def copy_bandwidth(device: torch.device, size_bytes: int) -> float:
    """Bytes/s of a large device-to-device copy (read + write), best of 5."""
    source = torch.empty(size_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size_bytes / best


def time_decode(span, cache, context: int, steps: int) -> float:
    """Median seconds of `steps` single-token steps after `context` cached tokens (synchronized)."""
    device = span.device
    step = torch.randn(1, 1, span.hidden_size).to(span.dtype)
    times = []
    for position in range(context, context + steps):
        synchronize(device)
        started = time.perf_counter()
        span(step, cache, position)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_block(model_dir: Path, device: torch.device, dtype: str, quant: str, context: int, steps: int):
    """One block's bytes, its cache's bytes, and its decode time eagerly and from CUDA graphs (the
    same span and prefix, one after the other)."""
    before = allocated(device)
    span, _ = load_span(model_dir, 0, 1, dtype=dtype, device=device, quant=quant)
    synchronize(device)
    real_block_bytes = allocated(device) - before
    before = allocated(device)
    cache = span.new_cache(1, context + steps + 1)
    real_cache_bytes = allocated(device) - before
    hidden = torch.randn(1, context, span.hidden_size, generator=torch.Generator().manual_seed(0))
    span(hidden.to(span.dtype), cache, 0)
    eager = time_decode(span, cache, context, steps)
    graphs = None
    if span.use_decode_graphs():
        graphs = time_decode(span, cache, context, steps)
        if span.decode_graphs.replays == 0:  # capture failed (logged): nothing was measured
            graphs = None
    result = {
        "dtype": dtype,
        "quant": quant,
        "s_m": span.block_bytes,
        "s_m_allocated": real_block_bytes,  # 0 on the CPU: no allocator to ask
        "decode_s": graphs if graphs is not None else eager,
        "decode_eager_s": eager,
        "decode_graph_s": graphs,
        "cache_formula": span.cache_bytes(context + steps + 1),
        "cache_allocated": real_cache_bytes or cache.nbytes,
    }
    del span, cache
    gc.collect()  # the next row's "allocated" must not see this one's blocks freed while it loads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def measure_swarm(
    model_dir: Path, args, dtype: str, quant: str, log_dir: Path, graphs: bool = True
) -> list[float]:
    layers, servers = args.layers, args.servers
    bounds = [round(i * layers / servers) for i in range(servers + 1)]
    run_dir = log_dir / f"{dtype}-{quant}-{'graphs' if graphs else 'eager'}"
    run_dir.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(run_dir)
    try:
        swarm.start_dht()
        for i in range(servers):
            swarm.start_server(
                f"s{i}", model_dir, f"{bounds[i]}:{bounds[i + 1]}", args.memory_per_server,
                "--device", args.device, "--dtype", dtype, "--quant", quant,
                *([] if graphs else ["--no-cuda-graphs"]),
            )  # fmt: skip
        swarm.wait_online(default_prefix(str(model_dir)), layers, [f"s{i}" for i in range(servers)], 600)
        model = DistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers, dtype=dtype)
        try:
            ids = torch.randint(4, 400, (1, 16), generator=torch.Generator().manual_seed(0))
            clock = TokenClock()
            model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, streamer=clock)
        finally:
            model.shutdown()
        return clock.intervals()
    except Exception:
        print(swarm.log_tails(), file=sys.stderr)
        raise
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--quants", default="none,nf4")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="cached tokens when timing decode")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per block")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--memory-per-server", default="16GB")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated through the swarm")
    parser.add_argument("--model-dir", type=Path, help="reuse a checkpoint built by an earlier run")
    parser.add_argument(
        "--rows", type=Path, default=Path("results/hardware/rows.json"), help="where rows accumulate"
    )
    parser.add_argument(
        "--swarm-for",
        default="all",
        help="DTYPE:QUANT pairs (comma-separated) whose swarm is timed; the others: one block only",
    )
    parser.add_argument(
        "--eager-swarm",
        action="store_true",
        help="also time the swarm with --no-cuda-graphs servers (side by side with graphs)",
    )
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    device = resolve_device(args.device, probe_device())
    args.device = str(device)
    dtypes, quants = args.dtypes.split(","), args.quants.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or Path(scratch) / "model"
        if not (model_dir / "config.json").exists():
            spec = TinyModelSpec(
                family="llama", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                intermediate_size=args.intermediate, vocab_size=512, initializer_range=0.02,
                dtype=dtypes[0],
            )  # fmt: skip
            print(
                f"building a {args.layers}-block hidden-{args.hidden} checkpoint in {model_dir}", flush=True
            )
            build_tiny_model(model_dir, spec, max_shard_size="2GB")
        bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 28)
        print(f"{device}: copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
        rows = []
        for dtype in dtypes:
            for quant in quants:
                block = measure_block(model_dir, device, dtype, quant, args.context, args.steps)
                block["bandwidth"] = bandwidth
                if args.swarm_for != "all" and f"{dtype}:{quant}" not in args.swarm_for.split(","):
                    rows.append(block)
                    print(block, flush=True)
                    continue
                intervals = measure_swarm(model_dir, args, dtype, quant, Path(scratch) / "logs")
                block["token_p50"] = statistics.median(intervals)
                block["token_p95"] = statistics.quantiles(intervals, n=20)[-1]
                if args.eager_swarm and device.type == "cuda":
                    eager = measure_swarm(model_dir, args, dtype, quant, Path(scratch) / "logs", graphs=False)
                    block["token_eager_p50"] = statistics.median(eager)
                block["bandwidth"] = bandwidth
                rows.append(block)
                print(block, flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    shape = f"{args.layers}x{args.hidden}x{args.intermediate}x{args.heads}"
    for row in rows:
        row.update(device=name, shape=shape, context=args.context, servers=args.servers)
    rows = merge_rows(args.rows, rows)  # earlier runs' other (dtype, quant) rows stay in the table
    table = render_table([row for row in rows if row["device"] == name and row["shape"] == shape])
    print(table)
    if args.write:
        command = " ".join(["benchmarks/families/hardware.py", *sys.argv[1:]])
        write_section(
            HEADER,
            f"{HEADER}\n\nCommand: `.venv/bin/python {command}` (each run adds its rows to "
            f"`{args.rows}`; the table shows every row kept there for this device and shape)\n\n"
            f"{name}, copy bandwidth {bandwidth / 1e9:.1f} GB/s; LLaMA shape {args.layers} blocks, "
            f"hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads; decode at "
            f"{args.context} cached tokens; {args.servers} servers on the one device.\n\n{table}\n",
        )


def merge_rows(path: Path, new_rows: list[dict]) -> list[dict]:
    """Rows kept in `path`, with those of the same device, shape, dtype and quant replaced."""
    key = ("device", "shape", "dtype", "quant")
    kept = json.loads(path.read_text()) if path.exists() else []
    fresh = {tuple(row[k] for k in key) for row in new_rows}
    merged = [row for row in kept if tuple(row[k] for k in key) not in fresh] + new_rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1) + "\n")
    return merged


def render_table(rows: list[dict]) -> str:
    lines = [
        "| dtype | quant | s_m (MB) | allocated (MB) | decode / block: eager (ms) | graphs (ms) "
        "| bandwidth limit (ms) | ratio | cache: real / s_c | per token p50 / p95 (ms) "
        "| eager swarm p50 (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        limit = row["s_m"] / row["bandwidth"]
        eager = row.get("decode_eager_s", row["decode_s"])  # rows from before graphs: eager only
        graphs = row.get("decode_graph_s")
        graph_text = f"{graphs * 1e3:.3f}" if graphs else "-"
        eager_swarm = row.get("token_eager_p50")
        eager_swarm_text = f"{eager_swarm * 1e3:.1f}" if eager_swarm else "-"
        token_text = "-"
        if row.get("token_p50"):
            token_text = f"{row['token_p50'] * 1e3:.1f} / {row['token_p95'] * 1e3:.1f}"
        lines.append(
            f"| {row['dtype']} | {row['quant']} | {row['s_m'] / 1e6:.1f} "
            f"| {row['s_m_allocated'] / 1e6:.1f} "
            f"| {eager * 1e3:.3f} | {graph_text} | {limit * 1e3:.3f} | {row['decode_s'] / limit:.2f}x "
            f"| {row['cache_allocated'] / row['cache_formula']:.3f} "
            f"| {token_text} | {eager_swarm_text} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
