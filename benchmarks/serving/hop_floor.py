"""Where a hop's time goes on one host: the raw floors of moving a message there and back, against
our session step through a server whose blocks cost nothing, side by side in one run.

For each message size (one token's hidden states at a width, or a prompt of many tokens), the
median and the 99th percentile round trip of:

- `tcp`: a length-prefixed echo over a plain TCP socket on loopback (asyncio streams, another
  process);
- `grpc`: a bidirectional gRPC stream echo (grpcio, another process), the transport grpcio offers;
- `libp2p`: an echo over a libp2p stream through two of hivemind's p2p daemons (another process), the
  path every message of ours takes today;
- `step`: our session step through a real `swarm-server` whose span returns its input
  (`benchmarks.serving.identity_server`): the client's serialization and event loop, both daemons,
  the server's checks, batching engine and reply;
- `direct`: the same step over a direct stream (TLS straight to the server, no daemon);
- `direct protobuf`: the same again with the step and its answer as protobuf messages instead of step
  frames (`ClientOptions(step_frames=False)`, what servers that predate frames speak).

`step - libp2p` is what our protocol adds to its transport; `libp2p - tcp` is what the transport
adds to the socket; `direct - tcp` is what a hop costs us over the socket on a direct stream;
`protobuf - frames` is what step frames save on it.

    .venv/bin/python -m benchmarks.serving.hop_floor [--sizes 4096x1,8192x1,4096x512] [--count 300]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from benchmarks.common import publish_table

ECHO_METHOD = "/floor.Echo/Stream"
GRPC_OPTIONS = [("grpc.max_receive_message_length", 1 << 28), ("grpc.max_send_message_length", 1 << 28)]
KINDS = ("tcp", "grpc", "libp2p", "step", "direct", "direct protobuf")


# --- echo servers, each in a process of its own ----------------------------------------------------
def _tcp_server(ready: multiprocessing.Queue) -> None:
    async def serve() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    header = await reader.readexactly(4)
                    writer.write(header + await reader.readexactly(int.from_bytes(header, "big")))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        ready.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(serve())


def _grpc_server(ready: multiprocessing.Queue) -> None:
    import grpc

    async def serve() -> None:
        async def echo(requests, _context):
            async for message in requests:
                yield message

        server = grpc.aio.server(options=GRPC_OPTIONS)
        handler = grpc.method_handlers_generic_handler(
            "floor.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _libp2p_server(ready: multiprocessing.Queue) -> None:
    from hivemind.p2p import P2P

    async def serve() -> None:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

        async def echo(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await P2P.send_raw_data(await P2P.receive_raw_data(reader), writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        await p2p.add_binary_stream_handler("floor_echo", echo)
        ready.put([str(maddr) for maddr in await p2p.get_visible_maddrs()])
        await asyncio.Event().wait()

    asyncio.run(serve())


def _started(target: Callable[[multiprocessing.Queue], None]) -> tuple[multiprocessing.Process, object]:
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    process = context.Process(target=target, args=(ready,), daemon=True)
    process.start()
    return process, ready.get(timeout=60)


# --- the clients ------------------------------------------------------------------------------------
async def _timed(count: int, round_trip: Callable[[], Awaitable[None]]) -> list[float]:
    for _ in range(min(20, count)):  # warm-up: connections, allocations
        await round_trip()
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        await round_trip()
        samples.append(time.perf_counter() - started)
    return samples


async def tcp_round_trips(port: int, payload: bytes, count: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    message = len(payload).to_bytes(4, "big") + payload

    async def round_trip() -> None:
        writer.write(message)
        await writer.drain()
        await reader.readexactly(len(message))

    try:
        return await _timed(count, round_trip)
    finally:
        writer.close()


async def grpc_round_trips(port: int, payload: bytes, count: int) -> list[float]:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
        call = channel.stream_stream(ECHO_METHOD)()

        async def round_trip() -> None:
            await call.write(payload)
            await call.read()

        try:
            return await _timed(count, round_trip)
        finally:
            call.cancel()


async def libp2p_round_trips(maddrs: list[str], payload: bytes, count: int) -> list[float]:
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        peer = PeerID.from_base58(Multiaddr(maddrs[0]).value_for_protocol("p2p"))
        _, reader, writer = await p2p.call_binary_stream_handler(peer, "floor_echo")

        async def round_trip() -> None:
            await P2P.send_raw_data(payload, writer)
            await P2P.receive_raw_data(reader)

        try:
            return await _timed(count, round_trip)
        finally:
            writer.close()
    finally:
        await p2p.shutdown()


def step_round_trips(work: Path, width: int, tokens: int, count: int) -> dict[str, list[float]]:
    """Our session step, `tokens` x `width` float32 hidden states, through an identity server: over
    libp2p (`step`) and over a direct stream (`direct`)."""
    from harness.local_swarm import LocalSwarm
    from llm_swarm.client import AutoDistributedModelForCausalLM
    from llm_swarm.client.connection import run_sync
    from llm_swarm.client.options import ClientOptions
    from llm_swarm.client.stream import ServerStream, StepInput
    from llm_swarm.swarm.dht_keys import default_prefix
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
    from llm_swarm.swarm.route_request import RouteHop, SessionShape

    spec = TinyModelSpec(
        family="llama", num_layers=1, hidden_size=width, num_heads=32, num_kv_heads=8, intermediate_size=64
    )
    model_dir = build_tiny_model(work / f"identity-{width}", spec)
    decode = tokens == 1
    max_length = count + 40 if decode else tokens
    swarm = LocalSwarm(work / f"swarm-{width}-{tokens}")
    swarm.log_dir.mkdir(parents=True, exist_ok=True)
    model = None
    try:
        swarm.start_dht()
        module = ("benchmarks.serving.identity_server",)
        swarm.start_server(
            "identity", model_dir, "0:1", "4GB", "--max-length", str(max_length), module=module
        )
        swarm.wait_online(default_prefix(str(model_dir)), 1, ["identity"])
        hidden = torch.randn(1, tokens, width)
        samples = {}
        # a client with direct streams off, then one with them on, then one on them without frames
        for kind in ("step", "direct", "direct protobuf"):
            # a loaded machine's loopback ping may take tens of ms: every server counts as near here
            options = ClientOptions(
                direct_streams=kind != "step", direct_max_rtt=1.0, step_frames=kind != "direct protobuf"
            )
            model = AutoDistributedModelForCausalLM.from_pretrained(
                model_dir, swarm.initial_peers, options=options
            )
            connection = model.backend.connection
            (peer,) = list(run_sync(connection.roster.servers(refresh=True)))
            run_sync(connection.probes.rtt(peer))  # a near server: its streams go direct when allowed
            stream = ServerStream(
                RouteHop(peer, 0, 1), uuid.uuid4().hex, SessionShape(1, max_length, tokens, 1)
            )
            run_sync(stream.open(connection))
            path = "libp2p" if kind == "step" else "direct"
            assert connection.streams.opened[path] == 1, f"{kind}: not opened over {path}"
            position = 0

            async def round_trip(stream=stream) -> None:
                nonlocal position
                await stream.step(StepInput(hidden, position, None, None, None, 0), 60.0)
                stream.history.clear()  # what a failover would replay: not what this measures
                position = position + tokens if decode else 0

            samples[kind] = run_sync(_timed(count, round_trip))
            run_sync(stream.close_and_wait(5.0))
            model.shutdown()
            model = None
        return samples
    finally:
        if model is not None:
            model.shutdown()
        swarm.close()


# --- the report -------------------------------------------------------------------------------------
def measure(sizes: list[tuple[int, int]], count: int) -> list[dict]:
    tcp, tcp_port = _started(_tcp_server)
    grpc_server, grpc_port = _started(_grpc_server)
    libp2p, maddrs = _started(_libp2p_server)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-hop-floor-") as work:
            for width, tokens in sizes:
                payload = bytes(width * tokens * 4)  # float32 hidden states
                samples = {
                    "tcp": asyncio.run(tcp_round_trips(tcp_port, payload, count)),
                    "grpc": asyncio.run(grpc_round_trips(grpc_port, payload, count)),
                    "libp2p": asyncio.run(libp2p_round_trips(maddrs, payload, count)),
                    **step_round_trips(Path(work), width, tokens, count),
                }
                row = {"width": width, "tokens": tokens, "bytes": len(payload)}
                for kind, values in samples.items():
                    values.sort()
                    row[kind] = (statistics.median(values), values[int(0.99 * (len(values) - 1))])
                rows.append(row)
                print(row, flush=True)
    finally:
        for process in (tcp, grpc_server, libp2p):
            process.terminate()
            process.join(10)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| message | bytes | "
        + " | ".join(f"{kind} p50 / p99 (ms)" for kind in KINDS)
        + " | step - libp2p (p50) | libp2p - tcp (p50) | direct - tcp (p50) | protobuf - frames (p50) |",
        "|---|---:|" + "---:|" * len(KINDS) + "---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [f"{row[kind][0] * 1e3:.3f} / {row[kind][1] * 1e3:.3f}" for kind in KINDS]
        protocol, transport = row["step"][0] - row["libp2p"][0], row["libp2p"][0] - row["tcp"][0]
        direct = row["direct"][0] - row["tcp"][0]
        frames = row["direct protobuf"][0] - row["direct"][0]
        lines.append(
            f"| {row['tokens']} x {row['width']} | {row['bytes']:,} | "
            + " | ".join(cells)
            + f" | {protocol * 1e3:.3f} | {transport * 1e3:.3f} | {direct * 1e3:.3f} | {frames * 1e3:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4096x1,8192x1,4096x512", help="WIDTHxTOKENS, comma-separated")
    parser.add_argument("--count", type=int, default=300, help="round trips per kind and size")
    parser.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md")
    args = parser.parse_args()
    sizes = [tuple(int(part) for part in size.split("x")) for size in args.sizes.split(",")]
    rows = measure(sizes, args.count)
    text = (
        "One host, loopback, every echo server in a process of its own; float32 hidden states. `step`: "
        "our session step through a real server whose span returns its input "
        "(`benchmarks.serving.identity_server`), the client's own `ServerStream` driven on its event "
        "loop (`generate` adds one hand-off between threads per step), over libp2p by a client with "
        "direct streams off, and `direct` over a direct stream (TLS, the server's key checked), its steps "
        "as step frames, and `direct protobuf` the same as protobuf messages; "
        f"{args.count} round trips of each after 20 of warm-up."
    )
    publish_table(__file__, args, table(rows), "## Where a hop's time goes on one host", text)


if __name__ == "__main__":
    main()
