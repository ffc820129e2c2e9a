"""Speculative decoding through the swarm: several tokens verified per round trip (docs/speculative.md)."""

from llm_swarm.client.speculation.draft_length import DraftLength, DraftLengthOptions

__all__ = ["DraftLength", "DraftLengthOptions"]
