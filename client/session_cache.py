"""An inference session seen by `transformers`' `generate()` as its cache (`past_key_values`).

The attention caches live on the servers; what `generate()` needs of a cache object is to know its
length, and to crop it: assisted generation (`assistant_model=`, `prompt_lookup_num_tokens=`)
verifies several candidate tokens in one forward and then calls `past_key_values.crop(n)` to drop
the rejected ones, the same public `Cache.crop` that `DynamicCache` implements. Here cropping
rewinds the session (`InferenceSession.rewind`): nothing is sent, and the next step, which starts
at the cropped length, overwrites the rejected positions on every server.

Lengths are counted in `generate()`'s coordinates: the positions after the session's embedded
prefix (trained prompts, or a prompt given as `inputs_embeds`), i.e. the token ids it processed.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from llm_swarm.client.session import InferenceSession


class SessionCache(Cache):
    """The `Cache` face of an `InferenceSession`: length, crop (rewind) and beam reordering."""

    def __init__(self, session: InferenceSession):
        super().__init__(layers=[])  # no layers here: keys and values stay on the servers
        self.session = session

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.session.token_ids.shape[1]

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.session.max_length - self.session.prefix_length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` token positions; a negative value drops that many from the end,
        and 0 drops nothing: transformers 5 crops only by negative counts (`crop(0)`: nothing to
        undo), 4.57 also by positive lengths, and neither crops a generation to nothing."""
        length = self.get_seq_length()
        if max_length <= 0:
            max_length = length + max_length
        if max_length < length:
            self.session.rewind(self.session.prefix_length + max(max_length, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.session.reorder(beam_idx)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        raise NotImplementedError("a swarm session's keys and values live on its servers")

    @property
    def is_compileable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"SessionCache(length={self.get_seq_length()}, max_length={self.session.max_length})"
