"""`swarm-api`: serve an OpenAI-compatible API (and a chat page) for a model whose blocks run in a swarm."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from aiohttp import web
from transformers import AutoTokenizer

from llm_swarm.client.api.app import SwarmApi
from llm_swarm.client.api.config import ApiConfig
from llm_swarm.client.connection import ClientOptions
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.client.speculation.assistant import load_assistant
from llm_swarm.swarm.cli.args import (
    add_model_source_arguments,
    add_swarm_secret_argument,
    command_parser,
    dht_prefix_from_args,
    resolve_model_argument,
    swarm_secret_from_args,
)
from llm_swarm.swarm.cli.dataclass_args import dataclass_from_args
from llm_swarm.swarm.cli.errors import run_cli
from llm_swarm.swarm.cli.logs import add_log_level_argument, configure_logging
from llm_swarm.swarm.cli.signals import stop_on_signals, terminate_like_interrupt

logger = logging.getLogger("swarm-api")

EXAMPLES = """examples:
  swarm-api models/tiny-llama --initial-peers $(head -1 dht.maddrs) --port 8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 20}'
"""


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "swarm-api",
        "An OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) "
        "and a chat page at /, generating through the swarm.",
        EXAMPLES,
    )
    parser.add_argument(
        "model_dir", help="the model: a local checkpoint directory or a Hub id (client modules, tokenizer)"
    )
    add_model_source_arguments(parser)
    parser.add_argument(
        "--initial-peers", nargs="+", required=True, help="multiaddrs of the swarm's DHT peers"
    )
    parser.add_argument("--dht-prefix", help="the model's swarm namespace (default: the directory's name)")
    parser.add_argument("--model-name", help="the model id clients pass (default: the DHT prefix)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (logged)")
    parser.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (at least 8 characters)"
    )
    parser.add_argument("--api-key-file", type=Path, help="read the API key from this file instead")
    parser.add_argument("--max-concurrent", type=int, default=16, help="generations running at once")
    parser.add_argument(
        "--max-queued", type=int, default=64, help="requests waiting beyond those; more get 429"
    )
    parser.add_argument("--max-tokens", type=int, default=1024, help="the most tokens a request may ask for")
    parser.add_argument("--max-context", type=int, default=2048, help="prompt + completion tokens, at most")
    parser.add_argument(
        "--max-request-tokens",
        type=int,
        default=16384,
        help="prompt + max_tokens summed over a request's choices (prompts times n), at most",
    )
    parser.add_argument("--scheduler-key", help="route through the scheduler whose records this key signs")
    parser.add_argument(
        "--wait-for-servers",
        type=float,
        default=ClientOptions.wait_for_servers,
        help="seconds a request waits for some server to cover blocks nobody serves before it is answered "
        "503",
    )
    parser.add_argument(
        "--verify-fraction", type=float, default=0.0, help="replica verification (see swarm-generate)"
    )
    parser.add_argument(
        "--assistant",
        type=Path,
        metavar="MODEL_DIR",
        help="speculative decoding for every request: a small local model with the same tokenizer drafts, "
        "the swarm verifies several tokens per round trip (same outputs; docs/speculative.md)",
    )
    add_swarm_secret_argument(parser)
    add_log_level_argument(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ApiConfig:
    args.model_dir = Path(resolve_model_argument(args, tokenizer=True))
    prefix = dht_prefix_from_args(args)
    api_key = args.api_key
    if args.api_key_file is not None:
        api_key = args.api_key_file.read_text().strip()
    options = dataclass_from_args(ClientOptions, args, swarm_secret=swarm_secret_from_args(args))
    return dataclass_from_args(
        ApiConfig,
        args,
        initial_peers=tuple(args.initial_peers),
        model_name=args.model_name or prefix,
        dht_prefix=prefix,
        api_key=api_key,
        options=options,
    )


async def serve(config: ApiConfig, model, tokenizer, assistant=None) -> None:
    api = SwarmApi(config, model, tokenizer, assistant)
    runner = web.AppRunner(api.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor for port 0
    logger.info(
        "OpenAI-compatible API at http://%s:%d/v1 for model %r (chat page at /, %d concurrent, key %s)",
        config.host,
        port,
        config.model_name,
        config.max_concurrent,
        "required" if config.api_key else "not required",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    stop_on_signals(loop, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down: closing the API and the swarm client")
        await runner.cleanup()


def run(args: argparse.Namespace) -> None:
    configure_logging(args.log_level)
    terminate_like_interrupt()  # SIGTERM during start-up still runs the cleanup below
    config = config_from_args(args)
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    model = DistributedModelForCausalLM.from_pretrained(
        config.model_dir, list(config.initial_peers), dht_prefix=config.dht_prefix, options=config.options
    )
    try:
        assistant = None
        if args.assistant is not None:
            assistant = load_assistant(args.assistant, model.config, model.dtype, model.device)
            logger.info("speculative decoding with the draft model %s", args.assistant)
        asyncio.run(serve(config, model, tokenizer, assistant))
    finally:
        model.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_cli("swarm-api", lambda: run(args))


if __name__ == "__main__":
    main()
