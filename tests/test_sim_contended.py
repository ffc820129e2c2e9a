"""The simulator's contended servers: hand-computed timelines of the servers' loops,
hand-offs, the live rule mirrored, determinism, and Sun et al.'s model left as the default."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.scheduler.algorithms.routing_graph import ChainHop
from llm_swarm.scheduler.algorithms.wsrr import RoutingState
from llm_swarm.scheduler.sim.contended import ContendedConfig, ContendedService
from llm_swarm.scheduler.sim.contended_roles import Disaggregation, parse_roles
from llm_swarm.scheduler.sim.discrete_events import CLIENT, service_hops, simulate
from llm_swarm.scheduler.sim.host_cpu import HostCpuModel, SharedCpu
from llm_swarm.scheduler.sim.monte_carlo import CellConfig, run_seed
from llm_swarm.scheduler.sim.policies import WsRrRouting
from llm_swarm.scheduler.sim.scenarios import Link
from llm_swarm.scheduler.sim.server_costs import IterationCost, ServerCost, from_scenario, relative_host_cost
from llm_swarm.scheduler.sim.workload import Request
from llm_swarm.swarm import step_scheduler
from llm_swarm.swarm.cost import request_time
from llm_swarm.swarm.prefill_cost import (
    choose_prefill_server,
    disaggregated_seconds,
    prompt_chunks,
    scaled_prefill_seconds,
    streamed_seconds,
)
from llm_swarm.swarm.server_info import ServerRole

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

MODEL = ModelSpec(num_blocks=2, block_bytes=1.0, cache_bytes=1.0)  # one slot per block per session


def _server(sessions: int, name: str = "s", tau_prefill: float = 0.5) -> ServerSpec:
    """Both blocks and room for `sessions` sessions; round trips 0.2 s per token, 0.3 s for a prompt."""
    memory = 2.0 + 2.0 * sessions
    return ServerSpec(
        name, memory, tau=0.1, tau_prefill=tau_prefill, rtt={CLIENT: 0.2}, rtt_prefill={CLIENT: 0.3}
    )


def _run(servers, costs, requests, accelerator="serial", batch_wait=0.0, roles=None, engine_servers=None):
    engine_servers = engine_servers or servers
    spans = [Span(0, 2)] * len(engine_servers)
    dispatcher = WsRrRouting(RoutingState(engine_servers, MODEL, spans), spans, setup_s=0.0)
    config = ContendedConfig(accelerator, step_scheduler.SchedulerPolicy(batch_wait=batch_wait))
    service = ContendedService(servers, costs, config, roles=roles)
    result = simulate(engine_servers, MODEL, dispatcher, requests, service=service)
    return {r.id: (r.start, r.first_token, r.finish) for r in result.records}, result


def test_a_lone_session_takes_eq1_whatever_the_accelerator():
    # (0.3 + 2*0.5) + 2 * (0.2 + 2*0.1) = 2.1 s per request; one slot, so one after another
    cost = [ServerCost(IterationCost(fixed=0.1, prefill_fixed=0.5))]
    requests = [Request(0, 0.0, 20, 3), Request(1, 1.0, 20, 3), Request(2, 1.5, 20, 3)]
    for accelerator in ("serial", "overlap"):
        timeline, _ = _run([_server(1)], cost, requests, accelerator, batch_wait=0.002)
        expected = [(0.0, 1.3, 2.1), (2.1, 3.4, 4.2), (4.2, 5.5, 6.3)]
        assert [timeline[k] for k in range(3)] == [pytest.approx(e) for e in expected]


def test_serial_runs_one_iteration_at_a_time_and_overlap_lets_sessions_overlap():
    cost = [ServerCost(IterationCost(fixed=0.1, prefill_fixed=0.5))]
    requests = [Request(0, 0.0, 20, 2), Request(1, 0.0, 20, 2)]
    serial, _ = _run([_server(2)], cost, requests, "serial")
    # both prompts reach the server at 0.15: 0.15-1.15 and 1.15-2.15; r0's decode step (there at
    # 1.4) runs 2.15-2.35, back at 2.45; r1's (there at 2.4) runs 2.4-2.6, back at 2.7
    assert serial[0] == pytest.approx((0.0, 1.3, 2.45))
    assert serial[1] == pytest.approx((0.0, 2.3, 2.7))
    overlap, _ = _run([_server(2)], cost, requests, "overlap")
    # each prompt and each step takes its own 2 x 0.5 s and 2 x 0.1 s, whatever the other does
    assert overlap[0] == pytest.approx((0.0, 1.3, 1.7))
    assert overlap[1] == pytest.approx((0.0, 1.3, 1.7))


def test_a_prefill_delays_decoding_and_the_steps_behind_it_batch():
    # per block: decode 0.1 + 0.05 per row, prefill 0.01 per token; r2's 100-token prompt costs 2 s
    cost = [ServerCost(IterationCost(fixed=0.1, per_row=0.05, prefill_per_token=0.01))]
    requests = [Request(0, 0.0, 2, 2), Request(1, 0.0, 2, 2), Request(2, 0.05, 100, 2)]
    timeline, _ = _run([_server(3)], cost, requests, "serial")
    # prompts: r0 0.15-0.19, r1 0.19-0.23, r2 (there at 0.2) 0.23-2.23; r0's and r1's decode steps
    # (there at 0.44 and 0.48) wait behind r2's prompt, then run as ONE iteration of 2 rows:
    # 2 x (0.1 + 0.05*2) = 0.4 s (one after the other: 2 x 0.3 s), 2.23-2.63, back at 2.73
    assert timeline[0] == pytest.approx((0.0, 0.34, 2.73))
    assert timeline[1] == pytest.approx((0.0, 0.38, 2.73))
    # r2: first token 2.38, its step (there at 2.48) waits for that iteration: 2.63-2.93, back 3.03
    assert timeline[2] == pytest.approx((0.05, 2.38, 3.03))


def test_a_start_that_finds_no_room_waits_for_the_real_end():
    # the host part makes each decode step 2 x 0.15 s where eq. 1 (tau) says 2 x 0.1 s: r0 overruns
    cost = [ServerCost(IterationCost(fixed=0.1, prefill_fixed=0.5), host=IterationCost(fixed=0.05))]
    requests = [Request(0, 0.0, 20, 3), Request(1, 1.0, 20, 3)]
    timeline, _ = _run([_server(1)], cost, requests, "serial")
    assert timeline[0] == pytest.approx((0.0, 1.3, 2.3))  # 1.3 + 2 x (0.2 + 0.3)
    assert timeline[1] == pytest.approx((2.3, 3.6, 4.6))  # WS-RR said 2.1: it starts when r0 ends


def _roles(
    link_bps: float, policy: str = "auto", stream_chunk: int = 0
) -> tuple[list[ServerSpec], list[ServerCost], Disaggregation]:
    """A decode server D (index 0; its prefill 1 s per block for 10 tokens) and a prefill server P
    (0.1 s), 100 cache bytes per token per block, 50 ms between them; caches handed off after the
    prompt unless `stream_chunk` (tokens per streamed part)."""
    decode, prefill = _server(1, "d", tau_prefill=1.0), _server(1, "p", tau_prefill=0.1)
    costs = [
        ServerCost(IterationCost(fixed=0.1, prefill_fixed=1.0)),
        ServerCost(IterationCost(fixed=0.1, prefill_fixed=0.1)),
    ]
    same, link = Link(0.0, math.inf), Link(0.05, link_bps)
    plan = Disaggregation(
        num_decode=1,
        prefill_spans=[Span(0, 2)],
        room_bytes=[1e9],
        announced=[(1.0, 10, 0.1), (0.1, 10, 0.1)],
        links=[[same, link], [link, same]],
        client_rtt=[0.2, 0.2],
        kv_token_bytes=100,
        policy=policy,
        stream_chunk=stream_chunk,
    )
    return [decode, prefill], costs, plan


def test_a_handoff_charges_the_cache_bytes_over_the_link():
    servers, costs, plan = _roles(16000.0)  # 2,000 bytes of cache at 2,000 bytes/s: 1 s
    timeline, result = _run(servers, costs, [Request(0, 0.0, 10, 2)], roles=plan, engine_servers=servers[:1])
    # the rule: P's 2 x 0.1 s + 1 s hand-off < D's 2 x 1 s. The prompt runs on P 0.15-0.35, back
    # at 0.5: the first token (it does not wait for the hand-off); the hand-off: a client round
    # trip to P (0.2) + the link's (0.05) + 1 s -> 1.75; then D decodes: there at 1.85, 1.85-2.05,
    # back at 2.15
    assert timeline[0] == pytest.approx((0.0, 0.5, 2.15))
    assert result.service_stats["handoffs"] == 1


def test_a_cache_streamed_during_the_prompt_leaves_only_what_the_prompt_could_not_hide():
    servers, costs, plan = _roles(16000.0, stream_chunk=5)  # the 10-token prompt in 2 parts
    timeline, result = _run(servers, costs, [Request(0, 0.0, 10, 2)], roles=plan, engine_servers=servers[:1])
    # the rule: the pipeline of P's 2 x 0.1 s and the 1 s transfer in 2 parts, (0.2 + 1) / 2 +
    # 1 / 2 x max(0.2, 1) = 1.1 s < D's 2 s. Back from the prompt at 0.5; what is left of the
    # transfer, 1.1 - 0.2 = 0.9 s, plus the link's round trip (no client round trip: the order went
    # before the prompt) -> 1.45; then D decodes as above, back at 1.85. The first token: 0.5
    assert timeline[0] == pytest.approx((0.0, 0.5, 1.85))
    assert result.service_stats["handoffs"] == 1


def test_streaming_a_cache_is_a_two_stage_pipeline():
    assert streamed_seconds(0.2, 1.0, 1) == pytest.approx(1.2)  # one part: prompt, then transfer
    assert streamed_seconds(0.2, 1.0, 2) == pytest.approx(1.1)
    assert streamed_seconds(1.0, 0.2, 4) == pytest.approx(1.05)  # a fast link: its last part is left
    assert streamed_seconds(1.0, 0.2, 10**6) == pytest.approx(1.0, abs=1e-5)  # the limit: max(P, T)
    assert prompt_chunks(1) == 1 and prompt_chunks(256) == 1 and prompt_chunks(257) == 2
    assert prompt_chunks(1024, 0) == 1  # no chunking: one part
    assert disaggregated_seconds(0.1, 4, 1000.0, 500.0, chunks=4) == pytest.approx(2.1)
    with pytest.raises(ValueError):
        streamed_seconds(1.0, 1.0, 0)


def test_a_slow_link_keeps_the_prompt_on_its_decode_server():
    servers, costs, plan = _roles(4000.0)  # the hand-off would take 4 s: 0.2 + 4 > 2
    timeline, result = _run(servers, costs, [Request(0, 0.0, 10, 2)], roles=plan, engine_servers=servers[:1])
    assert timeline[0] == pytest.approx((0.0, 2.3, 2.7))  # colocated: D's own 2 s prefill
    assert result.service_stats["handoffs"] == 0
    servers, costs, plan = _roles(4000.0, policy="always")
    timeline, _ = _run(servers, costs, [Request(0, 0.0, 10, 2)], roles=plan, engine_servers=servers[:1])
    # the first token at 0.5; the second after the hand-off (0.2 + 0.05 + 4 s) and D's step (0.4)
    assert timeline[0] == pytest.approx((0.0, 0.5, 0.5 + 0.2 + 0.05 + 4.0 + 0.4))


def test_same_seed_same_result_and_the_default_is_paper_000s_model():
    config = CellConfig(rate=1.0, l_out=32, requests=40, setup="none", contended="serial")
    first = run_seed(config, seed=5).records
    assert run_seed(config, seed=5).records == first
    assert run_seed(config, seed=6).records != first
    # without --contended every request follows eq. 1 from its start, as before
    default = CellConfig(rate=1.0, l_out=32, requests=40, setup="none")
    assert default.contended is None
    records = run_seed(default, seed=5).records
    assert records != first
    assert all(r.finish > r.first_token > r.start for r in records)
    assert len({round((r.finish - r.first_token) / (r.l_out - 1), 9) for r in records}) <= 2  # 2-hop chains


def test_one_request_on_an_idle_swarm_costs_eq1_plus_its_context_reads():
    config = CellConfig(rate=0.01, l_out=16, requests=1, setup="none", contended="overlap")
    result = run_seed(config, seed=0)
    plain = run_seed(CellConfig(rate=0.01, l_out=16, requests=1, setup="none"), seed=0)
    (contended,), (paper,) = result.records, plain.records
    assert contended.first_token == pytest.approx(paper.first_token)  # prompts read no context
    assert paper.finish <= contended.finish <= paper.finish * 1.01


def test_roles_on_the_hetero_swarm_hand_off_over_fast_links_only():
    base = dict(
        scenario="hetero", rate=0.2, l_in=2048, l_out=128, requests=12, arrivals="azure-lengths",
        max_l_in=2048, max_l_out=16, setup="none", contended="serial", roles="prefill*2,decode*6",
    )  # fmt: skip
    fast = run_seed(CellConfig(**base, link_mbps=1000.0), seed=0)
    slow = run_seed(CellConfig(**base, link_mbps=20.0), seed=0)
    assert fast.service_stats["handoffs"] > 0 and slow.service_stats["handoffs"] == 0
    assert len(fast.records) == len(slow.records) == 12


def test_prefill_servers_too_small_for_the_model_pair_with_the_placed_decode_spans():
    """The simulator places prefill spans by the live scheduler's rule (`role_placement`): an A100 of
    the hetero swarm given memory for half the model holds the half whose decode servers it reaches
    fastest once the decode servers are placed, and is laid from block 0 before they are; the
    engine takes the placement from the dispatcher, through the goodput search's wrapper."""
    import dataclasses

    from llm_swarm.scheduler.sim.contended_roles import split, uniform_links
    from llm_swarm.scheduler.sim.contended_run import placed_spans
    from llm_swarm.scheduler.sim.monte_carlo import make_scenario
    from llm_swarm.scheduler.sim.plan_runs import _Guarded

    config = CellConfig(scenario="hetero", rate=0.2, l_in=2048, l_out=128, requests=1, setup="none")
    scenario = make_scenario(config, np.random.default_rng(0))
    model, middle = scenario.model, scenario.model.num_blocks // 2
    prompt_per_block = 2 * (model.kv_dim or model.hidden_size) * model.dtype_bytes * scenario.l_in
    memory = (model.block_bytes + prompt_per_block) * (middle + 2)  # just over half the model
    servers = [
        dataclasses.replace(s, memory_bytes=memory) if j == 0 else s for j, s in enumerate(scenario.servers)
    ]
    links = [list(row) for row in uniform_links(len(servers), 0.01, 1e9)]
    for j in (4, 5, 6):  # the A100 reaches the decode servers of the back half fastest
        links[0][j] = Link(0.01, 10e9)
    roles = ("prefill",) + ("decode",) * (len(servers) - 1)
    scenario = dataclasses.replace(
        scenario, servers=tuple(servers), roles=roles, server_links=tuple(tuple(r) for r in links)
    )
    # three decode servers per half (as many to serve on each side) and one holding every block
    decode_spans = [Span(0, middle)] * 3 + [Span(middle, model.num_blocks)] * 3 + [Span(0, model.num_blocks)]
    _, _, laid = split(scenario)
    _, order, paired = split(scenario, decode_spans=decode_spans)
    (before,), (after,) = [p.span for p in laid.prefill], [p.span for p in paired.prefill]
    assert before == Span(0, middle + 2) and order[-1] == 0
    assert after == Span(middle - 2, model.num_blocks)  # holds the back half's decode spans

    class Holder:
        spans = decode_spans
        setup_s = 0.0

    assert placed_spans(_Guarded(Holder())) == decode_spans and placed_spans(object()) is None


