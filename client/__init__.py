"""The client: `AutoDistributedModelForCausalLM` runs `generate()` through a swarm of servers;
`AutoDistributedModel` (hidden states) and `AutoDistributedModelForSequenceClassification` (a local,
trainable head) run whole sequences through it."""

import llm_swarm.swarm  # noqa: F401  (first: sets gRPC's fork option before the scheduler link imports grpc)
from llm_swarm.client.base_model import AutoDistributedModel, DistributedModel
from llm_swarm.client.connection import ClientOptions
from llm_swarm.client.model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from llm_swarm.client.sequence_classification import (
    AutoDistributedModelForSequenceClassification,
    DistributedModelForSequenceClassification,
)

__all__ = [
    "AutoDistributedModel",
    "AutoDistributedModelForCausalLM",
    "AutoDistributedModelForSequenceClassification",
    "ClientOptions",
    "DistributedModel",
    "DistributedModelForCausalLM",
    "DistributedModelForSequenceClassification",
]
