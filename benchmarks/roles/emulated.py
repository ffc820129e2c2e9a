"""Colocated serving against prefill/decode roles on the emulated swarm, beside the simulator.

Four servers of a tiny LLaMA (6 blocks, hidden 512, 8 KV heads: a float32 cache of 24 KB per token over
the span), each holding every block, in four sites joined by `--link-mbps` links (2 ms); the client
(with the DHT; no scheduler: the client routes each session itself, by eq. 1 among the servers with
cache room; `--scheduler`: a `swarm-scheduler`, cg-bp, in the client's site routes every session
by WS-RR and plans where its prompt runs) in its own site, `--client-rtt-ms` and `--uplink` Mbit/s
from each. Every server sleeps `--compute-delay` per block per step and `per-token x tokens` when longer
(`--compute-delay-per-token`): two compute-rich servers (`--rich-per-token`; with
`--rich-compute-delay`, also slower at decoding, like the simulator's `split` swarm) and two
prefill-slow ones (`--slow-per-token`). `colocated`: all four `--role
both`; `roles`: the compute-rich ones `--role prefill`, the others `--role decode`; `auto` (with
`--scheduler`): four managed servers whose roles the scheduler plans (`--roles auto` for the SLOs
`--slo-ttft`/`--slo-tpot`, reviews every 10 s; the load starts 25 s after every server has measured
its links, and the roles announced are recorded per rate); the client
disaggregates by its own rule (`ClientOptions.disaggregate = "auto"`) with the links the servers
probed (`--link-probe-period 5`). Load: Poisson arrivals at each `--rates`, prompts of the Azure code
trace divided by `--length-scale` and capped at `--max-l-in`, answers capped at `--max-l-out`.
Measured TTFT and TPOT beside the contended simulator's on the same arrivals and lengths
(`benchmarks/roles/sim.py`); some outputs are checked against local transformers.

    sudo .venv/bin/python -m benchmarks.roles.emulated [--rates 0.5,1.0,1.5,2.0] [--link-mbps 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import LogLines, measuring_parser, run_emulated, run_measuring

LAYERS, HIDDEN = 6, 512
HANDED = re.compile(
    r"session (\w+): prompt of blocks \d+:\d+ on prefill server (\w+), cache to (\w+) by (.*)"
)

CHECKS_PER_RATE = 2


# --- the measuring client (runs in the client's site) ---------------------------------------------------
def _wait_links(connection, seconds: float) -> dict:
    """Until every prefill server announces a rate to every decode server (or `seconds` pass):
    the client's rule then decides with measured links from the first request."""
    from llm_swarm.client.connection import run_sync

    deadline = time.monotonic() + seconds
    while True:
        servers = run_sync(connection.roster.servers(refresh=True))
        prefill = {p: i for p, i in servers.items() if str(i.role) in ("prefill", "ServerRole.PREFILL")}
        decode = [p for p, i in servers.items() if p not in prefill]
        known = {p[-6:]: {d[-6:]: i.links.get(d) for d in decode} for p, i in prefill.items()}
        if not prefill or all(None not in row.values() for row in known.values()):
            return known
        if time.monotonic() > deadline:
            return known
        time.sleep(1.0)


def _announced_roles(connection) -> dict[str, str]:
    """Peer id -> the role each server announces now."""
    from llm_swarm.client.connection import run_sync

    servers = run_sync(connection.roster.servers(refresh=True))
    return {peer: getattr(info.role, "value", str(info.role)) for peer, info in servers.items()}


def _settle_roles(connection, seconds: float) -> dict[str, str]:
    """`auto`: until every server announces a rate to every other (or a minute passes), then
    `seconds` more for the scheduler's next placement reviews to plan the roles; the roles then."""
    from llm_swarm.client.connection import run_sync

    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        servers = run_sync(connection.roster.servers(refresh=True))
        if len(servers) > 1 and all(len(info.links) >= len(servers) - 1 for info in servers.values()):
            break
        time.sleep(1.0)
    time.sleep(seconds)
    return _announced_roles(connection)


