"""Closed swarms: the scheduler answers only callers that prove they hold the swarm secret.

Every call carries a timed HMAC of the secret in its metadata (`swarm.closed_swarm`); anything else
is refused with UNAUTHENTICATED before it reaches the API.
"""

from __future__ import annotations

import grpc

from llm_swarm.swarm.closed_swarm import PROOF_METADATA_KEY, SwarmSecret


class SwarmProofInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, secret: SwarmSecret):
        self.secret = secret

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        proof = metadata.get(PROOF_METADATA_KEY, "")
        if isinstance(proof, str) and self.secret.check_timed_proof(proof, "scheduler"):
            return await continuation(handler_call_details)
        return _refusal(await continuation(handler_call_details))


def _refusal(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape as `handler` that refuses the call."""
    if handler is None:
        return None

    async def refuse(_request, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "this scheduler serves a closed swarm: the call does not prove the swarm secret",
        )

    return grpc.unary_unary_rpc_method_handler(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
