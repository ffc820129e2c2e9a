"""The RPCs of a block server as hivemind sees them: names, message types and which ones stream.

Clients take their stubs from here (`BlockRpc.get_stub`) and the server implements these methods
(`server/handler.py`), so neither imports the other. The messages inside are `swarm.wire`'s.
"""

from __future__ import annotations

from typing import AsyncIterator  # noqa: UP035  (hivemind detects streaming RPCs by typing's alias)

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

WIRE_NAME = "BlockServicer"  # the name in every handler's address on the wire


class BlockRpc(ServicerBase):
    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # one address for every subclass: the server's implementation and the clients' stubs agree
        handle = f"{WIRE_NAME}.{method_name}"
        return f"{namespace}::{handle}" if namespace else handle

    async def rpc_info(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """The server's `ServerInfo` (`InfoRequest` in, msgpack out): also the clients' ping."""
        raise NotImplementedError

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """An inference session: `Open`, then `Step`s, each answered (`Opened`, `StepDone` or `Error`)."""
        raise NotImplementedError
        yield  # an async generator, as the server's is

    async def rpc_forward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """`Forward` of whole sequences, nothing kept (training and session-less inference)."""
        raise NotImplementedError

    async def rpc_backward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """`Backward`: gradients of a forward, recomputed."""
        raise NotImplementedError

    async def rpc_report(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """`Report`: a client says this server's output was wrong (counted and logged)."""
        raise NotImplementedError
