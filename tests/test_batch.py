"""`swarm-batch`: input checks, the resumable results file, the planner against its
lower bound and exact optima, work stealing, and a real swarm with two chains where the command is
killed part-way and restarted: every prompt answered exactly once, token for token as transformers."""

from __future__ import annotations

import itertools
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_swarm.client.batch.chains import ChainServer, disjoint_chains
from llm_swarm.client.batch.execute import BatchRunner, Generated
from llm_swarm.client.batch.jobs import Job
from llm_swarm.client.batch.plan import choose_steal, fcfs_plan, lower_bound, lpt_plan
from llm_swarm.client.batch.queues import WorkQueues
from llm_swarm.client.batch.records import (
    BatchInputError,
    InputLimits,
    PromptRecord,
    TokenBounds,
    check_prompt_tokens,
    parse_prompt_lines,
)
from llm_swarm.client.batch.results import ResultsWriter, drop_error_lines, load_results
from llm_swarm.swarm.errors import SwarmUserError
from tests.conftest import NUM_BLOCKS

LIMITS = InputLimits(default_max_new_tokens=8, max_new_tokens_limit=64, max_prompt_chars=100)


# --- the prompts file ---------------------------------------------------------------------------------
def test_valid_lines_blank_lines_and_defaults():
    lines = ['{"id": "a", "prompt": "hi"}', "", '{"id": 7, "prompt": "yo", "max_new_tokens": 16.0}', "  "]
    records = parse_prompt_lines(lines, LIMITS)
    assert [(r.id, r.prompt, r.max_new_tokens, r.line) for r in records] == [
        ("a", "hi", 8, 1),
        (7, "yo", 16, 3),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not valid JSON"),
        ('["a", "b"]', "line 2: expected a JSON object"),
        ('{"prompt": "x"}', 'line 2: missing "id"'),
        ('{"id": "b"}', 'line 2: missing "prompt"'),
        ('{"id": true, "prompt": "x"}', '"id" must be a string or an integer'),
        ('{"id": 1.5, "prompt": "x"}', '"id" must be a string or an integer'),
        ('{"id": "", "prompt": "x"}', '"id" must be 1..256 characters'),
        ('{"id": "b", "prompt": 3}', '"prompt" must be a string'),
        ('{"id": "b", "prompt": ""}', '"prompt" is empty'),
        ('{"id": "b", "prompt": "' + "x" * 101 + '"}', "more than --max-prompt-chars (100)"),
        ('{"id": "b", "prompt": "x", "max_new_tokens": 65}', "must be in 1..64"),
        ('{"id": "b", "prompt": "x", "max_new_tokens": 0}', "must be in 1..64"),
        ('{"id": "b", "prompt": "x", "max_new_tokens": "9"}', '"max_new_tokens" must be an integer'),
        ('{"id": "b", "prompt": "x", "max_tokens": 9}', "unknown field(s) 'max_tokens'"),
        ('{"id": "a", "prompt": "again"}', 'line 2: id "a" was already used on line 1'),
    ],
)
def test_bad_lines_are_refused_naming_the_line(line, message):
    with pytest.raises(BatchInputError) as error:
        parse_prompt_lines(['{"id": "a", "prompt": "first"}', line], LIMITS, "p.jsonl")
    assert message in str(error.value) and str(error.value).startswith("p.jsonl line 2")


def test_string_and_integer_ids_stay_distinct_and_huge_lines_are_refused_unread(tmp_path):
    assert len(parse_prompt_lines(['{"id": "7", "prompt": "a"}', '{"id": 7, "prompt": "b"}'], LIMITS)) == 2
    path = tmp_path / "huge.jsonl"
    path.write_text('{"id": "a", "prompt": "' + "x" * 10_000 + '"}\n')
    from llm_swarm.client.batch.records import read_prompts

    with pytest.raises(BatchInputError, match="huge.jsonl line 1: the line is longer than any valid record"):
        read_prompts(path, LIMITS)


def test_token_bounds_name_the_line():
    record = PromptRecord("a", "text", 10, line=4)
    check_prompt_tokens(record, 5, TokenBounds(8, 16), "p")
    with pytest.raises(BatchInputError, match='p line 4 \\(id "a"\\): "prompt" is 9 tokens, more than'):
        check_prompt_tokens(record, 9, TokenBounds(8, 16), "p")
    with pytest.raises(BatchInputError, match="8 prompt tokens \\+ 10 new tokens exceed the model's 16"):
        check_prompt_tokens(record, 8, TokenBounds(8, 16), "p")
    with pytest.raises(BatchInputError, match="no tokens"):
        check_prompt_tokens(record, 0, TokenBounds(8, None), "p")


