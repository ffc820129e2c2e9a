"""Chain sessions against hub-spoke over emulated links: a token through a chain of servers that push
each output to the next server, against one whose every output comes back to the client first, side
by side in one run (two clients in the client's site, alternating which goes first).

Settings (each its own emulated network; a LLaMA of 6 blocks, hidden 64, spread evenly):
- `near`: the client 100 ms (round trip) from every server, the servers 4 ms from each other, 3 hops;
- `near6`: the same with 6 hops (one block each);
- `far`: every site 60 ms from every other, 3 hops;
- `lan`: every site 0.3 ms from every other (a LAN of four machines), 3 hops: where what a hop costs
  besides the network shows, against the links' own time plus the local model's compute per token.
For each: the median time per generated token (decode steps of a 32-token answer after a 16-token
prompt), the median whole request (open, prompt, 32 new tokens), and in `near` speculative decoding
with a perfect draft (the local model as assistant: every draft accepted) per generated token; every
output checked against local transformers.

    sudo .venv/bin/python -m benchmarks.serving.chain_push [--settings near,near6,far] [--repeats 6] [--write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import common

LAYERS = 6
PROMPT_TOKENS, NEW_TOKENS = 16, 32
HEADER = "## Chain sessions against hub-spoke, over emulated links"
SETTINGS = {  # name: (hops, client rtt ms, server-to-server rtt ms)
    "near": (3, 100.0, 4.0),
    "near6": (6, 100.0, 4.0),
    "far": (3, 60.0, 60.0),
    "lan": (3, 0.3, 0.3),
}


# --- the measuring client (runs in the client's site) ---------------------------------------------------
def measure(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions

    torch.set_num_threads(1)
    models = {
        name: AutoDistributedModelForCausalLM.from_pretrained(
            args.model_dir, args.initial_peers, options=ClientOptions(request_timeout=60.0, chain_push=push)
        )
        for name, push in (("chain", True), ("hub-spoke", False))
    }
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    tokens: dict[str, list[float]] = {name: [] for name in models}
    requests: dict[str, list[float]] = {name: [] for name in models}
    speculative: dict[str, list[float]] = {name: [] for name in models}
    local: list[float] = []  # the same answer computed by the local model, per token
    wrong, hops = 0, {}
    try:
        for repeat in range(args.repeats):
            prompt = torch.randint(
                4, 100, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(repeat)
            )
            started = time.perf_counter()
            expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            local.append((time.perf_counter() - started) / NEW_TOKENS)
            order = list(models) if repeat % 2 == 0 else list(reversed(models))
            for name in order:
                model = models[name]
                started = time.perf_counter()
                with model.inference_session(
                    PROMPT_TOKENS + NEW_TOKENS, prompt_tokens=PROMPT_TOKENS
                ) as session:
                    output = model.generate(
                        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, session=session
                    )
                    hops[name] = len(session.blocks.streams)
                    tokens[name] += session.blocks.later_step_seconds
                requests[name].append(time.perf_counter() - started)
                wrong += not torch.equal(output, expected)
                if args.setting == "near":  # speculation measured where the chain pays most
                    started = time.perf_counter()
                    output = model.generate(
                        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=reference
                    )
                    speculative[name].append((time.perf_counter() - started) / NEW_TOKENS)
                    wrong += not torch.equal(output, expected)
    finally:
        for model in models.values():
            model.shutdown()
    result = {
        "tokens": tokens,
        "requests": requests,
        "speculative": speculative,
        "local": local,
        "wrong": wrong,
        "hops": hops,
    }
    Path(args.out).write_text(json.dumps(result))


# --- the emulated swarm -----------------------------------------------------------------------------------
def scenario(hops: int, rtt_ms: float, server_rtt_ms: float):
    from benchmarks.netem.scenario import parse_scenario

    return parse_scenario(
        {
            "name": "bench_chain_push",
            "links": {
                "within_group": {"rtt_ms": server_rtt_ms, "bandwidth_mbit": 1000},
                "between_groups": {"rtt_ms": rtt_ms, "bandwidth_mbit": 100},
            },
            "sites": [
                {"name": "client", "group": "client", "processes": [{"role": "dht", "name": "dht"}]},
                *({"name": f"s{j}", "group": "servers"} for j in range(hops)),
            ],
        },
        "bench_chain_push",
    )


def run(args: argparse.Namespace, setting: str, work: Path) -> dict:
    from benchmarks.netem.emulator import Emulation
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    hops, rtt_ms, server_rtt_ms = SETTINGS[setting]
    spec = TinyModelSpec(family="llama", num_layers=LAYERS, hidden_size=64, num_heads=4, num_kv_heads=2)
    model_dir = build_tiny_model(work / "llama-64", spec)
    per_hop = LAYERS // hops
    with Emulation(scenario(hops, rtt_ms, server_rtt_ms), work / "netem") as emulation:
        emulation.start_dht("client")
        names = []
        for j in range(hops):
            span = f"{j * per_hop}:{(j + 1) * per_hop}"
            emulation.start_server(f"server{j}", f"s{j}", model_dir, span, "1GB", 0.0)
            names.append(f"server{j}")
        emulation.wait_online("client", model_dir, names)
        out = work / "chain.json"
        argv = [
            sys.executable, str(Path(__file__).resolve()), "measure", "--model-dir", str(model_dir),
            "--initial-peers", *emulation.initial_peers, "--out", str(out), "--repeats", str(args.repeats),
            "--setting", setting,
        ]  # fmt: skip
        return common.run_measuring_client(emulation, argv, out)


def table(results: dict[str, dict]) -> list[str]:
    lines = [
        "| setting | hops | client RTT / servers' RTT (ms) | per token: chain / hub-spoke (ms) | chain / RTT "
        "| hub-spoke / RTT | chain / hub-spoke | whole request: chain / hub-spoke (ms) | outputs wrong |",
        "|---|---:|---|---|---:|---:|---:|---|---:|",
    ]
    notes = []
    for setting, result in results.items():
        hops, rtt_ms, server_rtt_ms = SETTINGS[setting]
        token = {name: statistics.median(times) * 1e3 for name, times in result["tokens"].items()}
        request = {name: statistics.median(times) * 1e3 for name, times in result["requests"].items()}
        lines.append(
            f"| {setting} | {result['hops']['chain']} | {rtt_ms:g} / {server_rtt_ms:g} "
            f"| {token['chain']:.0f} / {token['hub-spoke']:.0f} | {token['chain'] / rtt_ms:.2f} "
            f"| {token['hub-spoke'] / rtt_ms:.2f} | {token['chain'] / token['hub-spoke']:.2f} "
            f"| {request['chain']:.0f} / {request['hub-spoke']:.0f} "
            f"({request['chain'] / request['hub-spoke']:.2f}x) "
            f"| {result['wrong']} |"
        )
        if result["speculative"].get("chain"):
            speculative = {name: statistics.median(v) * 1e3 for name, v in result["speculative"].items()}
            notes.append(
                f"- {setting}, speculative decoding with a perfect draft, per generated token: chain "
                f"{speculative['chain']:.0f} ms, hub-spoke {speculative['hub-spoke']:.0f} ms "
                f"({speculative['chain'] / speculative['hub-spoke']:.2f}x); against plain hub-spoke decoding "
                f"{speculative['chain'] / token['hub-spoke']:.2f}x"
            )
        if setting == "lan":
            # a token of a chain session crosses the client's link twice and each server-to-server
            # link once, one way each
            links = rtt_ms + (hops - 1) * server_rtt_ms / 2
            compute = statistics.median(result["local"]) * 1e3
            notes.append(
                f"- lan: per token {token['chain']:.2f} ms through the chain against the links' "
                f"{links:.2f} ms plus the local model's {compute:.2f} ms of compute: "
                f"{token['chain'] / (links + compute):.2f}x (target <= 1.3x)"
            )
    return lines + ([""] + notes if notes else [])


def shared_options(options: argparse.ArgumentParser) -> None:
    """The options the benchmark passes on to its measuring client."""
    options.add_argument("--repeats", type=int, default=6, help="requests of each kind per setting")


def main() -> None:
    parser = common.measuring_parser(__doc__, "--model-dir", "--out", "--setting", shared=shared_options)
    parser.add_argument("--settings", default="near,near6,far", help=f"of {', '.join(SETTINGS)}")
    common.add_report_options(parser, keep_logs=True)
    common.run_measuring(parser, measure, benchmark)


def benchmark(args: argparse.Namespace) -> None:
    settings = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}: choose among {', '.join(SETTINGS)}")
    results = {
        setting: common.run_emulated(
            f"bench-chain-{setting}-", args.keep_logs, lambda work, setting=setting: run(args, setting, work)
        )
        for setting in settings
    }
    text = (
        "netem: the client (with the DHT) in its own site, each server in a site of its own; a LLaMA of 6 "
        f"blocks (hidden 64) spread evenly over the hops. Per setting, {args.repeats} requests of a "
        f"{PROMPT_TOKENS}-token prompt and {NEW_TOKENS} new tokens through each kind of client, alternating "
        "which goes first; per token: the median decode step (after the prompt). Links from the client "
        "100 Mbit/s, between servers 1 Gbit/s."
    )
    options = argparse.Namespace(settings=args.settings, repeats=args.repeats, write=args.write)
    common.publish_table(__file__, options, table(results), HEADER, text)


if __name__ == "__main__":
    main()