def measure(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    handed = LogLines()
    logger = logging.getLogger("llm_swarm.client")  # client.remote's hand-offs and fallbacks
    logger.setLevel(logging.INFO)
    logger.addHandler(handed)
    plan = json.loads(Path(args.plan).read_text())
    key = plan.get("scheduler_key")
    options = ClientOptions(
        request_timeout=120.0,
        uplink_mbps=float(plan["uplink"]),
        rtt_ttl=600.0,
        refresh_period=10.0,
        wait_for_servers=60.0,
        wait_for_room=3600.0,
        # --scheduler: the scheduler routes each session and plans where its prompt runs
        # (scheduler/service/prefill_routing.py); else the client routes itself, by eq. 1 among the
        # servers with cache room, and decides by its own rule
        scheduler_key=key,
        use_scheduler=key is not None,
        expected_l_in=plan["max_l_in"],
        # `auto` gives the scheduler SLOs (for its role plan): a session it expects to miss them is
        # measured as a miss, not dropped
        accept_slo_miss=True,
    )
    model = AutoDistributedModelForCausalLM.from_pretrained(
        args.model_dir, args.initial_peers, options=options
    )
    model.generation_config.eos_token_id = None  # random weights may say EOS: every answer has its length
    connection = model.backend.connection
    links = _wait_links(connection, 60.0)
    settled = _settle_roles(connection, plan["role_settle"]) if plan.get("role_settle") else None
    if settled is not None:  # `auto`: the prefill servers' links as announced once roles are planned
        links = _wait_links(connection, 10.0)
    probes = []
    for _ in range(3):  # the per-session set-up on an idle swarm: the simulator's set-up constant
        opened = time.monotonic()
        model.open_session(max_length=64, prompt_tokens=32).close()
        probes.append(time.monotonic() - opened)
    results = {"links": links, "setup_s": sorted(probes)[1], "rates": [], "announced_roles": settled}
    vocab = model.config.vocab_size
    for batch in plan["batches"]:
        before = len(handed.lines)
        rows = [dict(r) for r in batch["requests"]]
        start = time.monotonic()

        def one(row: dict, start: float = start, seed: int = int(batch["seed"])) -> None:
            generator = torch.Generator().manual_seed(1000 * seed + row["id"])
            prompt = torch.randint(4, vocab, (1, row["l_in"]), generator=generator)
            delay = start + row["arrival"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            times: list[float] = []

            class Streamer:
                calls = 0

                def put(self, value) -> None:
                    self.calls += 1
                    if self.calls > 1:  # the first call is the prompt
                        times.append(time.monotonic())

                def end(self) -> None:
                    pass

            try:
                session = model.open_session(
                    row["l_in"] + row["l_out"], prompt_tokens=row["l_in"], expected_new_tokens=row["l_out"]
                )
                row["session"] = getattr(session.blocks, "session_id", "")[:8]
                try:
                    output = model.generate(
                        prompt, session=session, max_new_tokens=row["l_out"], do_sample=False,
                        streamer=Streamer(), pad_token_id=0,
                    )  # fmt: skip
                finally:
                    session.close()
                row["first_token"], row["finish"] = times[0] - start, times[-1] - start
                row["tokens"] = output[0, row["l_in"] :].tolist()
            except Exception as error:  # recorded; the run goes on (a failed request misses its SLOs)
                row["error"] = f"{type(error).__name__}: {error}"

        threads = [threading.Thread(target=one, args=(row,), daemon=True) for row in rows]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        moves = [HANDED.search(line) for line in handed.lines[before:]]
        by_session = {m.group(1): m.groups()[1:] for m in moves if m}
        for row in rows:
            prefill_server, decode_server, how = by_session.get(row.get("session", "-"), ("", "", ""))
            row["prefill"], row["prefill_server"], row["decode_server"] = how, prefill_server, decode_server
        local = sum("routing locally" in line for line in handed.lines[before:])
        entry = {"rate": batch["rate"], "requests": rows, "routed_locally": local}
        if settled is not None:  # `auto`: the scheduler may re-plan the roles as the rate changes
            entry["announced_roles"] = _announced_roles(connection)
        results["rates"].append(entry)
        results.setdefault("scheduler_lines", []).extend(
            line for line in handed.lines[before:] if "scheduler" in line
        )
        print(f"rate {batch['rate']}: {sum('error' not in r for r in rows)} of {len(rows)} done", flush=True)
        time.sleep(2.0)  # the last sessions' caches freed before the next rate starts
    model.shutdown()
    # exact outputs: a few requests per rate (disaggregated ones first) against local transformers
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    reference.generation_config.eos_token_id = None
    checked, wrong = 0, []
    for index, entry in enumerate(results["rates"]):
        done = [r for r in entry["requests"] if "tokens" in r]
        done.sort(key=lambda r: (not r["prefill"].startswith("hand-off"), r["l_in"]))
        for row in done[:CHECKS_PER_RATE]:
            generator = torch.Generator().manual_seed(1000 * int(plan["batches"][index]["seed"]) + row["id"])
            prompt = torch.randint(4, vocab, (1, row["l_in"]), generator=generator)
            with torch.inference_mode():
                expected = reference.generate(
                    prompt, max_new_tokens=row["l_out"], do_sample=False, pad_token_id=0
                )
            checked += 1
            if expected[0, row["l_in"] :].tolist() != row["tokens"]:
                wrong.append(row["id"])
    results["checked"], results["wrong"] = checked, wrong
    for entry in results["rates"]:
        for row in entry["requests"]:
            row.pop("tokens", None)
    Path(args.out).write_text(json.dumps(results))
    print(f"checked {checked} outputs against transformers, {len(wrong)} differ", flush=True)


# --- the emulated swarm -----------------------------------------------------------------------------------
def scenario(args: argparse.Namespace):
    from benchmarks.netem.scenario import parse_scenario

    sites = [{"name": "client", "group": "client", "processes": [{"role": "dht", "name": "dht"}]}]
    sites += [{"name": f"site{j}", "group": "servers"} for j in range(4)]
    return parse_scenario(
        {
            "name": "bench_roles_netem",
            "links": {
                "within_group": {"rtt_ms": 2, "bandwidth_mbit": args.link_mbps},
                "between_groups": {"rtt_ms": args.client_rtt_ms, "bandwidth_mbit": args.uplink},
            },
            "sites": sites,
        },
        "bench_roles_netem",
    )


def cpu_costs(model_dir: Path):
    """The tiny block's CPU costs (one thread, best of 3), for the simulator's host part."""
    import torch

    from benchmarks.roles.sim import CpuCosts
    from llm_swarm.swarm.models import load_span

    torch.set_num_threads(1)
    span, _ = load_span(str(model_dir), 0, LAYERS, dtype="float32")
    with torch.inference_mode():

        def timed(rows: int, tokens: int, context: int) -> float:
            best = float("inf")
            for _ in range(3):
                cache = span.new_cache(batch_size=rows, max_length=context + tokens + 1)
                if context:
                    span(torch.randn(rows, context, HIDDEN), cache, position=0)
                started = time.perf_counter()
                span(torch.randn(rows, tokens, HIDDEN), cache, position=context)
                best = min(best, time.perf_counter() - started)
            return best / LAYERS

        one, eight = timed(1, 1, 256), timed(8, 1, 256)
        prefill = timed(1, 512, 0)
    return CpuCosts(
        one,
        max(eight - one, 0.0) / 7,
        prefill / 512,
        span.block_bytes,
        span.cache_bytes(num_tokens=1),  # per block
    )


def run_mode(args, emulation, model_dir: Path, mode: str, plan: dict, work: Path, label: str) -> dict:
    """One configuration: four servers with the mode's roles (and with --scheduler a fresh scheduler in
    the client's site), the measuring client over every rate."""
    # `auto`: managed servers, roles (and spans) from the scheduler's `--roles auto` planner
    auto = mode == "auto"
    if auto and not args.scheduler:
        raise SystemExit("--modes auto needs --scheduler (the scheduler plans the roles)")
    roles = ["prefill", "prefill", "decode", "decode"] if mode == "roles" else ["both"] * 4
    names = []
    if args.scheduler:
        scheduler = f"scheduler-{label}"
        lengths = [r for b in plan["batches"] for r in b["requests"]]
        planning = (
            # R = 1: every server holds the whole (tiny) model, as the pinned servers do; reviews
            # every 10 s re-plan the roles once the servers have measured their links
            ["--roles", "auto", "--slo-ttft", repr(args.slo_ttft), "--slo-tpot", repr(args.slo_tpot),
             "--num-requests", "1", "--period", "10"]
            if auto
            else ["--period", "3600"]
        )  # fmt: skip
        emulation.start_scheduler(
            "client", model_dir, "--policy", "cg-bp", *planning, "--lease", "600",
            "--l-in", str(round(sum(r["l_in"] for r in lengths) / len(lengths))),
            "--l-out", str(round(sum(r["l_out"] for r in lengths) / len(lengths))),
            "--roster-read-period", "0.5", "--full-pass", "2", name=scheduler,
        )  # fmt: skip
        names.append(scheduler)
    for j, role in enumerate(roles):
        per_token = args.rich_per_token if j < 2 else args.slow_per_token
        name = f"{label}-{'rich' if j < 2 else 'slow'}{j % 2}"
        memory = args.prefill_memory if role == "prefill" else args.memory
        delay = (
            args.rich_compute_delay if j < 2 and args.rich_compute_delay is not None else args.compute_delay
        )
        emulation.start_server(
            name, f"site{j}", model_dir, None if auto else f"0:{LAYERS}", memory, delay,
            "--compute-delay-per-token", repr(per_token), "--role", role, "--link-probe-period", "5",
            "--session-timeout", "600", "--drain-timeout", "1",
            *(["--prefill-tokens", str(args.prefill_tokens)] if args.prefill_tokens else []),
        )  # fmt: skip
        names.append(name)
    servers = [n for n in names if not n.startswith("scheduler")]
    online = emulation.wait_online("client", model_dir, servers, timeout=300)
    time.sleep(12)  # two probe periods: every server has measured its links
    plan_path, out = work / f"{label}.plan.json", work / f"{label}.out.json"
    plan_path.write_text(json.dumps({**plan, "role_settle": 25.0 if auto else 0.0}))
    argv = [
        sys.executable, str(Path(__file__).resolve()), "measure", "--model-dir", str(model_dir),
        "--initial-peers", *emulation.initial_peers, "--out", str(out), "--plan", str(plan_path),
    ]  # fmt: skip
    client = emulation.start(f"measure-{label}", "client", argv)
    limit = sum(b["requests"][-1]["arrival"] for b in plan["batches"]) + 300 + 60 * len(plan["batches"])
    started = time.monotonic()
    while client.poll() is None:
        emulation.check_alive([n for n in emulation.processes if n in names])
        if time.monotonic() - started > limit:
            raise SystemExit(f"{label}: the measuring client ran past {limit:.0f} s")
        time.sleep(1)
    if client.returncode != 0 or not out.exists():
        raise SystemExit(
            f"{label}: the measuring client failed:\n{emulation.log(f'measure-{label}')[-3000:]}"
        )
    emulation.stop_many(names)
    for name in names:
        emulation.processes.pop(name)
    result = json.loads(out.read_text())
    result["online"] = online
    result["roles"] = roles
    return result


def run(args: argparse.Namespace, work: Path) -> dict:
    from benchmarks.netem.emulator import Emulation
    from benchmarks.roles.sim import trace_requests
    from llm_swarm.scheduler.sim.workload import load_azure_trace
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(family="llama", num_layers=LAYERS, hidden_size=HIDDEN, num_heads=8, num_kv_heads=8)
    model_dir = build_tiny_model(work / "llama-512", spec)
    cpu = cpu_costs(model_dir)
    trace = load_azure_trace()
    rates = [float(r) for r in args.rates.split(",")]
    batches = []
    for k, rate in enumerate(rates):
        requests = trace_requests(
            trace, rate, args.requests, args.length_scale, args.max_l_in, args.max_l_out, args.seed + k
        )
        batches.append({"rate": rate, "seed": args.seed + k, "requests": [r.__dict__ for r in requests]})
    report = {"cpu": cpu.__dict__, "batches": batches, "modes": {}}
    with Emulation(scenario(args), work / "netem") as emulation:
        emulation.start_dht("client")
        plan = {
            "uplink": args.uplink,
            "max_l_in": args.max_l_in,
            "batches": batches,
            "scheduler_key": emulation.scheduler_key if args.scheduler else None,
        }
        for mode in args.modes.split(","):
            print(f"[{mode}] starting", flush=True)
            report["modes"][mode] = run_mode(args, emulation, model_dir, mode, plan, work, mode)
            Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    parser = measuring_parser(__doc__, "--model-dir", "--out", "--plan")
    parser.add_argument("--rates", default="0.5,1.0,1.5,2.0", help="Poisson arrival rates, req/s")
    parser.add_argument("--requests", type=int, default=30, help="requests per rate and mode")
    parser.add_argument("--modes", default="colocated,roles")
    parser.add_argument("--link-mbps", type=float, default=1000.0, help="between servers")
    parser.add_argument("--client-rtt-ms", type=float, default=30.0)
    parser.add_argument("--uplink", type=float, default=100.0, help="Mbit/s between the client and servers")
    parser.add_argument("--compute-delay", type=float, default=0.005, help="seconds per block per step")
    parser.add_argument(
        "--rich-compute-delay", type=float, default=None,
        help="the compute-rich servers' seconds per block per step (default: --compute-delay; more: "
        "compute-rich but slower at decoding, like the simulator's `split` swarm)",
    )  # fmt: skip
    parser.add_argument("--rich-per-token", type=float, default=0.0001)
    parser.add_argument("--slow-per-token", type=float, default=0.001)
    # blocks take 63 MB: the rest holds a few sessions, so that routing spreads them over servers
    parser.add_argument("--memory", default="120MB")
    # a prefill-only server holds prompts only until their hand-off: its memory bounds prompts in flight
    parser.add_argument(
        "--prefill-memory", default=None, help="memory of --role prefill servers (default: --memory)"
    )
    parser.add_argument(
        "--prefill-tokens", type=int, default=None,
        help="every server's swarm-server --prefill-tokens: the prompt length its announced prefill time "
        "is measured on (default: not passed, the server's default)",
    )  # fmt: skip
    parser.add_argument("--length-scale", type=int, default=4, help="trace prompts divided by this")
    parser.add_argument("--max-l-in", type=int, default=1024)
    parser.add_argument("--max-l-out", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scheduler", action="store_true",
        help="a swarm-scheduler (cg-bp: WS-RR routing; it plans where each prompt runs) in the client's "
        "site routes the sessions (default: none, the client routes itself)",
    )  # fmt: skip
    parser.add_argument(
        "--slo-ttft", type=float, default=3.0, help="`auto`: the SLOs the scheduler plans roles for (s)"
    )
    parser.add_argument("--slo-tpot", type=float, default=0.15)
    parser.add_argument("--out", default="results/roles_netem.json", help="the raw results (JSON)")
    parser.add_argument("--keep-logs", help="copy the processes' logs to this folder at the end")
    parser.add_argument("--label", default="", help="added to the report's row names (what this run changed)")
    run_measuring(parser, measure, benchmark)


def benchmark(args: argparse.Namespace) -> None:
    args.prefill_memory = args.prefill_memory or args.memory

    def inside(work: Path) -> dict:
        # the servers' timing cache stays inside the run (Emulation passes os.environ to children)
        os.environ["SWARM_CACHE_DIR"] = str(work / "cache")
        return run(args, work)

    report = run_emulated("bench-roles-", args.keep_logs, inside)
    report["args"] = {k: v for k, v in vars(args).items() if k != "command"}
    # servers announce their slowdown per decoding session and WS-RR routes by it (runs from
    # 2026-11-26 on; the report simulates earlier runs without it)
    report["args"]["load_routing"] = True
    # the first token returns before the prompt's hand-offs end (runs from 2026-11-26 on)
    report["args"]["early_first_token"] = True
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"raw results in {args.out}; tables: .venv/bin/python -m benchmarks.roles.report {args.out}")


if __name__ == "__main__":
    main()