# --- the results file ----------------------------------------------------------------------------------
def test_a_torn_last_line_is_cut_off_and_complete_lines_count(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a", "text": "x"}\n{"id": 2, "error": "boom"}\n{"id": "c", "te')
    state = load_results(path)
    assert (
        state.done == {'"a"', "2"} and state.errors == {"2"} and state.torn_bytes == len(b'{"id": "c", "te')
    )
    assert path.read_bytes().endswith(b'"boom"}\n')
    writer = ResultsWriter(path, state.done)
    writer.write({"id": "c", "text": "y"})
    with pytest.raises(RuntimeError, match="already written"):
        writer.write({"id": "a", "text": "again"})
    writer.close()
    assert load_results(path).done == {'"a"', "2", '"c"'}
    assert drop_error_lines(path) == 1
    assert load_results(path).done == {'"a"', '"c"'}


def test_a_results_file_that_is_not_ours_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a"}\nsomething else\n')
    with pytest.raises(BatchInputError, match="out.jsonl line 2 is not JSON"):
        load_results(path)


def test_a_finished_batch_has_nothing_to_do_and_says_whether_some_prompts_failed(tmp_path, capsys):
    from llm_swarm.client.batch.cli import build_parser, run_batch

    prompts, out = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    out.write_text('{"id": "a", "text": "1"}\n{"id": "b", "text": "2"}\n')
    args = build_parser().parse_args(
        [str(prompts), "--out", str(out), "--model", "m", "--initial-peers", "x"]
    )
    assert run_batch(args) == 0 and "2 already in r.jsonl" in capsys.readouterr().out
    out.write_text('{"id": "a", "text": "1"}\n{"id": "b", "error": "boom"}\n')
    assert run_batch(args) == 1 and "nothing to do" in capsys.readouterr().out
    with pytest.raises(SwarmUserError, match="--out must not be the prompts file"):
        run_batch(
            build_parser().parse_args(
                [str(prompts), "--out", str(prompts), "--model", "m", "--initial-peers", "x"]
            )
        )


# --- chains --------------------------------------------------------------------------------------------
def _server(name: str, start: int, end: int, tau: float, rtt: float = 0.001) -> ChainServer:
    return ChainServer(name, name, start, end, rtt, tau, tau * 1.5, 20, 4096, 100, 10**9)


def test_two_replicas_of_two_spans_make_two_disjoint_chains_fastest_first():
    servers = [_server("b1", 0, 3, 0.02), _server("a1", 0, 3, 0.01), _server("a2", 3, 6, 0.01)]
    servers.append(_server("b2", 2, 6, 0.02))  # enters part-way: processes 3:6 only
    chains = disjoint_chains(servers, 6)
    assert [chain.describe() for chain in chains] == ["a1[0:3] -> a2[3:6]", "b1[0:3] -> b2[3:6]"]
    fast, slow = (chain.speed for chain in chains)
    assert fast.decode_step == pytest.approx(0.002 + 6 * 0.01) and slow.decode_step > fast.decode_step
    assert fast.job_seconds(20, 1) == pytest.approx(fast.first_step(20))
    assert fast.job_seconds(20, 5) == pytest.approx(fast.first_step(20) + 4 * fast.decode_step)
    assert fast.first_step(20) == pytest.approx(0.002 + 6 * 0.015)  # the announced prefill point
    assert fast.first_step(1) == pytest.approx(0.002 + 6 * 0.01)  # ... and the one-token one
    measured = fast.measured(0.1, {10: 0.2, 110: 0.7})  # a line through the two measured first steps
    assert measured.decode_step == 0.1 and measured.first_step(60) == pytest.approx(0.45)
    assert fast.measured(0.1, {10: 0.2}).first_per_token == fast.first_per_token  # one point: slope kept
    # a lane of three sessions pays its prompt three times: it stalls the other two meanwhile
    assert fast.lane_seconds(20, 5, 3) == pytest.approx(fast.job_seconds(20, 5) + 2 * fast.first_step(20))
    bound = lower_bound(np.array([[6.0, 12.0]]), [2], alone=np.array([[4.0, 5.0]]))
    assert (bound.longest_job, bound.fractional) == (5.0, 9.0)  # the longest job alone; lane time / lanes
    assert chains[0].session_room(100) == 10**9 // (100 * 3 * 100)
    assert disjoint_chains([_server("a1", 0, 3, 0.01)], 6) == []


def test_the_scheduler_s_status_leaves_out_servers_about_to_move():
    from llm_swarm.client.batch.discover import staying_spans
    from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb

    def status(peer, state, span, assigned=(-1, -1), managed=False):
        start, end = span
        return pb.ServerStatus(
            peer_id=peer, state=state, start=start, end=end, managed=managed,
            assigned_start=assigned[0], assigned_end=assigned[1],
        )  # fmt: skip

    servers = [
        status("fixed", "online", (0, 3)),
        status("managed-staying", "online", (3, 6), (3, 6), managed=True),
        status("managed-moving", "online", (0, 3), (2, 6), managed=True),
        status("leaving", "offline", (0, 6)),
        status("joining", "online", (-1, -1)),
    ]
    assert staying_spans(servers) == {"fixed": (0, 3), "managed-staying": (3, 6)}


def test_the_probe_takes_the_median_prompt_to_decode_and_a_short_and_a_long_one_to_time_prompts():
    from llm_swarm.client.batch.probe import probe_jobs

    jobs = [Job(PromptRecord(f"p{n}", "x", 9, n), tuple(range(n))) for n in range(1, 21)]
    decoding, prompts = probe_jobs(jobs, 8)
    assert (decoding.prompt_tokens, decoding.new_tokens) == (11, 8)
    assert [(job.prompt_tokens, job.new_tokens) for job in prompts] == [(3, 1), (19, 1)]
    same = [Job(PromptRecord(f"p{n}", "x", 9, n), (1, 2)) for n in range(5)]
    assert len(probe_jobs(same, 1)[1]) == 1 and probe_jobs(same, 1)[0].new_tokens == 2


# --- the planner ---------------------------------------------------------------------------------------
def brute_force_makespan(times: np.ndarray, slots: list[int]) -> float:
    lanes = [k for k, n in enumerate(slots) for _ in range(n)]
    best = math.inf
    for assignment in itertools.product(range(len(lanes)), repeat=times.shape[1]):
        loads = [0.0] * len(lanes)
        for job, lane in enumerate(assignment):
            loads[lane] += times[lanes[lane], job]
        best = min(best, max(loads))
    return best


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.1, 10.0), min_size=1, max_size=6),
    st.lists(st.floats(0.2, 5.0), min_size=1, max_size=3),
    st.lists(st.integers(1, 2), min_size=3, max_size=3),
    st.booleans(),
)
def test_lpt_against_the_bound_and_the_optimum(sizes, speeds, slot_choice, unrelated):
    speeds_ = np.array(speeds)
    times = np.array(sizes)[None, :] / speeds_[:, None]
    if unrelated:  # chains that prefill and decode at different relative speeds: times not proportional
        times = times * np.linspace(1.0, 1.7, len(sizes))[None, :] ** np.arange(len(speeds))[:, None]
    slots = slot_choice[: len(speeds)]
    if sum(slots) ** len(sizes) > 5000:
        slots = [1] * len(speeds)
    plan, bound = lpt_plan(times, slots), lower_bound(times, slots)
    optimum = brute_force_makespan(times, slots)
    assert bound.value <= optimum * (1 + 1e-9) <= plan.makespan * (1 + 1e-9) + 1e-12
    assert sorted(j for queue in plan.queues for j in queue) == list(range(len(sizes)))
    assert plan.makespan == pytest.approx(max(plan.loads))
    if not unrelated:
        lanes = sum(slots)  # LPT on uniform machines: within 2m / (m + 1) (Gonzalez, Ibarra, Sahni 1977)
        assert plan.makespan <= optimum * 2 * lanes / (lanes + 1) + 1e-9
        if len(set(speeds)) == 1:  # identical machines: Graham's 4/3 - 1/(3m)
            assert plan.makespan <= optimum * (4 / 3 - 1 / (3 * lanes)) + 1e-9


