"""`python -m benchmarks.netem COMMAND`: build an emulated geo-distributed network and run a swarm in it.

    python -m benchmarks.netem check benchmarks/netem/scenarios/ci_small.json [--throughput]
    python -m benchmarks.netem run   benchmarks/netem/scenarios/ci_small.json [--run-dir DIR]
    python -m benchmarks.netem up    benchmarks/netem/scenarios/table2.json   # hold the network until Ctrl-C
    python -m benchmarks.netem --cleanup [--all]                            # remove leftovers of dead runs

Needs root (network namespaces). Missing system packages are installed with apt-get.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

from .emulator import Emulation, Terminated
from .scenario import Scenario, ScenarioError, load_scenario
from .system import SetupError, ensure_commands, netns_works
from .topology import cleanup

logger = logging.getLogger("netem")


def prepare_model(scenario: Scenario, run_dir: Path) -> Path:
    """The scenario's checkpoint: `model.dir`, or a tiny random-weight one built into the run dir."""
    spec = scenario.model
    if spec.get("dir"):
        return Path(spec["dir"]).resolve()
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    keys = {
        "family": "family",
        "layers": "num_layers",
        "hidden": "hidden_size",
        "heads": "num_heads",
        "kv_heads": "num_kv_heads",
        "vocab": "vocab_size",
        "intermediate": "intermediate_size",
        "seed": "seed",
    }
    unknown = set(spec) - set(keys)
    if unknown:
        raise ScenarioError(f"model: unknown keys {sorted(unknown)} (known: dir, {', '.join(keys)})")
    path = run_dir / f"model-{scenario.name}"
    build_tiny_model(path, TinyModelSpec(**{keys[k]: v for k, v in spec.items()}))
    return path


def start_swarm(emulation: Emulation, model_dir: Path) -> dict:
    """DHT, schedulers and servers of the scenario; returns the servers' records once online."""
    scenario = emulation.scenario
    dht = scenario.processes_of("dht")
    if not dht:
        raise ScenarioError("the scenario has no dht process")
    emulation.start_dht(dht[0].site, dht[0].name)
    for proc in scenario.processes_of("scheduler"):
        options = proc.options
        extra = ["--policy", options.get("policy", "cg-bp"), *map(str, options.get("args", []))]
        emulation.start_scheduler(proc.site, model_dir, *extra, name=proc.name)
    servers = scenario.processes_of("server")
    for proc in servers:
        options = proc.options
        emulation.start_server(
            proc.name,
            proc.site,
            model_dir,
            options.get("blocks"),
            options.get("memory", "1GB"),
            float(options.get("compute_delay_ms", 0.0)) / 1e3,
            "--compute-delay-per-token",
            repr(float(options.get("compute_delay_per_token_us", 0.0)) / 1e6),
            *map(str, options.get("args", [])),
        )
    if not servers:
        return {}
    observer = (scenario.processes_of("client") or dht)[0].site
    return emulation.wait_online(observer, model_dir, [p.name for p in servers])


def run_clients(emulation: Emulation, model_dir: Path, timeout: float) -> dict:
    """Start the scenario's clients and commands and wait for them; returns their results."""
    scenario = emulation.scenario
    names = []
    for proc in scenario.processes_of("client"):
        options = proc.options
        argv = emulation.python(
            "benchmarks.netem.swarm_tools", "generate", "--initial-peers", *emulation.initial_peers,
            "--model-dir", str(model_dir), "--prompt", options.get("prompt", "Once upon a time"),
            "--max-new-tokens", str(options.get("max_new_tokens", 16)),
            *(["--check"] if options.get("check", True) else []),
        )  # fmt: skip
        emulation.start(proc.name, proc.site, argv)
        names.append(proc.name)
    for proc in scenario.processes_of("command"):
        argv = [
            str(a).replace("{dht}", emulation.initial_peers[0]).replace("{model}", str(model_dir))
            for a in proc.options.get("argv", [])
        ]
        if not argv:
            raise ScenarioError(f"command {proc.name}: argv is empty")
        emulation.start(proc.name, proc.site, argv)
        names.append(proc.name)
    deadline = time.monotonic() + timeout
    results = {}
    for name in names:
        process = emulation.processes[name][1]
        while process.poll() is None:
            emulation.check_alive([n for n in emulation.processes if n not in names])
            if time.monotonic() > deadline:
                emulation.stop(name)
                break
            time.sleep(0.5)
        lines = [line for line in emulation.log(name).splitlines() if line.startswith("{")]
        result = {"returncode": process.returncode}
        if lines:
            try:
                result.update(json.loads(lines[-1]))
            except json.JSONDecodeError:
                pass
        results[name] = result
    return results


