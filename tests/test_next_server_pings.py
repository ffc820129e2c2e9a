"""What a server announces of its round trips to the servers after its span (`server/next_server_pings.py`):
the servers a chain session may push to from it, each measured a few times, bounded."""

from __future__ import annotations

from llm_swarm.server.next_server_pings import (
    MAX_NEXT_RTTS,
    PINGS_PER_ROUND,
    NextServerRtts,
    next_servers,
    ping_targets,
)
from llm_swarm.swarm.server_info import ServerInfo
from tests.test_record_validation import server_record


def info(**overrides) -> ServerInfo:
    return ServerInfo.from_wire(server_record(**{"chain_push": True, **overrides}))


def test_the_servers_after_a_span_are_those_holding_its_next_block_that_push():
    servers = {
        "me": info(start=0, end=3),
        "next": info(start=3, end=6),
        "overlapping": info(start=1, end=5),
        "later": info(start=4, end=6),
        "old": info(start=3, end=6, chain_push=False),
        "leaving": info(start=3, end=6, state="offline"),
        "dark": info(start=3, end=6, reachability="unreachable"),
    }
    assert next_servers(servers, "me", 3) == ["next", "overlapping"]
    last_pinged = {"next": 5.0}
    many = [f"p{k:02d}" for k in range(20)] + ["next"]
    targets = ping_targets(many, last_pinged)
    assert len(targets) == PINGS_PER_ROUND and "next" not in targets  # least recently pinged first


def test_each_server_announces_its_lowest_recent_round_trip_and_the_record_stays_bounded():
    rtts = NextServerRtts()
    for sample in (0.050, 0.004, 0.006):
        rtts.record("b", sample)
    assert rtts.announced() == {"b": 0.004}
    for sample in (0.007, 0.008, 0.009):  # the 4 ms sample is now older than the last three
        rtts.record("b", sample)
    assert rtts.announced() == {"b": 0.007}
    for k in range(2 * MAX_NEXT_RTTS):
        rtts.record(f"p{k}", 0.01)
    announced = rtts.announced()
    assert len(announced) == MAX_NEXT_RTTS and f"p{2 * MAX_NEXT_RTTS - 1}" in announced
    rtts.forget_all_but({"p31", "gone"})
    assert rtts.announced() == {"p31": 0.01}
    ServerInfo.from_wire(server_record(next_rtts=announced))  # what it announces is a valid record
