"""Training through the swarm, client side: forward and backward of whole sequences over a chain.

The forward routes a chain over the blocks and calls each server's forward RPC in turn, keeping
every hop's input: that is all the backward needs, since servers keep nothing and recompute. The
backward walks the hops in reverse with the output gradient. A failed server is banned and only
its blocks are redone elsewhere: in the forward the rest of the chain is re-routed from there; in
the backward a replacement chain for its blocks is first run forward from the kept input (for its
own hops' inputs), then backward. `SequenceFunction` wraps both as one autograd operation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from llm_swarm.client.connection import SwarmConnection, SwarmUnavailable, run_sync
from llm_swarm.client.stream import FATAL_CODES, StreamFailure
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.tensor_wire import all_finite
from llm_swarm.swarm.wire import (
    Backward,
    Computed,
    Error,
    ErrorCode,
    Forward,
    RemoteError,
    decode_tensors,
    encode,
    parse,
)

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 3 * 1024 * 1024  # hivemind's unary messages are capped at 4 MiB: larger batches split


@dataclass(frozen=True)
class SequenceInputs:
    """What every hop of one forward/backward shares; `prompts` cover absolute blocks from `prompts_start`."""

    padding_mask: torch.Tensor | None
    prompts: torch.Tensor | None
    prompts_start: int

    def prompts_for(self, hop: RouteHop) -> torch.Tensor | None:
        if self.prompts is None:
            return None
        return self.prompts[hop.start - self.prompts_start : hop.end - self.prompts_start]


@dataclass(frozen=True)
class HopInput:
    hop: RouteHop
    hidden: torch.Tensor


async def sequence_forward(
    connection: SwarmConnection, start: int, end: int, hidden: torch.Tensor, shared: SequenceInputs
) -> tuple[torch.Tensor, list[HopInput]]:
    """Blocks `[start, end)` on `hidden`; returns the output and each hop's input (for the backward)."""
    shape = _shape(hidden)
    block, done, failures = start, [], 0
    deadline = time.monotonic() + connection.options.wait_for_room
    while block < end:
        chain = await connection.chains.route(block, end, shape)
        for hop in chain:
            try:
                (output,) = await _call(connection, hop, hidden, None, shared)
            except Exception as error:
                failures = _failed(connection, hop, error, failures, deadline)
                break  # re-route the rest from this block
            done.append(HopInput(hop, hidden))
            hidden, block = output, hop.end
    return hidden, done