@pytest.mark.parametrize("chains", [1, 2, 3])
def test_the_fractional_bound_is_total_work_over_total_speed_for_proportional_times(chains):
    rng = np.random.default_rng(chains)
    sizes, speeds, slots = rng.uniform(1, 20, 200), rng.uniform(0.5, 3, chains), [2, 3, 1][:chains]
    times = sizes[None, :] / speeds[:, None]
    expected = sizes.sum() / float(np.dot(slots, speeds))
    bound = lower_bound(times, slots)
    assert bound.fractional <= expected * (1 + 1e-9)
    assert bound.fractional >= expected * 0.999
    assert bound.longest_job == pytest.approx(sizes.max() / speeds.max())
    plan = lpt_plan(times, slots)
    assert bound.value <= plan.makespan <= 1.05 * bound.value  # many small jobs: LPT is nearly tight


def test_fcfs_follows_input_order_and_jobs_no_chain_fits_are_left_out():
    times = np.array([[1.0, 1.0, 8.0, np.inf], [2.0, 2.0, 16.0, np.inf]])
    fcfs = fcfs_plan(times, [1, 1])
    assert fcfs.queues == ((0, 2), (1,)) and fcfs.unplaceable == (3,)
    lpt = lpt_plan(times, [1, 1])
    assert lpt.makespan == 8.0 < fcfs.makespan == 9.0 and lpt.unplaceable == (3,)


