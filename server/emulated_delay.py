"""The emulated accelerator's time for one forward of a block (CPU servers standing in for GPUs).

A GPU forward is bound either by launching its kernels (a fixed cost per block, what a one-token
decode step pays: about 1 ms per LLaMA-7B block in eager mode on an H100, BENCHMARKS.md) or by its
arithmetic (a cost per token, what a long prefill pays), whichever is longer: the host queues the
next kernels while the device computes. So a step of `tokens` tokens costs, per block,

    max(compute_delay, compute_delay_per_token * tokens)

With `compute_delay_per_token = 0` this is the old constant `--compute-delay` per step. The `max`
(rather than a sum) matters for chunked prefill: a 512-token chunk costs no more launch time than
the whole prompt would have, as on a real device, so chunking is charged what it really costs.
"""

from __future__ import annotations


def emulated_seconds_per_block(compute_delay: float, compute_delay_per_token: float, tokens: int) -> float:
    return max(compute_delay, compute_delay_per_token * tokens)
