"""An explicit, preallocated per-session attention cache for one span of blocks.

Each session reserves `max_length` positions per block at open time, exactly the bytes that eq. 2 of
the SPEC charges against a server's memory budget; nothing grows afterwards. Steps carry their
absolute position, so writing at position `p` discards anything cached at `>= p`: a replayed or
retried step simply overwrites what it wrote before, which is what makes replays safe.

The object speaks the one method of the `transformers` cache protocol that attention layers call
(`update`), so the library's own BLOOM and LLaMA attention code runs unchanged on it.
"""

from __future__ import annotations

import torch


class SpanCache:
    """Keys and values of one session for every block of a span: `[batch, kv_heads, max_length, head_dim]`."""

    def __init__(
        self,
        num_blocks: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        block_offset: int = 0,
    ):
        if min(num_blocks, batch_size, max_length) <= 0:
            raise ValueError("a cache needs at least one block, one sequence and one position")
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_blocks)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_blocks)]
        # the cache serves span-local blocks [block_offset, block_offset + num_blocks): a session may
        # enter a server's span in the middle, where its predecessor on the chain stopped
        self.block_offset = block_offset
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.max_length = max_length
        self.length = 0  # positions [0, length) hold valid keys/values in every block
        self._step_start = 0
        self._step_end = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def begin_step(self, position: int, num_tokens: int) -> None:
        """Prepare to write `num_tokens` new positions starting at absolute `position`."""
        if position < 0 or position > self.length:
            raise ValueError(f"step position {position} is outside the cached prefix [0, {self.length}]")
        if position + num_tokens > self.max_length:
            raise ValueError(
                f"step would fill positions up to {position + num_tokens}, past the session's max_length "
                f"{self.max_length}"
            )
        self._step_start, self._step_end = position, position + num_tokens

    def end_step(self) -> None:
        self.length = self._step_end

    # --- the transformers cache protocol -------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._step_start, self._step_end
        layer_idx -= self.block_offset
        self.keys[layer_idx][:, :, start:end] = key_states
        self.values[layer_idx][:, :, start:end] = value_states
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._step_start

    # --- helpers for failover and tests ---------------------------------------------------------
    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
