"""What the OpenAI-compatible API costs: streaming clients through `swarm-api` against
calling `generate()` directly, at 1, 4 and 16 concurrent clients.

    .venv/bin/python -m benchmarks.serving.api [--levels 1,4,16] [--requests 3] [--tokens 32] [--write]

One swarm on loopback: a DHT and two servers (blocks 0:3 and 3:6 of a tiny LLaMA-GQA), a `swarm-api`
process, and this process as the client. At each level, N threads each run `--requests` greedy
generations of `--tokens` tokens one after another, first through the API (the `openai` package,
streaming) and then with `generate()` on a client model in this process (alternating which goes
first per round). Requests/s is of the whole level; TTFT is from sending a request to its first
token; time per output token is per request, after the first.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import openai
import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from benchmarks.common import parse_bench_args, publish_table, run_concurrently, serving_swarm
from benchmarks.serving.timing import TokenClock, percentile
from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

PROMPT = "Once upon a time there was"
SERVERS = {"first": "0:3", "second": "3:6"}


def run_level(clients: int, requests: int, one_request) -> tuple[float, list[float], list[float]]:
    """(requests/s, TTFTs, times per output token) of `clients` threads doing `requests` each."""
    ttfts, tpots = [], []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(requests):
            started = time.perf_counter()
            first, tokens, ended = one_request()
            with lock:
                ttfts.append(first - started)
                if tokens > 1:
                    tpots.append((ended - first) / (tokens - 1))

    seconds = run_concurrently([worker] * clients)
    return clients * requests / seconds, ttfts, tpots


def main() -> None:
    args = parse_bench_args(__doc__, levels="1,4,16", requests=3, tokens=32, rounds=2)
    levels = [int(level) for level in args.levels.split(",")]
    results: dict[tuple[str, int], list] = {}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "bench-llama"
        build_tiny_model(model_dir, TinyModelSpec(family="llama", num_layers=6, num_kv_heads=2))
        with serving_swarm(LocalSwarm(Path(scratch)), model_dir, SERVERS, 6) as swarm:
            prefix = default_prefix(str(model_dir))
            url = swarm.start_api("api", model_dir, "--max-concurrent", str(max(levels)))
            api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            prompt_ids = torch.tensor([tokenizer(PROMPT).input_ids])

            def through_api():
                first, tokens = None, 0
                stream = api.completions.create(
                    model=prefix, prompt=PROMPT, max_tokens=args.tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and first is None:
                        first = time.perf_counter()
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                return first or time.perf_counter(), tokens, time.perf_counter()

            def direct():
                clock = TokenClock()
                model.generate(prompt_ids, max_new_tokens=args.tokens, do_sample=False, streamer=clock)
                return clock.first, clock.tokens, time.perf_counter()

            try:
                run_level(1, 1, through_api)  # warm-up: connections, routes
                run_level(1, 1, direct)
                with tqdm(total=args.rounds * len(levels) * 2, desc="api vs generate()", unit="run") as bar:
                    for round_index in range(args.rounds):
                        for level in levels:
                            ways = [("api", through_api), ("generate", direct)]
                            for way, call in ways if round_index % 2 == 0 else ways[::-1]:
                                rate, ttfts, tpots = run_level(level, args.requests, call)
                                entry = results.setdefault((way, level), [[], [], []])
                                entry[0].append(rate)
                                entry[1] += ttfts
                                entry[2] += tpots
                                bar.update()
            finally:
                model.shutdown()

    lines = [
        "| clients | way | requests/s | TTFT p50 (ms) | TTFT p95 (ms) | per token p50 (ms) "
        "| per token vs generate() |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for level in levels:
        base_tpot = statistics.median(results[("generate", level)][2])
        for way in ("generate", "api"):
            rates, ttfts, tpots = results[(way, level)]
            tpot = statistics.median(tpots)
            lines.append(
                f"| {level} | {way} | {statistics.median(rates):.2f} | "
                f"{statistics.median(ttfts) * 1e3:.1f} | {percentile(ttfts, 95) * 1e3:.1f} | "
                f"{tpot * 1e3:.2f} | {tpot / base_tpot:.2f}x |"
            )
    publish_table(
        __file__,
        args,
        lines,
        "## The OpenAI-compatible API",
        "A DHT, two servers (0:3, 3:6) of a tiny LLaMA-GQA and a `swarm-api` process on loopback on this "
        "shared 2-core machine; the benchmark process is the client. At each level, N threads each run "
        f"{args.requests} greedy generations of {args.tokens} tokens in turn: through the API with the "
        "`openai` package (streaming), and with `generate()` on a client model in the benchmark process, "
        f"alternating which goes first over {args.rounds} rounds. The API's overhead is the HTTP hop, JSON "
        "chunks and incremental detokenization on top of the same client code.",
    )


if __name__ == "__main__":
    main()
