"""Tensors on the wire: hivemind's uncompressed `runtime_pb2.Tensor` (raw bytes, shape, dtype name),
written and read without its compression framework, and the finiteness check every receiver makes.

The bytes are hivemind's own, so peers that use `hivemind.compression` read what we write and the
other way round; a tensor in another compression, or bfloat16 in hivemind's legacy float32 form, is
left to hivemind. The framework costs a dozen Python calls and three torch operations per tensor;
a one-token step sends one small tensor each way per hop, where those calls cost more than its bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

# the dtypes a tensor travels in; their order is also the step frames' dtype codes
# (`swarm.step_frame`), so it is never reordered, only appended to
WIRE_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in WIRE_DTYPES}
_NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)  # numpy checks these without torch
_all_true = np.logical_and.reduce


def write_tensor(proto: runtime_pb2.Tensor, tensor: torch.Tensor) -> None:
    """Fill `proto` (a message's own field, so that the bytes are copied into it once, not into a
    tensor message and again into the message) with a host tensor in hivemind's uncompressed format
    (bfloat16 as its raw 16-bit words)."""
    proto.compression = runtime_pb2.CompressionType.NONE
    proto.buffer = bytes(host_bytes(tensor))
    proto.size.extend(tensor.shape)
    proto.dtype = str(tensor.dtype).removeprefix("torch.")
    proto.requires_grad = tensor.requires_grad


def host_bytes(tensor: torch.Tensor) -> memoryview | bytes:
    """A tensor's bytes in C order (bfloat16 as its raw 16-bit words), without a copy where it is a
    contiguous host tensor: a view of the tensor's own memory."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)  # numpy has no bfloat16: the same bits under a 2-byte type
    return tensor.numpy().data.cast("B") if tensor.numel() else b""


def tensor_from_proto(message: runtime_pb2.Tensor) -> torch.Tensor:
    """The tensor a `runtime_pb2.Tensor` holds, in memory of its own; ValueError if the bytes do not
    make the shape."""
    dtype = _DTYPES.get(message.dtype)
    if message.compression != runtime_pb2.CompressionType.NONE or dtype is None:
        return deserialize_torch_tensor(message)  # hivemind's other formats (it raises on garbage)
    shape = tuple(message.size)
    numel = math.prod(shape)
    if len(message.buffer) != numel * dtype.itemsize:
        if dtype == torch.bfloat16:
            return deserialize_torch_tensor(message)  # bfloat16 sent as float32 (hivemind's legacy mode)
        raise ValueError(f"{len(message.buffer)} bytes do not make a {message.dtype} tensor of {shape}")
    if numel == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:  # a writable copy: the message's bytes are immutable
        tensor = torch.frombuffer(bytearray(message.buffer), dtype=dtype).view(shape)
    return tensor.requires_grad_(True) if message.requires_grad and dtype.is_floating_point else tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in `tensor` (numpy for host floats it can view: one call, not three;
    the reduction called directly, not through `ndarray.all`'s Python wrapper)."""
    if tensor.is_cpu and tensor.dtype in _NUMPY_FLOATS:
        array = (tensor.detach() if tensor.requires_grad else tensor).numpy()
        return bool(_all_true(np.isfinite(array), axis=None))
    return bool(torch.isfinite(tensor).all())