def test_an_idle_lane_steals_the_largest_job_it_finishes_sooner():
    times = np.array([[1.0, 2.0, 4.0, 8.0], [2.0, 4.0, 8.0, 16.0]])  # chain 0 twice as fast
    # lane 0 (chain 0) is idle; lane 1 (chain 1) still holds jobs 1, 2, 3: 28 s of work
    assert choose_steal(0.0, 0, [0, 1], [[], [3, 2, 1]], [0.0, 0.0], times) == (1, 3)
    # the slow chain idle, the fast one holding 8 + 2 s: job 3 would take it 16 s, too late; job 1 4 s
    assert choose_steal(0.0, 1, [0, 1], [[3, 1], []], [0.0, 0.0], times) == (0, 1)
    # the fast one holding only job 3 (8 s there, 16 s here): nothing helps
    assert choose_steal(0.0, 1, [0, 1], [[3], []], [0.0, 0.0], times) is None
    # job 2 (4 s there, 8 s here) behind a running job: stolen only if that one ends after 4 s
    assert choose_steal(0.0, 1, [0, 1], [[2], []], [3.0, 0.0], times) is None
    assert choose_steal(0.0, 1, [0, 1], [[2], []], [5.0, 0.0], times) == (0, 2)


def test_each_job_is_handed_out_once_under_concurrency():
    rng = np.random.default_rng(0)
    times = rng.uniform(1, 5, (2, 300)) * np.array([[1.0], [2.0]])
    plan = lpt_plan(times, [3, 2])
    queues = WorkQueues(plan, times, steal=True, clock=lambda: 0.0)
    taken: list[list[int]] = [[] for _ in plan.lane_chain]

    def lane_worker(lane: int) -> None:
        while (assignment := queues.next_job(lane)) is not None:
            taken[lane].append(assignment.job)
            queues.finished(lane, assignment.job, times[plan.lane_chain[lane], assignment.job] * 1.1)

    threads = [threading.Thread(target=lane_worker, args=(lane,)) for lane in range(len(plan.lane_chain))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(itertools.chain.from_iterable(taken)) == list(range(300))
    done_by_chain = [sum(len(taken[lane]) for lane in range(5) if plan.lane_chain[lane] == k) for k in (0, 1)]
    expected = [1 + 0.1 * (1 - 0.7**done) for done in done_by_chain]  # exponential average toward 1.1
    assert queues.corrections() == pytest.approx(expected)
    shared = WorkQueues(plan, times, shared=True, clock=lambda: 0.0)
    assert [shared.next_job(lane).job for lane in (4, 0, 1)] == [0, 1, 2]  # FCFS: input order


def test_a_failed_prompt_is_an_error_line_and_the_others_finish(tmp_path):
    jobs = [Job(PromptRecord(f"p{i}", "x", 4, i + 1), (1, 2, 3)) for i in range(5)]
    times = np.ones((1, 5))

    def generate(model, connection, job, pad):
        if job.record.id == "p2":
            raise RuntimeError("every server of blocks 0:6 failed")
        return Generated([5, 6, 7, 8], 0.01, [0.004, 0.002, 0.002, 0.002])

    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=2))
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda tokens, skip_special_tokens: "abcd")
    writer = ResultsWriter(tmp_path / "out.jsonl", set())
    queues = WorkQueues(lpt_plan(times, [2]), times)
    stats = BatchRunner(model, tokenizer, jobs, [None], queues, writer, False, generate).run()
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert stats.done == 5 and stats.errors == 1 and stats.tokens == 16
    assert sorted(line["id"] for line in lines) == [f"p{i}" for i in range(5)]
    assert [line["error"] for line in lines if line["id"] == "p2"] == [
        "RuntimeError: every server of blocks 0:6 failed"
    ]
    assert all(
        line["tokens"] == [5, 6, 7, 8] and line["finish_reason"] == "length"
        for line in lines
        if "text" in line
    )


