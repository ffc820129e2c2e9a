"""`swarm-batch`: generate a file of prompts through the swarm, packed onto its disjoint chains.

Reads PROMPTS.jsonl (checked whole first), skips the ids RESULTS.jsonl already holds, finds the
swarm's disjoint chains and their speeds, plans the prompts onto them (LPT against a lower bound on
the makespan, both printed), runs them (one worker per session slot of each chain, work stealing at
the end) and appends each answer to RESULTS.jsonl as it finishes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm_swarm.client.batch.chains import BatchChain, ChainSpeed
from llm_swarm.client.batch.discover import find_chains
from llm_swarm.client.batch.execute import BatchRunner
from llm_swarm.client.batch.jobs import Job, job_times, timeline, tokenize
from llm_swarm.client.batch.pinned import PinnedConnection
from llm_swarm.client.batch.plan import fcfs_plan, lower_bound, lpt_plan
from llm_swarm.client.batch.probe import probe_speeds
from llm_swarm.client.batch.queues import WorkQueues
from llm_swarm.client.batch.records import (
    InputLimits,
    PromptRecord,
    TokenBounds,
    error_record,
    read_prompts,
)
from llm_swarm.client.batch.report import PlanReport, plan_lines, summary_json, summary_line
from llm_swarm.client.batch.results import ResultsWriter, drop_error_lines, load_results
from llm_swarm.client.connection import ClientOptions, SwarmUnavailable, run_sync
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.cli.args import (
    add_model_source_arguments,
    add_swarm_secret_argument,
    command_parser,
    resolve_model_argument,
    swarm_secret_from_args,
)
from llm_swarm.swarm.cli.errors import run_cli
from llm_swarm.swarm.cli.logs import add_log_level_argument, configure_logging
from llm_swarm.swarm.cli.signals import terminate_like_interrupt
from llm_swarm.swarm.errors import SwarmUserError

logger = logging.getLogger(__name__)

EXAMPLES = """examples:
  swarm-batch prompts.jsonl --out results.jsonl --model models/tiny-llama --initial-peers $PEER
  swarm-batch prompts.jsonl --out results.jsonl --model models/tiny-llama --initial-peers $PEER \\
      --max-new-tokens 64 --sessions-per-chain 4 --scheduler-key scheduler.pub
  swarm-batch prompts.jsonl --out results.jsonl --model models/tiny-llama --initial-peers $PEER --plan-only

