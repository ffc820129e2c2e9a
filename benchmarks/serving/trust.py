"""What trust costs: per-token latency and client start-up with signed, validated records,
against the commit before that change, side by side in one run.

    .venv/bin/python -m benchmarks.serving.trust [--baseline 1a6834b] [--rounds 3] [--tokens 64] [--write]

The baseline is checked out into a temporary git worktree; each round starts a swarm (a DHT and
three servers, 0:2, 2:4, 4:6 of a tiny LLaMA) and a client from each tree in turn, alternating which
goes first, so that load from elsewhere on this shared machine hits both. Client start-up is
`from_pretrained` until the first generated token (joining the DHT, reading and validating records,
pinging servers, routing, opening streams, prefill); per-token latency is each later decode step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BASELINE = "1a6834b"  # the last commit before records were signed and validated
SPANS = ["0:2", "2:4", "4:6"]


def worker(tree: Path, model_dir: Path, log_dir: Path, tokens: int, out: Path) -> None:
    """Runs inside `tree` (its modules first on sys.path): one swarm, one client, measured."""
    sys.path.insert(0, str(tree))
    import torch

    from benchmarks.serving.timing import TokenClock

    # a baseline from before the one import name has its folders at the top, and its local swarm in swarm/
    package = "llm_swarm." if (tree / "llm_swarm").is_dir() else ""
    server = importlib.import_module(f"{package}server")
    DistributedModelForCausalLM = importlib.import_module(
        f"{package}client.model"
    ).DistributedModelForCausalLM
    default_prefix = importlib.import_module(f"{package}swarm.dht_keys").default_prefix
    swarm_tools = "harness.local_swarm" if (tree / "harness").is_dir() else "swarm.local_swarm"
    LocalSwarm = importlib.import_module(swarm_tools).LocalSwarm

    assert Path(server.__file__).resolve().is_relative_to(tree.resolve()), server.__file__
    torch.set_num_threads(1)

    prompt = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
    swarm = LocalSwarm(log_dir)
    try:
        swarm.start_dht()
        names = [f"trust-{i}" for i in range(len(SPANS))]
        for name, span in zip(names, SPANS, strict=True):
            swarm.start_server(name, model_dir, span)
        swarm.wait_online(default_prefix(str(model_dir)), 6, names)
        started = time.perf_counter()
        model = DistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers)
        try:
            clock = TokenClock()
            model.generate(prompt, max_new_tokens=tokens, do_sample=False, streamer=clock)
            startup = clock.times[1] - started  # times[0] is the prompt, times[1] the first token
            steps = clock.intervals()
            clock = TokenClock()
            model.generate(prompt, max_new_tokens=tokens, do_sample=False, streamer=clock)
            steps += clock.intervals()
        finally:
            model.shutdown()
    finally:
        swarm.close()
    out.write_text(json.dumps({"startup": startup, "steps": steps}))


def run_tree(tree: Path, model_dir: Path, scratch: Path, tokens: int, label: str) -> dict:
    out = scratch / f"{label}.json"
    log_dir = scratch / label
    log_dir.mkdir()
    argv = [sys.executable, "-m", "benchmarks.serving.trust", "--worker", str(tree)]
    argv += [
        "--model-dir",
        str(model_dir),
        "--log-dir",
        str(log_dir),
        "--tokens",
        str(tokens),
        "--out",
        str(out),
    ]
    # the tree's packages first (the working directory), this benchmark's own from this checkout
    environment = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(argv, cwd=tree, env=environment, capture_output=True, text=True, timeout=900)
    if completed.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default=BASELINE, help="commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.model_dir, args.log_dir, args.tokens, args.out)
        return

    from tqdm import tqdm

    from benchmarks.serving.timing import percentile
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        model_dir = scratch / "bench-llama"
        build_tiny_model(model_dir, TinyModelSpec(family="llama", num_layers=6, num_kv_heads=2))
        baseline_tree = scratch / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(baseline_tree), args.baseline], cwd=REPO, check=True
        )
        results: dict[str, list[dict]] = {"baseline": [], "trust": []}
        try:
            trees = {"baseline": baseline_tree, "trust": REPO}
            with tqdm(total=2 * args.rounds, desc="swarms", unit="swarm") as progress:
                for round_index in range(args.rounds):
                    order = ["baseline", "trust"] if round_index % 2 == 0 else ["trust", "baseline"]
                    for name in order:
                        label = f"{name}-{round_index}"
                        results[name].append(run_tree(trees[name], model_dir, scratch, args.tokens, label))
                        progress.update()
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(baseline_tree)], cwd=REPO, check=False
            )

    rows, summary = [], {}
    for name in ("baseline", "trust"):
        startups = [run["startup"] for run in results[name]]
        steps = [step for run in results[name] for step in run["steps"]]
        summary[name] = (statistics.median(startups), statistics.median(steps), percentile(steps, 95))
        start, p50, p95 = summary[name]
        rows.append(f"| {name} | {start:.2f} | {p50 * 1e3:.2f} | {p95 * 1e3:.2f} |")
    ratio = [summary["trust"][i] / summary["baseline"][i] for i in range(3)]
    rows.append(f"| trust / baseline, pooled | {ratio[0]:.2f}x | {ratio[1]:.2f}x | {ratio[2]:.2f}x |")
    # each round measured both trees back to back: the median of those paired ratios is what load
    # from elsewhere on the machine disturbs least
    paired = [
        (
            trust["startup"] / base["startup"],
            statistics.median(trust["steps"]) / statistics.median(base["steps"]),
            percentile(trust["steps"], 95) / percentile(base["steps"], 95),
        )
        for base, trust in zip(results["baseline"], results["trust"], strict=True)
    ]
    for round_index, (start, p50, p95) in enumerate(paired):
        print(f"round {round_index}: start-up {start:.2f}x, per-token p50 {p50:.2f}x, p95 {p95:.2f}x")
    # the geometric mean: the second swarm of a round tends to run slower, and the order alternates
    means = [statistics.geometric_mean(values) for values in zip(*paired, strict=True)]
    rows.append(
        f"| trust / baseline, geometric mean of {len(paired)} paired rounds "
        f"| {means[0]:.2f}x | {means[1]:.2f}x | {means[2]:.2f}x |"
    )
    table = "\n".join(
        [
            "| tree | client start-up p50 (s) | per-token p50 (ms) | per-token p95 (ms) |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.write:
        from benchmarks.markdown import write_section

        header = "## What trust costs"
        command = (
            f".venv/bin/python -m benchmarks.serving.trust --baseline {args.baseline} --rounds {args.rounds} "
            f"--tokens {args.tokens} --write"
        )
        body = (
            f"{header}\n\nCommand: `{command}`\n\nThe commit before signed records (`{args.baseline}`, "
            "in a git worktree) against this tree, side by side: each round starts a DHT, three servers "
            "(0:2, 2:4, 4:6 of a tiny LLaMA-GQA, 6 blocks, hidden 64) and a client from each tree in turn, "
            f"alternating which goes first, on this shared 2-core machine; {args.rounds} rounds, "
            f"{2 * args.tokens} decode steps per client. Start-up is `from_pretrained` until the first "
            "generated token; per-token latency is each later decode step. Target: under 5% per-token "
            "overhead.\n\n"
            f"{table}\n"
        )
        write_section(header, body)


if __name__ == "__main__":
    main()
