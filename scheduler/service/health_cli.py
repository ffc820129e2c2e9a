"""`swarm-health`: the status page of a swarm without a scheduler, from the DHT alone.

Shows the same page and JSON as the scheduler's (servers, spans, coverage, cache slots), minus
what only a scheduler knows (placement policy, R, the eq. 17 bound, request metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

from hivemind.dht import DHT

from llm_swarm.scheduler.service.model_args import model_from_args
from llm_swarm.scheduler.service.status import announced_capacity, describe_servers
from llm_swarm.scheduler.service.view import ModelShape, SwarmView
from llm_swarm.scheduler.service.web import make_app, start_web
from llm_swarm.swarm.cli.args import (
    add_model_config_arguments,
    add_swarm_secret_argument,
    command_parser,
    dht_prefix_from_args,
    swarm_secret_from_args,
)
from llm_swarm.swarm.cli.errors import run_cli
from llm_swarm.swarm.cli.logs import add_log_level_argument, configure_logging
from llm_swarm.swarm.cli.signals import stop_on_signals, terminate_like_interrupt
from llm_swarm.swarm.dht_peer import start_dht
from llm_swarm.swarm.dht_records import fetch_roster_async
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.until_stop import DHT_READ_TIMEOUT, Stopped, until_stop

logger = logging.getLogger(__name__)

EXAMPLES = """examples:
  swarm-health --initial-peers $(head -1 dht.maddrs) --model-dir models/tiny-llama --port 8080
  swarm-health --initial-peers $(head -1 dht.maddrs) --model-dir models/tiny-llama --json   # print once
"""


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "swarm-health", "Serve a status page (and /api/status JSON) of a swarm, read from its DHT.", EXAMPLES
    )
    add_model_config_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address the page is served on")
    parser.add_argument("--port", type=int, default=8080, help="port (0 = any free port)")
    parser.add_argument("--refresh", type=float, default=2.0, help="seconds between DHT reads")
    parser.add_argument("--json", action="store_true", help="print the status as JSON once and exit")
    parser.add_argument("--address-file", help="write the page's URL here once serving")
    add_swarm_secret_argument(parser)
    add_log_level_argument(parser)
    return parser


class HealthMonitor:
    def __init__(self, dht: DHT, prefix: str, shape: ModelShape, limits: ModelLimits):
        self.dht, self.prefix, self.limits = dht, prefix, limits
        self.view = SwarmView(shape, l_in=1, l_out=1)  # cache slots counted per token of context
        self.updated_at = 0.0

    async def refresh(self) -> None:
        self.view.records = await fetch_roster_async(self.dht, self.prefix, self.limits)
        self.updated_at = time.monotonic()

    async def status(self) -> dict:
        capacity, in_use = announced_capacity(self.view)
        described = describe_servers(self.view, {}, capacity, in_use)
        return {
            "policy": "none (no scheduler)",
            "epoch": 0,
            "num_blocks": self.view.shape.num_blocks,
            "num_requests": 0,
            "bound": -1.0,
            "arrival_rate": 0.0,
            **described,
            "active_sessions": sum(s["active_sessions"] for s in described["servers"]),
            "waiting_sessions": 0,
            "plan_input": None,
            "plan_output": None,
            "uptime": 0.0,
        }


async def serve(args: argparse.Namespace, prefix: str, shape: ModelShape, limits: ModelLimits) -> None:
    dht = start_dht(args.initial_peers, secret=swarm_secret_from_args(args))
    try:
        monitor = HealthMonitor(dht, prefix, shape, limits)
        await monitor.refresh()
        if args.json:
            print(json.dumps(await monitor.status(), indent=2))
            return
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        stop_on_signals(loop, stop.set)
        app = make_app(monitor.status, f"llm-swarm: {prefix}", "health monitor (DHT only)")
        runner, port = await start_web(app, args.host, args.port)
        url = f"http://{args.host}:{port}/"
        logger.info("status page of %s at %s", prefix, url)
        if args.address_file:
            with open(args.address_file, "w") as file:
                file.write(url + "\n")
        try:
            while not stop.is_set():
                try:  # bounded, and given up at a stop (a DHT that stopped answering must not hold it)
                    await until_stop(monitor.refresh(), stop, DHT_READ_TIMEOUT)
                except Stopped:
                    break
                except Exception as error:  # keep serving the last view; the next read may work
                    logger.warning("reading the DHT failed: %s", error or type(error).__name__)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=args.refresh)
                except TimeoutError:
                    pass
        finally:
            await runner.cleanup()
    finally:
        dht.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)

    def run() -> None:
        if args.refresh <= 0 or not 0 <= args.port <= 65535:
            raise SwarmUserError("--refresh must be positive and --port in 0..65535")
        shape, limits = model_from_args(args)
        terminate_like_interrupt()  # while joining: a SIGTERM still leaves the DHT through `finally`
        asyncio.run(serve(args, dht_prefix_from_args(args), shape, limits))

    run_cli("swarm-health", run)


if __name__ == "__main__":
    main()
