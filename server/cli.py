"""`swarm-server`: serve a span of a model's blocks to the swarm.

With `--blocks` the span is pinned. Without it the server is managed: it takes its span from the
`swarm-scheduler`, or chooses one PETALS-style when no scheduler answers (see `server.server`).
"""

from __future__ import annotations

import argparse
import logging

import torch
import uvloop

from llm_swarm.server.joining import RELAY_MODES
from llm_swarm.server.server import ServerConfig, SwarmServer
from llm_swarm.swarm.cli.args import (
    add_model_source_arguments,
    add_swarm_secret_argument,
    command_parser,
    dht_prefix_from_args,
    resolve_model_argument,
    span_argument,
    swarm_secret_from_args,
)
from llm_swarm.swarm.cli.dataclass_args import add_field_options, dataclass_from_args
from llm_swarm.swarm.cli.device_args import add_device_arguments, device_and_dtype_from_args
from llm_swarm.swarm.cli.errors import run_cli
from llm_swarm.swarm.cli.logs import add_log_level_argument, configure_logging
from llm_swarm.swarm.cli.signals import terminate_like_interrupt
from llm_swarm.swarm.dtypes import dtype_name
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.hardware import server_memory_budget
from llm_swarm.swarm.identity import read_public_key
from llm_swarm.swarm.models.adapters import AdapterSource, check_adapters
from llm_swarm.swarm.models.checkpoint import load_config
from llm_swarm.swarm.models.family import family_for
from llm_swarm.swarm.models.span import validate_span
from llm_swarm.swarm.quantization import QUANT_CHOICES, check_quant_device
from llm_swarm.swarm.units import parse_bytes

logger = logging.getLogger(__name__)

