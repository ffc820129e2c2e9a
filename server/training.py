"""Training through the swarm, server side: the forward and backward of whole sequences.

Nothing is kept between calls: the backward recomputes the forward (with autograd on) from the
inputs the client sends again, so a server holds a client's activations only while one call runs,
and never its gradients. The blocks' weights are frozen; gradients reach only the hidden states
and the deep prompts the client sent. Validation is pure and lives here; the handler does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_swarm.server.session import check_hidden, check_padding_mask, check_prompts
from llm_swarm.swarm.models.adapters import adapter_rows
from llm_swarm.swarm.models.span import TransformerSpan
from llm_swarm.swarm.wire import ErrorCode, ProtocolError


@dataclass(frozen=True)
class SequenceCall:
    """A validated forward or backward request over absolute blocks `[start, end)`."""

    start: int
    end: int
    hidden: torch.Tensor  # [batch, tokens, hidden]
    padding_mask: torch.Tensor | None  # [batch, tokens], 1 = real token
    prompts: torch.Tensor | None  # [end - start, batch or 1, prefix, hidden]
    grad_output: torch.Tensor | None  # backward only: d loss / d output, like `hidden`

    @property
    def batch_size(self) -> int:
        return self.hidden.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[1]


def parse_sequence_call(
    tensors: list[torch.Tensor],
    start: int,
    end: int,
    *,
    backward: bool,
    with_prompts: bool,
    hidden_size: int,
    max_batch_size: int,
    max_length: int,
) -> SequenceCall:
    """Check a forward's or backward's tensors (see `swarm.wire.Forward` / `Backward` for the layout)."""
    expected = 1 + backward + with_prompts
    if len(tensors) not in (expected, expected + 1):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"a {'backward' if backward else 'forward'} {'with' if with_prompts else 'without'} prompts "
            f"carries {expected} or {expected + 1} tensors, got {len(tensors)}",
        )
    hidden = check_hidden(tensors[0], hidden_size, "hidden states")
    batch, tokens, _ = hidden.shape
    if not 1 <= batch <= max_batch_size:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"batch size {batch} is outside 1..{max_batch_size}")
    if not 1 <= tokens <= max_length:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{tokens} tokens are outside 1..{max_length}")
    rest = tensors[1:]
    grad_output = None
    if backward:
        grad_output = check_hidden(rest.pop(0), hidden_size, "output gradients")
        if grad_output.shape != hidden.shape:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"output gradients of shape {tuple(grad_output.shape)} do not match the hidden states "
                f"{tuple(hidden.shape)}",
            )
    prompts = check_prompts(rest.pop(), end - start, batch, hidden_size, tokens) if with_prompts else None
    padding_mask = check_padding_mask(rest[0], batch, tokens) if rest else None
    return SequenceCall(start, end, hidden, padding_mask, prompts, grad_output)


def run_forward(span: TransformerSpan, call: SequenceCall, adapter: str | None = None) -> torch.Tensor:
    """The blocks' output, in the request's dtype, on the CPU (for the wire); `adapter`: a LoRA
    adapter the span holds, applied to every row."""
    with torch.no_grad(), adapter_rows(span, [adapter] * call.batch_size):
        output = span.forward_sequence(call.hidden, call.start, call.end, call.padding_mask, call.prompts)
    return output.to("cpu", call.hidden.dtype)


def run_backward(span: TransformerSpan, call: SequenceCall, adapter: str | None = None) -> list[torch.Tensor]:
    """Gradients of the hidden states (and of the prompts, if sent) given the output's gradient."""
    with torch.enable_grad(), adapter_rows(span, [adapter] * call.batch_size):
        hidden = call.hidden.to(span.device, span.dtype).detach().requires_grad_()
        leaves = [hidden]
        prompts = None
        if call.prompts is not None:
            prompts = call.prompts.to(span.device, span.dtype).detach().requires_grad_()
            leaves.append(prompts)
        output = span.forward_sequence(hidden, call.start, call.end, call.padding_mask, prompts)
        grads = torch.autograd.grad(output, leaves, call.grad_output.to(output))
    originals = [call.hidden] + ([call.prompts] if call.prompts is not None else [])
    return [grad.to("cpu", original.dtype) for grad, original in zip(grads, originals, strict=True)]
