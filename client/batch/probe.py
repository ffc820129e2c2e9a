"""Measuring each chain before planning, so that the plan's times include what announcements leave out:
the client's own work per step, how the servers share steps among concurrent sessions, and what a
prompt really costs (an emulated or real accelerator's prefill is not the line through the one-token
and 20-token points a server announces).

Per chain, all chains at once (a thread each, sessions in threads of their own):

1. decoding: as many sessions at once as the batch will run there, each generating `new_tokens`
   from a typical prompt: the median of their decode steps is the chain's decode step (and what a
   session took beyond its steps, opening and closing its streams, its overhead);
2. prompts: one session at a time, a short and a long prompt of the batch, one token each: the first
   step's line in the prompt's length, through those two points.

A chain whose probe fails keeps its announced speed (a failed prompt probe keeps the announced slope).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
from collections.abc import Sequence

from llm_swarm.client.batch.chains import BatchChain, ChainSpeed
from llm_swarm.client.batch.execute import Generated, generate_pinned
from llm_swarm.client.batch.jobs import Job
from llm_swarm.client.batch.pinned import PinnedConnection
from llm_swarm.client.model import DistributedModelForCausalLM

logger = logging.getLogger(__name__)


def probe_jobs(jobs: Sequence[Job], new_tokens: int) -> tuple[Job, list[Job]]:
    """The decoding probe (the median prompt, `new_tokens` new, at least 2) and the prompt probes (the
    10th and 90th percentile prompts by length, one new token each; one if they are as long)."""
    ordered = sorted(jobs, key=lambda job: (job.prompt_tokens, job.record.line))

    def probe(job: Job, tokens: int) -> Job:
        return Job(dataclasses.replace(job.record, max_new_tokens=tokens), job.input_ids)

    short, long = ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]
    prompts = [probe(short, 1)] + ([probe(long, 1)] if long.prompt_tokens > short.prompt_tokens else [])
    return probe(ordered[len(ordered) // 2], max(new_tokens, 2)), prompts


def probe_speeds(
    model: DistributedModelForCausalLM,
    connections: Sequence[PinnedConnection],
    chains: Sequence[BatchChain],
    slots: Sequence[int],
    jobs: Sequence[Job],
    new_tokens: int,
    pad_token_id: int | None,
) -> list[ChainSpeed]:
    """Each chain's speed measured as the module docstring says."""
    decoding, prompts = probe_jobs(jobs, new_tokens)
    decode_steps: list[list[float]] = [[] for _ in chains]
    first_steps: list[dict[int, float]] = [{} for _ in chains]
    overheads: list[list[float]] = [[] for _ in chains]  # a session's seconds beyond its steps
    failures: list[str | None] = [None] * len(chains)

    def run(k: int, job: Job) -> Generated | None:
        try:
            generated = generate_pinned(model, connections[k], job, pad_token_id)
        except Exception as error:  # the chain keeps what is announced of it
            failures[k] = f"{type(error).__name__}: {error}"
            return None
        overheads[k].append(generated.seconds - sum(generated.steps))  # list.append is atomic
        return generated

    def decode(k: int) -> None:
        generated = run(k, decoding)
        if generated is not None:
            decode_steps[k].extend(generated.steps[1:])

    def prompt(k: int) -> None:
        for job in prompts:
            generated = run(k, job)
            if generated is not None:
                first_steps[k][job.prompt_tokens] = generated.steps[0]

    def chain_probe(k: int) -> None:
        sessions = [threading.Thread(target=decode, args=(k,), daemon=True) for _ in range(slots[k])]
        for thread in sessions:
            thread.start()
        for thread in sessions:
            thread.join()
        prompt(k)

    threads = [threading.Thread(target=chain_probe, args=(k,), daemon=True) for k in range(len(chains))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    speeds = []
    for k, chain in enumerate(chains):
        if failures[k] is not None:
            logger.warning("probing chain %d: %s", k, failures[k])
        if not decode_steps[k]:
            speeds.append(chain.speed)
            continue
        overhead = statistics.median(overheads[k])
        speeds.append(chain.speed.measured(statistics.median(decode_steps[k]), first_steps[k], overhead))
    return speeds
