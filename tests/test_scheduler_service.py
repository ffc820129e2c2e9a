"""The scheduler service with real processes: a DHT, `swarm-scheduler`, managed servers
started without --blocks, and clients in this process.

Three swarms: five servers of different memory budgets and emulated speeds (placement, generation,
a server leaving); two servers with room for exactly R = 2 sessions (admission in WS-RR order,
the scheduler killed and restarted); and two pinned servers of one session each under the `chains`
policy (JFFC's central queue).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.swarm.models.span import load_span
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc
from tests.conftest import NUM_BLOCKS
from tests.swarm_processes import dht_started

pytestmark = pytest.mark.swarm  # every test here starts processes

L_IN, L_OUT = 16, 48  # the scheduler's planned session: 64 tokens = one cache slot
SLOT_TOKENS = L_IN + L_OUT
OPTIONS = ClientOptions(scheduler_retry=1.0, wait_for_room=120.0)


def options_for(swarm: LocalSwarm) -> ClientOptions:
    """The tests' client options, trusting the swarm's scheduler key."""
    return dataclasses.replace(OPTIONS, scheduler_key=swarm.scheduler_key)


def sizes(model_dir) -> tuple[int, int]:
    """(s_m, s_c) of the model in float32, as servers announce them."""
    span, _ = load_span(model_dir, 0, 1)
    return span.block_bytes, span.cache_bytes(SLOT_TOKENS)


def budget(model_dir, blocks: int, sessions: int) -> str:
    """Memory for exactly `blocks` blocks and `sessions` full sessions on each (plus half a slot)."""
    block_bytes, slot_bytes = sizes(model_dir)
    return str(blocks * (block_bytes + sessions * slot_bytes) + slot_bytes // 2)


def status(address: str) -> pb.Status:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.SchedulerStub(channel).GetStatus(pb.StatusRequest(), timeout=10)


def wait_until(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(poll)


def placed(address: str, count: int) -> pb.Status | None:
    """The status once `count` managed servers serve exactly their assigned spans."""
    try:
        current = status(address)
    except grpc.RpcError:
        return None
    servers = [s for s in current.servers if s.managed]
    ready = (
        len(servers) == count
        and all(s.state == "online" and s.assigned_start >= 0 for s in servers)
        and all((s.start, s.end) == (s.assigned_start, s.assigned_end) for s in servers)
        and not current.uncovered_blocks
    )
    return current if ready else None


def scheduler_args(*policy: str, settle: int) -> tuple[str, ...]:
    """`swarm-scheduler` flags of these tests: `policy` flags, the planned session, a 5 s period."""
    return (*policy, "--l-in", str(L_IN), "--l-out", str(L_OUT), "--period", "5", "--settle", str(settle))


@contextlib.contextmanager
def scheduled_swarm(directory, llama_dir, args: tuple[str, ...]):
    """A DHT and `swarm-scheduler ARGS`; yields (swarm, scheduler address) and stops every process
    it started (servers the caller adds included), asserting none is left running."""
    with dht_started(LocalSwarm(directory)) as swarm:
        yield swarm, swarm.start_scheduler("scheduler", llama_dir, *args)


@pytest.fixture(scope="module")
def reference(llama_dir, local_reference):
    return local_reference(llama_dir)


def expected(reference, prompt: str, new_tokens: int) -> torch.Tensor:
    model, tokenizer = reference
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False)


def generate(client, reference, prompt: str, new_tokens: int, max_length: int = SLOT_TOKENS):
    """Generate in an explicit session; returns (tokens, the session's scheduler admission or None)."""
    _, tokenizer = reference
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with client.inference_session(max_length=max_length) as session:
        output = client.generate(ids, max_new_tokens=new_tokens, do_sample=False, session=session)
        return output, session.blocks.admission


def generate_concurrently(swarm, llama_dir, reference, plan):
    """Run `plan` ([(name, prompt, new tokens, start)]) in threads of one client, each in its own
    session; `start` is a delay in seconds or a predicate the thread waits for. Checks every output
    against local generation and returns (admissions, chain peer ids) by name and the client's
    no-cache-room refusals."""
    client = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, initial_peers=swarm.initial_peers, options=options_for(swarm)
    )
    _, tokenizer = reference
    results, admissions, peers, errors = {}, {}, {}, []

    def run(name: str, prompt: str, new_tokens: int, start) -> None:
        try:
            if callable(start):
                wait_until(start, 60, f"the condition to start {name}", poll=0.02)
            else:
                time.sleep(start)
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with client.inference_session(max_length=SLOT_TOKENS) as session:
                results[name] = client.generate(
                    ids, max_new_tokens=new_tokens, do_sample=False, session=session
                )
                admissions[name] = session.blocks.admission
                peers[name] = [stream.hop.peer_id for stream in session.blocks.streams]
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=entry) for entry in plan]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        refusals = client.backend.connection.bans.no_cache_room_refusals
    finally:
        client.shutdown()
    assert not errors, errors
    for name, prompt, new_tokens, _ in plan:
        assert torch.equal(results[name], expected(reference, prompt, new_tokens)), name
    return admissions, peers, refusals