# --- a real swarm: two chains, a kill part-way, a restart ----------------------------------------------
SERVERS = {"a1": ("0:3", "0.01"), "a2": ("3:6", "0.01"), "b1": ("0:3", "0.02"), "b2": ("3:6", "0.02")}
WORDS = "the quick brown fox jumps over a lazy dog once upon a time in paris and london".split()


def batch_args(prompts: Path, out: Path, model_dir: Path, peers: list[str], *extra: str) -> list[str]:
    return [
        str(prompts), "--out", str(out), "--model", str(model_dir), "--initial-peers", *peers,
        "--sessions-per-chain", "2", "--no-progress", "--torch-threads", "1", *extra,
    ]  # fmt: skip


@pytest.fixture
def one_torch_thread():
    """Tiny tensors on a busy 2-core machine: intra-op threads only contend (measured 40x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.swarm
def test_a_killed_batch_resumes_and_answers_every_prompt_once_exactly(
    llama_dir, tmp_path, capsys, one_torch_thread, local_reference
):
    from transformers import AutoTokenizer

    from harness.local_swarm import LocalSwarm
    from llm_swarm.client.batch.cli import build_parser, run_batch
    from llm_swarm.swarm.dht_keys import default_prefix

    rng = np.random.default_rng(38)
    prompts = [
        {"id": f"p{i}", "prompt": " ".join(rng.choice(WORDS, int(rng.integers(2, 24)))), "max_new_tokens": 16}
        for i in range(12)
    ]
    prompts[3]["max_new_tokens"] = 6
    prompts_path, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    swarm = LocalSwarm(tmp_path)
    try:
        swarm.start_dht()
        for name, (blocks, delay) in SERVERS.items():
            swarm.start_server(name, llama_dir, blocks, "1GB", "--compute-delay", delay)
        swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, list(SERVERS))
        peers = swarm.initial_peers
        argv = batch_args(prompts_path, out, llama_dir, peers, "--probe-tokens", "0")
        first = swarm.start("batch-1", [sys.executable, "-m", "llm_swarm.client.batch.cli", *argv])
        deadline = time.monotonic() + 120
        while not out.exists() or out.read_text().count("\n") < 3:
            assert first.poll() is None and time.monotonic() < deadline, swarm.log("batch-1")[-3000:]
            time.sleep(0.05)
        swarm.stop("batch-1", signal.SIGKILL)  # by PID, then whatever its group left (its DHT process)
        answered = out.read_text().count("\n")
        assert first.returncode == -signal.SIGKILL and answered < len(prompts), answered
        with out.open("a") as handle:  # as if killed inside a write
            handle.write('{"id": "p11", "text": "tor')
        summary = tmp_path / "summary.json"
        # the restart runs in this process (the test's interpreter has torch loaded already: faster)
        args = build_parser().parse_args(
            batch_args(prompts_path, out, llama_dir, peers, "--summary-json", str(summary))
        )
        assert run_batch(args) == 0
        printed = capsys.readouterr().out
        assert "lower bound" in printed and f"{answered} already in results.jsonl" in printed, printed
    finally:
        assert not swarm.close()
    report = json.loads(summary.read_text())
    assert report["skipped"] == answered and report["done"] == len(prompts) - answered
    assert (
        len(report["chains"]) == 2 and report["makespan"] > 0 and report["estimate"] >= report["lower_bound"]
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == sorted(p["id"] for p in prompts)  # each exactly once
    assert {line["chain"] for line in lines} == {0, 1}
    reference = local_reference(llama_dir)[0]
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    by_id = {line["id"]: line for line in lines}
    for prompt in prompts:
        ids = tokenizer(prompt["prompt"], return_tensors="pt").input_ids
        expected = reference.generate(ids, max_new_tokens=prompt["max_new_tokens"], do_sample=False)
        assert by_id[prompt["id"]]["tokens"] == expected[0, ids.shape[1] :].tolist(), prompt["id"]
        assert by_id[prompt["id"]]["text"] == tokenizer.decode(
            expected[0, ids.shape[1] :], skip_special_tokens=True
        )
