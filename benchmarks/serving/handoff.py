"""A server drains with a long session open: its cache handed to the replacement, or rebuilt there by
replay, over emulated links; and which one the client chooses by itself.

A LLaMA of LLaMA-2's attention layout at small scale (6 blocks, hidden 512, 8 KV heads: a float32
cache of 24 KB per token over the span, against 2 KB of hidden states) is served whole by server A
(site s0, 20 ms from the client). After `--history` generated tokens, a target server for the same
blocks joins, either in A's site ("near": 1 Gbit/s, 2 ms between them) or in another one ("far":
20 Mbit/s, 40 ms), both 60 ms from the client; then A gets SIGTERM and drains. The client's next
tokens move the session: `handoff=never` replays (one catch-up prefill: the client uploads the hidden
states, the target recomputes the cache), `always` hands the cache off A -> target, `auto` decides
(client/handoff_cost.py; an unmeasured link is tried with the replay's estimate as the limit, which A
enforces from the target's acknowledgements). Servers emulate a GPU: `--compute-delay-per-token`
seconds per block per token of a step (prefill cost), at least `--compute-delay` per step. Timed: the
two tokens across the move, against two tokens before it. Every output equals local transformers.

    sudo .venv/bin/python -m benchmarks.serving.handoff [--history 500] [--write]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

from benchmarks.common import (
    LogLines,
    add_report_options,
    measuring_parser,
    publish_table,
    run_emulated,
    run_measuring,
)

LAYERS = 6
PROMPT = [5, 17, 99, 200, 33, 41, 7]
CASES = ("near", "far")
MODES = ("never", "always", "auto")
MOVED = re.compile(r"by (hand-off|replay) in (\d+) ms")


# --- the measuring client (runs in the client's site) ---------------------------------------------------
def _wait_file(path: Path, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing came at {path}")
        time.sleep(0.1)
    return json.loads(path.read_text())


def _wait_until_leaving(connection, peer: str, timeout: float = 60.0) -> None:
    """Until the server's record says it left ONLINE (it then marks its answers: the next step moves)."""
    from llm_swarm.client.connection import run_sync
    from llm_swarm.swarm.server_info import ServerState

    deadline = time.monotonic() + timeout
    while (
        info := run_sync(connection.roster.servers(refresh=True)).get(peer)
    ) and info.state == ServerState.ONLINE:
        if time.monotonic() > deadline:
            raise SystemExit(f"server {peer} still ONLINE {timeout:.0f} s after SIGTERM")
        time.sleep(0.2)


def measure(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    moves = LogLines()
    logging.getLogger("llm_swarm.client.remote").addHandler(moves)
    work, history = Path(args.work), int(args.history)
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    reference.generation_config.eos_token_id = None  # a random model may say EOS: generate on
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=history + 4, do_sample=False)
    options = ClientOptions(request_timeout=120.0, uplink_mbps=float(args.uplink))
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model_dir, args.initial_peers, options=options
    )
    model.generation_config.eos_token_id = None
    rows = []
    try:
        for index, (case, mode) in enumerate(_runs(args)):
            order = _wait_file(work / f"go-{index}.json")
            options.handoff = mode
            with model.inference_session(max_length=len(PROMPT) + history + 4) as session:
                sequence = model.generate(torch.tensor([PROMPT]), max_new_tokens=history, do_sample=False)
                started = time.perf_counter()
                sequence = model.generate(sequence, max_new_tokens=2, do_sample=False)
                normal = time.perf_counter() - started
                (work / f"ready-{index}.json").write_text("{}")
                _wait_file(work / f"target-{index}.json")
                serving = session.blocks.streams[0].hop.peer_id
                os.kill(order["victim"], signal.SIGTERM)
                _wait_until_leaving(model.backend.connection, serving)
                before = len(moves.lines)
                started = time.perf_counter()
                sequence = model.generate(sequence, max_new_tokens=2, do_sample=False)
                across = time.perf_counter() - started
                if not torch.equal(sequence[0], expected[0, : sequence.shape[1]]):
                    raise SystemExit(f"{case}/{mode}: the output differs from transformers")
                found = [MOVED.search(line) for line in moves.lines[before:] if MOVED.search(line)]
                how, move_ms = found[-1].groups() if found else ("?", "0")
            rows.append(
                {
                    "case": case,
                    "mode": mode,
                    "normal": normal,
                    "across": across,
                    "how": how,
                    "move": int(move_ms) / 1e3,
                }
            )
            print(
                f"{case}/{mode}: {how} {move_ms} ms; 2 tokens {across * 1e3:.0f} ms "
                f"({normal * 1e3:.0f} ms normal)"
            )
            (work / f"done-{index}.json").write_text("{}")
    finally:
        model.shutdown()
    Path(args.out).write_text(json.dumps(rows))


def _runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [(case, mode) for case in args.cases.split(",") for mode in args.modes.split(",")]


# --- the emulated swarm -----------------------------------------------------------------------------------
def scenario(args: argparse.Namespace):
    from benchmarks.netem.scenario import parse_scenario

    client_link = {"rtt_ms": 60, "bandwidth_mbit": args.uplink}
    return parse_scenario(
        {
            "name": "bench_handoff",
            "links": {
                "between_groups": client_link,
                "pairs": [
                    {"sites": ["client", "s0"], "rtt_ms": 20, "bandwidth_mbit": args.uplink},
                    {"sites": ["s0", "near"], "rtt_ms": 2, "bandwidth_mbit": 1000},
                    {"sites": ["s0", "far"], "rtt_ms": 40, "bandwidth_mbit": 20},
                ],
            },
            "sites": [
                {"name": "client", "group": "client", "processes": [{"role": "dht", "name": "dht"}]},
                {"name": "s0", "group": "s0"},
                {"name": "near", "group": "near"},
                {"name": "far", "group": "far"},
            ],
        },
        "bench_handoff",
    )


