"""Model families, span loading and the client-side modules."""

from llm_swarm.swarm.models.cache import SpanCache
from llm_swarm.swarm.models.checkpoint import CheckpointReader, load_config
from llm_swarm.swarm.models.client_parts import ClientParts, load_client_parts
from llm_swarm.swarm.models.family import ModelFamily, family_for
from llm_swarm.swarm.models.span import TransformerSpan, load_span

__all__ = [
    "CheckpointReader",
    "ClientParts",
    "ModelFamily",
    "SpanCache",
    "TransformerSpan",
    "family_for",
    "load_client_parts",
    "load_config",
    "load_span",
]
