"""Tensors on the wire (swarm/tensor_wire.py) are hivemind's own format: what hivemind's
`serialize_torch_tensor` writes we read, what we write hivemind's `deserialize_torch_tensor` reads, and
bytes that do not make the announced shape are refused."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from llm_swarm.swarm.tensor_wire import all_finite, tensor_from_proto, write_tensor
from llm_swarm.swarm.wire import ProtocolError, Step, decode_tensors, encode

pytestmark = pytest.mark.version_neutral

TENSORS = {
    "float32": torch.randn(2, 3, 4),
    "float16": torch.randn(3, 4).half(),
    "bfloat16": torch.randn(2, 3).to(torch.bfloat16),
    "bool": torch.rand(2, 5) > 0.5,
    "int64": torch.arange(6).view(2, 3),
    "empty": torch.zeros(0, 4),
    "strided": torch.randn(4, 5)[:, 1:3],
    "requires grad": torch.randn(3, requires_grad=True),
}


@pytest.mark.parametrize("name", TENSORS)
def test_what_we_write_hivemind_reads_and_what_hivemind_writes_we_read(name):
    tensor = TENSORS[name]
    ours = runtime_pb2.Tensor()
    write_tensor(ours, tensor)
    theirs = serialize_torch_tensor(tensor)  # bfloat16: hivemind's legacy float32 form by default
    for proto in (ours, theirs):
        for read in (tensor_from_proto(proto), deserialize_torch_tensor(proto)):
            assert read.dtype == tensor.dtype and read.shape == tensor.shape
            assert torch.equal(read.detach(), tensor.detach())
            assert read.requires_grad == tensor.requires_grad
    if tensor.dtype != torch.bfloat16:
        assert ours.SerializeToString() == theirs.SerializeToString()


def test_a_decoded_tensor_is_writable_memory_of_its_own():
    message = encode(Step(step_id="a", position=0), [torch.ones(2, 2)])
    (tensor,) = decode_tensors(message)
    tensor += 1  # the message's bytes stay as they were
    assert torch.equal(decode_tensors(message)[0], torch.ones(2, 2))


@pytest.mark.parametrize(
    "fields",
    [
        {"buffer": bytes(12), "size": [2, 2], "dtype": "float32"},  # 12 bytes for 16
        {"buffer": bytes(4), "size": [2, 2], "dtype": "int64"},
        {"buffer": bytes(8), "size": [2], "dtype": "complex_float"},
    ],
)
def test_bytes_that_do_not_make_the_shape_are_refused(fields):
    message = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(**fields)])
    with pytest.raises(ProtocolError, match="cannot decode tensors"):
        decode_tensors(message)


def test_finiteness_is_checked_for_every_float_type():
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert all_finite(torch.ones(3, dtype=dtype))
        for bad in (float("nan"), float("inf"), -float("inf")):
            assert not all_finite(torch.tensor([1.0, bad, 2.0], dtype=dtype))