def test_the_scheduler_s_queue_aware_prompt_plan_beats_each_client_s_own_rule_under_load():
    """WS-RR routing both phases: at 3 requests/s the two prefill servers of the hetero swarm
    are oversubscribed; clients alone (spread over the two by their session ids) still send every
    prompt there, the scheduler's plan keeps some on the decode servers (simulated, deterministic:
    mean TTFT 5.4 s against 6.1 s)."""
    base = dict(
        scenario="hetero", rate=3.0, l_in=2048, l_out=128, requests=30, arrivals="azure-lengths",
        max_l_in=2048, max_l_out=16, setup="none", contended="serial", roles="prefill*2,decode*6",
        link_mbps=1000.0,
    )  # fmt: skip
    alone = run_seed(CellConfig(**base, disaggregate="auto"), seed=0)
    planned = run_seed(CellConfig(**base, disaggregate="scheduler"), seed=0)

    def mean_ttft(result) -> float:
        return sum(r.first_token - r.arrival for r in result.records) / len(result.records)

    assert planned.service_stats["handoffs"] < alone.service_stats["handoffs"]
    assert mean_ttft(planned) < 0.95 * mean_ttft(alone)


def test_server_costs_from_a_scenario():
    server = ServerSpec("s", 1.0, tau=0.004, tau_prefill=0.05)
    from llm_swarm.scheduler.sim.prefill import PrefillModel

    model = ModelSpec(num_blocks=1, block_bytes=1e9, cache_bytes=1.0, kv_dim=1024, dtype_bytes=2)
    (cost,) = from_scenario([server], model, PrefillModel((0.001,), (1e-5,), (0.0,), (0.0,)))
    assert cost.device.decode(1, 0) == pytest.approx(0.004)  # one row at no context: tau
    assert cost.device.per_row == pytest.approx(1e-5)  # a row costs a prompt token's compute
    assert cost.device.per_context == pytest.approx(4096 * 0.004 / 1e9)  # its cache read at tau's bandwidth
    assert cost.device.prefill(100) == pytest.approx(0.001 + 1e-3)
    host = relative_host_cost(0.002, 0.003, (1.0, 1.0, 0.0), reference_context=20)
    assert host.decode(1, 20) == pytest.approx(0.002) and host.decode(3, 0) == pytest.approx(0.004)
    with pytest.raises(ValueError):
        IterationCost(fixed=-1.0)


