"""Opening a session through a chain of servers over emulated links: one server after another (as the
client did before 2026-11-26) against all at once (as it does now), side by side in one run.

A LLaMA of 6 blocks (hidden 64) served by three servers in three sites, blocks 0:2, 2:4 and 4:6; the
client (with the DHT) in its own site, `--rtt-ms` from each server. The measuring client routes once,
then, `--repeats` times and alternating which goes first, opens a stream on every server of that chain
(`client.stream.ServerStream.open`: the server reserves the session's cache and answers) either one
after another or all at once, and closes them. Then it times a fresh read of the servers' records
from the DHT, sessions opened through the client's API (routing on its own, then with a
`swarm-scheduler` in the client's site) and whole requests (route, open, a 16-token prompt, 4 new
tokens); each output equals local transformers.

    sudo .venv/bin/python -m benchmarks.serving.session_open [--rtt-ms 100] [--repeats 10] [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    add_report_options,
    measuring_parser,
    publish_table,
    run_emulated,
    run_measuring,
    run_measuring_client,
)

LAYERS = 6
SPANS = ("0:2", "2:4", "4:6")
PROMPT_TOKENS, NEW_TOKENS = 16, 4
HEADER = "## Opening a session through a chain, over emulated links"


# --- the measuring client (runs in the client's site) ---------------------------------------------------
def measure(args: argparse.Namespace) -> None:
    import asyncio
    import uuid

    import torch
    from transformers import AutoModelForCausalLM

    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
    from llm_swarm.client.connection import run_sync
    from llm_swarm.client.stream import ServerStream
    from llm_swarm.swarm.route_request import SessionShape

    torch.set_num_threads(1)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model_dir, args.initial_peers, options=ClientOptions(request_timeout=60.0)
    )
    routed = AutoDistributedModelForCausalLM.from_pretrained(
        args.model_dir,
        args.initial_peers,
        options=ClientOptions(request_timeout=60.0, scheduler_key=args.scheduler_key, use_scheduler=True),
    )
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    connection = model.backend.connection
    shape = SessionShape(batch_size=1, max_length=64, l_in=PROMPT_TOKENS, l_out=NEW_TOKENS)
    chain = run_sync(connection.chains.route(0, LAYERS, shape))

    async def one_after_another(streams: list[ServerStream]) -> None:
        for stream in streams:
            await stream.open(connection)

    async def all_at_once(streams: list[ServerStream]) -> None:
        await asyncio.gather(*(stream.open(connection) for stream in streams))

    async def close(streams: list[ServerStream]) -> None:
        await asyncio.gather(*(stream.close_and_wait(timeout=5.0) for stream in streams))

    opens: dict[str, list[float]] = {"one after another": [], "all at once": []}
    ways = {"one after another": one_after_another, "all at once": all_at_once}
    try:
        for repeat in range(args.repeats):
            order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
            for name in order:
                streams = [ServerStream(hop, uuid.uuid4().hex, shape) for hop in chain]
                started = time.perf_counter()
                run_sync(ways[name](streams))
                opens[name].append(time.perf_counter() - started)
                run_sync(close(streams))
        refreshes = []  # a fresh read of the servers' records from the DHT
        for _ in range(args.repeats):
            started = time.perf_counter()
            run_sync(connection.roster.servers(refresh=True))
            refreshes.append(time.perf_counter() - started)
        scheduled = []  # sessions the scheduler routes: route, admission, opening
        for repeat in range(args.repeats + 1):
            started = time.perf_counter()
            session = routed.open_session(PROMPT_TOKENS + NEW_TOKENS, prompt_tokens=PROMPT_TOKENS)
            elapsed = time.perf_counter() - started
            if getattr(session.blocks, "admission", None) is None:
                raise SystemExit("the scheduler did not route the session")
            session.close()
            if repeat:  # the first also found the scheduler
                scheduled.append(elapsed)
        requests, sessions, wrong = [], [], 0
        for repeat in range(args.repeats):
            seed = torch.Generator().manual_seed(repeat)
            prompt = torch.randint(4, 100, (1, PROMPT_TOKENS), generator=seed)
            started = time.perf_counter()
            session = model.open_session(PROMPT_TOKENS + NEW_TOKENS, prompt_tokens=PROMPT_TOKENS)
            sessions.append(time.perf_counter() - started)
            try:
                output = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, session=session)
            finally:
                session.close()
            requests.append(time.perf_counter() - started)
            expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            wrong += not torch.equal(output, expected)
    finally:
        model.shutdown()
        routed.shutdown()
    result = {
        "opens": opens,
        "sessions": sessions,
        "refreshes": refreshes,
        "scheduled": scheduled,
        "requests": requests,
        "wrong": wrong,
        "hops": len(chain),
    }
    Path(args.out).write_text(json.dumps(result))


# --- the emulated swarm -----------------------------------------------------------------------------------
def scenario(args: argparse.Namespace):
    from benchmarks.netem.scenario import parse_scenario

    return parse_scenario(
        {
            "name": "bench_session_open",
            "links": {"between_groups": {"rtt_ms": args.rtt_ms, "bandwidth_mbit": 100}},
            "sites": [
                {"name": "client", "group": "client", "processes": [{"role": "dht", "name": "dht"}]},
                *({"name": f"s{j}", "group": f"s{j}"} for j in range(len(SPANS))),
            ],
        },
        "bench_session_open",
    )


def run(args: argparse.Namespace, work: Path) -> dict:
    from benchmarks.netem.emulator import Emulation
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(family="llama", num_layers=LAYERS, hidden_size=64, num_heads=4, num_kv_heads=2)
    model_dir = build_tiny_model(work / "llama-64", spec)
    with Emulation(scenario(args), work / "netem") as emulation:
        emulation.start_dht("client")
        names = []
        for j, span in enumerate(SPANS):
            emulation.start_server(f"server{j}", f"s{j}", model_dir, span, "1GB", 0.0)
            names.append(f"server{j}")
        emulation.wait_online("client", model_dir, names)
        emulation.start_scheduler(
            "client", model_dir, "--policy", "cg-bp", "--period", "3600", "--roster-read-period", "0.5",
            "--full-pass", "2",
        )  # fmt: skip
        out = work / "open.json"
        argv = [
            sys.executable, str(Path(__file__).resolve()), "measure", "--model-dir", str(model_dir),
            "--initial-peers", *emulation.initial_peers, "--out", str(out),
            "--repeats", str(args.repeats), "--scheduler-key", emulation.scheduler_key,
        ]  # fmt: skip
        return run_measuring_client(emulation, argv, out)


def table(result: dict, rtt_ms: float) -> list[str]:
    rtt = rtt_ms / 1e3
    opens = {name: statistics.median(times) for name, times in result["opens"].items()}
    lines = [
        "| opening the chain's streams | p50 (ms) | max (ms) | round trips (p50 / RTT) |",
        "|---|---:|---:|---:|",
    ]
    for name, times in result["opens"].items():
        lines.append(
            f"| {name} | {opens[name] * 1e3:.0f} | {max(times) * 1e3:.0f} | {opens[name] / rtt:.2f} |"
        )
    ratio = opens["one after another"] / opens["all at once"]
    requests, sessions = statistics.median(result["requests"]), statistics.median(result["sessions"])
    refreshes = statistics.median(result["refreshes"])
    scheduled = statistics.median(result["scheduled"])
    lines += [
        "",
        f"- {result['hops']} hops: one after another / all at once = {ratio:.2f}x",
        f"- a session opened through the client's API (routing, with its servers' round trips measured "
        f"before, and opening): p50 {sessions * 1e3:.0f} ms = {sessions / rtt:.2f} round trips",
        f"- a fresh read of the servers' records from the DHT: p50 {refreshes * 1e3:.0f} ms = "
        f"{refreshes / rtt:.2f} round trips",
        f"- a session the scheduler routes (its route and admission, in the client's site, then the "
        f"opening): p50 {scheduled * 1e3:.0f} ms = {scheduled / rtt:.2f} round trips",
        f"- whole requests through the client's API (route, open, {PROMPT_TOKENS}-token prompt, "
        f"{NEW_TOKENS} new tokens): p50 {requests * 1e3:.0f} ms = {requests / rtt:.1f} round trips; "
        f"outputs differing from local transformers: {result['wrong']} of {len(result['requests'])}",
    ]
    return lines


def shared_options(options: argparse.ArgumentParser) -> None:
    """The options the benchmark passes on to its measuring client."""
    options.add_argument("--repeats", type=int, default=10, help="opens of each kind (and requests)")


def main() -> None:
    parser = measuring_parser(__doc__, "--model-dir", "--out", "--scheduler-key", shared=shared_options)
    parser.add_argument("--rtt-ms", type=float, default=100.0, help="between the client and each server")
    add_report_options(parser, keep_logs=True)
    run_measuring(parser, measure, benchmark)


def benchmark(args: argparse.Namespace) -> None:
    result = run_emulated("bench-open-", args.keep_logs, lambda work: run(args, work))
    text = (
        f"netem: three servers in three sites (blocks 0:2, 2:4, 4:6 of a 6-block LLaMA, hidden 64), the "
        f"client {args.rtt_ms:.0f} ms (round trip) and 100 Mbit/s from each. Opening a stream: the server "
        "reserves the session's cache and answers. Both ways of opening run on the same chain in one run, "
        f"{args.repeats} times each, alternating which goes first."
    )
    options = argparse.Namespace(rtt_ms=args.rtt_ms, repeats=args.repeats, write=args.write)
    publish_table(__file__, options, table(result, args.rtt_ms), HEADER, text)


if __name__ == "__main__":
    main()
