"""Small swarm clients that run *inside* a site's namespace (the emulator's own process cannot
reach the emulated addresses: they exist only in the namespaces).

    python -m benchmarks.netem.swarm_tools wait-online --initial-peers MADDR --model-dir DIR \
        --names a,b --out F
    python -m benchmarks.netem.swarm_tools generate --initial-peers MADDR --model-dir DIR \
        --prompt ... [--check]

`wait-online` polls the DHT until the named servers are ONLINE, then writes what they announced
(span, memory, tau, tau_prefill, sizes) and this site's measured round trip to each (the client's
own info-RPC ping: network RTT + serialization + the RPC stack) as JSON: the inputs the
simulator needs to predict the same swarm. `generate` runs a greedy generation through the swarm
and, with `--check`, compares the tokens with local `transformers` on the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def wait_online(args: argparse.Namespace) -> int:

    from llm_swarm.client.connection import ClientOptions, SwarmConnection, run_sync
    from llm_swarm.swarm.dht_keys import default_prefix
    from llm_swarm.swarm.dht_peer import start_dht
    from llm_swarm.swarm.dht_records import fetch_servers
    from llm_swarm.swarm.models.checkpoint import load_config
    from llm_swarm.swarm.models.family import family_for
    from llm_swarm.swarm.server_info import ServerState

    config = load_config(args.model_dir)
    num_blocks = family_for(config).num_blocks(config)
    prefix = args.dht_prefix or default_prefix(args.model_dir)
    names = [name for name in args.names.split(",") if name]
    dht = start_dht(args.initial_peers)
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            servers = fetch_servers(dht, prefix, num_blocks)
            online = {i.public_name: (p, i) for p, i in servers.items() if i.state == ServerState.ONLINE}
            if set(names) <= set(online):
                break
            if time.monotonic() > deadline:
                print(
                    f"not online after {args.timeout} s: {sorted(set(names) - set(online))}", file=sys.stderr
                )
                return 1
            time.sleep(0.5)
    finally:
        dht.shutdown()
    result = {}
    connection = SwarmConnection(args.initial_peers, prefix, num_blocks, ClientOptions(use_scheduler=False))
    try:
        for name in names:
            peer, info = online[name]
            rtts = []
            for _ in range(args.pings if info.routable else 0):  # nobody can dial an unreachable one
                connection.probes.forget(peer)  # measure afresh each time (the cache is for routing)
                rtts.append(run_sync(connection.probes.rtt(peer)))
            result[name] = {
                "peer_id": peer,
                "start": info.start,
                "end": info.end,
                "memory_bytes": info.memory_bytes,
                "block_bytes": info.block_bytes,
                "cache_token_bytes": info.cache_token_bytes,
                "tau": info.tau,
                "tau_prefill": info.tau_prefill,
                "prefill_tokens": info.prefill_tokens,
                "rtt_info_s": statistics.median(rtts) if rtts else None,
                "reachability": str(info.reachability),
            }
    finally:
        connection.shutdown()
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    print(text)
    return 0


def generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model_dir, initial_peers=args.initial_peers, options=ClientOptions(wait_for_servers=60.0)
    )
    try:
        started = time.monotonic()
        output = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
        elapsed = time.monotonic() - started
        rtts = model.backend.connection.probes.measured()
    finally:
        model.shutdown()
    report = {
        "prompt": args.prompt,
        "tokens": output[0].tolist(),
        "text": tokenizer.decode(output[0]),
        "seconds": elapsed,
        # every server the client pinged (inf: no answer): who it considered routing through
        "rtts": {peer: (rtt if rtt < float("inf") else None) for peer, rtt in rtts.items()},
    }
    status = 0
    if args.check:
        reference = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
        with torch.inference_mode():
            expected = reference.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
        report["matches_local"] = bool(torch.equal(output, expected))
        status = 0 if report["matches_local"] else 3
    print(json.dumps(report))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks.netem.swarm_tools", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("wait-online", "generate"):
        sub = commands.add_parser(name)
        sub.add_argument("--initial-peers", nargs="+", required=True)
        sub.add_argument("--model-dir", required=True)
        sub.add_argument("--dht-prefix")
        if name == "wait-online":
            sub.add_argument("--names", required=True, help="comma-separated public names")
            sub.add_argument("--timeout", type=float, default=180.0)
            sub.add_argument("--pings", type=int, default=5)
            sub.add_argument("--out")
        else:
            sub.add_argument("--prompt", required=True)
            sub.add_argument("--max-new-tokens", type=int, default=16)
            sub.add_argument("--check", action="store_true", help="compare with local transformers")
    args = parser.parse_args(argv)
    return wait_online(args) if args.command == "wait-online" else generate(args)


if __name__ == "__main__":
    sys.exit(main())
