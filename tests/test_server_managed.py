"""Managed servers (server side): spans from the scheduler, PETALS-style fallback, moves.

- `rebuild_span` (a move keeps the blocks both spans share) computes exactly what a fresh load does;
- the PETALS-style block choice on hand-made inputs;
- real processes: managed servers without a scheduler come online PETALS-style and serve generation;
  managed servers follow a scheduler speaking the proto contract, move, and keep serving when it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.local_swarm import PYTHON, LocalSwarm, prometheus_sample
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.problem import ModelSpec
from llm_swarm.server.block_choice import (
    ServedSpan,
    block_throughput,
    choose_blocks,
    petals_model_spec,
    served_spans,
)
from llm_swarm.server.cli import build_parser, config_from_args
from llm_swarm.server.server import ServerConfig
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.dht_records import fetch_roster_async, publish_scheduler
from llm_swarm.swarm.errors import SpanError, SwarmUserError
from llm_swarm.swarm.identity import owner_subkey
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.span import rebuild_span
from llm_swarm.swarm.scheduler_api import scheduler_pb2, scheduler_pb2_grpc
from llm_swarm.swarm.server_info import ServerInfo, ServerState
from tests.conftest import NUM_BLOCKS
from tests.swarm_processes import dht_started
from tests.test_record_validation import server_record

# --- (a) rebuild_span reuses blocks and computes what a fresh load computes -----------------------

MOVES = [
    ((0, 3), (1, 5)),  # shift right: blocks 1, 2 move down one position, 3 and 4 are read
    ((2, 6), (0, 4)),  # shift left: blocks 2, 3 move up two positions
    ((0, 1), (0, 6)),  # the managed start-up: the probe's block 0 grows into a whole span
    ((0, 2), (3, 6)),  # disjoint: nothing reused
    ((1, 5), (2, 4)),  # shrink
    ((1, 4), (1, 4)),  # same span: everything reused
]


def _attention_indices(block: torch.nn.Module) -> list[int]:
    return [m.layer_idx for m in block.modules() if getattr(m, "layer_idx", None) is not None]


def _run(span, hidden: torch.Tensor, steps: list[torch.Tensor], first: int | None = None) -> torch.Tensor:
    """A prefill then single-token decode steps through `span` (or its tail from `first`)."""
    cache = span.new_cache(hidden.shape[0], 32, first=first)
    outputs, position = [span(hidden, cache, 0)], hidden.shape[1]
    for step in steps:
        outputs.append(span(step, cache, position))
        position += 1
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("move", MOVES, ids=lambda m: f"{m[0][0]}:{m[0][1]}->{m[1][0]}:{m[1][1]}")
def test_rebuild_span_matches_a_fresh_load(model_dir, move):
    (old_start, old_end), (start, end) = move
    old, _ = load_span(model_dir, old_start, old_end)
    old_blocks = {index: old.blocks[index - old_start] for index in range(old_start, old_end)}
    rebuilt, reused, loaded = rebuild_span(old, model_dir, start, end)
    fresh, _ = load_span(model_dir, start, end)

    shared = list(range(max(start, old_start), min(end, old_end)))
    assert reused == shared
    assert loaded == [index for index in range(start, end) if index not in shared]
    assert (rebuilt.start, rebuilt.end, rebuilt.num_blocks) == (start, end, end - start)
    for index in range(start, end):
        block = rebuilt.blocks[index - start]
        assert (block is old_blocks.get(index)) == (index in shared)
        assert set(_attention_indices(block)) == {index - start}  # the cache layer it writes

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, fresh.hidden_size, generator=generator)
    steps = [torch.randn(2, 1, fresh.hidden_size, generator=generator) for _ in range(4)]
    for first in (None, end - 1):  # whole span, and a session entering at the last block
        expected, got = _run(fresh, hidden, steps, first), _run(rebuilt, hidden, steps, first)
        assert (got - expected).abs().max().item() <= 1e-6


def test_rebuild_consumes_the_old_span(llama_dir):
    old, _ = load_span(llama_dir, 0, 3)
    rebuild_span(old, llama_dir, 1, 4)
    assert len(old.blocks) == 0  # blocks moved or released, not duplicated
    with pytest.raises(SpanError, match="already consumed"):
        rebuild_span(old, llama_dir, 0, 2)


def test_rebuild_refuses_another_model(llama_dir, bloom_dir):
    old, _ = load_span(llama_dir, 0, 2)
    with pytest.raises(SpanError, match="does not hold blocks of the model"):
        rebuild_span(old, bloom_dir, 0, 2)


# --- (b) the PETALS-style choice on hand-made inputs --------------------------------------------

# autograd reserve 2 GiB * 7 / 14336 = 1 MiB; multi-head d_kv = 7: cache 2*7*4096*2 bytes per block
MODEL = ModelSpec(
    num_blocks=6, block_bytes=1_000_000, cache_bytes=1000, hidden_size=7, kv_dim=7, dtype_bytes=2
)
PER_BLOCK = 1_000_000 + 2 * 7 * 4096 * 2
RESERVE = 2**20


def memory_for(blocks: int) -> int:
    return RESERVE + blocks * PER_BLOCK + PER_BLOCK // 2


def test_block_count_follows_petals_memory_rule():
    assert petals.block_count(petals.ServerSpec(name="x", memory_bytes=memory_for(2), tau=0.01), MODEL) == 2
    choice = choose_blocks(MODEL, memory_for(2), 0.01, [])
    assert (choice.start, choice.end, choice.fitted) == (0, 2, 2)  # empty swarm: lowest start


def test_choice_takes_the_least_served_window():
    others = [ServedSpan(0, 2, 10.0), ServedSpan(2, 4, 5.0)]
    choice = choose_blocks(MODEL, memory_for(2), 0.01, others)
    assert (choice.start, choice.end) == (4, 6)
    assert choice.block_throughput == (10.0, 10.0, 5.0, 5.0, 0.0, 0.0)


def test_choice_compares_sorted_windows_lexicographically():
    # windows of 2 sorted: a=0 [1,3], a=1 [1,2], a=2 [2,4], a=3 [4,4], a=4 [1,4]
    others = [ServedSpan(0, 1, 3.0), ServedSpan(1, 2, 1.0), ServedSpan(2, 3, 2.0), ServedSpan(3, 5, 4.0)]
    others.append(ServedSpan(5, 6, 1.0))
    assert block_throughput(others, 6).tolist() == [3.0, 1.0, 2.0, 4.0, 4.0, 1.0]
    assert choose_blocks(MODEL, memory_for(2), 0.01, others).start == 1
    # ties keep the lowest start: [1,1,1,1,2,2] -> a=0
    even = [ServedSpan(0, 6, 1.0), ServedSpan(4, 6, 1.0)]
    assert choose_blocks(MODEL, memory_for(2), 0.01, even).start == 0


def test_choice_takes_at_least_one_block_and_at_most_all():
    tiny = choose_blocks(MODEL, RESERVE // 2, 0.01, [ServedSpan(0, 3, 1.0)])
    assert (tiny.fitted, tiny.num_blocks, tiny.start) == (0, 1, 3)
    huge = choose_blocks(MODEL, 10**12, 0.01, [])
    assert (huge.start, huge.end) == (0, 6)


def test_gqa_models_reserve_a_longer_cache():
    gqa = petals_model_spec(
        num_blocks=6, block_bytes=1_000_000, hidden_size=8, kv_dim=4, dtype_bytes=4, cache_bytes=1
    )
    assert petals.cache_bytes_per_block(gqa) == 2 * 4 * 16384 * 4


def _info(state: ServerState, start: int | None, end: int | None, throughput: float | None) -> ServerInfo:
    return ServerInfo.from_wire(server_record(state=state.value, start=start, end=end, throughput=throughput))


def test_only_serving_spans_count():
    servers = {
        "online": _info(ServerState.ONLINE, 0, 2, 3.0),
        "joining": _info(ServerState.JOINING, 2, 4, 2.0),
        "moving": _info(ServerState.MOVING, 4, 6, 9.0),
        "offline": _info(ServerState.OFFLINE, 4, 6, 9.0),
        "measuring": _info(ServerState.JOINING, 4, 6, None),
        "waiting": _info(ServerState.JOINING, None, None, None),
        "me": _info(ServerState.ONLINE, 4, 6, 9.0),
    }
    assert served_spans(servers, exclude="me") == [ServedSpan(0, 2, 3.0), ServedSpan(2, 4, 2.0)]


# --- command line -------------------------------------------------------------------------------


def _config(model_dir, *extra: str):
    args = build_parser().parse_args([str(model_dir), "--initial-peers", "x", "--memory", "1GB", *extra])
    return config_from_args(args)


def test_cli_blocks_are_optional(llama_dir):
    managed = _config(llama_dir)
    assert managed.managed and (managed.start, managed.end) == (None, None)
    assert (managed.scheduler_timeout, managed.assignment_poll) == (10.0, 2.0)
    pinned = _config(llama_dir, "--blocks", "1:3", "--scheduler-timeout", "4")
    assert not pinned.managed and (pinned.start, pinned.end, pinned.scheduler_timeout) == (1, 3, 4.0)


@pytest.mark.parametrize(
    "flag, value", [("--scheduler-timeout", "0"), ("--scheduler-timeout", "nan"), ("--assignment-poll", "-1")]
)
def test_cli_rejects_non_positive_scheduler_options(llama_dir, flag, value):
    with pytest.raises(SwarmUserError, match=f"^{flag} must be positive"):
        _config(llama_dir, flag, value)


def test_a_config_built_in_code_gets_the_same_checks_as_the_command_line(llama_dir):
    good = dict(model_dir=str(llama_dir), initial_peers=[], start=0, end=3, memory_bytes=10**9)
    good["dht_prefix"] = "checked"
    assert not ServerConfig(**good).managed
    assert ServerConfig(**{**good, "start": None, "end": None}).managed
    for bad, message in [
        ({"max_length": 0}, "--max-length must be at least 1"),
        ({"announce_period": float("nan")}, "--announce-period must be in"),
        ({"start": 3, "end": 1}, "not a span"),
        ({"start": None}, "not a span"),
        ({"relay": "sometimes"}, "--relay must be one of"),
        ({"metrics_port": 70000}, "--metrics-port must be in"),
        ({"max_peer_cache_fraction": 1.5}, "--max-peer-cache-fraction"),
        ({"drain_timeout": -1.0}, "--drain-timeout must be >= 0"),
        ({"idle_announce_factor": 0.5}, "--idle-announce-factor must be in"),
        ({"idle_announce_factor": float("nan")}, "--idle-announce-factor must be in"),
        ({"announce_period": 60.0, "idle_announce_factor": 3.0}, "--idle-announce-factor must be in"),
    ]:
        with pytest.raises(SwarmUserError, match=message):
            ServerConfig(**{**good, **bad})


# --- (c) real processes -------------------------------------------------------------------------


def start_managed(swarm: LocalSwarm, name: str, model_dir, memory: int, *extra: str):
    """A server started without --blocks (`LocalSwarm.start_server` always pins a span)."""
    argv = [PYTHON, "-m", "llm_swarm.server.cli", str(model_dir), "--initial-peers", *swarm.initial_peers]
    argv += ["--memory", str(memory), "--announce-period", "2", "--torch-threads", "1"]
    # float32 as `petals_memory` counts (on a GPU, `--dtype auto` halves the bytes per block)
    argv += ["--scheduler-key", swarm.scheduler_key, "--dtype", "float32"]
    return swarm.start(name, [*argv, "--public-name", name, *extra])


def wait_spans(swarm: LocalSwarm, prefix: str, spans: dict[str, tuple[int, int]], timeout: float = 120.0):
    """Until every named server is ONLINE with the given span."""
    return swarm.wait_for(
        prefix,
        NUM_BLOCKS,
        lambda online: all(
            name in online and (online[name].start, online[name].end) == span for name, span in spans.items()
        ),
        timeout,
        what=f"spans {spans}",
    )


def wait_announced(swarm: LocalSwarm, prefix: str, names: set[str], timeout: float = 120.0):
    """Until every named server has a record (with or without blocks): the roster, and the peer id of
    each public name in it."""
    deadline = time.monotonic() + timeout
    while True:
        roster = asyncio.run(fetch_roster_async(swarm.observer, prefix, NUM_BLOCKS))
        peers = {info.public_name: peer for peer, info in roster.items()}
        if names <= set(peers):
            return roster, peers
        assert time.monotonic() < deadline, (
            f"servers {sorted(names - set(peers))} did not announce themselves"
        )
        time.sleep(0.3)


def wait_log(swarm: LocalSwarm, name: str, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in swarm.log(name):
        assert time.monotonic() < deadline, f"{name} never logged {text!r}:\n{swarm.log(name)[-2000:]}"
        time.sleep(0.2)


def generate_and_compare(swarm: LocalSwarm, model_dir, prompt_text: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(prompt_text, return_tensors="pt").input_ids
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    client = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers)
    try:
        assert torch.equal(client.generate(prompt, max_new_tokens=24, do_sample=False), expected)
    finally:
        client.shutdown()


def petals_memory(model_dir, blocks: int) -> int:
    """A budget for which PETALS' formula (docs/reference.md 3.3) gives exactly `blocks` blocks of this
    model."""
    probe, _ = load_span(model_dir, 0, 1)
    family, config = probe.family, probe.config
    model = petals_model_spec(
        num_blocks=NUM_BLOCKS,
        block_bytes=probe.block_bytes,
        hidden_size=family.hidden_size(config),
        kv_dim=family.num_kv_heads(config) * family.head_dim(config),
        dtype_bytes=4,
        cache_bytes=1,
    )
    per_block = model.block_bytes + petals.cache_bytes_per_block(model)
    return math.ceil(petals.autograd_reserve_bytes(model) + blocks * per_block + per_block // 2)


@pytest.mark.swarm
def test_managed_servers_without_scheduler_choose_petals_style(llama_dir, tmp_path):
    prefix = default_prefix(str(llama_dir))
    memory = petals_memory(llama_dir, 3)
    with dht_started(LocalSwarm(tmp_path)) as swarm:
        # one at a time, as PETALS servers join: the second one sees the first one's span
        start_managed(swarm, "first", llama_dir, memory, "--scheduler-timeout", "2")
        wait_spans(swarm, prefix, {"first": (0, 3)})
        start_managed(swarm, "second", llama_dir, memory, "--scheduler-timeout", "2")
        online = wait_spans(swarm, prefix, {"first": (0, 3), "second": (3, 6)})
        assert all(info.managed and info.throughput for info in online.values())
        for name in ("first", "second"):
            assert "PETALS-style" in swarm.log(name), swarm.log(name)[-2000:]
        assert re.search(
            r"blocks 0:3 loaded in \d+ ms \(1 reused from the probe, 2 read\)", swarm.log("first")
        )
        generate_and_compare(swarm, llama_dir, "The quick brown fox")


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """A gRPC scheduler that answers GetAssignment from a table the test sets (by peer id)."""

    def __init__(self):
        self.epoch = 0
        self.spans: dict[str, tuple[int, int]] = {}
        self.asked: set[str] = set()

    def GetAssignment(self, request, context):  # noqa: N802  (the proto's name)
        self.asked.add(request.peer_id)
        if request.peer_id not in self.spans:
            return scheduler_pb2.Assignment(
                assigned=False, epoch=self.epoch, retry_after=0.3, reason="not placed by the test yet"
            )
        start, end = self.spans[request.peer_id]
        return scheduler_pb2.Assignment(
            assigned=True, start=start, end=end, epoch=self.epoch, policy="scripted", retry_after=0.5
        )


@contextlib.contextmanager
def scripted_scheduler(
    swarm: LocalSwarm, prefix: str, scheduler: scheduler_pb2_grpc.SchedulerServicer
) -> Iterator[grpc.Server]:
    """`scheduler` served over gRPC on a free loopback port and published, signed by the swarm's
    trusted scheduler key, as the scheduler of `prefix`; stopped when the block ends."""
    grpc_server = grpc.server(ThreadPoolExecutor(max_workers=2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        owner = owner_subkey(swarm.scheduler_key)
        publish_scheduler(swarm.scheduler_dht(), prefix, owner, {"address": f"127.0.0.1:{port}"}, ttl=300)
        yield grpc_server
    finally:
        grpc_server.stop(0)


@pytest.mark.swarm
def test_managed_servers_follow_the_scheduler_and_move(bloom_dir, tmp_path):
    prefix = default_prefix(str(bloom_dir))
    scheduler = ScriptedScheduler()
    with (
        dht_started(LocalSwarm(tmp_path)) as swarm,
        scripted_scheduler(swarm, prefix, scheduler) as grpc_server,
    ):
        for name in ("a", "b"):  # a short scheduler timeout: the scheduler answers, so it never fires
            options = ["--scheduler-timeout", "1", "--assignment-poll", "0.5", "--drain-timeout", "60"]
            start_managed(swarm, name, bloom_dir, 10**9, *options, "--metrics-port", "0")

        # both announce themselves without blocks (managed, JOINING, with the probe's timings)
        roster, peers = wait_announced(swarm, prefix, {"a", "b"})
        for peer in peers.values():
            info = roster[peer]
            assert info.managed and not info.has_blocks and info.state == ServerState.JOINING
            assert info.tau and info.block_bytes and info.cache_token_bytes and info.memory_bytes == 10**9
        time.sleep(2)  # longer than --scheduler-timeout: an answering scheduler is waited for
        assert set(peers.values()) <= scheduler.asked

        scheduler.epoch, scheduler.spans = 1, {peers["a"]: (0, 3), peers["b"]: (3, 6)}
        wait_spans(swarm, prefix, {"a": (0, 3), "b": (3, 6)})
        generate_and_compare(swarm, bloom_dir, "Once upon a time")

        # a new placement while a session is open: both servers refuse new sessions (MOVING), let the
        # open one finish on their old spans, then switch: a shifts right (block 2 changes position)
        tokenizer = AutoTokenizer.from_pretrained(bloom_dir)
        prompt = tokenizer("It learned", return_tensors="pt").input_ids
        expected = (
            AutoModelForCausalLM.from_pretrained(bloom_dir)
            .eval()
            .generate(prompt, max_new_tokens=24, do_sample=False)
        )
        client = AutoDistributedModelForCausalLM.from_pretrained(bloom_dir, initial_peers=swarm.initial_peers)
        try:
            with client.inference_session(max_length=64) as session:
                first = client.generate(prompt, max_new_tokens=8, do_sample=False, session=session)
                scheduler.epoch, scheduler.spans = 2, {peers["a"]: (2, 6), peers["b"]: (0, 3)}
                wait_log(swarm, "a", "draining 1 sessions")
                output = client.generate(first, max_new_tokens=16, do_sample=False, session=session)
            assert torch.equal(output, expected)
        finally:
            client.shutdown()
        wait_spans(swarm, prefix, {"a": (2, 6), "b": (0, 3)})
        move = r"moved blocks {} -> {} \(epoch 2\): {} blocks reused, {} loaded; "
        move += r"drain \d+ ms \(0 sessions cut\)"
        assert re.search(move.format("0:3", "2:6", 1, 3), swarm.log("a")), swarm.log("a")[-3000:]
        assert re.search(move.format("3:6", "0:3", 0, 3), swarm.log("b")), swarm.log("b")[-3000:]
        for name in ("a", "b"):  # the first span was loaded, not moved to: one move each
            assert prometheus_sample(swarm.metrics(name), "swarm_server_span_changes_total") == 1
        generate_and_compare(swarm, bloom_dir, "The quick brown fox")

        # the scheduler dies: servers keep serving, and say so once, not at every poll
        grpc_server.stop(0)
        time.sleep(4)
        wait_spans(swarm, prefix, {"a": (2, 6), "b": (0, 3)}, timeout=10)
        assert swarm.log("a").count("scheduler unreachable") == 1
        generate_and_compare(swarm, bloom_dir, "Paris London")


@pytest.mark.swarm
def test_managed_server_stopped_while_waiting_leaves_cleanly(llama_dir, tmp_path):
    """SIGTERM before any span is chosen: announce OFFLINE (without blocks) and exit 0 at once."""
    prefix = default_prefix(str(llama_dir))
    with dht_started(LocalSwarm(tmp_path)) as swarm:
        process = start_managed(swarm, "waiting", llama_dir, 10**9, "--scheduler-timeout", "600")
        wait_log(swarm, "waiting", "waiting for a span", timeout=60)
        roster = asyncio.run(fetch_roster_async(swarm.observer, prefix, NUM_BLOCKS))
        assert [(i.state, i.has_blocks, i.managed) for i in roster.values()] == [
            (ServerState.JOINING, False, True)
        ]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        deadline = time.monotonic() + 10  # the observer may answer from its cache for a moment
        while [info.state for info in roster.values()] != [ServerState.OFFLINE]:
            assert time.monotonic() < deadline, roster
            time.sleep(0.3)
            roster = asyncio.run(fetch_roster_async(swarm.observer, prefix, NUM_BLOCKS))