def test_shared_cpu_is_processor_sharing():
    done: dict[str, float] = {}
    events: list = []

    def schedule(time, callback, argument):
        events.append((time, len(events), callback, argument))

    def drain():
        while events:
            events.sort(key=lambda e: (e[0], e[1]))
            time, _, callback, argument = events.pop(0)
            callback(time, argument)

    for cores, expected in ((1.0, 2.0), (2.0, 1.0)):
        cpu = SharedCpu(HostCpuModel(cores), schedule)
        cpu.run(0.0, 1.0, lambda t, name: done.__setitem__(name, t), f"a{cores}")
        cpu.run(0.0, 1.0, lambda t, name: done.__setitem__(name, t), f"b{cores}")
        drain()
        assert done[f"a{cores}"] == pytest.approx(expected) and done[f"b{cores}"] == pytest.approx(expected)
    cpu = SharedCpu(HostCpuModel(1.0, background=0.5), schedule)  # half a core left
    cpu.run(0.0, 1.0, lambda t, name: done.__setitem__(name, t), "alone")
    drain()
    assert done["alone"] == pytest.approx(2.0)


def test_clients_spread_over_alike_prefill_servers_by_session():
    alike = {"a": 1.0, "b": 1.02, "c": 3.0}
    chosen = {choose_prefill_server(alike, 5.0, spread=f"session-{k}") for k in range(50)}
    assert chosen == {"a", "b"}  # c is not alike: never chosen
    assert choose_prefill_server(alike, 5.0, spread="s1") == choose_prefill_server(alike, 5.0, spread="s1")
    assert choose_prefill_server({"a": 1.0, "b": 1.02}, 1.01, spread="s") in (None, "a")
    assert {choose_prefill_server({"a": 1.0, "b": 1.02}, 1.01, spread=k) for k in range(20)} == {"a"}
    assert choose_prefill_server(alike, 0.5, spread="s") is None  # colocated is cheaper


