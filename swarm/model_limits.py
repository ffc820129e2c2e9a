"""What a record may say about a model, from the reader's own copy of its config (never from peers).

The number of blocks and the size of a block are facts of the checkpoint: a server announcing
`block_bytes = 2^62` or a span past the last block is lying or broken, and a reader that took such
numbers at face value would let one record starve the placement or route into nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from llm_swarm.swarm.cost import cached_positions
from llm_swarm.swarm.models.family import family_for
from llm_swarm.swarm.models.span import prepare_config
from llm_swarm.swarm.server_info import ServerInfo

# bytes per parameter a served block may take: nf4 packs 0.5 (plus scales), float32 takes 4
MIN_BYTES_PER_PARAM = 0.4
MAX_BYTES_PER_PARAM = 4.5
CACHE_ELEMENT_BYTES = (1, 2, 4)  # int8, 16-bit and float32 attention caches


@dataclass(frozen=True)
class ModelLimits:
    num_blocks: int
    block_params: int | None = None  # parameters of one block; None: sizes are not checked
    kv_dim: int | None = None  # key/value width of one block
    # each block's sliding attention window (None: full attention); empty: every block attends fully
    block_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelLimits:
        family = family_for(config)
        with torch.device("meta"):  # shapes only: no memory, no weights
            block = family.build_block(prepare_config(config), family.representative_block(config))
        num_blocks = family.num_blocks(config)
        return cls(
            num_blocks=num_blocks,
            block_params=sum(parameter.numel() for parameter in block.parameters()),
            kv_dim=family.kv_dim(config),
            block_windows=tuple(family.layer_window(config, index) for index in range(num_blocks)),
        )

    def cached_positions(self, first: int, last: int, num_tokens: int) -> int:
        """Positions blocks `[first, last)` keep together for a session of `num_tokens` positions (a
        sliding-window block only its ring): what the announced per-token cache size multiplies."""
        return cached_positions(self.block_windows, first, last, num_tokens)

    def problem(self, info: ServerInfo) -> str | None:
        """Why `info` cannot be a true record of a server of this model (None: it can)."""
        if info.has_blocks and info.end > self.num_blocks:
            return f"span {info.start}:{info.end} is outside the model's {self.num_blocks} blocks"
        if self.block_params is not None and info.block_bytes:
            low, high = self.block_params * MIN_BYTES_PER_PARAM, self.block_params * MAX_BYTES_PER_PARAM
            if not low <= info.block_bytes <= high + 65536:
                return f"block_bytes {info.block_bytes} is impossible for {self.block_params} parameters"
        if self.kv_dim is not None and info.cache_token_bytes:
            if info.cache_token_bytes not in {2 * self.kv_dim * size for size in CACHE_ELEMENT_BYTES}:
                return (
                    f"cache_token_bytes {info.cache_token_bytes} does not match key/value width {self.kv_dim}"
                )
        return None
