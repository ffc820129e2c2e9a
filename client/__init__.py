"""The client: `AutoDistributedModelForCausalLM` runs `generate()` through a swarm of servers."""

from client.connection import ClientOptions
from client.model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM

__all__ = ["AutoDistributedModelForCausalLM", "ClientOptions", "DistributedModelForCausalLM"]
