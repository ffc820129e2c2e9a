"""Trace replay: each request keeps its own lengths and pays the prefill of its own l_in (eq. 1)."""

from __future__ import annotations

import numpy as np
import pytest

from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.scheduler.algorithms.wsrr import RoutingState
from llm_swarm.scheduler.sim import scenarios
from llm_swarm.scheduler.sim.discrete_events import CLIENT, simulate
from llm_swarm.scheduler.sim.policies import WsRrRouting
from llm_swarm.scheduler.sim.prefill import affine_prefill
from llm_swarm.scheduler.sim.workload import Request, TraceRecord, trace_replay

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

RECORDS = [TraceRecord(10.0, 5000, 300), TraceRecord(10.5, 100, 3), TraceRecord(12.0, 20, 40)]


def test_trace_keeps_own_lengths_and_clips_only_where_capped():
    rng = np.random.default_rng(0)
    requests = trace_replay(RECORDS, 3, None, None, rng)
    expected = [(0.0, 5000, 300), (0.5, 100, 3), (2.0, 20, 40)]
    assert [(r.arrival, r.l_in, r.l_out) for r in requests] == expected
    capped = trace_replay(RECORDS, 3, 2048, None, np.random.default_rng(0))
    assert [(r.l_in, r.l_out) for r in capped] == [(2048, 300), (100, 3), (20, 40)]


def test_each_request_pays_the_prefill_of_its_own_input():
    # One server, L = 2 blocks. Prefill per block 0.3 + 0.01*l_in s (0.5 s at the nominal l_in = 20),
    # first-token round trip 0.3 + 0.001*l_in s; decode 0.1 s per block, 0.2 s round trip.
    server = ServerSpec("s", 4.0, tau=0.1, tau_prefill=0.5, rtt={CLIENT: 0.2}, rtt_prefill={CLIENT: 0.32})
    model = ModelSpec(num_blocks=2, block_bytes=1.0, cache_bytes=1.0)
    prefill = affine_prefill([(0.3, 0.01)], [(0.3, 0.001)])
    spans = [Span(0, 2)]
    dispatcher = WsRrRouting(RoutingState([server], model, spans), spans, 0.0, prefill)
    requests = [Request(0, 0.0, 20, 3), Request(1, 1.0, 120, 3), Request(2, 2.0, 20, 3)]
    first, second, third = simulate([server], model, dispatcher, requests, prefill).records
    # l_in = 20: (0.32 + 2*0.5) + 2*(0.2 + 2*0.1) = 1.32 + 0.8 = 2.12 s
    assert (first.first_token, first.finish) == pytest.approx((1.32, 2.12))
    # l_in = 120 waits for the slot (2.12 s): prefill (0.3 + 0.12) + 2*(0.3 + 1.2) = 3.42 s, decode 0.8 s
    assert (second.start, second.first_token, second.finish) == pytest.approx((2.12, 5.54, 6.34))
    # WS-RR recorded the long request's true end, so the third starts exactly then
    assert third.start == pytest.approx(6.34)


def test_scenario_prefill_lines_pass_through_the_nominal_values():
    scenario = scenarios.clustered(0, 20, 128)
    for j, server in enumerate(scenario.servers):
        assert scenario.prefill.tau_prefill(j, 20) == server.tau_prefill
        assert scenario.prefill.rtt_prefill(j, 20) == server.rtt_prefill[CLIENT]
        # longer inputs cost more compute and more transfer (inter-cluster links are 100 Mbit/s)
        assert scenario.prefill.tau_prefill(j, 2000) > server.tau_prefill
        assert scenario.prefill.rtt_prefill(j, 2000) > server.rtt_prefill[CLIENT]
