"""The client: `AutoDistributedModelForCausalLM` runs `generate()` through a swarm of servers."""

from client.model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from client.remote import ClientOptions

__all__ = ["AutoDistributedModelForCausalLM", "ClientOptions", "DistributedModelForCausalLM"]
