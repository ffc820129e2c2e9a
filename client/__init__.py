"""The client: `AutoDistributedModelForCausalLM` runs `generate()` through a swarm of servers;
`AutoDistributedModel` (hidden states) and `AutoDistributedModelForSequenceClassification` (a local,
trainable head) run whole sequences through it."""

import llm_swarm
import llm_swarm.swarm  # noqa: F401  (first: sets gRPC's fork option before the scheduler link imports grpc)
from llm_swarm.client.base_model import AutoDistributedModel as AutoDistributedModel
from llm_swarm.client.base_model import DistributedModel as DistributedModel
from llm_swarm.client.connection import ClientOptions as ClientOptions
from llm_swarm.client.model import AutoDistributedModelForCausalLM as AutoDistributedModelForCausalLM
from llm_swarm.client.model import DistributedModelForCausalLM as DistributedModelForCausalLM
from llm_swarm.client.sequence_classification import (
    AutoDistributedModelForSequenceClassification as AutoDistributedModelForSequenceClassification,
)
from llm_swarm.client.sequence_classification import (
    DistributedModelForSequenceClassification as DistributedModelForSequenceClassification,
)

# the user-facing classes are listed once, in the top-level package, which re-exports them lazily
__all__ = list(llm_swarm.__all__)
