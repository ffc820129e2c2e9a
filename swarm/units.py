"""Human-friendly sizes: `8GB`, `512MiB`, `1e9`."""

from __future__ import annotations

import re

from llm_swarm.swarm.errors import SwarmUserError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$")


def parse_bytes(text: str) -> int:
    match = _SIZE.match(str(text).lower())
    if not match or match.group(2) not in _UNITS:
        raise SwarmUserError(f"{text!r} is not a size; write e.g. 8GB, 512MiB or 1000000")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise SwarmUserError(f"size {text!r} must be positive")
    return value
