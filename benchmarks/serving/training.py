"""What training through the swarm costs: forward+backward of 128 tokens, swarm vs local.

    .venv/bin/python -m benchmarks.serving.training [--rounds 10] [--tokens 128] [--hidden 512] [--write]

One swarm on loopback: a DHT and two servers holding blocks 0:4 and 4:8 of a random LLaMA-shaped
model (8 blocks, `--hidden`, MLP 2x wider), one torch thread each. The same 8 blocks also run in
this process (one torch thread) as the reference. Each round times, alternating which goes first:
- local: `forward_sequence` over the blocks, then `backward()` to the input and deep prompts;
- swarm: `model.blocks(hidden, prompts)`, then `backward()` (2 forward RPCs, then 2 backward RPCs
  that recompute the forward, as the servers keep nothing between calls).
Ratios are of medians measured in the same run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import parse_bench_args, publish_table, serving_swarm
from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.swarm.models.span import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

NUM_BLOCKS = 8
SERVERS = {"first": "0:4", "second": "4:8"}


def timed(run) -> tuple[float, float]:
    """Seconds of the forward and of forward+backward."""
    started = time.perf_counter()
    output = run()
    forward = time.perf_counter() - started
    output.sum().backward()
    return forward, time.perf_counter() - started


def main() -> None:
    args = parse_bench_args(__doc__, rounds=10, tokens=128, hidden=512)
    torch.set_num_threads(1)
    times: dict[str, list[tuple[float, float]]] = {"local": [], "swarm": []}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "bench-llama"
        spec = TinyModelSpec(family="llama", num_layers=NUM_BLOCKS, hidden_size=args.hidden, num_heads=8)
        build_tiny_model(model_dir, spec)
        local = load_span(model_dir, 0, NUM_BLOCKS)[0]
        server_args = ("4GB", "--max-length", str(args.tokens))
        with serving_swarm(LocalSwarm(Path(scratch)), model_dir, SERVERS, NUM_BLOCKS, *server_args) as swarm:
            model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers)
            try:
                for round_index in tqdm(range(args.rounds + 1), desc="forward+backward rounds", unit="round"):
                    hidden = torch.randn(1, args.tokens, args.hidden)
                    prompts = 0.1 * torch.randn(NUM_BLOCKS, 1, 4, args.hidden)
                    runs = {
                        "local": lambda h, p: local.forward_sequence(h, 0, NUM_BLOCKS, None, p),
                        "swarm": lambda h, p: model.blocks(h, p),
                    }
                    order = list(runs) if round_index % 2 else list(reversed(runs))
                    for name in order:
                        leaves = hidden.clone().requires_grad_(), prompts.clone().requires_grad_()
                        measured = timed(lambda run=runs[name], leaves=leaves: run(*leaves))
                        if round_index:  # round 0 warms up connections and allocators
                            times[name].append(measured)
            finally:
                model.shutdown()

    def median(name: str, index: int) -> float:
        return statistics.median(sample[index] for sample in times[name])

    lines = ["| where | forward (ms) | forward+backward (ms) | vs local |", "|---|---|---|---|"]
    base = median("local", 1)
    for name in ("local", "swarm"):
        forward, both = median(name, 0), median(name, 1)
        lines.append(f"| {name} | {forward * 1e3:.1f} | {both * 1e3:.1f} | {both / base:.2f}x |")
    publish_table(
        __file__,
        args,
        lines,
        "## Training through the swarm",
        f"Forward+backward of one sequence of {args.tokens} tokens "
        f"through {NUM_BLOCKS} LLaMA-shaped blocks (hidden {args.hidden}, 8 heads, float32) with deep "
        "prompts of 4 positions, gradients to the input and the prompts. Swarm: a 2-server chain (0:4, "
        "4:8) on loopback on this shared 2-core machine, one torch thread per server; local: the same "
        "blocks in the client's process, one thread. Medians of "
        f"{args.rounds} alternating rounds after a warm-up. The swarm's backward recomputes each "
        "server's forward (servers keep no activations between calls), so its compute is about "
        "forward x 2 + backward, plus four round trips carrying the hidden states.",
    )


if __name__ == "__main__":
    main()