PROMPTS.jsonl: one JSON object per line, {"id": "a1", "prompt": "def fib(n):", "max_new_tokens": 64}
("max_new_tokens" optional). RESULTS.jsonl: {"id", "text", "tokens", "prompt_tokens",
"finish_reason", "chain", "seconds"} per answered prompt, {"id", "error", "chain"} per failed one.
Run the same command again after an interruption: answered ids are skipped.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "swarm-batch",
        "Generate every prompt of a JSON-lines file through the swarm's disjoint chains (greedy), "
        "planned to finish as early as possible, resumable.",
        EXAMPLES,
    )
    parser.add_argument(
        "prompts", help='the prompts: JSON lines with "id", "prompt", optional "max_new_tokens"'
    )
    parser.add_argument(
        "--out", required=True, help="the results file (JSON lines), appended to and resumed from"
    )
    parser.add_argument(
        "--model",
        required=True,
        help="the model: a local checkpoint directory or a Hub id (client modules, tokenizer)",
    )
    add_model_source_arguments(parser)
    parser.add_argument(
        "--initial-peers", nargs="+", required=True, help="multiaddrs of the swarm's DHT peers"
    )
    parser.add_argument(
        "--dht-prefix", help="swarm namespace of the model (default: the model directory's name)"
    )
    parser.add_argument(
        "--scheduler-key",
        help="find the chains from the status of the scheduler whose records this public key signs (the "
        "key text, or the file swarm-scheduler wrote); without it, from the DHT records",
    )
    limits = InputLimits()
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=limits.default_max_new_tokens,
        help="new tokens for prompts that do not say",
    )
    parser.add_argument(
        "--max-new-tokens-limit",
        type=int,
        default=limits.max_new_tokens_limit,
        help="refuse the file if a line asks for more new tokens",
    )
    parser.add_argument("--max-prompt-chars", type=int, default=limits.max_prompt_chars)
    parser.add_argument("--max-prompt-tokens", type=int, default=4096, help="refuse longer prompts")
    parser.add_argument("--max-prompts", type=int, default=limits.max_prompts)
    parser.add_argument(
        "--sessions-per-chain",
        type=int,
        default=4,
        help="sessions each chain runs at once (at most what its servers' free cache holds); our servers "
        "batch concurrent sessions' decode steps, so more sessions add throughput; use 1 for servers "
        "that do not batch",
    )
    parser.add_argument(
        "--assign",
        choices=["lpt", "fcfs"],
        default="lpt",
        help="lpt: the makespan plan (default); fcfs: one queue in file order, each prompt to the next "
        "free session (the baseline)",
    )
    parser.add_argument("--no-steal", action="store_true", help="lpt: no work stealing once a lane runs dry")
    parser.add_argument(
        "--probe-tokens",
        type=int,
        default=8,
        help="before planning, generate this many tokens on every chain (as many sessions as it will run) "
        "to measure its speed; 0: plan with the announced timings and round trips only",
    )
    parser.add_argument(
        "--retry-errors", action="store_true", help="run again the prompts RESULTS lists as failed"
    )
    parser.add_argument("--plan-only", action="store_true", help="print the chains and the plan, run nothing")
    parser.add_argument(
        "--summary-json", metavar="FILE", help="also write the plan and the run's numbers here"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads of this client (default: torch's choice); its sessions run in threads "
        "of their own, each step's tensors are small: 1 is often fastest on a busy machine",
    )
    parser.add_argument(
        "--dtype", default="float32", help="of the client-side modules (float32: exact greedy)"
    )
    add_swarm_secret_argument(parser)
    add_log_level_argument(parser)
    parser.set_defaults(log_level="warning")
    return parser


def check_arguments(args: argparse.Namespace) -> InputLimits:
    if args.sessions_per_chain < 1:
        raise SwarmUserError("--sessions-per-chain must be at least 1")
    if args.probe_tokens < 0:
        raise SwarmUserError("--probe-tokens must be >= 0")
    if args.torch_threads is not None and args.torch_threads < 1:
        raise SwarmUserError("--torch-threads must be at least 1")
    if args.max_prompt_tokens < 1:
        raise SwarmUserError("--max-prompt-tokens must be at least 1")
    out = Path(args.out)
    if out.resolve() == Path(args.prompts).resolve():
        raise SwarmUserError("--out must not be the prompts file")
    directory = out.parent if str(out.parent) else Path(".")
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise SwarmUserError(f"--out: cannot write in {directory} (no such directory, or not writable)")
    return InputLimits(
        args.max_new_tokens, args.max_new_tokens_limit, args.max_prompt_chars, args.max_prompts
    )


@dataclass
class Pending:
    """What the prompts file asks for and the results file does not hold yet."""

    records: list[PromptRecord]
    pending: list[PromptRecord]
    done: set[str]  # id keys the results file holds

    @property
    def skipped(self) -> int:
        return len(self.records) - len(self.pending)


def pending_prompts(args: argparse.Namespace, limits: InputLimits) -> Pending:
    """The prompts still to run (the results file repaired if its last line is torn)."""
    prompts_path, out = Path(args.prompts), Path(args.out)
    records = read_prompts(prompts_path, limits)
    if args.retry_errors and out.exists():
        dropped = drop_error_lines(out)
        if dropped:
            print(f"--retry-errors: {dropped} failed prompt(s) will run again")
    state = load_results(out)
    pending = [record for record in records if record.key not in state.done]
    strangers = len(state.done - {record.key for record in records})
    print(
        f"swarm-batch: {len(records)} prompts in {prompts_path.name}, "
        f"{len(records) - len(pending)} already in {out.name}"
        + (f" ({strangers} ids there are not in the prompts)" if strangers else "")
    )
    return Pending(records, pending, state.done)


@dataclass
class Measured:
    """The chains found, one pinned connection and its number of sessions each, and their speeds."""

    chains: list[BatchChain]
    connections: list[PinnedConnection]
    slots: list[int]
    speeds: list[ChainSpeed]
    probe_seconds: float


def measure_chains(model: DistributedModelForCausalLM, jobs: list[Job], args, pad_token_id) -> Measured:
    connection = model.backend.connection
    chains = run_sync(find_chains(connection))
    if not chains:
        raise SwarmUnavailable(
            f"no complete chain of online servers covers blocks 0:{connection.num_blocks} "
            f"of {connection.prefix}"
        )
    connections = [
        PinnedConnection(connection, [hop.server.peer_id for hop in chain.hops]) for chain in chains
    ]
    longest = max(job.prompt_tokens + job.new_tokens for job in jobs)
    slots = [
        max(1, min(args.sessions_per_chain, chain.session_room(longest, connection.limits.block_windows)))
        for chain in chains
    ]
    speeds = [chain.speed for chain in chains]
    started = time.monotonic()
    if args.probe_tokens:
        speeds = probe_speeds(model, connections, chains, slots, jobs, args.probe_tokens, pad_token_id)
    return Measured(chains, connections, slots, speeds, time.monotonic() - started)


def plan_jobs(jobs: list[Job], measured: Measured, args) -> tuple[PlanReport, np.ndarray]:
    """The plan that runs (with the others beside it and the lower bound) and the lane times."""
    times, alone = job_times(jobs, measured.chains, measured.speeds, measured.slots)
    lpt, fcfs = lpt_plan(times, measured.slots), fcfs_plan(times, measured.slots)
    report = PlanReport(
        chains=measured.chains,
        speeds=measured.speeds,
        slots=measured.slots,
        probed=bool(args.probe_tokens),
        plan=lpt if args.assign == "lpt" else fcfs,
        lpt_makespan=lpt.makespan,
        fcfs_makespan=fcfs.makespan,
        bound=lower_bound(times, measured.slots, alone),
        assign=args.assign,
        steal=args.assign == "lpt" and not args.no_steal,
    )
    return report, times


def run_batch(args: argparse.Namespace) -> int:
    """The command; returns its exit status (1 when some prompts failed)."""
    limits = check_arguments(args)
    todo = pending_prompts(args, limits)
    if not todo.pending:
        print("nothing to do")
        failed = load_results(Path(args.out), repair=False).errors
        return 1 if failed & {record.key for record in todo.records} else 0
    import torch
    from transformers import AutoTokenizer

    from llm_swarm.swarm.models.checkpoint import load_config

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    resolve_model_argument(args, "model", tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = load_config(args.model)
    bounds = TokenBounds(args.max_prompt_tokens, getattr(config, "max_position_embeddings", None))
    jobs = tokenize(todo.pending, tokenizer, bounds, Path(args.prompts).name)
    options = ClientOptions(scheduler_key=args.scheduler_key, swarm_secret=swarm_secret_from_args(args))
    model = DistributedModelForCausalLM.from_pretrained(
        args.model, args.initial_peers, dht_prefix=args.dht_prefix, dtype=args.dtype, options=options
    )
    writer = None
    try:
        measured = measure_chains(model, jobs, args, tokenizer.pad_token_id)
        report, times = plan_jobs(jobs, measured, args)
        typical_prompt = int(np.median([job.prompt_tokens for job in jobs]))
        print(
            f"{len(jobs)} to run on {len(measured.chains)} disjoint chain(s), "
            f"{sum(measured.slots)} session(s) at once:"
        )
        for line in plan_lines(report, typical_prompt):
            print(line, flush=True)
        if args.plan_only:
            return 0
        writer = ResultsWriter(Path(args.out), todo.done)
        limit = max(chain.max_length for chain in measured.chains)
        for j in report.plan.unplaceable:
            needed = jobs[j].prompt_tokens + jobs[j].new_tokens
            why = f"needs {needed} positions; the chains' servers accept at most {limit}"
            writer.write(error_record(jobs[j].record, why, None))
        queues = WorkQueues(report.plan, times, steal=report.steal, shared=args.assign == "fcfs")
        runner = BatchRunner(
            model, tokenizer, jobs, measured.connections, queues, writer, not args.no_progress
        )
        stats = runner.run()
        errors = stats.errors + len(report.plan.unplaceable)
        print(
            summary_line(stats.done, errors, stats.tokens, stats.makespan, report, queues.steals), flush=True
        )
        fallbacks = sum(c.fallbacks for c in measured.connections)
        if fallbacks:
            print(f"{fallbacks} session(s) left their chain (a server failed or had no room)")
        if args.summary_json:
            summary = summary_json(
                report,
                len(todo.records),
                todo.skipped,
                stats.done,
                errors,
                stats.tokens,
                stats.makespan,
                queues.steals,
                queues.corrections(),
                measured.probe_seconds,
                timeline(jobs, stats.timeline, queues),
            )
            Path(args.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
        return 1 if errors else 0
    finally:
        if writer is not None:
            writer.close()
        model.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    terminate_like_interrupt()
    status = 0

    def run() -> None:
        nonlocal status
        status = run_batch(args)

    run_cli("swarm-batch", run)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
