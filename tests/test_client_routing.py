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


def test_a_sliding_window_block_needs_cache_room_for_its_ring_only():
    # every other block slides over 100 positions: a session of 1100 keeps 1100 positions in a full
    # block and 99 + 64 (its ring) in a sliding one
    windows = (100, None) * 3
    kept = 3 * 1100 + 3 * (99 + 64)
    exact = Candidate("a", info(tau=0.01, cache_bytes_left=256 * kept), 0.03)
    short = Candidate("a", info(tau=0.01, cache_bytes_left=256 * kept - 1), 0.03)
    assert choose_chain([exact], 0, 6, LONG) is None  # as if every block kept every position
    assert choose_chain([exact], 0, 6, LONG, block_windows=windows) == [RouteHop("a", 0, 6)]
    assert choose_chain([short], 0, 6, LONG, block_windows=windows) is None
    # a hop over blocks 1:4 keeps two full blocks and one ring
    tail = Candidate("t", info(start=1, tau=0.01, cache_bytes_left=256 * (2 * 1100 + 163)), 0.03)
    head = Candidate("h", info(end=1, tau=0.01), 0.03)
    assert choose_chain([head, tail], 0, 4, LONG, block_windows=windows) == [
        RouteHop("h", 0, 1),
        RouteHop("t", 1, 4),
    ]


def test_a_chain_session_is_routed_through_servers_that_announce_they_are_near_each_other():
    """A client 100 ms from everyone: a, b, c hold two blocks each and announce 4 ms to the next
    one; d holds all six but decodes slower. Hub-spoke prices a, b, c at three round trips and takes
    d; a chain session prices them at about one and takes them, as long as both ends push."""
    short = SessionShape(batch_size=1, max_length=40, l_in=8, l_out=16)
    a = Candidate("a", info(start=0, end=2, chain_push=True, next_rtts={"b": 0.004}), 0.1)
    b = Candidate("b", info(start=2, end=4, chain_push=True, next_rtts={"c": 0.004}), 0.1)
    c = Candidate("c", info(start=4, end=6, chain_push=True), 0.1)
    d = Candidate("d", info(tau=0.005, chain_push=True), 0.1)
    assert choose_chain([a, b, c, d], 0, 6, short) == [RouteHop("d", 0, 6)]
    assert choose_chain([a, b, c, d], 0, 6, short, pushed=True) == [
        RouteHop("a", 0, 2),
        RouteHop("b", 2, 4),
        RouteHop("c", 4, 6),
    ]
    # a server that does not push (it predates chain sessions) is reached through the client
    old_b = Candidate("b", info(start=2, end=4, next_rtts={"c": 0.004}), 0.1)
    assert choose_chain([a, old_b, c, d], 0, 6, short, pushed=True) == [RouteHop("d", 0, 6)]
