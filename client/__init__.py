"""The client: `AutoDistributedModelForCausalLM` runs `generate()` through a swarm of servers."""

import swarm  # noqa: F401  (first: sets gRPC's fork option before the scheduler link imports grpc)
from client.connection import ClientOptions
from client.model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM

__all__ = ["AutoDistributedModelForCausalLM", "ClientOptions", "DistributedModelForCausalLM"]
