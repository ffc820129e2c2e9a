"""Chunked prefill over emulated internet links: how long a decoding session's tokens wait while long
prompts arrive at its server, and what chunking costs those prompts' time to first token.

One server holds all blocks of a tiny LLaMA; two clients sit at their own sites, `--rtt` ms from it.
The decoder generates `--decode-tokens` tokens in one session, first alone (`quiet`), then while the
prompter sends `--prompt-tokens`-token prompts one after another (`--prompt-pause` s apart), each a
one-token generation (its time is the prompt's time to first token). The server emulates a GPU with
`--compute-delay` (launch-bound: seconds per block per forward) and `--compute-delay-per-token`
(compute-bound: seconds per block per token); a forward costs the larger of the two per block
(`server/emulated_delay.py`). Each `--chunks` value is a server run with `--prefill-chunk` set to it
(0: whole prefills); rounds rotate the order so that load from elsewhere hits every setting.

    sudo .venv/bin/python -m benchmarks.serving.chunked_prefill [--chunks 0,256,512,1024] [--write]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    add_mig_slice_delays,
    add_report_options,
    measuring_parser,
    publish_table,
    run_measuring,
)

DECODER_PROMPT = [5, 17, 99, 200, 33, 41, 7]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- the measuring clients (each in its own site) --------------------------------------------------
def decoder(args: argparse.Namespace) -> None:
    """Two sessions of `--decode-tokens` greedy tokens: quiet, then (after telling the prompter to
    start) while prompts arrive. Writes each phase's gaps between consecutive tokens."""
    import torch

    from benchmarks.serving.timing import TokenClock
    from llm_swarm.client import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    work = Path(args.work)
    model = AutoDistributedModelForCausalLM.from_pretrained(args.model_dir, args.initial_peers)
    gaps = {}
    try:
        for phase in ("quiet", "busy"):
            if phase == "busy":
                (work / "go").touch()
                deadline = time.monotonic() + 60
                while not (work / "prompting").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(args.prompt_pause + 0.5)  # prompts are flowing
            clock = TokenClock()
            with model.inference_session(max_length=len(DECODER_PROMPT) + args.decode_tokens):
                model.generate(
                    torch.tensor([DECODER_PROMPT]),
                    max_new_tokens=args.decode_tokens,
                    do_sample=False,
                    streamer=clock,
                )
            tokens = clock.times[2:]  # from the second generated token on: decode steps only
            gaps[phase] = [later - earlier for earlier, later in zip(tokens, tokens[1:], strict=False)]
    finally:
        (work / "stop").touch()
        model.shutdown()
    (work / "decoder.json").write_text(json.dumps(gaps))


def prompter(args: argparse.Namespace) -> None:
    """Long prompts one after another while the decoder's busy phase runs; writes their times to
    first token (one warm-up prompt before it starts is not counted)."""
    import torch

    from llm_swarm.client import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    work = Path(args.work)
    rng = random.Random(0)
    model = AutoDistributedModelForCausalLM.from_pretrained(args.model_dir, args.initial_peers)
    first_token: list[float] = []
    try:
        while not (work / "go").exists():
            time.sleep(0.05)
        while not (work / "stop").exists():
            prompt = torch.tensor([[rng.randrange(3, 500) for _ in range(args.prompt_tokens)]])
            started = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, do_sample=False)
            first_token.append(time.perf_counter() - started)
            (work / "prompting").touch()
            time.sleep(args.prompt_pause)
    finally:
        model.shutdown()
    (work / "prompter.json").write_text(json.dumps(first_token[1:]))


# --- the emulated swarm --------------------------------------------------------------------------------
def run(args: argparse.Namespace, work: Path) -> list[dict]:
    from benchmarks.netem.emulator import Emulation
    from benchmarks.netem.scenario import equidistant_scenario
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    model_dir = build_tiny_model(
        work / "tiny-llama", TinyModelSpec(family="llama", num_layers=args.layers, num_kv_heads=2)
    )
    sites = ("decoder", "prompter", "server")
    scenario = equidistant_scenario("bench_chunked_prefill", sites, args.rtt, args.bandwidth)
    chunks = [int(value) for value in args.chunks.split(",")]
    rows = []
    with Emulation(scenario, work / "netem") as emulation:
        emulation.start_dht("decoder")
        for round_index in range(args.rounds):
            order = chunks if round_index % 2 == 0 else chunks[::-1]
            for chunk in order:
                name = f"server-{round_index}-{chunk}"
                extra = ("--compute-delay-per-token", repr(args.compute_delay_per_token))
                extra += ("--prefill-chunk", str(chunk), "--torch-threads", "1")
                emulation.start_server(
                    name, "server", model_dir, f"0:{args.layers}", "2GB", args.compute_delay, *extra
                )
                emulation.wait_online("decoder", model_dir, [name])
                run_dir = work / name
                run_dir.mkdir()
                common = [
                    "--model-dir", str(model_dir), "--initial-peers", *emulation.initial_peers,
                    "--work", str(run_dir), "--decode-tokens", str(args.decode_tokens),
                    "--prompt-tokens", str(args.prompt_tokens), "--prompt-pause", repr(args.prompt_pause),
                ]  # fmt: skip
                script = str(Path(__file__).resolve())
                processes = {
                    role: emulation.start(
                        f"{role}-{name}", role, [sys.executable, script, "measure", "--role", role, *common]
                    )
                    for role in ("prompter", "decoder")
                }
                while any(process.poll() is None for process in processes.values()):
                    emulation.check_alive(["dht", name])
                    time.sleep(0.5)
                for role, process in processes.items():
                    if process.returncode != 0:
                        raise SystemExit(f"the {role} failed:\n{emulation.log(f'{role}-{name}')[-3000:]}")
                emulation.stop(name)
                gaps = json.loads((run_dir / "decoder.json").read_text())
                first_token = json.loads((run_dir / "prompter.json").read_text())
                rows.append({"chunk": chunk, "round": round_index, **gaps, "first_token": first_token})
                quiet_p99, busy_p99 = percentile(gaps["quiet"], 0.99), percentile(gaps["busy"], 0.99)
                ttft = statistics.median(first_token)
                print(
                    f"round {round_index}, chunk {chunk}: quiet p99 {quiet_p99 * 1e3:.0f} ms, busy p99 "
                    f"{busy_p99 * 1e3:.0f} ms, TTFT p50 {ttft * 1e3:.0f} ms, {len(first_token)} prompts",
                    flush=True,
                )
    return rows