EXAMPLES = """examples:
  swarm-server models/tiny-llama --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/Qm... --blocks 0:3 --memory 1GB
  swarm-server models/tiny-llama --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/Qm... --memory 1GB  # managed
  swarm-server models/bloom --initial-peers $(cat dht.maddrs) --blocks 0:35 --memory 70GB --dtype bfloat16
  swarm-server models/llama-2-70b --initial-peers $(cat dht.maddrs) --memory auto --device cuda --quant nf4
  swarm-server models/bloom @server.args --metrics-port 9100  # flags from a file, one per line
"""


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "swarm-server",
        "Load blocks of a local checkpoint and serve them to the swarm: the span given by --blocks, or "
        "(without it) the span the scheduler assigns, chosen PETALS-style if no scheduler answers.",
        EXAMPLES,
    )
    parser.add_argument("model_dir", help="the model: a local checkpoint directory or a Hub id (ORG/NAME)")
    add_model_source_arguments(parser)
    parser.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of DHT peers")
    parser.add_argument(
        "--blocks",
        type=span_argument,
        help="0-based half-open span, e.g. 0:12 (default: managed, the scheduler assigns the span)",
    )
    parser.add_argument(
        "--memory",
        required=True,
        help="memory budget M_j for blocks + caches, e.g. 8GB; auto: what the device has free, "
        "less headroom for the allocator and activations",
    )
    add_device_arguments(
        parser,
        "auto",
        device_help="cpu, cuda, cuda:N or auto (the first GPU if any, else the CPU)",
        dtype_help="compute dtype; auto: float32 on CPU, on a GPU the checkpoint's 16-bit dtype or bfloat16",
    )
    parser.add_argument(
        "--quant",
        default="none",
        choices=QUANT_CHOICES,
        help="store the blocks' linear layers as bitsandbytes int8 or nf4 (CUDA only)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--announce-host", help="address clients dial, behind NAT or with --host 0.0.0.0 (needs --port)"
    )
    parser.add_argument(
        "--relay",
        choices=RELAY_MODES,
        default="auto",
        help="auto: check at start-up that clients can dial us and, behind NAT, serve through a relay "
        "(the bootstrap peers); always: skip the check, use a relay; never: no relay (unreachable "
        "servers are announced so and not routed to)",
    )
    parser.add_argument(
        "--relay-peers", nargs="*", default=[], help="more circuit relays (multiaddrs ending in /p2p/ID)"
    )
    parser.add_argument(
        "--relay-service",
        action="store_true",
        help="relay for servers behind NAT (needs a public address; bounded: 64 reservations, 8 "
        "circuits per peer, 30 min and 4 GiB per circuit)",
    )
    parser.add_argument(
        "--no-legacy-records",
        action="store_true",
        help="announce only in the sharded roster, not in the legacy records that older clients and "
        "schedulers read (those values grow with the swarm): once every reader of the swarm is current",
    )
    parser.add_argument(
        "--identity-path",
        help="RSA identity file (created if missing): keeps the peer id, and the key that signs our "
        "records, across restarts (default: a fresh identity per run)",
    )
    parser.add_argument(
        "--scheduler-key",
        help="managed: follow only the scheduler whose records this public key signs (the key text, or "
        "the file swarm-scheduler wrote); without it, choose blocks PETALS-style",
    )
    add_swarm_secret_argument(parser)
    add_field_options(  # types and defaults: ServerConfig's
        parser,
        ServerConfig,
        {
            "--max-sessions-per-peer": "open sessions one client peer may hold",
            "--max-peer-cache-fraction": "share of the attention-cache memory one client peer may reserve "
            "(0-1]",
            "--max-session-lifetime": "close a session after this many seconds however active (its client "
            "replays elsewhere)",
        },
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on --host at this port (0: any free port, logged)",
    )
    parser.add_argument("--public-name", default="", help="a name shown to operators")
    parser.add_argument(
        "--role",
        choices=["prefill", "decode", "both"],
        default="both",
        help="which phase of sessions to take: prompts only (their caches are handed to decode servers), "
        "decoding only, or both (default)",
    )
    parser.add_argument(
        "--adapters",
        nargs="+",
        default=[],
        metavar="[NAME=]DIR",
        help="PEFT LoRA adapters to serve for our blocks (adapter_config.json + adapter_model.safetensors; "
        "NAME defaults to the directory's name); clients choose one per session (active_adapter=NAME)",
    )
    parser.add_argument(
        "--dht-prefix", help="swarm namespace of the model (default: the model directory's name)"
    )
    add_field_options(
        parser,
        ServerConfig,
        {
            "--max-length": "longest session accepted, in tokens",
            "--slot-tokens": "session length cache slots are counted for",
            "--max-batch-size": None,
            "--announce-period": "seconds between DHT announcements while sessions are open",
            "--idle-announce-factor": "with no session open, announce every this many periods (records "
            "live two of them: how long a crashed server's record outlives it)",
            "--session-timeout": "close sessions idle this long (s)",
            "--compute-delay": "emulation: extra seconds per block per step, to make a CPU server behave "
            "like a slower GPU",
            "--compute-delay-per-token": "emulation: seconds per block per token of a step; a step costs "
            "max(--compute-delay, this x its tokens) per block, like a GPU (launch-bound decode, "
            "compute-bound prefill)",
            "--prefill-tokens": "prompt length the announced prefill time is measured on (scaled linearly "
            "for other lengths: measure at a typical prompt length where a step has a large fixed cost)",
            "--prefill-chunk": "run prefills longer than this many tokens in chunks (default 256, "
            "measured), other sessions' decode steps in between (0: whole prefills)",
            "--compute-delay-overlap": "emulation: concurrent sessions' delays overlap (an accelerator whose "
            "step time does not depend on how many sessions it serves, Sun et al.'s model); default: a "
            "delay holds the compute thread",
            "--no-cuda-graphs": "on a GPU, run every decode step eagerly instead of replaying captured "
            "CUDA graphs (for comparison and debugging)",
            "--batch-wait-ms": "how long a decode step waits to be batched with other sessions' steps (0: "
            "no batching)",
            "--drain-timeout": "on SIGTERM or a move to a new span, seconds to let open sessions finish "
            "before closing them",
            "--scheduler-timeout": "managed: choose blocks PETALS-style if no scheduler answers for this "
            "many seconds",
            "--assignment-poll": "managed: seconds between asking the scheduler for our span while serving",
            "--link-probe-period": "seconds between measuring the links to a few servers holding our blocks "
            "(4 MB each; announced, for clients' cache hand-off decisions; 0: only from hand-offs)",
            "--next-ping-period": "seconds between pinging the servers that hold the block after ours "
            "(announced, for pricing chain sessions; 0: never)",
            "--direct-port": "port of the direct streams: TLS under this server's identity key, for peers "
            "that can reach it, so that their messages skip both p2p daemons (0: any free port)",
            "--no-direct-streams": "serve streams over libp2p only",
            "--direct-max-rtt": "push to a next server over its direct stream when its measured round "
            "trip is at most this many seconds",
        },
        field_names={"--session-timeout": "session_idle_timeout"},
    )
    parser.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's choice)")
    add_log_level_argument(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    start, end = args.blocks if args.blocks is not None else (None, None)
    model_config = load_config(resolve_model_argument(args))
    if args.blocks is not None:
        validate_span(start, end, family_for(model_config).num_blocks(model_config))
    # numbers are checked by ServerConfig itself (so code that builds one gets the same checks); the
    # ones that need the checkpoint or the hardware are checked here, before anything is loaded
    dht_options: dict = {}
    if args.announce_host:
        if args.port == 0:
            raise SwarmUserError("--announce-host needs a fixed --port (clients dial that port)")
        dht_options["announce_maddrs"] = [f"/ip4/{args.announce_host}/tcp/{args.port}"]
    device, dtype = device_and_dtype_from_args(args, model_config)
    check_quant_device(args.quant, device)
    adapters = tuple(AdapterSource.parse(text) for text in args.adapters)
    check_adapters(args.model_dir, adapters)  # a bad adapter is refused before the server joins
    requested = None if args.memory.strip().lower() == "auto" else parse_bytes(args.memory)
    return dataclass_from_args(
        ServerConfig,
        args,
        start=start,
        end=end,
        memory_bytes=server_memory_budget(requested, device),
        dht_prefix=dht_prefix_from_args(args),
        dtype=dtype_name(dtype),
        device=str(device),
        session_idle_timeout=args.session_timeout,
        scheduler_key=read_public_key(args.scheduler_key) if args.scheduler_key else None,
        swarm_secret=swarm_secret_from_args(args),
        extra_dht_options=dht_options,
        relay_peers=validate_relay_peers(args.relay_peers),
        serve_as_relay=args.relay_service,
        legacy_records=not args.no_legacy_records,
        adapters=adapters,
    )


def validate_relay_peers(maddrs: list[str]) -> list[str]:
    for maddr in maddrs:
        if "/p2p/" not in maddr or "/p2p-circuit" in maddr:
            raise SwarmUserError(f"--relay-peers takes multiaddrs ending in /p2p/<peer id>, got {maddr!r}")
    return maddrs


def run_server(config: ServerConfig, torch_threads: int | None = None) -> None:
    if torch_threads:
        torch.set_num_threads(torch_threads)
    terminate_like_interrupt()  # while loading: a SIGTERM still leaves the DHT through `finally`
    server = SwarmServer(config)
    try:
        server.start()
        # uvloop, as hivemind's own processes run: its TLS and sockets (Cython) cost less than
        # asyncio's Python ones; a direct stream's step took 0.29-0.32 ms of the server's CPU against
        # 0.31-0.34 ms (measured alternating)
        uvloop.run(server.serve())
    finally:
        server.shutdown()
        logger.info("stopped")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    run_cli("swarm-server", lambda: run_server(config_from_args(args), torch_threads=args.torch_threads))


if __name__ == "__main__":
    main()
