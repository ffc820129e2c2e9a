"""`swarm-scheduler`: place blocks (CG-BP by default) and route sessions (WS-RR) for a swarm."""

from __future__ import annotations

import argparse

from llm_swarm.scheduler.service.core import CoreSettings
from llm_swarm.scheduler.service.model_args import model_from_args
from llm_swarm.scheduler.service.planner import POLICIES, PlanSettings
from llm_swarm.scheduler.service.runner import SchedulerConfig, run_scheduler
from llm_swarm.swarm.cli.args import (
    add_model_config_arguments,
    add_swarm_secret_argument,
    command_parser,
    dht_prefix_from_args,
    swarm_secret_from_args,
)
from llm_swarm.swarm.cli.dataclass_args import add_field_options, dataclass_from_args
from llm_swarm.swarm.cli.errors import run_cli
from llm_swarm.swarm.cli.logs import add_log_level_argument, configure_logging
from llm_swarm.swarm.errors import SwarmUserError

EXAMPLES = """examples:
  swarm-scheduler --initial-peers $(head -1 dht.maddrs) --model-dir models/tiny-llama
  swarm-scheduler --initial-peers $(head -1 dht.maddrs) --model-dir models/bloom --policy cg-bp \\
      --period 30 --arrival-rate auto --l-in 20 --l-out 128 --slo-ttft 10 --slo-tpot 0.5 \\
      --host 0.0.0.0 --port 50051 --announce-host PUBLIC_ADDRESS

Servers started without --blocks ask it for their span; clients ask it for routes. Both find it
through the DHT, follow it only if given its public key (--scheduler-key, printed at start and
written to --public-key-file), and fall back to local decisions when it is unreachable.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "swarm-scheduler",
        "Place the model's blocks on the swarm's servers periodically and route sessions.",
        EXAMPLES,
    )
    add_model_config_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address the gRPC server listens on")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    parser.add_argument("--announce-host", help="address published in the DHT (default: --host)")
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="cg-bp",
        help="placement and routing: cg-bp (CG-BP + WS-RR, Sun et al.), gbp-cr (GBP-CR + WS-RR), "
        "chains (GBP-CR + GCA chains + JFFC queue, Sun, He and Hou), petals (PETALS' own rules)",
    )
    # the settings' types and defaults are those of CoreSettings and PlanSettings
    add_field_options(parser, CoreSettings, {"--period": "seconds between placement reviews"})
    parser.add_argument(
        "--arrival-rate",
        default="auto",
        help="requests/s used to choose R (docs/reference.md 3.1), or 'auto' to estimate it online",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        help="fix R instead of choosing it from the arrival rate (gbp-cr and chains: the capacity c per "
        "chain, which chains otherwise tunes for the arrival rate)",
    )
    add_field_options(
        parser,
        CoreSettings,
        {
            "--l-in": "prompt tokens a request is planned for",
            "--l-out": "generated tokens a request is planned for",
            "--settle": "after servers join or leave, wait this long before re-placing",
            "--lease": "seconds a session lives without KeepAlive",
        },
    )
    add_field_options(
        parser, PlanSettings, {"--min-gain": "re-place a working swarm only if this much faster (0.1 = 10%%)"}
    )
    parser.add_argument(
        "--roles",
        choices=["off", "auto"],
        default="off",
        help="auto: tell managed servers to run as prefill or both, planned from the server-to-server "
        "links they announce and scored by the contended simulator for the SLOs (docs/algorithms.md); "
        "servers started with --role prefill|decode keep theirs (default off: no role is assigned)",
    )
    for name, what in (("ttft", "time to first token"), ("tpot", "time per later token")):
        parser.add_argument(
            f"--slo-{name}",
            type=float,
            help=f"{what} target, seconds: a route expected to miss it says so in its reply at once (with "
            "the expected wait), and clients give up unless they accept misses (docs/operations.md)",
        )
    parser.add_argument("--address-file", help="write the gRPC address (host:port) here once serving")
    parser.add_argument(
        "--identity-path",
        help="RSA identity file (created if missing): the key clients and servers trust this scheduler "
        "by; keep it to keep the key across restarts (default: a new key per run)",
    )
    parser.add_argument(
        "--public-key-file", help="write the public key here (what --scheduler-key of clients/servers reads)"
    )
    add_field_options(
        parser,
        CoreSettings,
        {
            "--max-sessions-per-client": "sessions one client may have routed at once",
            "--l-out-prediction": "route and estimate waits by the output length learned from the tokens "
            "ended sessions reported (per prompt length; at most the l_out the client declared) instead of "
            "the declared l_out (docs/reference.md 3.2)",
        },
    )
    add_field_options(
        parser,
        SchedulerConfig,
        {
            "--roster-read-period": "seconds between roster reads (each reads the keys that are due; "
            "one read asks several servers, whatever the number of keys)",
            "--full-pass": "every roster key is re-read within this many seconds: how late the scheduler "
            "sees a server join, leave or fill up",
        },
    )
    add_swarm_secret_argument(parser)
    parser.add_argument("--http-host", help="address of the status page and /metrics (default: --host)")
    parser.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="port of the status page and /metrics (0: any free; -1: none)",
    )
    add_log_level_argument(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    shape, limits = model_from_args(args)
    # the configuration objects check their own values; only what the flags spell differently is here
    arrival_rate = None
    if args.arrival_rate != "auto":
        try:
            arrival_rate = float(args.arrival_rate)
        except ValueError:
            raise SwarmUserError(
                f"--arrival-rate must be 'auto' or a number, got {args.arrival_rate!r}"
            ) from None
    plan = dataclass_from_args(PlanSettings, args, arrival_rate=arrival_rate)
    return dataclass_from_args(
        SchedulerConfig,
        args,
        dht_prefix=dht_prefix_from_args(args),
        shape=shape,
        core=dataclass_from_args(CoreSettings, args, plan=plan),
        http_port=None if args.http_port == -1 else args.http_port,
        limits=limits,
        swarm_secret=swarm_secret_from_args(args),
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    run_cli("swarm-scheduler", lambda: run_scheduler(config_from_args(args)))


if __name__ == "__main__":
    main()
