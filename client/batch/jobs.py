"""The jobs of a batch: prompts tokenized and checked, and their estimated times on the chains. Pure."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llm_swarm.client.batch.chains import BatchChain, ChainSpeed
from llm_swarm.client.batch.queues import WorkQueues
from llm_swarm.client.batch.records import PromptRecord, TokenBounds, check_prompt_tokens


@dataclass(frozen=True)
class Job:
    record: PromptRecord
    input_ids: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def new_tokens(self) -> int:
        return self.record.max_new_tokens


def tokenize(records: list[PromptRecord], tokenizer, bounds: TokenBounds, source: str) -> list[Job]:
    """Each record's prompt as token ids (as `tokenizer(prompt)` gives them), checked against `bounds`."""
    jobs = []
    for record in records:
        ids = tokenizer(record.prompt).input_ids
        check_prompt_tokens(record, len(ids), bounds, source)
        jobs.append(Job(record, tuple(int(i) for i in ids)))
    return jobs


def job_times(
    jobs: list[Job], chains: list[BatchChain], speeds: list[ChainSpeed], slots: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """`[chains, jobs]` estimated seconds, as a lane is charged (`ChainSpeed.lane_seconds`) and alone;
    inf where a job is longer than the chain's servers accept."""
    lane, alone = np.full((len(chains), len(jobs)), np.inf), np.full((len(chains), len(jobs)), np.inf)
    for k, (chain, speed) in enumerate(zip(chains, speeds, strict=True)):
        for j, job in enumerate(jobs):
            if job.prompt_tokens + job.new_tokens <= chain.max_length:
                lane[k, j] = speed.lane_seconds(job.prompt_tokens, job.new_tokens, slots[k])
                alone[k, j] = speed.job_seconds(job.prompt_tokens, job.new_tokens)
    return lane, alone


def timeline(jobs: list[Job], runs: dict[int, tuple[int, float, float]], queues: WorkQueues) -> list[dict]:
    """Each answered job's lane, chain, start and end (seconds into the run) and planned lane time."""
    rows = []
    for index, (lane, start, end) in sorted(runs.items(), key=lambda item: item[1][1]):
        chain = queues.lane_chain[lane]
        rows.append(
            {
                "id": jobs[index].record.id,
                "lane": lane,
                "chain": chain,
                "start": round(start, 4),
                "end": round(end, 4),
                "planned": round(queues.planned(chain, index), 4),
                "prompt_tokens": jobs[index].prompt_tokens,
                "new_tokens": jobs[index].new_tokens,
            }
        )
    return rows
