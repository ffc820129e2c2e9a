"""An explicit, preallocated per-session attention cache for one span of blocks.

Each session reserves its positions per block at open time, exactly the bytes that eq. 2
(docs/reference.md 2) charges against a server's memory budget; nothing grows afterwards. Steps carry their
absolute position, so writing at position `p` discards anything cached at `>= p`: a replayed or
retried step simply overwrites what it wrote before, which is what makes replays safe.

A block of full attention reserves `max_length` positions. A block whose attention slides over the
last `window` positions (Mistral, Gemma's local layers, GPT-OSS) reserves only `ring_capacity`:
the `window - 1` positions a new query can still see, plus `REWIND_RESERVE` so that a step may
overwrite its last few positions (speculative rounds, retries). Position `x` lives in slot
`x % capacity`, so a session runs past the window in bounded memory. While a session fits its
capacity the slots are its positions in order, exactly the full cache's layout; past it, attention
reads the slots in slot order and the mask says which absolute position each slot holds
(`key_positions`): softmax over keys does not depend on their order, and keys are stored after
their rotary embedding, so the result is the same as over keys in position order.

The object speaks the one method of the `transformers` cache protocol that attention layers call
(`update`), so the library's own BLOOM and LLaMA attention code runs unchanged on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from llm_swarm.swarm.cost import ring_capacity
from llm_swarm.swarm.models.inplace_attention import SessionKeyValues, SessionView

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
        windows: Sequence[int | None] | None = None,  # each block's sliding window (None: full)
    ):
        if min(num_blocks, batch_size, max_length) <= 0:
            raise ValueError("a cache needs at least one block, one sequence and one position")
        windows = [None] * num_blocks if windows is None else list(windows)
        if len(windows) != num_blocks or any(w is not None and w < 1 for w in windows):
            raise ValueError("a cache needs one window (None or at least 1) per block")
        value_dim = head_dim if value_dim is None else value_dim
        self.windows = windows
        self.capacities = [ring_capacity(window, max_length) for window in windows]
        self._capacity_by_window = dict(zip(windows, self.capacities, strict=True))
        # (window, capacity) of the blocks that keep less than the session: the only ones a step can wrap
        pairs = zip(windows, self.capacities, strict=True)
        self._rings = sorted({(window, capacity) for window, capacity in pairs if capacity < max_length})
        self.keys = [
            torch.zeros((batch_size, num_kv_heads, capacity, head_dim), dtype=dtype, device=device)
            for capacity in self.capacities
        ]
        self.values = [
            torch.zeros((batch_size, num_kv_heads, capacity, value_dim), dtype=dtype, device=device)
            for capacity in self.capacities
        ]
        # the cache serves span-local blocks [block_offset, block_offset + num_blocks): a session may
        # enter a server's span in the middle, where its predecessor on the chain stopped
        self.block_offset = block_offset
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.max_length = max_length
        self._length = 0  # positions [0, length) hold valid keys/values in every block
        # the furthest position ever written plus one: past a rewind, slots of positions up to here
        # were overwritten by later ones, so a ring keeps from `written - capacity` on
        self._written = 0
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

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, length: int) -> None:
        """Positions `[0, length)` hold what was written there outside steps (a received hand-off), or
        nothing (0: the session is empty again)."""
        self._length = self._written = length

    @property
    def written(self) -> int:
        """The furthest position any step wrote, plus one (at least `length`)."""
        return self._written

    def oldest_kept(self, block: int, written: int | None = None) -> int:
        """The first position block `block` (cache-local) holds once positions up to `written` were
        written (default: now); 0 until it wraps."""
        return max(0, (self._written if written is None else written) - self.capacities[block])

    def rewind_error(self, position: int, written: int | None = None) -> str | None:
        """Why a step at `position` cannot follow a cache written up to `written` (default: this one)
        in a sliding-window block: it would need keys the block no longer keeps. None if it can."""
        written = self._written if written is None else written
        for window, capacity in self._rings:
            if max(0, written - capacity) > max(0, position - window + 1):
                return (
                    f"step position {position} rewinds {written - position} positions: past its sliding "
                    f"window a block keeps only the last {capacity} positions, so a step may rewind at most "
                    f"{capacity - window + 1}; replay the session to go further back"
                )
        return None

    def wraps(self, position: int, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` at `position` passes some block's capacity (then attention
        reads that block's slots out of position order, with `key_positions` in its mask)."""
        return any(position + num_tokens > capacity for _, capacity in self._rings)

    def begin_step(self, position: int, num_tokens: int) -> None:
        """Prepare to write `num_tokens` new positions starting at absolute `position`."""
        if position < 0 or position > self.length:
            raise ValueError(f"step position {position} is outside the cached prefix [0, {self.length}]")
        if position + num_tokens > self.max_length:
            raise ValueError(
                f"step would fill positions up to {position + num_tokens}, past the session's max_length "
                f"{self.max_length}"
            )
        refused = self.rewind_error(position)
        if refused is not None:
            raise ValueError(refused)
        self._step_start, self._step_end = position, position + num_tokens

    def end_step(self) -> None:
        self._length = self._step_end
        self._written = max(self._written, self._step_end)

    def key_positions(self, window: int | None) -> torch.Tensor | None:
        """The absolute position of each key column that `update` returns for the blocks of `window`
        in the current step (negative: a slot nothing valid is in), or None when those columns are
        simply positions `[0, step end)`."""
        start, end = self._step_start, self._step_end
        capacity = self._capacity_by_window.get(window, self.max_length)
        if end <= capacity:
            return None
        device = self.keys[0].device
        slots = torch.arange(capacity, device=device)
        if end - start <= capacity - window + 1:  # the step's keys fit beside the ones it needs
            return slots + capacity * torch.div(end - 1 - slots, capacity, rounding_mode="floor")
        held = slots + capacity * torch.div(start - 1 - slots, capacity, rounding_mode="floor")
        return torch.cat([held, torch.arange(start, end, device=device)])

    # --- the transformers cache protocol -------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_args, **_kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._step_start, self._step_end
        layer = layer_idx - self.block_offset
        keys, values = self.keys[layer], self.values[layer]
        capacity = self.capacities[layer]
        if end <= capacity:
            keys[:, :, start:end] = key_states
            values[:, :, start:end] = value_states
            return keys[:, :, :end], values[:, :, :end]
        if end - start <= capacity - self.windows[layer] + 1:
            _write_slots(keys, start, key_states)
            _write_slots(values, start, value_states)
            return keys, values
        # a chunk longer than the reserve: its queries see the kept keys and each other, then its
        # last positions stay (the same columns `key_positions` describes)
        seen = torch.cat([keys, key_states], dim=2), torch.cat([values, value_states], dim=2)
        kept = min(end - start, capacity)
        _write_slots(keys, end - kept, key_states[:, :, -kept:])
        _write_slots(values, end - kept, value_states[:, :, -kept:])
        return seen

    # --- positions, wherever their slots are (cache hand-offs) ---------------------------------
    def read(self, block: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions `[start, end)` in block `block` (cache-local), which it holds."""
        if not self.oldest_kept(block) <= start < end <= self._length:
            raise ValueError(
                f"block {block} holds positions [{self.oldest_kept(block)}, {self.length}), "
                f"not [{start}, {end})"
            )
        return _read_slots(self.keys[block], start, end), _read_slots(self.values[block], start, end)

    def write(self, block: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys and values of positions `start...` in block `block` (cache-local)."""
        _write_slots(self.keys[block], start, keys.to(self.keys[block]))
        _write_slots(self.values[block], start, values.to(self.values[block]))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._step_start

    def reorder(self, indices: torch.Tensor) -> None:
        """Beam search: sequence `i` of the batch continues what sequence `indices[i]` held (in place:
        the preallocated tensors stay the ones the budget counted)."""
        indices = indices.to(self.keys[0].device)
        for tensors in (self.keys, self.values):
            for tensor in tensors:
                tensor.copy_(tensor.index_select(0, indices))


def _write_slots(tensor: torch.Tensor, start: int, states: torch.Tensor) -> None:
    """Write `states` (`[batch, heads, n, width]`, n at most the capacity) at positions `start...` of a
    slot tensor of capacity `tensor.shape[2]`: position x goes to slot x % capacity."""
    capacity, count = tensor.shape[2], states.shape[2]
    first = start % capacity
    head = min(count, capacity - first)
    tensor[:, :, first : first + head] = states[:, :, :head]
    if head < count:
        tensor[:, :, : count - head] = states[:, :, head:]


def _read_slots(tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions `[start, end)` (at most the capacity) of a slot tensor, in position order."""
    capacity = tensor.shape[2]
    first = start % capacity
    head = min(end - start, capacity - first)
    if head == end - start:
        return tensor[:, :, first : first + head].contiguous()
    return torch.cat([tensor[:, :, first:], tensor[:, :, : end - start - head]], dim=2)


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
        ring_masks: dict[tuple[int, int], torch.Tensor] | None = None,
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
        # (member index, window) -> that member's mask over the slots of its blocks of that window,
        # for the members past a ring (`SpanCache.key_positions` of the step: slot order)
        self.ring_masks = ring_masks or {}
        if self.ring_masks and gathered:
            raise ValueError("a gathered batch cannot hold a session past a sliding-window ring")
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
        for index, (cache, position, (first, last), masked) in enumerate(
            zip(self.caches, self.positions, self.row_bounds, self.masked, strict=True)
        ):
            keys, values = cache.keys[layer], cache.values[layer]
            ring_mask = self.ring_masks.get((index, cache.windows[layer]))
            if ring_mask is not None:  # past the ring: its slot, and every slot read under its own mask
                slot = position % cache.capacities[layer]
                keys[:, :, slot : slot + 1] = key_states[first:last]
                values[:, :, slot : slot + 1] = value_states[first:last]
                sessions.append(SessionView(slice(first, last), keys, values, 0, True, ring_mask))
                continue
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
