"""The server's unary RPCs besides `info`: reports of wrong outputs, and training's forward and
backward of whole sequences (nothing kept between calls).

`UnaryRpcs` is a part of `BlockServicer` (server/handler.py): it uses the servicer's span, budget,
metrics, compute executor and the validation helpers shared by every RPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.memory import NoCacheRoom
from server.training import parse_sequence_call, run_backward, run_forward
from swarm.wire import (
    Ack,
    Backward,
    Computed,
    ErrorCode,
    Forward,
    ProtocolError,
    Report,
    decode_tensors,
    parse,
)

logger = logging.getLogger(__name__)

REPORT_WINDOW = 10.0  # seconds: one peer's reports of wrong outputs count at most once per window
MAX_REPORTERS = 10_000


class UnaryRpcs:
    """Reports and training calls of `BlockServicer` (see the module docstring)."""

    # --- reports of wrong outputs ---------------------------------------------------------------
    async def rpc_report(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A client says this server's output was wrong (outvoted by replicas, or malformed): counted
        and logged for the operator, nothing more (any client may send it; one per peer per window)."""
        try:
            report = parse(request.metadata, Report)
            self._check_proof(report.swarm_proof, context)
            self._check_blocks(report.start, report.end)
        except ProtocolError as error:
            return self._error(error.code, str(error))
        peer, now = str(context.remote_id), time.monotonic()
        if now - self._reported_at.get(peer, -REPORT_WINDOW) >= REPORT_WINDOW:
            if len(self._reported_at) >= MAX_REPORTERS:  # forget the old windows, never grow unbounded
                self._reported_at = {p: t for p, t in self._reported_at.items() if now - t < REPORT_WINDOW}
            self._reported_at[peer] = now
            self.metrics.wrong_output_reports.labels(reason=report.reason).inc()
            detail = (
                f"{report.relative_difference:.3g} relative difference from two agreeing replicas"
                if report.reason == "outvoted"
                else "NaN, infinity or a wrong shape"
            )
            logger.warning(
                "client %s reports this server's output for blocks %d:%d as wrong (%s): check the device, "
                "dtype and quantization",
                peer[-8:],
                report.start,
                report.end,
                detail,
            )
        return self._reply(Ack(), [])

    # --- training: forward and backward of whole sequences, nothing kept -----------------------------
    async def rpc_forward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """Run blocks [start, end) on whole sequences (no cache): inference without a session, and the
        forward pass of training."""
        return await self._sequence_call(request, context, backward=False)

    async def rpc_backward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """Gradients of blocks [start, end) with respect to their inputs (and deep prompts), the
        forward recomputed: nothing of a client's is kept between calls."""
        return await self._sequence_call(request, context, backward=True)

    async def _sequence_call(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext, backward: bool
    ) -> runtime_pb2.ExpertResponse:
        kind = "backward" if backward else "forward"
        owner = f"{kind}:{id(request)}"
        self.metrics.received.inc(request.ByteSize())
        try:
            if not self.accepting:
                raise ProtocolError(ErrorCode.NOT_SERVING, "this server is shutting down")
            size, limit = request.ByteSize(), 3 * self._message_limit(self.max_batch_size, self.max_length)
            if size > limit:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"message of {size:,} bytes exceeds the limit of {limit:,}"
                )
            message = parse(request.metadata, Backward if backward else Forward)
            self._check_proof(message.swarm_proof, context)
            self._check_blocks(message.start, message.end)
            adapter = self._check_adapter(message.adapter)
            call = parse_sequence_call(
                decode_tensors(request),
                message.start,
                message.end,
                backward=backward,
                with_prompts=message.prompts,
                hidden_size=self.span.hidden_size,
                max_batch_size=self.max_batch_size,
                max_length=self.max_length,
            )
            # activations: one block's at a time without autograd, every block's for a backward
            blocks = call.end - call.start if backward else 1
            needed = self.span.training_bytes(call.batch_size, call.num_tokens, blocks)
            self._check_peer_share(str(context.remote_id), needed)
            self.budget.reserve(owner, needed)
            started = time.perf_counter()
            compute = partial(run_backward if backward else run_forward, self.span, call, adapter)
            outputs = await asyncio.get_running_loop().run_in_executor(self.executor, compute)
            self.metrics.steps.labels(kind=kind).observe(time.perf_counter() - started)
            return self._reply(Computed(), outputs if backward else [outputs])
        except ProtocolError as error:
            return self._error(error.code, str(error))
        except NoCacheRoom as error:
            return self._error(ErrorCode.NO_CACHE_ROOM, str(error))
        except Exception as error:
            logger.exception("%s failed", kind)
            return self._error(
                ErrorCode.INTERNAL, f"{kind} failed on the server: {type(error).__name__}: {error}"
            )
        finally:
            self.budget.release(owner)
