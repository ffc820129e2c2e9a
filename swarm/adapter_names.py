"""What a LoRA adapter may be called: the name servers announce and sessions ask for (no peft here,
so that clients and record readers need not import it)."""

from __future__ import annotations

import re

from llm_swarm.swarm.errors import SwarmUserError

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
BASE = "__base__"  # peft's name for "no adapter" in a mixed batch: never an adapter's name


class AdapterError(SwarmUserError):
    """An adapter that cannot be served (refused at start-up), or an unknown adapter name."""


def check_adapter_name(name: str) -> str:
    if not re.fullmatch(ADAPTER_NAME, name):
        raise AdapterError(
            f"adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name
