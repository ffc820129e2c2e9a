"""Server throughput and per-token latency with many concurrent sessions, batching on vs off.

Two real server processes serve all blocks of a tiny-but-not-trivial LLaMA (hidden 512, 8 blocks,
built by `swarm-make-tiny-model`), one with batching off (`--batch-wait-ms 0`) and one with it on;
each concurrency level runs against one and then the other, so that load from elsewhere on a shared
machine hits both alike. One client process drives N concurrent sessions through the
real client stream code (`client.stream.ServerStream`: hivemind P2P, wire encoding, validation,
the server's handler and engine). Each of the N slots runs `--sessions-per-slot` sessions back to
back: open, a prefill of 8..32 tokens, `--tokens` single-token decode steps, close, so prefills of
new sessions keep arriving while others decode. Clients send random hidden states (the embeddings
and LM head are client-side and cost the server nothing), which keeps the client process cheap.

    .venv/bin/python -m benchmarks.serving.batching [--sessions 1,4,16,64] [--tokens 64] [--repeats 2] \\
        [--write]

Prints decode throughput (generated tokens per second over the whole run) and per-token p50/p95
latency for each concurrency with batching off and on, and their ratios;
`--write` puts the table into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.markdown import write_section
from harness.local_swarm import LocalSwarm
from llm_swarm.client.connection import ClientOptions, SwarmConnection, run_sync
from llm_swarm.client.stream import ServerStream, StepInput
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.route_request import (
    RouteHop,
    SessionShape,
)

HEADER = "## Batching concurrent sessions on one server"
GPU_HEADER = "## Batching concurrent sessions on one server, on a GPU"


@dataclass
class Level:
    sessions: int
    wall: float = 0.0
    decode: list[float] = field(default_factory=list)  # seconds per decode step, as the client saw it
    prefill: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return len(self.decode) / self.wall

    def p(self, q: float) -> float:
        return percentile(self.decode, q)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run_session(
    connection: SwarmConnection,
    peer: str,
    args: argparse.Namespace,
    rng: random.Random,
    level: Level,
) -> None:
    prompt = rng.randint(8, 32)
    shape = SessionShape(batch_size=1, max_length=prompt + args.tokens, l_in=prompt, l_out=args.tokens)
    stream = ServerStream(RouteHop(peer, 0, args.layers), uuid.uuid4().hex, shape)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    await stream.open(connection)
    try:
        started = time.perf_counter()
        await stream.step(StepInput(torch.randn(1, prompt, args.hidden, generator=generator), 0), 60.0)
        level.prefill.append(time.perf_counter() - started)
        for position in range(prompt, prompt + args.tokens):
            hidden = torch.randn(1, 1, args.hidden, generator=generator)
            started = time.perf_counter()
            await stream.step(StepInput(hidden, position), 60.0)
            level.decode.append(time.perf_counter() - started)
    finally:
        await stream.close_and_wait(10.0)


async def run_level(connection: SwarmConnection, peer: str, sessions: int, args: argparse.Namespace) -> Level:
    level = Level(sessions)
    rng = random.Random(sessions)

    async def slot() -> None:
        for _ in range(args.sessions_per_slot):
            await run_session(connection, peer, args, rng, level)

    started = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(sessions)))
    level.wall = time.perf_counter() - started
    return level


MODES = {"off": 0.0, "on": None}  # batch wait of each server; None: --batch-wait-ms


def measure(model_dir: Path, log_dir: Path, args: argparse.Namespace) -> tuple[dict[str, list[Level]], str]:
    """Both servers run side by side and the levels alternate between them, so that other load on
    this shared machine falls on both modes alike instead of on whichever ran second."""
    swarm = LocalSwarm(log_dir)
    connection = None
    results: dict[str, list[Level]] = {name: [] for name in args.modes}
    try:
        swarm.start_dht()
        for name in args.modes:
            wait = MODES[name] if MODES[name] is not None else args.batch_wait_ms
            swarm.start_server(
                name, model_dir, f"0:{args.layers}", args.memory, "--batch-wait-ms", str(wait),
                "--device", args.device, "--dtype", args.dtype,
            )  # fmt: skip
        prefix = default_prefix(str(model_dir))
        swarm.wait_online(prefix, args.layers, list(args.modes))
        options = ClientOptions(use_scheduler=False)
        connection = SwarmConnection(swarm.initial_peers, prefix, args.layers, options)
        servers = run_sync(connection.roster.servers(refresh=True))
        peers = {info.public_name: peer for peer, info in servers.items()}
        warm = argparse.Namespace(**{**vars(args), "tokens": 4, "sessions_per_slot": 1})
        for name in args.modes:  # connections, allocator, the engine's cost fits
            run_sync(run_level(connection, peers[name], 2, warm))
        for sessions in args.sessions:
            rounds = {name: Level(sessions) for name in args.modes}
            for repeat in range(args.repeats):
                order = list(args.modes) if repeat % 2 == 0 else list(reversed(args.modes))
                for name in order:
                    level = run_sync(run_level(connection, peers[name], sessions, args))
                    rounds[name].wall += level.wall
                    rounds[name].decode += level.decode
                    rounds[name].prefill += level.prefill
            for name, level in rounds.items():
                print(
                    f"batching {name:3s}, {sessions:3d} sessions: {level.throughput:8.1f} tok/s, "
                    f"p50 {level.p(50) * 1e3:7.2f} ms, p95 {level.p(95) * 1e3:7.2f} ms",
                    flush=True,
                )
                results[name].append(level)
    except Exception:
        print(swarm.log_tails(), file=sys.stderr)
        raise
    finally:
        if connection is not None:
            connection.shutdown()
        swarm.close()
    engine = re.findall(r"batching engine: (.*)", swarm.log("on")) if "on" in args.modes else []
    if engine:
        print(f"server engine (batching on): {engine[-1]}", flush=True)
    return results, engine[-1] if engine else ""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", default="1,4,16,64", help="concurrency levels, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps per session")
    parser.add_argument("--sessions-per-slot", type=int, default=2, help="sessions each slot runs in turn")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--batch-wait-ms", type=float, default=2.0, help="the server's window with batching on"
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2x hidden)")
    parser.add_argument("--init-range", type=float, default=0.1, help="0.02 keeps real-size fp16 finite")
    parser.add_argument("--device", default="cpu", help="the servers' device: cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--memory", default="2GB", help="each server's memory budget")
    parser.add_argument("--modes", default="off,on", help="which servers to measure (both for the table)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds per level, alternating which server goes first"
    )
    parser.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md")
    args = parser.parse_args()
    args.sessions = [int(n) for n in args.sessions.split(",")]
    args.modes = [name for name in args.modes.split(",") if name in MODES]
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "bench-llama"
        subprocess.run(
            [
                sys.executable, "-m", "llm_swarm.swarm.models.tiny", str(model_dir), "--family", "llama",
                "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
                "--kv-heads", str(args.kv_heads), "--dtype", args.dtype, "--init-range", str(args.init_range),
                *(["--intermediate", str(args.intermediate)] if args.intermediate else []),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        log_dir = Path(scratch) / "logs"
        log_dir.mkdir()
        results, engine = measure(model_dir, log_dir, args)

    if len(results) < 2:
        return
    off, on = results["off"], results["on"]
    lines = [
        "| sessions | off: tok/s | off: p50 (ms) | off: p95 (ms) | on: tok/s | on: p50 (ms) | on: p95 (ms) "
        "| throughput on/off | p95 on/off | prefill p50 off / on (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(off, on, strict=True):
        lines.append(
            f"| {a.sessions} | {a.throughput:.0f} | {a.p(50) * 1e3:.2f} | {a.p(95) * 1e3:.2f} "
            f"| {b.throughput:.0f} | {b.p(50) * 1e3:.2f} | {b.p(95) * 1e3:.2f} "
            f"| {b.throughput / a.throughput:.2f}x | {b.p(95) / a.p(95):.2f} "
            f"| {statistics.median(a.prefill) * 1e3:.1f} / {statistics.median(b.prefill) * 1e3:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_batching_section(table, engine, args)


def write_batching_section(table: str, engine: str, args: argparse.Namespace) -> None:
    sessions = ",".join(str(n) for n in args.sessions)
    on_gpu = args.device != "cpu"
    command = (
        f".venv/bin/python -m benchmarks.serving.batching --sessions {sessions} --tokens {args.tokens} "
        f"--sessions-per-slot {args.sessions_per_slot} --hidden {args.hidden} --layers {args.layers} "
        f"--heads {args.heads} --kv-heads {args.kv_heads} "
        + (f"--intermediate {args.intermediate} " if args.intermediate else "")
        + (
            f"--device {args.device} --dtype {args.dtype} --memory {args.memory} "
            f"--init-range {args.init_range:g} "
            if on_gpu
            else ""
        )
        + f"--batch-wait-ms {args.batch_wait_ms:g} --repeats {args.repeats} --write"
    )
    wait = f"{args.batch_wait_ms:g}"
    servers_run = (
        f"on one {torch.cuda.get_device_name(torch.device(args.device))}"
        if on_gpu
        else "(`--torch-threads 1`)"
    )
    where = (
        f"{'' if on_gpu else 'Tiny '}LLaMA-GQA ({args.layers} blocks, hidden {args.hidden}, {args.heads} "
        f"heads, {args.kv_heads} KV heads, {args.dtype}) built by `swarm-make-tiny-model`; two server "
        f"processes with all blocks {servers_run}, one with batching off and one with it on, side by "
        f"side, and one client process, all on loopback{'' if on_gpu else ' on this shared 2-core machine'}. "
    )
    setup = where + (
        f"Each level runs on one server, then on the other "
        f"(alternating which goes first over {args.repeats} round(s)), so that load from elsewhere "
        f"hits both. N concurrent slots each run {args.sessions_per_slot} sessions in turn (prefill "
        f"of 8..32 tokens, then {args.tokens} decode steps) through the real client stream code. "
        "`off` is `--batch-wait-ms 0` (every step its own forward); `on` is "
        f"`--batch-wait-ms {wait}` (decode steps of concurrent sessions run as one batched forward; "
        "prefills scheduled against decoding by Pang et al.'s rule). Throughput is decode tokens per "
        "second of the whole run (prefills included in the time); latencies are per decode step as "
        "the client sees them; the last column is the time to first token. Target: >= 3x throughput "
        "at 16 sessions, p95 no worse."
    )
    header = GPU_HEADER if on_gpu else HEADER
    body = (
        f"{header}\n\nCommand: `{command}`\n\n{setup}\n\n{table}\n\n"
        f"Server engine counters for the `on` server: {engine}\n"
    )
    write_section(header, body)


if __name__ == "__main__":
    main()