# --- five servers: placement, generation, a server leaving ---------------------------------------

FIVE = {  # name: (blocks its budget holds with R = 2, emulated per-block delay in seconds)
    "m1": (4, 0.0),
    "m2": (3, 0.002),
    "m3": (3, 0.004),
    "m4": (2, 0.001),
    "m5": (2, 0.006),
}


@pytest.fixture(scope="module")
def five(llama_dir, tmp_path_factory):
    args = scheduler_args("--num-requests", "2", settle=4)
    with scheduled_swarm(tmp_path_factory.mktemp("scheduler-five"), llama_dir, args) as (swarm, address):
        for name, (blocks, delay) in FIVE.items():
            memory = budget(llama_dir, blocks, sessions=2)
            swarm.start_server(name, llama_dir, None, memory, "--compute-delay", str(delay))
        yield swarm, address


def test_managed_spans_equal_swarm_plan_and_generation_is_exact(five, llama_dir, reference):
    swarm, address = five
    current = wait_until(lambda: placed(address, len(FIVE)), 150, "the five servers to serve their spans")
    plan = subprocess.run(
        [sys.executable, "-m", "llm_swarm.scheduler.plan.cli", "place", "--algo", "cg-bp"],
        input=current.plan_input,
        capture_output=True,
        text=True,
        check=True,
    )
    planned = {
        entry["name"]: (entry["start"], entry["end"]) for entry in json.loads(plan.stdout)["placement"]
    }
    live = {server.peer_id: (server.start, server.end) for server in current.servers}
    assert live == planned
    assert json.loads(current.plan_input)["num_requests"] == 2
    assert min(current.coverage) >= 1 and len(current.coverage) == NUM_BLOCKS
    assert current.bound > 0

    client = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, initial_peers=swarm.initial_peers, options=options_for(swarm)
    )
    try:
        output, admission = generate(client, reference, "Once upon a time", 24)
        assert admission is not None  # routed by the scheduler
        assert torch.equal(output, expected(reference, "Once upon a time", 24))
    finally:
        client.shutdown()


