"""Failover over emulated internet links: the time from a SIGKILL to the next token, by history length
and replay mode (`steps`: one round trip per recorded step, as before; `exact`: the recorded steps in
one Replay message; `prefill`: one catch-up prefill).

A tiny LLaMA (6 blocks): blocks 0:2 are held by several servers at one site (each failover kills the
session's current one and the next takes over), 2:4 and 4:6 by one server each at their own sites;
the client's site is `--rtt` ms from every server site (3 hops). Servers emulate a GPU's step with
`--compute-delay` seconds per block per step. For each history length the client generates that
many tokens in one session, then for each mode in turn: one normal token (timed), SIGKILL of the
first server of its chain, one more token (timed: detection, routing, opening a stream, rebuilding
the cache, the step). Every output is checked against local `transformers`.

    sudo .venv/bin/python -m benchmarks.serving.replay [--history 50,200,500] [--rtt 50] [--write]

With `--leave`, the first server leaves instead of dying: SIGTERM, servers started with
`--drain-timeout 0` (no draining: its sessions end at once), the default replay mode only; the
client knows the replacement (it is online and pinged), so the time is the leave's notice, routing,
and one round trip that opens the replacement and catches it up with the token's step riding on the
catch-up, then the rest of the chain.

    sudo .venv/bin/python -m benchmarks.serving.replay --leave --history 120 --rtt 60 [--write]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from benchmarks import common

LAYERS = 6
MODES = ("steps", "exact", "prefill")
PROMPT = [5, 17, 99, 200, 33, 41, 7]
RERUN_OPTIONS = ("history", "rtt", "compute_delay", "leave", "write")


# --- the measuring client (runs in the client's site) ---------------------------------------------------
def measure(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    pids = json.loads(Path(args.pids).read_text())  # public name -> process group of the server
    histories = [int(n) for n in args.history.split(",")]
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    expected = reference.generate(
        torch.tensor([PROMPT]), max_new_tokens=max(histories) + 2 * len(MODES) + 2, do_sample=False
    )
    options = ClientOptions(request_timeout=120.0, ban_base=3600.0, ban_max=3600.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model_dir, args.initial_peers, options=options
    )
    connection = model.backend.connection
    rows = []
    modes = leave_modes(args.leave)
    stop_signal = signal.SIGTERM if args.leave else signal.SIGKILL
    try:
        for history in histories:
            with model.inference_session(max_length=len(PROMPT) + history + 4 * len(MODES)) as session:
                sequence = model.generate(torch.tensor([PROMPT]), max_new_tokens=history, do_sample=False)
                sequence = model.generate(sequence, max_new_tokens=1, do_sample=False)  # in the session now
                for mode in modes:
                    started = time.perf_counter()
                    sequence = model.generate(sequence, max_new_tokens=1, do_sample=False)
                    normal = time.perf_counter() - started
                    victim = session.blocks.streams[0].hop.peer_id
                    name = connection.roster.known[victim].public_name
                    connection.options.replay_mode = mode
                    # SIGKILL: the server and its p2p daemon at once; SIGTERM: the server, which leaves
                    os.killpg(pids[name], stop_signal)
                    started = time.perf_counter()
                    sequence = model.generate(sequence, max_new_tokens=1, do_sample=False)
                    recovery = time.perf_counter() - started
                    if not torch.equal(sequence[0], expected[0, : sequence.shape[1]]):
                        raise SystemExit(
                            f"{mode} after {history} tokens: the output differs from transformers"
                        )
                    rows.append({"history": history, "mode": mode, "normal": normal, "recovery": recovery})
                    print(
                        f"{history} tokens, {mode}: {recovery * 1e3:.0f} ms ({normal * 1e3:.0f} ms normal)",
                        flush=True,
                    )
    finally:
        model.shutdown()
    Path(args.out).write_text(json.dumps(rows))


# --- the emulated swarm -----------------------------------------------------------------------------------
def run(args: argparse.Namespace, work: Path) -> list[dict]:
    from benchmarks.netem.emulator import Emulation
    from benchmarks.netem.scenario import equidistant_scenario
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    model_dir = build_tiny_model(
        work / "tiny-llama", TinyModelSpec(family="llama", num_layers=LAYERS, num_kv_heads=2)
    )
    scenario = equidistant_scenario("bench_replay", ("client", "s0", "s1", "s2"), args.rtt)
    kills = len(args.history.split(",")) * len(leave_modes(args.leave))
    leaving = ("--drain-timeout", "0") if args.leave else ()
    with Emulation(scenario, work / "netem") as emulation:
        emulation.start_dht("client")
        names = {f"first-{index}": ("s0", "0:2") for index in range(kills + 1)}
        names.update({"second": ("s1", "2:4"), "third": ("s2", "4:6")})
        pids = {}
        for name, (site, blocks) in names.items():
            delay = args.compute_delay
            pids[name] = emulation.start_server(name, site, model_dir, blocks, "1GB", delay, *leaving).pid
        emulation.wait_online("client", model_dir, list(names))
        (work / "pids.json").write_text(json.dumps(pids))
        out = work / "replay.json"
        argv = [
            sys.executable, str(Path(__file__).resolve()), "measure", "--model-dir", str(model_dir),
            "--initial-peers", *emulation.initial_peers, "--out", str(out), "--pids", str(work / "pids.json"),
            "--history", args.history, *(["--leave"] if args.leave else []),
        ]  # fmt: skip
        return common.run_measuring_client(emulation, argv, out, ["dht", "second", "third", "measure"])


def leave_modes(leave: bool) -> tuple[str, ...]:
    """The replay modes measured: all of them after kills, the default one after leaves."""
    return ("prefill",) if leave else MODES


def table(rows: list[dict], leave: bool = False) -> list[str]:
    normal = statistics.median(row["normal"] for row in rows)
    modes = leave_modes(leave)
    event = "leave" if leave else "kill"
    lines = [
        f"| tokens before the {event} | "
        + " | ".join(f"{mode}: {event} -> next token (x a token)" for mode in modes)
        + " |",
        "|---|" + "---|" * len(modes),
    ]
    for history in sorted({row["history"] for row in rows}):
        cells = []
        for mode in modes:
            (row,) = [r for r in rows if r["history"] == history and r["mode"] == mode]
            cells.append(f"{row['recovery'] * 1e3:.0f} ms ({row['recovery'] / normal:.1f}x)")
        lines.append(f"| {history} | " + " | ".join(cells) + " |")
    lines.append(f"\nA token without failure: median {normal * 1e3:.0f} ms over {len(rows)} measurements.")
    return lines


def shared_options(options: argparse.ArgumentParser) -> None:
    """The options the benchmark passes on to its measuring client."""
    options.add_argument("--history", default="50,200,500", help="tokens generated before each kill")
    options.add_argument(
        "--leave", action="store_true", help="SIGTERM a server with --drain-timeout 0 instead of SIGKILL"
    )


def main() -> None:
    parser = common.measuring_parser(__doc__, "--model-dir", "--out", "--pids", shared=shared_options)
    parser.add_argument("--rtt", type=float, default=50.0, help="ms between the client and each server site")
    parser.add_argument("--compute-delay", type=float, default=0.001, help="seconds per block per step")
    common.add_report_options(parser, keep_logs=True)
    common.run_measuring(parser, measure, benchmark)


def benchmark(args: argparse.Namespace) -> None:
    rows = common.run_emulated("bench-replay-", args.keep_logs, lambda work: run(args, work))
    # the options the section's command repeats (not --keep-logs)
    options = argparse.Namespace(**{name: getattr(args, name) for name in RERUN_OPTIONS})
    if args.leave:
        text = (
            f"netem: the client {args.rtt:.0f} ms (round trip) from each of three server sites, 100 Mbit/s; "
            f"a tiny LLaMA ({LAYERS} blocks, two per hop), {args.compute_delay * 1e3:.0f} ms emulated "
            "compute per block per step; servers run with `--drain-timeout 0`. After the tokens, the first "
            "server of the chain gets SIGTERM (it leaves at once, its sessions end) and the next token is "
            "timed: the leave's notice, routing to the replacement (online, already pinged), one round "
            "trip that opens it and sends the catch-up prefill behind the `Open` (the token's step rides "
            "on it, and the replacement pushes its output on to the next hop), and the rest of the chain. "
            "Every output equalled local transformers."
        )
        title = "## A server that leaves without draining, over emulated links"
        common.publish_table(__file__, options, table(rows, leave=True), title, text)
        return
    text = (
        f"netem: the client {args.rtt:.0f} ms (round trip) from each of three server sites, 100 Mbit/s; "
        f"a tiny LLaMA ({LAYERS} blocks, two per hop), {args.compute_delay * 1e3:.0f} ms emulated compute "
        "per block per step. One session per history length; for each mode in turn the first server of "
        "its chain is SIGKILLed and the next token timed (detection, routing, a new stream, rebuilding "
        "the cache, the step). `steps` replays the recorded steps one round trip each, "
        "`exact` sends them in one Replay message (the server reruns them: a bit-identical cache), "
        "`prefill` sends one catch-up prefill. Every output equalled local transformers."
    )
    common.publish_table(
        __file__, options, table(rows), "## Failover in one round trip, over emulated links", text
    )


if __name__ == "__main__":
    main()
