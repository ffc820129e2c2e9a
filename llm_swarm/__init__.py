"""llm-swarm: large language models run across a swarm of volunteer servers.

Everything installs under this one name: `llm_swarm.client` (generate through a swarm),
`llm_swarm.server` (serve blocks), `llm_swarm.scheduler` (placement, routing, the simulator) and
`llm_swarm.swarm` (the shared core). The user-facing classes are here too:

    from llm_swarm import AutoDistributedModelForCausalLM

They load on first use: the scheduler's and the simulator's commands import this package without
needing torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

# `llm_swarm.client` exports the same names: it takes them from here, where importing costs nothing
__all__ = [
    "AutoDistributedModel",
    "AutoDistributedModelForCausalLM",
    "AutoDistributedModelForSequenceClassification",
    "ClientOptions",
    "DistributedModel",
    "DistributedModelForCausalLM",
    "DistributedModelForSequenceClassification",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("llm_swarm.client"), name)
    raise AttributeError(f"module 'llm_swarm' has no attribute {name!r}")
