"""llm-swarm: large language models run across a swarm of volunteer servers.

Everything installs under this one name: `llm_swarm.client` (generate through a swarm),
`llm_swarm.server` (serve blocks), `llm_swarm.scheduler` (placement, routing, the simulator) and
`llm_swarm.swarm` (the shared core). The user-facing classes are here too:

    from llm_swarm import AutoDistributedModelForCausalLM
"""

from llm_swarm.client import (
    AutoDistributedModel,
    AutoDistributedModelForCausalLM,
    AutoDistributedModelForSequenceClassification,
    ClientOptions,
    DistributedModel,
    DistributedModelForCausalLM,
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
