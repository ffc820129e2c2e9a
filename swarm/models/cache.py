"""An explicit, preallocated per-session attention cache for one span of blocks.

Each session reserves `max_length` positions per block at open time, exactly the bytes that eq. 2
(docs/reference.md 2) charges against a server's memory budget; nothing grows afterwards. Steps carry their
absolute position, so writing at position `p` discards anything cached at `>= p`: a replayed or
retried step simply overwrites what it wrote before, which is what makes replays safe.

The object speaks the one method of the `transformers` cache protocol that attention layers call
(`update`), so the library's own BLOOM and LLaMA attention code runs unchanged on it.
"""

from __future__ import annotations

import itertools

import torch

from swarm.models.inplace_attention import SessionKeyValues, SessionView

_SERIALS = itertools.count()


class SpanCache:
    """Keys and values of one session for every block of a span: `[batch, kv_heads, max_length,
    head_dim]` and `[batch, kv_heads, max_length, value_dim]`. What a family's attention caches as
    its "keys" and "values" may be other tensors of other widths: DeepSeek's latent attention caches
    its compressed latent and its shared rotary key, one "head" each."""

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
        value_dim: int | None = None,  # None: head_dim
    ):
        if min(num_blocks, batch_size, max_length) <= 0:
            raise ValueError("a cache needs at least one block, one sequence and one position")
        value_dim = head_dim if value_dim is None else value_dim
        key_shape = (batch_size, num_kv_heads, max_length, head_dim)
        value_shape = (batch_size, num_kv_heads, max_length, value_dim)
        self.keys = [torch.zeros(key_shape, dtype=dtype, device=device) for _ in range(num_blocks)]
        self.values = [torch.zeros(value_shape, dtype=dtype, device=device) for _ in range(num_blocks)]
        # the cache serves span-local blocks [block_offset, block_offset + num_blocks): a session may
        # enter a server's span in the middle, where its predecessor on the chain stopped
        self.block_offset = block_offset
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.max_length = max_length
        self.length = 0  # positions [0, length) hold valid keys/values in every block
        # never reused (unlike id()): what CUDA graphs of this cache's tensors are keyed by
        self.serial = next(_SERIALS)
        self._step_start = 0
        self._step_end = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def position_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """`(batch, heads, width)` of one block's keys and of its values, per position."""
        key, value = self.keys[0], self.values[0]
        return (key.shape[0], key.shape[1], key.shape[3]), (value.shape[0], value.shape[1], value.shape[3])

    @property
    def position_bytes(self) -> int:
        """Bytes one position takes in one block, keys and values together."""
        keys, values = self.position_shapes
        return (keys[0] * keys[1] * keys[2] + values[0] * values[1] * values[2]) * self.keys[0].element_size()

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
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_args, **_kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._step_start, self._step_end
        layer_idx -= self.block_offset
        self.keys[layer_idx][:, :, start:end] = key_states
        self.values[layer_idx][:, :, start:end] = value_states
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._step_start

    def reorder(self, indices: torch.Tensor) -> None:
        """Beam search: sequence `i` of the batch continues what sequence `indices[i]` held (in place:
        the preallocated tensors stay the ones the budget counted)."""
        indices = indices.to(self.keys[0].device)
        for tensors in (self.keys, self.values):
            for tensor in tensors:
                tensor.copy_(tensor.index_select(0, indices))


class BatchedStepCache:
    """Several sessions' `SpanCache`s seen as one batch, for one decode step run as a single forward.

    Each member contributes its own rows (its session's batch) and writes its new keys and values
    into its *own* cache at its *own* position. Attention reads them there, in place: `update`
    returns `SessionKeyValues` (per session: its rows and views of its cache up to its position;
    `swarm.models.inplace_attention`), and the attention of each family runs once per session on
    those views. Nothing is copied but the new token's key and value. The batch's masks and ALiBi
    columns are right-aligned to `total` (padding first, like left-padded `transformers` batches):
    a session's keys are their last `position + 1` columns, which is what its views line up with.

    All members must serve the same span-local block range (`block_offset`, `num_blocks`): the view
    maps a block's `layer_idx` to a cache layer exactly as `SpanCache.update` does. Each member
    must have had `begin_step(position, 1)` called; the caller calls `end_step()` afterwards.
    """

    batched_view = True  # what BLOOM's attention override looks for

    def __init__(
        self,
        caches: list[SpanCache],
        positions: list[int],
        total: int,
        masked: list[bool] | None = None,
        gathered: bool = False,
    ):
        if not caches or len(caches) != len(positions):
            raise ValueError("a batched step needs one position per cache, and at least one cache")
        first = caches[0]
        if any((c.block_offset, c.num_blocks) != (first.block_offset, first.num_blocks) for c in caches):
            raise ValueError("a batched step needs caches of the same block range")
        if any(position + 1 > total for position in positions):
            raise ValueError("the batched view is shorter than a member's prefix")
        self.caches, self.positions, self.total = caches, positions, total
        self.masked = masked if masked is not None else [False] * len(caches)
        # gathered: `update` returns every session's keys and values copied into one batch, each
        # right-aligned to `total` with zeros before (the batch's mask hides them)
        self.gathered = gathered
        self.block_offset, self.num_blocks = first.block_offset, first.num_blocks
        bounds, row = [], 0
        for cache in caches:
            bounds.append((row, row + cache.batch_size))
            row += cache.batch_size
        self.row_bounds: list[tuple[int, int]] = bounds
        self.num_rows = row

    # --- the transformers cache protocol -------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_args, **_kwargs
    ) -> tuple[SessionKeyValues, SessionKeyValues]:
        layer = layer_idx - self.block_offset
        sessions = []
        for cache, position, (first, last), masked in zip(
            self.caches, self.positions, self.row_bounds, self.masked, strict=True
        ):
            keys, values = cache.keys[layer], cache.values[layer]
            keys[:, :, position : position + 1] = key_states[first:last]
            values[:, :, position : position + 1] = value_states[first:last]
            sessions.append(
                SessionView(
                    rows=slice(first, last),
                    keys=keys[:, :, : position + 1],
                    values=values[:, :, : position + 1],
                    first_column=self.total - 1 - position,
                    masked=masked,
                )
            )
        if self.gathered:
            return self._gather(sessions, key_states, value_states)
        views = SessionKeyValues(tuple(sessions))
        return views, views

    def _gather(
        self, sessions: list[SessionView], key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = []
        for states, field in ((key_states, "keys"), (value_states, "values")):
            batch = states.new_zeros(self.num_rows, states.shape[1], self.total, states.shape[3])
            for session in sessions:
                batch[session.rows, :, session.first_column :] = getattr(session, field)
            gathered.append(batch)
        return gathered[0], gathered[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.total - 1
