"""A client that routes alone (no scheduler) prices servers as the scheduler's WS-RR does: by where a
session's prompt runs, and by the sessions each server already decodes (`client/routing.py`)."""

from __future__ import annotations

from llm_swarm.client.routing import Candidate, choose_chain
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.server_info import ServerInfo
from tests.test_record_validation import server_record

LONG = SessionShape(batch_size=1, max_length=1100, l_in=1024, l_out=16)


def info(**overrides) -> ServerInfo:
    return ServerInfo.from_wire(server_record(prefill_tokens=512, **overrides))


def test_a_decode_servers_own_prefill_does_not_decide_where_a_prefill_server_takes_the_prompt():
    # a decodes faster; b prefills 10% faster itself, which decides alone (1024 tokens of prompt
    # against 15 decode steps), but a prefill server that holds both takes the prompt anyway
    a = Candidate("a", info(role="decode", tau=0.010, tau_prefill=0.50), 0.03)
    b = Candidate("b", info(role="decode", tau=0.011, tau_prefill=0.45), 0.03)
    assert choose_chain([a, b], 0, 6, LONG) == [RouteHop("b", 0, 6)]
    rich = {"p": info(role="prefill", tau=0.010, tau_prefill=0.05)}
    assert choose_chain([a, b], 0, 6, LONG, prefill_servers=rich) == [RouteHop("a", 0, 6)]
    # one that holds only some of the blocks takes none of these prompts
    partial = {"p": info(role="prefill", end=3, tau=0.010, tau_prefill=0.05)}
    assert choose_chain([a, b], 0, 6, LONG, prefill_servers=partial) == [RouteHop("b", 0, 6)]


def test_each_session_a_server_announces_open_adds_its_measured_slowdown():
    short = SessionShape(batch_size=1, max_length=64, l_in=4, l_out=32)
    idle = Candidate("idle", info(tau=0.0105), 0.03)
    busy = Candidate("busy", info(tau=0.0100, tau_per_session=0.001, active_sessions=1), 0.03)
    assert choose_chain([idle, busy], 0, 6, short) == [RouteHop("idle", 0, 6)]  # 0.011 > 0.0105
    unmeasured = Candidate("busy", info(tau=0.0100, active_sessions=3), 0.03)
    assert choose_chain([idle, unmeasured], 0, 6, short) == [RouteHop("busy", 0, 6)]