def test_a_server_leaving_triggers_re_placement_and_loses_no_session(five, llama_dir, reference):
    swarm, address = five
    before = wait_until(lambda: placed(address, len(FIVE)), 150, "a settled placement")
    client = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, initial_peers=swarm.initial_peers, options=options_for(swarm)
    )
    results, errors = {}, []

    def run(index: int, prompt: str) -> None:
        try:
            results[index] = generate(client, reference, prompt, 40)[0]
        except BaseException as error:  # reported below
            errors.append(error)

    prompts = ["The quick brown fox", "A swarm"]
    threads = [threading.Thread(target=run, args=(k, p)) for k, p in enumerate(prompts)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        left_at = time.monotonic()
        swarm.stop("m1", signal.SIGTERM)  # the biggest server leaves while sessions run through it
        after = wait_until(
            lambda: (s := status(address)).epoch > before.epoch and s, 30, "a re-placement after m1 left"
        )
        # within one period (5 s) plus the settle time (4 s) and the drain of m1 (<= 10 s)
        assert time.monotonic() - left_at < 5 + 4 + 10 + 3
        assert len([s for s in after.servers if s.managed and s.state != "offline"]) == len(FIVE) - 1
        for thread in threads:
            thread.join(timeout=180)
    finally:
        client.shutdown()
    assert not errors, errors
    for index, prompt in enumerate(prompts):
        assert torch.equal(results[index], expected(reference, prompt, 40)), prompt
    wait_until(lambda: placed(address, len(FIVE) - 1), 150, "the four servers to serve their new spans")


# --- two servers with room for exactly R = 2 sessions: admission and the scheduler's death ----------


@pytest.fixture(scope="module")
def tight(llama_dir, tmp_path_factory):
    args = scheduler_args("--num-requests", "2", settle=3)
    with scheduled_swarm(tmp_path_factory.mktemp("scheduler-tight"), llama_dir, args) as (swarm, address):
        memory = budget(llama_dir, NUM_BLOCKS // 2, sessions=2)
        for name in ("t1", "t2"):  # same budget: CG-BP gives each half the blocks, room for 2 sessions
            swarm.start_server(name, llama_dir, None, memory, "--compute-delay", "0.01")
        wait_until(lambda: placed(address, 2), 150, "the two servers to serve their spans")
        yield swarm, address, args


def test_twice_r_clients_are_admitted_in_ws_rr_order_without_refusals(tight, llama_dir, reference):
    swarm, address, _ = tight
    # A and B fill both slots; C arrives once they hold them and D once C waits. B is short, so C
    # (routed before D) is predicted, and admitted, first. B starts 0.3 s after A: the scheduler
    # predicts every session for the planned l_out, so C's predicted start (A's end) comes 0.3 s
    # before D's (B's end), well beyond the jitter of the clients' own clocks
    plan = [
        ("A", "Once upon a time", 40, 0.0),
        ("B", "Paris London", 16, 0.3),
        ("C", "It learned", 8, lambda: status(address).active_sessions == 2),
        ("D", "one two", 8, lambda: status(address).waiting_sessions == 1),
    ]
    admissions, _, refusals = generate_concurrently(swarm, llama_dir, reference, plan)
    assert refusals == 0  # the scheduler never sent a session to a server without room
    assert all(admissions[name] is not None for name in "ABCD")
    waited = {name: admissions[name].admitted_at - admissions[name].routed_at for name in "ABCD"}
    assert waited["C"] > 0.2 and waited["D"] > 0.2, waited
    predicted = sorted("CD", key=lambda n: admissions[n].routed_at + admissions[n].expected_wait)
    actual = sorted("CD", key=lambda n: admissions[n].admitted_at)
    assert predicted == actual == ["C", "D"]


def test_killing_and_restarting_the_scheduler(tight, llama_dir, reference):
    swarm, address, args = tight
    before = status(address)
    client = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, initial_peers=swarm.initial_peers, options=options_for(swarm)
    )
    results, errors = {}, []

    def run(name: str, prompt: str) -> None:
        try:
            results[name] = generate(client, reference, prompt, 40)
        except BaseException as error:  # reported below
            errors.append(error)

    try:
        running = threading.Thread(target=run, args=("running", "The quick brown fox"))
        running.start()
        time.sleep(1.0)
        swarm.stop("scheduler", signal.SIGKILL)
        # a new session while the scheduler is dead: routed locally
        fallback, admission = generate(client, reference, "A swarm", 12)
        assert admission is None
        assert torch.equal(fallback, expected(reference, "A swarm", 12))
        running.join(timeout=180)
        assert not errors, errors
        assert torch.equal(results["running"][0], expected(reference, "The quick brown fox", 40))

        # a new scheduler rebuilds its state from the DHT: same servers, same spans, no moves
        address = swarm.start_scheduler("scheduler-2", llama_dir, *args)
        rebuilt = wait_until(lambda: placed(address, 2), 60, "the restarted scheduler to see the servers")
        spans = lambda s: sorted((x.peer_id, x.start, x.end) for x in s.servers)  # noqa: E731
        assert spans(rebuilt) == spans(before)
        time.sleep(OPTIONS.scheduler_retry + 0.5)
        resumed, admission = generate(client, reference, "Paris London", 12)
        assert admission is not None  # the client found the new scheduler in the DHT
        assert torch.equal(resumed, expected(reference, "Paris London", 12))
    finally:
        client.shutdown()


# --- the `chains` policy: two pinned servers, one session each, a JFFC queue ----------------------


@pytest.fixture(scope="module")
def two_chains(llama_dir, tmp_path_factory):
    args = scheduler_args("--policy", "chains", "--num-requests", "1", settle=1)
    with scheduled_swarm(tmp_path_factory.mktemp("scheduler-chains"), llama_dir, args) as (swarm, address):
        memory = budget(llama_dir, NUM_BLOCKS, sessions=1)
        for name, delay in (("fast", "0.01"), ("slow", "0.03")):  # each its own chain of capacity 1
            swarm.start_server(name, llama_dir, f"0:{NUM_BLOCKS}", memory, "--compute-delay", delay)
        wait_until(
            lambda: len([s for s in status(address).servers if s.state == "online"]) == 2,
            150,
            "the two servers to come online",
        )
        yield swarm, address


def test_chains_policy_queues_for_the_first_free_chain_without_refusals(two_chains, llama_dir, reference):
    swarm, address = two_chains
    both_chains_busy = lambda: status(address).active_sessions == 2  # noqa: E731
    # B ends first whichever chain it gets: 12 steps on the slow chain (6 blocks x 0.03 s) take
    # less than A's 50 on the fast one (6 x 0.01 s); C arrives only once A and B hold both chains
    plan = [
        ("A", "Once upon a time", 50, 0.0),
        ("B", "Paris London", 12, 0.0),
        ("C", "one two", 8, both_chains_busy),
    ]
    admissions, peers, refusals = generate_concurrently(swarm, llama_dir, reference, plan)
    assert refusals == 0
    assert all(len(peers[name]) == 1 for name in "ABC") and peers["A"] != peers["B"]
    # C found both chains busy, waited in the scheduler's queue, and took the chain B freed
    assert admissions["C"].admitted_at - admissions["C"].routed_at > 0.1
    assert peers["C"] == peers["B"]
