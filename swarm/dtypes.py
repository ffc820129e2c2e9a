"""Parsing of user-facing dtype names."""

from __future__ import annotations

import torch

from llm_swarm.swarm.errors import SwarmUserError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"float32"`, `"bfloat16"` or `"float16"` (or a torch dtype) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise SwarmUserError(f"unsupported dtype {name}; choose one of {', '.join(DTYPES)}")
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise SwarmUserError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)