def run(args: argparse.Namespace, work: Path) -> list[dict]:
    from benchmarks.netem.emulator import Emulation
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(family="llama", num_layers=LAYERS, hidden_size=512, num_heads=8, num_kv_heads=8)
    model_dir = build_tiny_model(work / "llama-512", spec)
    delays = ("--compute-delay-per-token", repr(args.compute_delay_per_token), "--drain-timeout", "120")
    blocks = f"0:{LAYERS}"
    with Emulation(scenario(args), work / "netem") as emulation:
        emulation.start_dht("client")
        out = work / "handoff.json"
        argv = [
            sys.executable, str(Path(__file__).resolve()), "measure", "--model-dir", str(model_dir),
            "--initial-peers", *emulation.initial_peers, "--out", str(out), "--work", str(work),
            "--history", str(args.history), "--uplink", str(args.uplink), "--cases", args.cases,
            "--modes", args.modes,
        ]  # fmt: skip
        client = None
        for index, (case, _mode) in enumerate(_runs(args)):
            victim = emulation.start_server(
                f"a{index}", "s0", model_dir, blocks, "2GB", args.compute_delay, *delays
            )
            emulation.wait_online("client", model_dir, [f"a{index}"])
            (work / f"go-{index}.json").write_text(json.dumps({"victim": victim.pid}))
            if client is None:
                client = emulation.start("measure", "client", argv)
            _wait_file(work / f"ready-{index}.json")
            emulation.start_server(f"t{index}", case, model_dir, blocks, "2GB", args.compute_delay, *delays)
            emulation.wait_online("client", model_dir, [f"t{index}"])
            (work / f"target-{index}.json").write_text("{}")
            while not (work / f"done-{index}.json").exists():
                if client.poll() is not None:
                    raise SystemExit(f"the measuring client failed:\n{emulation.log('measure')[-3000:]}")
                time.sleep(0.5)
            emulation.stop_many([f"a{index}", f"t{index}"])
            for name in (f"a{index}", f"t{index}"):  # done with: their exit codes are no news
                emulation.processes.pop(name)
        client.wait(60)
        if client.returncode != 0:
            raise SystemExit(f"the measuring client failed:\n{emulation.log('measure')[-3000:]}")
        return json.loads(out.read_text())


def table(rows: list[dict]) -> list[str]:
    if {(row["case"], row["mode"]) for row in rows} != {(case, mode) for case in CASES for mode in MODES}:
        return [
            f"| {row['case']} | {row['mode']} | {row['how']} | {row['move'] * 1e3:.0f} ms |" for row in rows
        ]
    lines = [
        "| servers | replay (`never`) | hand-off (`always`) | `auto` chose | faster |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        cells = {row["mode"]: row for row in rows if row["case"] == case}

        def cell(mode: str, cells: dict = cells) -> str:
            row = cells[mode]
            return f"{row['move'] * 1e3:.0f} ms move, 2 tokens {row['across'] / row['normal']:.1f}x"

        faster = "hand-off" if cells["always"]["move"] < cells["never"]["move"] else "replay"
        auto = cells["auto"]
        chose = f"{auto['how']} ({auto['move'] * 1e3:.0f} ms)"
        where = "one site, 1 Gbit/s, 2 ms" if case == "near" else "two sites, 20 Mbit/s, 40 ms"
        lines.append(f"| {where} | {cell('never')} | {cell('always')} | {chose} | {faster} |")
    return lines


def shared_options(options: argparse.ArgumentParser) -> None:
    """The options the benchmark passes on to its measuring client."""
    options.add_argument("--history", default="500", help="tokens generated before the drain")
    options.add_argument("--uplink", default="50", help="Mbit/s of the client's links")
    options.add_argument("--cases", default=",".join(CASES), help="where the target is: near, far")
    options.add_argument("--modes", default=",".join(MODES), help="ClientOptions.handoff values")


def main() -> None:
    parser = measuring_parser(__doc__, "--model-dir", "--out", "--work", shared=shared_options)
    parser.add_argument("--compute-delay", type=float, default=0.001, help="seconds per block per step")
    parser.add_argument(
        "--compute-delay-per-token", type=float, default=0.0005, help="seconds per block per token of a step"
    )
    add_report_options(parser, keep_logs=True)
    run_measuring(parser, measure, benchmark)


def benchmark(args: argparse.Namespace) -> None:
    args.uplink = float(args.uplink)
    rows = run_emulated("bench-handoff-", args.keep_logs, lambda work: run(args, work))
    text = (
        f"netem: the client {args.uplink:.0f} Mbit/s from every server (20 ms to A, 60 ms to the targets); "
        f"a LLaMA of 6 blocks, hidden 512, 8 KV heads (float32 cache: 24 KB per token over the span), "
        f"served whole; {args.compute_delay_per_token * 1e3:.1f} ms emulated compute per block per token "
        f"of a step (at least {args.compute_delay * 1e3:.0f} ms per step). After {args.history} tokens the "
        "serving server drains; `move` is the client's own measure of moving the session (routing, opening "
        "the target, the hand-off or the replay), `2 tokens` the two tokens across the move against two "
        "before it. Every output equalled local transformers."
    )
    options = argparse.Namespace(
        history=args.history,
        uplink=args.uplink,
        compute_delay=args.compute_delay,
        compute_delay_per_token=args.compute_delay_per_token,
        write=args.write,
    )
    publish_table(__file__, options, table(rows), "## Cache hand-off against replay on a drain", text)


if __name__ == "__main__":
    main()