async def sequence_backward(
    connection: SwarmConnection,
    hops: list[HopInput],
    grad_output: torch.Tensor,
    shared: SequenceInputs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the hidden states at the first hop and of the prompts (None without prompts)."""
    pending = list(hops)
    grad_prompts = torch.zeros_like(shared.prompts) if shared.prompts is not None else None
    failures = 0
    deadline = time.monotonic() + connection.options.wait_for_room
    while pending:
        hop_input = pending.pop()
        hop = hop_input.hop
        try:
            grads = await _call(connection, hop, hop_input.hidden, grad_output, shared)
        except Exception as error:
            failures = _failed(connection, hop, error, failures, deadline)
            _output, replacement = await sequence_forward(
                connection, hop.start, hop.end, hop_input.hidden, shared
            )
            pending.extend(replacement)
            continue
        grad_output = grads[0]
        if grad_prompts is not None:
            offset = shared.prompts_start
            grad_prompts[hop.start - offset : hop.end - offset] += grads[1]
    return grad_output, grad_prompts


def _shape(hidden: torch.Tensor) -> SessionShape:
    tokens = hidden.shape[1]
    return SessionShape(batch_size=hidden.shape[0], max_length=tokens, l_in=tokens, l_out=1)


def _failed(
    connection: SwarmConnection, hop: RouteHop, error: Exception, failures: int, deadline: float
) -> int:
    """Count a failed call and ban its server (unless our own request is wrong: then raise)."""
    if isinstance(error, RemoteError) and error.code in FATAL_CODES:
        raise error
    if isinstance(error, RemoteError) and error.code == ErrorCode.NO_CACHE_ROOM:
        connection.refused(hop.peer_id, error.message)
        if time.monotonic() > deadline:
            raise SwarmUnavailable(
                f"servers of blocks {hop.start}:{hop.end} kept refusing: {error}"
            ) from error
        return failures
    connection.blame(hop.peer_id, error)
    failures += 1
    if failures > connection.options.max_failovers:
        raise SwarmUnavailable(
            f"blocks {hop.start}:{hop.end} failed {failures} times in one call; last error: {error}"
        ) from error
    return failures


async def _call(
    connection: SwarmConnection,
    hop: RouteHop,
    hidden: torch.Tensor,
    grad_output: torch.Tensor | None,
    shared: SequenceInputs,
) -> list[torch.Tensor]:
    """One forward (grad_output None) or backward RPC on one server, split by rows if too large."""
    prompts = shared.prompts_for(hop)
    rows = hidden.shape[0]
    per_row = hidden[:1].nbytes * (1 if grad_output is None else 2)
    if prompts is not None:
        per_row += prompts[:, :1].nbytes
    chunk = max(1, MAX_MESSAGE_BYTES // max(per_row, 1))
    if rows > chunk:
        parts = [
            await _call(
                connection,
                hop,
                hidden[first : first + chunk],
                grad_output[first : first + chunk] if grad_output is not None else None,
                _rows(shared, first, first + chunk, rows),
            )
            for first in range(0, rows, chunk)
        ]
        merged = [torch.cat([part[0] for part in parts])]
        if grad_output is not None and prompts is not None:
            per_sequence = prompts.shape[1] == rows
            grads = [part[1] for part in parts]
            merged.append(torch.cat(grads, dim=1) if per_sequence else torch.stack(grads).sum(0))
        return merged
    tensors = [hidden] + ([grad_output] if grad_output is not None else [])
    if shared.padding_mask is not None:
        tensors.append(shared.padding_mask)
    if prompts is not None:
        tensors.append(prompts)
    kind = Forward if grad_output is None else Backward
    message = kind(
        start=hop.start,
        end=hop.end,
        prompts=prompts is not None,
        swarm_proof=connection.swarm_proof(hop.peer_id),
        adapter=connection.options.active_adapter or "",
    )
    rpc = (
        connection.stub(hop.peer_id).rpc_forward
        if grad_output is None
        else connection.stub(hop.peer_id).rpc_backward
    )
    try:
        response = await rpc(encode(message, tensors), timeout=connection.options.request_timeout)
    except Exception as error:
        raise StreamFailure(hop.peer_id, error) from error
    reply = parse(response.metadata, Computed, Error)
    if isinstance(reply, Error):
        raise RemoteError(reply.code, reply.message, hop.peer_id)
    outputs = decode_tensors(response)
    expected = [hidden] + ([prompts] if grad_output is not None and prompts is not None else [])
    problem = _outputs_problem(outputs, expected)
    if problem is not None:
        raise StreamFailure(
            hop.peer_id, f"the server answered {problem}", wrong_output=True, blocks=(hop.start, hop.end)
        )
    return outputs


def _rows(shared: SequenceInputs, first: int, last: int, rows: int) -> SequenceInputs:
    prompts = shared.prompts
    if prompts is not None and prompts.shape[1] == rows:
        prompts = prompts[:, first:last]
    mask = shared.padding_mask[first:last] if shared.padding_mask is not None else None
    return dataclasses.replace(shared, padding_mask=mask, prompts=prompts)


def _outputs_problem(outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> str | None:
    if len(outputs) != len(expected):
        return f"{len(outputs)} tensors instead of {len(expected)}"
    for output, like in zip(outputs, expected, strict=True):
        if output.shape != like.shape or output.dtype != like.dtype:
            got = f"{output.dtype} {tuple(output.shape)}"
            return f"a {got} tensor for a {like.dtype} {tuple(like.shape)}"
        if not all_finite(output):
            return "NaN or infinity"
    return None


class SequenceFunction(torch.autograd.Function):
    """Blocks `[start, end)` of the swarm as one differentiable operation of the hidden states and the
    deep prompts (`[end - start, batch or 1, prefix, hidden]`)."""

    @staticmethod
    def forward(ctx, hidden, prompts, padding_mask, connection, start, end):
        shared = SequenceInputs(
            padding_mask.detach().cpu() if padding_mask is not None else None,
            prompts.detach().cpu() if prompts is not None else None,
            start,
        )
        output, hops = run_sync(sequence_forward(connection, start, end, hidden.detach().cpu(), shared))
        ctx.connection, ctx.shared, ctx.hops = connection, shared, hops
        ctx.devices = (hidden.device, hidden.dtype, prompts.device if prompts is not None else None)
        return output.to(hidden.device, hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        device, dtype, prompts_device = ctx.devices
        grad_output = grad_output.detach().to("cpu", dtype).contiguous()
        grad_hidden, grad_prompts = run_sync(
            sequence_backward(ctx.connection, ctx.hops, grad_output, ctx.shared)
        )
        if grad_prompts is not None:
            grad_prompts = grad_prompts.to(prompts_device)
        return grad_hidden.to(device), grad_prompts, None, None, None, None
