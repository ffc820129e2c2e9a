"""`swarm-server` whose blocks cost nothing: `python -m benchmarks.serving.identity_server SERVER_ARGS...`.

For measuring what a hop costs apart from the compute (`benchmarks.serving.hop_floor`): every step
goes through the whole server path (the stream, the checks, the batching engine, the cache's
bookkeeping, the reply) but the span returns its input, so the time measured is the protocol's.
Its outputs are wrong on purpose; nothing but that benchmark starts it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_swarm.swarm.models.span import BatchedStep, TransformerSpan


def _identity_blocks(self, blocks, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden


def _identity_batch(self, steps: Sequence[BatchedStep]) -> list[torch.Tensor]:
    outputs = []
    for hidden, cache, position, _mask in steps:
        cache.begin_step(position, hidden.shape[1])
        cache.end_step()
        outputs.append(hidden)
    return outputs


def main() -> None:
    TransformerSpan._run_blocks = _identity_blocks
    TransformerSpan.forward_batch = _identity_batch
    from llm_swarm.server.cli import main as server_main

    server_main()


if __name__ == "__main__":
    main()
