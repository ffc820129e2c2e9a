"""A test's own peer speaking a server's binary stream protocol directly (hand-off pushes, link probes):
the requests (protobuf messages or step frames) go as they are, however hostile, and the replies come
back as their types."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from hivemind.p2p import PeerID

from llm_swarm.swarm.block_rpc import BlockRpc
from llm_swarm.swarm.framing import receive_reply, send_message
from llm_swarm.swarm.step_frame import StepFrame, decode_frame
from llm_swarm.swarm.wire import StepDone, decode_metadata


async def exchange(
    connection,
    peer_id: str,
    handle: str,
    requests: list,
    read_more: Callable[[list[str]], bool],
    hold: threading.Event | None = None,
) -> list[str]:
    """Send `requests` on the `handle` stream of `peer_id`; then read replies while `read_more(kinds)`,
    each as its type (an error as "error: MESSAGE", the stream's end as "closed"). `hold`: read
    nothing, keep the stream open until it is set (a stalled sender)."""
    name = BlockRpc._get_handle_name(connection.prefix, handle)
    _, reader, writer = await connection.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
    kinds: list[str] = []
    try:
        try:
            for request in requests:
                await send_message(request, writer)
        except ConnectionError:  # the server refused early and ended the stream: its error is still to read
            pass
        if hold is not None:
            while not hold.is_set():
                await asyncio.sleep(0.05)
            return kinds
        while read_more(kinds):
            response, _ = await asyncio.wait_for(receive_reply(reader), 30)
            if isinstance(response, StepFrame):
                kinds.append(decode_frame(response, StepDone)[0].type)
                continue
            metadata = decode_metadata(response.metadata)
            kinds.append(metadata["type"] if metadata["type"] != "error" else f"error: {metadata['message']}")
    except (asyncio.IncompleteReadError, ConnectionError):  # the server ended the stream on an error
        kinds.append("closed")
    finally:
        writer.close()
    return kinds