def test_the_prefill_rule_is_shared_with_the_client():
    assert scaled_prefill_seconds(0.2, 20, 0.01, 100) == pytest.approx(1.0)
    assert scaled_prefill_seconds(None, 0, 0.01, 100) == pytest.approx(1.0)
    assert disaggregated_seconds(0.1, 4, 1000.0, 500.0) == pytest.approx(2.4)
    assert disaggregated_seconds(0.1, 4, 1000.0, None) == pytest.approx(0.4)  # unknown rate: free
    assert choose_prefill_server({"a": 2.0, "b": 1.0}, 3.0) == "b"
    assert choose_prefill_server({"a": 2.0, "b": 1.0}, 1.0) is None  # not cheaper than colocated
    assert choose_prefill_server({"a": 2.0}, 1.0, "always") == "a"
    assert choose_prefill_server({"a": 2.0}, 9.0, "never") is None
    with pytest.raises(ValueError):
        choose_prefill_server({}, 1.0, "sometimes")


def test_roles_and_contended_flags_are_checked():
    assert parse_roles("prefill*2,both", 3) == (ServerRole.PREFILL, ServerRole.PREFILL, ServerRole.BOTH)
    for text, count in (("prefill*2", 2), ("decode*2", 3), ("gpu*3", 3), ("both*0,both", 1)):
        with pytest.raises(ValueError):
            parse_roles(text, count)
    for bad in (
        dict(contended="fast"),
        dict(roles="both*9"),
        dict(contended="serial", batch_wait_ms=-1.0),
        dict(contended="serial", link_mbps=0.0),
        dict(contended="serial", disaggregate="maybe"),
    ):
        with pytest.raises(ValueError):
            CellConfig(**bad)


def test_service_hops_agree_with_the_contended_round_trips():
    # the engine's eq. 1 view of a chain and the service's per-hop round trips are the same numbers
    server = _server(1)
    (hop,) = service_hops([server], [ChainHop(0, 0, 2)])
    assert (hop.rtt, hop.rtt_prefill) == (0.2, 0.3)
    assert request_time([hop], 3) == pytest.approx(2.1)


def test_swarm_sim_runs_contended_with_roles(capsys):
    from llm_swarm.scheduler.sim.cli import main

    argv = ["--scenario", "hetero", "--arrivals", "azure-lengths", "--l-in", "2048", "--max-l-in", "2048"]
    argv += ["--max-l-out", "8", "--setup", "none", "--contended", "overlap", "--roles", "prefill*2,decode*6"]
    argv += ["--link-mbps", "1000", "--rate", "0.2", "--requests", "6", "--seeds", "1", "--json"]
    assert main(argv) == 0
    assert '"contended": "overlap"' in capsys.readouterr().out
    assert main(["--contended", "serial", "--roles", "prefill*9", "--link-mbps", "1000", "--seeds", "1"]) == 2
    assert "no server decodes" in capsys.readouterr().err
