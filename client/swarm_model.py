"""What the client models without `generate()` share: loading the client-side modules, joining the
swarm, trainable prompts, and the whole-sequence forward through the blocks.

`DistributedModel` (hidden states) and `DistributedModelForSequenceClassification` build on it. They
run whole sequences only (the servers' forward and backward RPCs); inference sessions and
`generate()` are the causal LM's (`client.model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import PreTrainedModel

from llm_swarm.client.backend import BlockBackend
from llm_swarm.client.connection import ClientOptions
from llm_swarm.client.model_source import ModelSource, leave_swarm
from llm_swarm.client.prompt_tuning import PromptTuning
from llm_swarm.client.sequence_forward import last_block_output
from llm_swarm.client.sequential import RemoteSequential
from llm_swarm.swarm.models.client_parts import ClientParts, load_client_parts

ModelT = TypeVar("ModelT", bound="SwarmModelBase")

# transformers' forward arguments that change nothing here: there is no cache to use, outputs index like
# tuples anyway, and transformers' classification loss ignores the Trainer's `num_items_in_batch` too
IGNORED_ARGUMENTS = frozenset({"use_cache", "return_dict", "num_items_in_batch"})


def check_unsupported_arguments(kwargs: dict[str, Any]) -> None:
    """Refuse transformers' forward arguments that this model cannot honour rather than ignore them
    (None and False ask for nothing, so they pass)."""
    unsupported = sorted(
        name
        for name, value in kwargs.items()
        if name not in IGNORED_ARGUMENTS and value is not None and value is not False
    )
    if unsupported:
        raise ValueError(
            f"forward() does not support {', '.join(unsupported)} here: the blocks run on the swarm "
            "on whole sequences (positions follow the attention mask)"
        )


class SwarmModelBase(PreTrainedModel):
    """The client-side modules of a model whose blocks run in `backend`, with optional prompts."""

    _supports_sdpa = True  # attention runs in the backend; this only keeps transformers from objecting
    main_input_name = "input_ids"

    def __init__(
        self,
        client_parts: ClientParts,
        backend: BlockBackend,
        tuning_mode: str | None = None,
        pre_seq_len: int = 0,
    ):
        super().__init__(client_parts.config)
        self.client_parts = client_parts
        self.backend = backend
        # PETALS' block-level API (its `model.transformer.h`): the swarm's blocks as a sliceable module
        connection = getattr(backend, "connection", None)
        self.blocks = RemoteSequential(connection) if connection is not None else None
        self.prompts = PromptTuning.create(client_parts, tuning_mode, pre_seq_len)
        self._add_own_parts()

    def _add_own_parts(self) -> None:
        """What a subclass keeps beside the shared client parts (a head, per-thread state); nothing
        here. Called once, at the end of construction."""

    @classmethod
    def from_local_parts(
        cls: type[ModelT],
        model_dir: str | Path,
        backend: BlockBackend,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        tuning_mode: str | None = None,
        pre_seq_len: int = 0,
        **kwargs: Any,
    ) -> ModelT:
        """`device` holds the embeddings and final norm (and a head). `tuning_mode` "ptune" /
        "deep_ptune" adds `pre_seq_len` trainable prompt positions. `kwargs`: the class's own options
        (e.g. config attributes to override, as transformers' `from_pretrained` takes them)."""
        parts = load_client_parts(model_dir, dtype=dtype, device=device)
        model = cls._from_parts(model_dir, parts, backend, tuning_mode, pre_seq_len, **kwargs)
        model._read_checkpoint(model_dir)
        return model.eval()

    @classmethod
    def _from_parts(
        cls: type[ModelT],
        model_dir: str | Path,
        parts: ClientParts,
        backend: BlockBackend,
        tuning_mode: str | None,
        pre_seq_len: int,
        **kwargs: Any,
    ) -> ModelT:
        """The model over loaded client parts; a subclass whose constructor takes more (read from
        `model_dir`, or options of its own in `kwargs`) builds it here."""
        override_config(parts, kwargs)
        return cls(parts, backend, tuning_mode, pre_seq_len)

    def _read_checkpoint(self, model_dir: str | Path) -> None:
        """What else the built model keeps from its checkpoint (subclasses' settings; nothing here)."""

    @classmethod
    def from_pretrained(
        cls: type[ModelT],
        model_dir: str | Path,
        initial_peers: list[str],
        dht_prefix: str | None = None,
        dtype: str | torch.dtype = "float32",
        options: ClientOptions | None = None,
        device: str | torch.device = "cpu",
        tuning_mode: str | None = None,
        pre_seq_len: int = 0,
        active_adapter: str | None = None,
        revision: str | None = None,
        token: str | None = None,
        **kwargs: Any,
    ) -> ModelT:
        """Load the client-side modules of `model_dir` and run its blocks on the swarm at `initial_peers`
        (under `dht_prefix`, default: `model_dir`'s name). `tuning_mode` ("ptune", "deep_ptune") and
        `pre_seq_len`: trainable prompts; `active_adapter`: a served LoRA adapter (PETALS' options).
        `model_dir` may be a Hub id (`revision`, `token`: which commit, and the token of a gated or
        private model)."""
        source = ModelSource(model_dir, initial_peers, dht_prefix, options, active_adapter, revision, token)
        parts = {"dtype": dtype, "device": device, "tuning_mode": tuning_mode, "pre_seq_len": pre_seq_len}
        return source.load(cls.from_local_parts, **parts, **kwargs)

    def shutdown(self) -> None:
        leave_swarm(self.backend)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding table (what `inputs_embeds` are looked up in, as in transformers)."""
        return self.client_parts.token_embedding

    def _normed_hidden_states(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        """The final norm's output `[batch, tokens, hidden]` for whole sequences (transformers' base
        models' `last_hidden_state`), differentiable through the swarm in prompts and `inputs_embeds`."""
        batch_size(input_ids, inputs_embeds)  # exactly one of them
        parts, prompts = self.client_parts, self.prompts
        output = last_block_output(parts, self.backend, prompts, input_ids, attention_mask, inputs_embeds)
        return parts.norm(output.to(device=parts.lm_head.weight.device, dtype=parts.dtype))


def batch_size(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> int:
    """How many sequences the input holds; it must be given one way, ids or embeddings."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("forward() takes exactly one of input_ids and inputs_embeds")
    return (input_ids if input_ids is not None else inputs_embeds).shape[0]


def override_config(parts: ClientParts, overrides: dict[str, Any]) -> None:
    """Set config attributes given to `from_pretrained` (e.g. `pad_token_id=0`), as transformers does;
    a name the config does not have is a mistake, not a new attribute."""
    for name, value in overrides.items():
        if not hasattr(parts.config, name):
            raise TypeError(f"unexpected argument {name!r}: it is not an attribute of the model's config")
        setattr(parts.config, name, value)
