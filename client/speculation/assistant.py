"""Loading a draft model (`--assistant MODEL_DIR`) for speculative decoding, checked against the target."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from llm_swarm.swarm.errors import SwarmUserError


def load_assistant(
    model_dir: str | Path, target: PretrainedConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
):
    """A small local causal LM that drafts for `target`: it must read the same token ids (same
    vocabulary size; the same tokenizer is the user's promise, as in transformers), and it is loaded
    from a local directory only (nothing is downloaded)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise SwarmUserError(f"--assistant {model_dir}: not a local checkpoint directory (no config.json)")
    try:
        assistant = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as error:
        raise SwarmUserError(f"--assistant {model_dir}: cannot load it ({error})") from None
    if assistant.config.vocab_size != target.vocab_size:
        raise SwarmUserError(
            f"--assistant {model_dir} has a vocabulary of {assistant.config.vocab_size} tokens, the model "
            f"{target.vocab_size}: a draft model must use the same tokenizer"
        )
    return assistant.to(device).eval()


def speculation_summary(stats) -> str:
    """One log line about a speculative generation (`InferenceSession.draft_stats`)."""
    if stats is None or stats.rounds == 0:
        return "speculation: no drafts verified (adaptive draft length kept it off)"
    return (
        f"speculation: {stats.rounds} rounds, {stats.drafted} drafts, {stats.accepted} accepted "
        f"({stats.acceptance_rate:.0%})"
    )
