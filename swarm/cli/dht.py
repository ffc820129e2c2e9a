"""`swarm-dht`: a bootstrap DHT peer that servers and clients join."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from llm_swarm.swarm.cli.args import add_swarm_secret_argument, swarm_secret_from_args
from llm_swarm.swarm.cli.errors import run_cli
from llm_swarm.swarm.cli.logs import add_log_level_argument, configure_logging
from llm_swarm.swarm.cli.signals import stop_on_signals, terminate_like_interrupt
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.dht_peer import dht_options
from llm_swarm.swarm.dht_process import SwarmDHT
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.p2p_daemon_flags import daemon_flags, relay_flags
from llm_swarm.swarm.reachability import DialBackService

logger = logging.getLogger(__name__)

EXAMPLES = """example:
  swarm-dht --host 127.0.0.1 --port 0 --maddr-file dht.maddrs
  swarm-server models/tiny-llama --initial-peers $(head -1 dht.maddrs) --blocks 0:3 --memory 1GB
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="swarm-dht",
        description="Run a bootstrap peer of the swarm's DHT until SIGINT/SIGTERM.",
        fromfile_prefix_chars="@",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0 = any free port)")
    parser.add_argument(
        "--initial-peers", nargs="*", default=[], help="multiaddrs of other DHT peers to join"
    )
    parser.add_argument("--maddr-file", type=Path, help="write the visible multiaddrs here, one per line")
    parser.add_argument("--identity-path", help="private key file, so the peer id survives restarts")
    add_swarm_secret_argument(parser)
    parser.add_argument(
        "--new-swarm-secret",
        action="store_true",
        help="with --swarm-secret FILE: write a new random secret to FILE first (closed swarms)",
    )
    parser.add_argument(
        "--announce-host",
        help="public IPv4 address peers should dial (behind NAT or when listening on 0.0.0.0)",
    )
    parser.add_argument(
        "--no-relay",
        action="store_true",
        help="do not relay for servers behind NAT (by default this public peer relays, bounded: 64 "
        "reservations, 8 circuits per peer, 30 min and 4 GiB per circuit)",
    )
    add_log_level_argument(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    run_cli("swarm-dht", lambda: run(args))


def run(args: argparse.Namespace) -> None:
    terminate_like_interrupt()  # until serving: a SIGTERM still stops what was started
    if args.new_swarm_secret:
        if not args.swarm_secret:
            raise SwarmUserError("--new-swarm-secret needs --swarm-secret FILE (where to write it)")
        if Path(args.swarm_secret).exists():
            raise SwarmUserError(f"{args.swarm_secret} exists: refusing to replace a swarm's secret")
        SwarmSecret.generate(args.swarm_secret)
    # every node of ours validates records; a bootstrap peer stores many, so it matters most here
    options: dict = dht_options(None, swarm_secret_from_args(args))
    if args.identity_path:
        options["identity_path"] = args.identity_path
    if args.announce_host:
        if args.port == 0:
            raise SwarmUserError("--announce-host needs a fixed --port (peers dial that port)")
        options["announce_maddrs"] = [f"/ip4/{args.announce_host}/tcp/{args.port}"]
    if not args.no_relay:
        # libp2p runs a relay only on a peer it believes public; a bootstrap peer is, by definition
        options["force_reachability"] = "public"
    with daemon_flags(relay_flags(not args.no_relay)):
        dht = SwarmDHT(
            initial_peers=args.initial_peers,
            host_maddrs=[f"/ip4/{args.host}/tcp/{args.port}"],
            start=True,
            **options,
        )
    try:
        asyncio.run(_serve(dht, args))
    finally:
        dht.shutdown()


async def _serve(dht: SwarmDHT, args: argparse.Namespace) -> None:
    """Answer servers' dial-back checks (swarm.reachability) until stopped."""
    stop = asyncio.Event()
    stop_on_signals(asyncio.get_running_loop(), stop.set)
    p2p = await dht.replicate_p2p()
    await DialBackService(p2p).add_p2p_handlers(p2p)
    maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
    if args.maddr_file:
        temporary = args.maddr_file.with_suffix(".tmp")
        temporary.write_text("".join(f"{maddr}\n" for maddr in maddrs))
        temporary.replace(args.maddr_file)  # readers never see a half-written file
    print("\n".join(maddrs), flush=True)
    logger.info("relaying for servers behind NAT: %s", "no" if args.no_relay else "yes (bounded)")
    await stop.wait()
    logger.info("stopping")
    await p2p.shutdown()


if __name__ == "__main__":
    main()
