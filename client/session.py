"""A client inference session: the token history and position of one batch of sequences."""

from __future__ import annotations

import torch

from llm_swarm.client.backend import BlockSession
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.linear_fit import LinearCost, LinearFit


class InferenceSession:
    """Feeds only the tokens the blocks have not seen yet, so `generate()` can be called repeatedly.

    Each call's `input_ids` must begin with every token the session has processed so far (the
    natural thing: pass the previous output plus new text); the session verifies that prefix and
    runs just the rest, reusing the attention caches on the servers.
    """

    def __init__(self, blocks: BlockSession, batch_size: int, max_length: int):
        self.blocks = blocks
        self.batch_size = batch_size
        self.max_length = max_length
        self.token_ids = torch.empty(batch_size, 0, dtype=torch.long)  # tokens processed so far
        self.prefix_length = 0  # positions given as embeddings first (`inputs_embeds`): no token ids
        self.padding_mask: torch.Tensor | None = None  # [batch, position], only once padding appears
        # the sequences the last generate() in this session returned: its last token is not processed
        # yet, and generate(None) continues from there
        self.last_output_ids: torch.Tensor | None = None
        self.last_mask: torch.Tensor | None = None  # its attention mask (None: no padding given)
        self._pending_reorder: torch.Tensor | None = None  # beam search: sent with the next step
        self.closed = False
        # seconds per step by its number of new tokens, as generate() measured them: what a round
        # trip costs, and each extra token on top (speculative decoding's draft length)
        self.step_costs = LinearFit(LinearCost(0.0, 1e-3))
        self.generation_cache = None  # the SessionCache generate() sees, once it has run here
        self.draft_stats = None  # the last speculative generate()'s DraftLength (acceptance, rounds)

    @property
    def position(self) -> int:
        return self.prefix_length + self.token_ids.shape[1]

    def unprocessed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The suffix of `input_ids` that the blocks have not processed yet."""
        if input_ids.shape[0] != self.batch_size:
            raise SwarmUserError(
                f"this session was opened for batch size {self.batch_size}, "
                f"got input of batch size {input_ids.shape[0]}"
            )
        known = self.token_ids.shape[1]  # after an embedded prefix, input_ids hold what follows it
        if input_ids.shape[1] < known or not torch.equal(input_ids[:, :known].cpu(), self.token_ids):
            raise SwarmUserError(
                "input_ids must start with the tokens this inference session has already processed "
                f"({known} tokens); pass the previous output followed by the new tokens"
            )
        return input_ids[:, known:]

    def step_embeddings(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a prompt given as embeddings (the first block's input) through every block: only at the
        start of a session, before any token ids (the positions it takes have no ids to check)."""
        if self.token_ids.shape[1]:
            raise SwarmUserError("inputs_embeds can only start an inference session, before any input_ids")
        if hidden.shape[0] != self.batch_size:
            raise SwarmUserError(
                f"this session was opened for batch size {self.batch_size}, got embeddings of batch size "
                f"{hidden.shape[0]}"
            )
        num_new = hidden.shape[1]
        self._check_room(num_new)
        padding_mask = self._padding_mask(attention_mask, num_new)
        output = self.blocks.step(hidden, self.position, padding_mask, prompts=prompts)
        self.prefix_length += num_new
        self.padding_mask = padding_mask
        return output

    def step(
        self, new_ids: torch.Tensor, hidden: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Run `hidden` (the embeddings of `new_ids`) through every block; record the tokens."""
        self._check_room(new_ids.shape[1])
        padding_mask = self._padding_mask(attention_mask, new_ids.shape[1])
        output = self.blocks.step(hidden, self.position, padding_mask, self._take_reorder())
        self.token_ids = torch.cat([self.token_ids, new_ids.cpu()], dim=1)
        self.padding_mask = padding_mask
        return output

    def rewind(self, position: int) -> None:
        """Continue the session from `position` (in positions, the embedded prefix included): what
        was processed at `>= position` is forgotten here, and every server overwrites it with the
        next step, which starts at `position`. Speculative decoding rewinds past rejected drafts;
        nothing is sent until that next step."""
        if self.closed:
            raise SwarmUserError("this inference session is closed")
        if not self.prefix_length <= position <= self.position:
            raise SwarmUserError(
                f"cannot rewind to position {position}: the session holds positions [{self.prefix_length}, "
                f"{self.position}] after its {self.prefix_length}-position embedded prefix"
            )
        if self._pending_reorder is not None:
            raise SwarmUserError("cannot rewind a beam search's session before its reordering was sent")
        if position == self.position:
            return
        self.token_ids = self.token_ids[:, : position - self.prefix_length]
        if self.padding_mask is not None:
            self.padding_mask = self.padding_mask[:, :position]
        self.blocks.rewind(position)

    def exclude_positions(self, padding_mask: torch.Tensor) -> None:
        """Set which processed positions later steps attend to (`[batch, position]`, 1 = attend): a
        batch whose rows accepted different numbers of drafts masks each row's rejected ones."""
        padding_mask = padding_mask.long().cpu()
        if tuple(padding_mask.shape) != (self.batch_size, self.position):
            raise SwarmUserError(
                f"a padding mask of shape {tuple(padding_mask.shape)} for a session of "
                f"{(self.batch_size, self.position)} positions"
            )
        if not bool(((padding_mask == 0) | (padding_mask == 1)).all()):
            raise SwarmUserError("padding mask values must be 0 or 1")
        if self.padding_mask is None and bool(padding_mask.all()):
            return
        self.padding_mask = padding_mask

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search chose which hypothesis each sequence continues: reorder what this session knows
        now, and the servers' caches with the next step (PETALS' `hypo_ids`, no replay)."""
        beam_idx = beam_idx.cpu().long()
        if torch.equal(beam_idx, torch.arange(self.batch_size)):
            return
        self.token_ids = self.token_ids[beam_idx]
        if self.padding_mask is not None:
            self.padding_mask = self.padding_mask[beam_idx]
        pending = self._pending_reorder
        self._pending_reorder = beam_idx if pending is None else pending[beam_idx]

    def _take_reorder(self) -> torch.Tensor | None:
        reorder, self._pending_reorder = self._pending_reorder, None
        return reorder

    def _check_room(self, num_new: int) -> None:
        if self.closed:
            raise SwarmUserError("this inference session is closed")
        if self.position + num_new > self.max_length:
            raise SwarmUserError(
                f"the session's max_length {self.max_length} is exceeded: {self.position} tokens processed, "
                f"{num_new} more requested; open the session with a larger max_length"
            )

    def _padding_mask(self, attention_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
        """The full `[batch, position + new]` mask, or None while no sequence has padding (the fast path)."""
        total = self.position + num_new
        if attention_mask is None or attention_mask.shape[1] < total:
            new_part = torch.ones(self.batch_size, num_new, dtype=torch.long)
        else:
            new_part = attention_mask[:, self.position : total].long().cpu()
        if self.padding_mask is None and bool(new_part.all()):
            return None
        history = (
            self.padding_mask
            if self.padding_mask is not None
            else torch.ones(self.batch_size, self.position, dtype=torch.long)
        )
        return torch.cat([history, new_part], dim=1)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.blocks.close()

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