def table(rows: list[dict]) -> list[str]:
    chunks = sorted({row["chunk"] for row in rows})

    def pooled(chunk: int, key: str) -> list[float]:
        return [value for row in rows if row["chunk"] == chunk for value in row[key]]

    quiet_p99 = percentile([value for row in rows for value in row["quiet"]], 0.99)
    unchunked_ttft = statistics.median(pooled(0, "first_token")) if 0 in chunks else None
    lines = [
        "| --prefill-chunk | gap p50, quiet (ms) | gap p99, quiet (ms) | gap p50, prompts arriving (ms) "
        "| gap p99, prompts arriving (ms) | p99 / quiet p99 | prompt's first token p50 (ms) | vs unchunked |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for chunk in chunks:
        quiet, busy, ttft = pooled(chunk, "quiet"), pooled(chunk, "busy"), pooled(chunk, "first_token")
        ratio = f"{statistics.median(ttft) / unchunked_ttft:.2f}x" if unchunked_ttft else "-"
        lines.append(
            f"| {chunk or 'off (whole prefills)'} | {statistics.median(quiet) * 1e3:.0f} "
            f"| {percentile(quiet, 0.99) * 1e3:.0f} | {statistics.median(busy) * 1e3:.0f} "
            f"| {percentile(busy, 0.99) * 1e3:.0f} | {percentile(busy, 0.99) / quiet_p99:.2f}x "
            f"| {statistics.median(ttft) * 1e3:.0f} | {ratio} |"
        )
    counts = {chunk: (len(pooled(chunk, "busy")), len(pooled(chunk, "first_token"))) for chunk in chunks}
    lines.append(
        f"\nThe quiet p99 all ratios use: {quiet_p99 * 1e3:.0f} ms (every setting's quiet gaps pooled; "
        "without prompts, chunking changes nothing). Samples (decode gaps with prompts, prompts): "
        + ", ".join(f"{chunk or 'off'}: {gaps}, {prompts}" for chunk, (gaps, prompts) in counts.items())
        + "."
    )
    return lines


def shared_options(options: argparse.ArgumentParser) -> None:
    """The options the benchmark passes on to its measuring client."""
    options.add_argument("--decode-tokens", type=int, default=150, help="tokens per decoding session")
    options.add_argument("--prompt-tokens", type=int, default=2000, help="tokens of each long prompt")
    options.add_argument("--prompt-pause", type=float, default=0.3, help="seconds between prompts")


def main() -> None:
    parser = measuring_parser(__doc__, "--model-dir", "--work", "--role", shared=shared_options)
    parser.add_argument("--chunks", default="0,256,512,1024", help="--prefill-chunk values (0: off)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4, help="blocks of the tiny model (all on the server)")
    parser.add_argument("--rtt", type=float, default=50.0, help="ms between each client and the server")
    parser.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s of each link")
    add_mig_slice_delays(parser)
    add_report_options(parser)
    run_measuring(parser, measure, benchmark)


def measure(args: argparse.Namespace) -> None:
    """The measuring client of `--role`: the decoder or the prompter."""
    logging.basicConfig(level=logging.WARNING)
    (decoder if args.role == "decoder" else prompter)(args)


def benchmark(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-chunked-") as work:
        rows = run(args, Path(work))
    prefill_ms = (
        args.layers * max(args.compute_delay, args.compute_delay_per_token * args.prompt_tokens) * 1e3
    )
    text = (
        f"netem: a decoding client and a prompting client, each {args.rtt:.0f} ms (round trip) from one "
        f"server, {args.bandwidth:.0f} Mbit/s; the server holds all {args.layers} blocks of a tiny LLaMA "
        f"and charges each forward max({args.compute_delay * 1e3:g} ms, "
        f"{args.compute_delay_per_token * 1e6:g} us "
        "x tokens) per block: each block stands for 4 blocks of LLaMA-2-7B on Sun, He and Hou's MIG 3g.40gb "
        "slice (1 ms launch overhead, 3.4 us per prompt token per block, the simulator's profile), so the "
        f"server is a 16-block span and a {args.prompt_tokens}-token prefill costs about "
        f"{prefill_ms:.0f} ms "
        "of emulated compute (plus the CPU's own, about 11 ms per block for 2,000 tokens). The decoder "
        f"generates {args.decode_tokens} greedy tokens alone, then again while the prompter sends "
        f"{args.prompt_tokens}-token prompts {args.prompt_pause:g} s apart (one-token generations: time to "
        f"first token). {args.rounds} rounds, the settings' order rotating; gaps are between consecutive "
        "decode tokens as the decoder's `generate` streams them. Targets: p99 with prompts at "
        "most 1.3x the p99 without; the prompts' first token at most 1.1x unchunked."
    )
    publish_table(
        __file__,
        args,
        table(rows),
        "## Chunked prefill against decoding, over emulated links",
        text,
    )


if __name__ == "__main__":
    main()