def command_run(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"netem-{scenario.name}-"))
    summary: dict = {"scenario": scenario.name, "run_dir": str(run_dir)}
    status = 0
    with Emulation(scenario, run_dir, args.delay) as emulation:
        summary["delay_mode"] = emulation.network.mode
        pings = emulation.check_rtts(args.tolerance)
        summary["pings"] = [p.__dict__ for p in pings]
        model_dir = prepare_model(scenario, run_dir)
        summary["servers"] = start_swarm(emulation, model_dir)
        summary["clients"] = run_clients(emulation, model_dir, args.timeout)
        status = 0 if all(c["returncode"] == 0 for c in summary["clients"].values()) else 1
    summary["delayer"] = emulation.network.delayer_stats()
    summary["teardown_problems"] = emulation.teardown_report
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        json.dumps(
            {k: summary[k] for k in ("scenario", "delay_mode", "clients", "teardown_problems")}, indent=1
        )
    )
    print(f"logs and summary.json in {run_dir}")
    return status or (2 if emulation.teardown_report else 0)


def command_check(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"netem-{scenario.name}-"))
    with Emulation(scenario, run_dir, args.delay) as emulation:
        print(f"delay mechanism: {emulation.network.mode}")
        try:
            emulation.check_rtts(args.tolerance)
            ok = True
        except SetupError as error:
            print(error)
            ok = False
        print((run_dir / "ping.txt").read_text(), end="")
        if args.throughput:
            for a, b, link in scenario.pairs():
                measured = emulation.network.throughput_mbit(a.name, b.name)
                print(
                    f"{a.name}->{b.name}: configured {link.bandwidth_mbit:g} Mbit/s, measured {measured:.1f}"
                )
    print(f"delayer: {emulation.network.delayer_stats()}; teardown problems: {emulation.teardown_report}")
    return 0 if ok and not emulation.teardown_report else 1


def command_up(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"netem-{scenario.name}-"))
    with Emulation(scenario, run_dir, args.delay) as emulation:
        if not args.no_check:
            emulation.check_rtts(args.tolerance)
        for site in scenario.sites:
            print(f"{site.name}: {site.address} (ip netns exec {emulation.network.netns(site.name)} ...)")
        print(f"network up ({emulation.network.mode}); Ctrl-C to tear it down", flush=True)
        (run_dir / "up").write_text(emulation.network.tag)
        while True:
            time.sleep(1)
            if not emulation.network.delayer_alive():
                raise SetupError("the delayer died")


def command_cleanup(args: argparse.Namespace) -> int:
    removed, kept = cleanup(all_runs=args.all)
    for name in removed:
        print(f"removed {name}")
    for name in kept:
        print(f"kept {name} (its run is still going; --all removes it too)")
    if not removed and not kept:
        print("nothing to clean up")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="netem",
        description="Emulate a geo-distributed swarm with network namespaces (see docs/netem.md).",
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces and processes of dead runs")
    parser.add_argument("--all", action="store_true", help="with --cleanup: also those of runs still going")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command")
    for name, helptext in (
        ("run", "build the network, start the scenario's processes, wait for its clients, tear down"),
        ("check", "build the network, ping every pair (and measure rates), tear down"),
        ("up", "build the network and hold it until Ctrl-C"),
    ):
        sub = commands.add_parser(name, help=helptext)
        sub.add_argument("scenario", help="scenario file (JSON, or YAML with PyYAML)")
        sub.add_argument("--run-dir", help="logs and results (default: a new temporary directory)")
        sub.add_argument("--delay", choices=["auto", "netem", "nfqueue"], default="auto")
        sub.add_argument("--tolerance", type=float, default=0.15, help="allowed relative RTT error")
        if name == "run":
            sub.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the clients")
        if name == "check":
            sub.add_argument("--throughput", action="store_true", help="also measure every pair's TCP rate")
        if name == "up":
            sub.add_argument("--no-check", action="store_true", help="skip the ping check")
    commands.add_parser("cleanup", help="same as --cleanup").add_argument("--all", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is it stuck?
    # a non-interactive shell starts background jobs with SIGINT ignored, and Python then leaves it
    # ignored; `up` promises that Ctrl-C (SIGINT) tears everything down, so take SIGINT back
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    reason = netns_works()
    if reason is not None:
        print(f"netem: {reason}", file=sys.stderr)
        return 2
    ensure_commands()
    try:
        if args.cleanup or args.command == "cleanup":
            return command_cleanup(args)
        if args.command is None:
            parser.print_help()
            return 2
        return {"run": command_run, "check": command_check, "up": command_up}[args.command](args)
    except (ScenarioError, SetupError) as error:
        print(f"netem: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated):
        print("netem: interrupted; everything was torn down", file=sys.stderr)
        return 130
