"""A server that dies in the middle of a cache hand-off, for tests only:
`python -m tests.faulty_handoff_server MODE SERVER_ARGS...`.

MODE `die-pushing`: asked to hand a session off, it sends the push's header and first chunk, then its
process group is killed at once (like a machine that loses power half-way). MODE `die-receiving`: receiving a
pushed cache, it dies so after the first chunk. Everything else is the real `swarm-server`.
"""

from __future__ import annotations

import os
import signal
import sys

from llm_swarm.server import cache_receiver, cache_sender, handler


def _power_loss() -> None:
    """The server and everything it started (its DHT process, p2pd) stop at once."""
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    mode = sys.argv.pop(1)
    if mode == "die-pushing":
        honest_send = cache_sender.P2P.send_protobuf

        async def send_then_die(message, writer):
            await honest_send(message, writer)
            if b"cache_chunk" in message.metadata:
                await writer.drain()
                _power_loss()

        cache_sender.P2P.send_protobuf = staticmethod(send_then_die)
    elif mode == "die-receiving":
        honest_receive = cache_receiver.receive_cache

        async def receive_then_die(*args, **kwargs):
            async for response in honest_receive(*args, **kwargs):
                if b"chunk_ack" in response.metadata:
                    _power_loss()
                yield response

        handler.receive_cache = receive_then_die
    else:
        raise SystemExit(f"unknown mode {mode!r}: die-pushing or die-receiving")
    from llm_swarm.server.cli import main as server_main

    server_main()


if __name__ == "__main__":
    main()
