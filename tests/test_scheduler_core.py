"""The scheduler service's decisions, without sockets: placement adoption, WS-RR admission, leases."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.scheduler.plan.commands import place
from llm_swarm.scheduler.plan.problem_io import dumps, parse_problem, problem_json
from llm_swarm.scheduler.service.core import CoreSettings, SchedulerCore
from llm_swarm.scheduler.service.planner import PlanSettings, r_changed
from llm_swarm.scheduler.service.runner import SchedulerConfig
from llm_swarm.scheduler.service.sessions import SessionBook
from llm_swarm.scheduler.service.view import ModelShape
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.route_request import RouteRequest, SessionShape
from llm_swarm.swarm.server_info import Reachability, ServerInfo, ServerState

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

L = 8
BLOCK = 1000
TOKEN = 10  # cache bytes per token per block
SLOT = TOKEN * (4 + 6)  # s_c for l_in=4, l_out=6
SHAPE = ModelShape(num_blocks=L, hidden_size=16, kv_dim=16)


def _request(
    client_id: str, rtts: dict, l_in: int, l_out: int, batch_size: int, max_length: int
) -> RouteRequest:
    return RouteRequest(client_id, rtts, SessionShape(batch_size, max_length, l_in, l_out))


def info(memory, tau, span=None, state=ServerState.JOINING, managed=True, used_slots=0, slot_tokens=10):
    start, end = span if span else (None, None)
    blocks = (end - start) if span else 0
    left = memory - BLOCK * blocks - used_slots * SLOT
    return ServerInfo(
        state=state,
        start=start,
        end=end,
        managed=managed,
        memory_bytes=memory,
        block_bytes=BLOCK,
        cache_token_bytes=TOKEN,
        cache_bytes_left=max(left, 0),
        cache_slots_left=0,
        slot_tokens=slot_tokens,
        max_length=64,
        tau=tau,
        tau_prefill=tau * 4,
        prefill_tokens=4,
    )


def core_with(settings=None, now=0.0):
    settings = settings or CoreSettings(plan=PlanSettings(num_requests=2), l_in=4, l_out=6, settle=1.0)
    return SchedulerCore(SHAPE, settings, now)


SERVERS = {
    "peer-a": info(6 * BLOCK + 12 * SLOT, 0.001),
    "peer-b": info(5 * BLOCK + 10 * SLOT, 0.004),
    "peer-c": info(4 * BLOCK + 8 * SLOT, 0.002),
    "peer-d": info(3 * BLOCK + 6 * SLOT, 0.003),
    "peer-e": info(2 * BLOCK + 4 * SLOT, 0.005),
}


def serving(assignment, base=SERVERS, used=None):
    """The records servers announce once they serve their assigned spans."""
    used = used or {}
    return {
        peer: info(
            record.memory_bytes,
            record.tau,
            span=(assignment[peer].start, assignment[peer].end) if assignment.get(peer) else None,
            state=ServerState.ONLINE if assignment.get(peer) else ServerState.JOINING,
            used_slots=used.get(peer, 0),
        )
        for peer, record in base.items()
    }


def test_placement_waits_to_settle_then_equals_swarm_plan():
    core = core_with()
    core.update_roster(SERVERS, now=0.0)
    assert not core.review(now=0.5)  # servers are still arriving
    assert core.review(now=1.2)
    plan_output = place(parse_problem(json.dumps(core.plan.plan_input)), "cg-bp")
    expected = {entry["name"]: (entry["start"], entry["end"]) for entry in plan_output["placement"]}
    got = {peer: (span.start, span.end) if span else (None, None) for peer, span in core.assignment.items()}
    assert got == expected
    assert core.assignment_for("peer-a").assigned and core.epoch == 1
    assert core.status(2.0)["bound"] == pytest.approx(plan_output["bound"])
    assert core.plan.plan_output == plan_output  # the record is what `swarm-plan place` prints
    # nothing changed: later reviews keep the placement
    core.update_roster(serving(core.assignment), now=2.0)
    assert not core.review(now=100.0)
    assert core.epoch == 1


def test_the_recorded_problem_reads_back_as_the_problem_the_algorithms_got():
    core = core_with()
    core.update_roster(SERVERS, now=0.0)
    for parameters in ({"num_requests": 3}, {"capacity": "auto", "arrival_rate": 0.5}, {"capacity": 2}):
        problem = core.view.plan_problem(sorted(SERVERS), **parameters)
        assert parse_problem(dumps(problem_json(problem))) == problem


def test_restarted_scheduler_adopts_the_live_spans():
    first = core_with()
    first.update_roster(SERVERS, now=0.0)
    first.review(now=2.0)
    records = serving(first.assignment)
    second = core_with(now=50.0)
    second.update_roster(records, now=50.0)
    assert second.assignment == first.assignment  # no server moves
    assert not second.review(now=200.0)


def test_a_server_leaving_triggers_re_placement_after_settle():
    core = core_with()
    core.update_roster(SERVERS, now=0.0)
    core.review(now=2.0)
    records = serving(core.assignment)
    core.update_roster(records, now=3.0)
    del records["peer-a"]
    core.update_roster(records, now=4.0)
    assert not core.review(now=4.5)
    assert core.review(now=5.1)
    assert "peer-a" not in core.assignment and core.epoch == 2


def test_waiting_sessions_are_admitted_in_ws_rr_order_and_never_overfill():
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {"peer-a": info(L * BLOCK + 2 * SLOT * L, 0.001)}  # one server, room for exactly 2 sessions
    core.update_roster(servers, 0.0)
    core.review(0.1)
    core.update_roster(serving(core.assignment, servers), 0.2)
    decisions = [core.route(_request(f"c{k}", {"peer-a": 0.001}, 4, 6, 1, 10), now=1.0) for k in range(4)]
    admitted = [core.book.sessions[d.session.session_id].admitted for d in decisions]
    assert admitted == [True, True, False, False]
    waits = [d.wait for d in decisions]
    assert waits[0] == waits[1] == 0 and 0 < waits[2] <= waits[3]
    # a session ending frees room for exactly the first waiting one
    core.book.end(decisions[1].session.session_id)
    assert core.tick(10.0) == [decisions[2].session.session_id]
    core.book.end(decisions[0].session.session_id)
    assert core.tick(11.0) == [decisions[3].session.session_id]


def test_a_session_that_ends_frees_its_room_before_the_servers_re_announce():
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0, lease=60.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {"peer-a": info(L * BLOCK + 1 * SLOT * L, 0.001)}  # room for one session
    core.update_roster(servers, 0.0)
    core.review(0.1)
    core.update_roster(serving(core.assignment, servers), 0.2)
    first = core.route(_request("c1", {"peer-a": 0.001}, 4, 6, 1, 10), now=1.0)
    assert first.session.admitted
    # the server's record now counts the first session's cache (announced after it opened)
    core.update_roster(serving(core.assignment, servers, used={"peer-a": L}), 1.5)
    second = core.route(_request("c2", {"peer-a": 0.001}, 4, 6, 1, 10), now=2.0)
    assert not second.session.admitted
    assert core.end_session(first.session.session_id)
    # no roster read since: the record still counts the first session, but the book knows it ended
    assert core.tick(2.1) == [second.session.session_id]


def test_announced_use_blocks_admission_and_leases_expire():
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0, lease=5.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {"peer-a": info(L * BLOCK + 2 * SLOT * L, 0.001)}
    core.update_roster(servers, 0.0)
    core.review(0.1)
    # the server says sessions routed without the scheduler hold its whole cache
    core.update_roster(serving(core.assignment, servers, used={"peer-a": 2 * L}), 0.2)
    first = core.route(_request("c1", {"peer-a": 0.001}, 4, 6, 1, 10), now=1.0)
    assert not core.book.sessions[first.session.session_id].admitted
    core.update_roster(serving(core.assignment, servers, used={"peer-a": L}), 2.0)  # one of them ended
    assert core.tick(2.0) == [first.session.session_id]
    second = core.route(_request("c2", {"peer-a": 0.001}, 4, 6, 1, 10), now=2.0)
    assert core.book.renew(first.session.session_id, 4.0)
    assert core.tick(7.5) == []
    assert first.session.session_id in core.book.sessions  # renewed at 4.0: lease until 9.0
    assert second.session.session_id not in core.book.sessions  # never renewed: expired at 7.0
    core.tick(9.5)
    assert not core.book.sessions


def test_a_requests_own_lengths_set_its_predicted_completion():
    """Routing on real lengths: the scheduler's estimate follows the request's prompt and
    answer, not its configured l_in/l_out (4 and 6 here)."""
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {"peer-a": info(L * BLOCK + 20 * SLOT * L, 0.001)}  # room for all three at once
    core.update_roster(servers, 0.0)
    core.review(0.1)
    core.update_roster(serving(core.assignment, servers), 0.2)
    short = core.route(_request("c1", {"peer-a": 0.01}, 4, 6, 1, 10), now=1.0)
    long_prompt = core.route(_request("c2", {"peer-a": 0.01}, 40, 6, 1, 46), now=1.0)
    long_answer = core.route(_request("c3", {"peer-a": 0.01}, 4, 60, 1, 64), now=1.0)
    per_block_token = 0.001  # tau_prefill is 4 x tau for 4 tokens: tau per prompt token per block
    assert long_prompt.completion - short.completion == pytest.approx(36 * per_block_token * L)
    assert long_answer.completion - short.completion == pytest.approx(54 * (0.01 + L * 0.001))


def test_ended_sessions_teach_the_scheduler_how_long_sessions_really_run():
    """Sessions that ran 3x their eq. 1 time stretch later predictions 3x (after a few of them); a
    session's end moves with its real admission; lease expiries teach nothing."""
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {"peer-a": info(L * BLOCK + 2 * SLOT * L, 0.001)}  # room for two sessions at a time
    core.update_roster(servers, 0.0)
    core.review(0.1)
    core.update_roster(serving(core.assignment, servers), 0.2)
    first = core.route(_request("c0", {"peer-a": 0.01}, 4, 6, 1, 10), now=1.0)
    service = first.completion  # admitted at once: its whole predicted run time
    now = 1.0
    for k in range(5):
        decision = core.route(_request(f"c{k}", {"peer-a": 0.01}, 4, 6, 1, 10), now=now)
        assert decision.completion == pytest.approx(service)  # nothing learned yet
        now += 3 * service
        assert core.end_session(decision.session.session_id, now=now)
    assert core.book.durations.scale == pytest.approx(3.0)
    later = core.route(_request("c9", {"peer-a": 0.01}, 4, 6, 1, 10), now=now)
    assert later.completion == pytest.approx(3 * service)
    # the room is now full (first and later): the next one waits
    waiting = core.route(_request("c10", {"peer-a": 0.01}, 4, 6, 1, 10), now=now)
    assert not waiting.session.admitted
    core.end_session(first.session.session_id)  # without `now`: teaches nothing
    assert core.book.durations.scale == pytest.approx(3.0)
    admitted_at = now + 0.5
    assert core.tick(admitted_at) == [waiting.session.session_id]
    record = core.book.sessions[waiting.session.session_id]
    assert record.ends_at == pytest.approx(admitted_at + 3 * service)  # re-anchored at its admission


def test_sessions_hold_the_slots_their_tokens_need():
    """A session holds `batch x max_length / (l_in + l_out)` slots per block, a fraction: exactly the
    bytes its servers reserve. Rounded up to whole slots (before), a server with room for 2 slots
    admitted 2 sessions of half a slot, where 4 fit."""
    core = core_with()
    assert core.book.units_for(batch_size=1, max_length=10) == 1
    assert core.book.units_for(batch_size=2, max_length=10) == 2
    assert core.book.units_for(batch_size=1, max_length=11) == pytest.approx(1.1)
    assert core.book.units_for(batch_size=1, max_length=5) == pytest.approx(0.5)

    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {"peer-a": info(L * BLOCK + 2 * SLOT * L, 0.001)}  # 2 slots per block
    core.update_roster(servers, 0.0)
    core.review(0.1)
    core.update_roster(serving(core.assignment, servers), 0.2)
    halves = [core.route(_request(f"c{k}", {"peer-a": 0.01}, 2, 3, 1, 5), now=1.0) for k in range(5)]
    assert [d.session.admitted for d in halves] == [True, True, True, True, False]
    assert core.book.granted("peer-a") == pytest.approx(2 * L)
    core.end_session(halves[0].session.session_id)
    assert core.tick(2.0) == [halves[4].session.session_id]
    # what a server announces in use counts in the same fractions: 3 tokens on 8 blocks, 2.4 slots
    record = serving(core.assignment, servers)["peer-a"]
    record = record.model_copy(update={"cache_bytes_left": record.cache_bytes_left - 3 * TOKEN * L})
    core.update_roster({"peer-a": record}, 2.5)
    assert core.view.used_units("peer-a", core.view.model_spec()) == pytest.approx(2.4)
    # a session longer than a slot needs more than one
    assert core.book.units_for(batch_size=1, max_length=25) == pytest.approx(2.5)


def test_a_session_past_its_expected_end_still_holds_its_room():
    """A session running past its predicted end is still there: a new session goes to the server
    with room (before, eq. 20 counted the overdue session's room as free, predicted no wait, and
    sent the new one to the full server to wait there)."""
    model = ModelSpec(num_blocks=2, block_bytes=10.0, cache_bytes=1.0)
    specs = [
        ServerSpec(name, 22.0, tau=tau, tau_prefill=tau, rtt={"c": 0.01}, rtt_prefill={"c": 0.01})
        for name, tau in (("fast", 0.001), ("slow", 0.002))
    ]  # 2 slots each: one session of both blocks
    book = SessionBook(lease_s=60.0, slot_tokens=10)
    book.set_servers(["fast", "slow"], specs, model, [Span(0, 2), Span(0, 2)], {})
    first = book.route("s1", "c", {"fast": 0.01, "slow": 0.01}, 4, 1.0, now=0.0)
    assert [hop.peer_id for hop in first.session.hops] == ["fast"]
    assert book.admit_ready(0.0) == ["s1"]
    late = first.session.ends_at + 5.0  # s1 has not ended: its client still generates
    second = book.route("s2", "c", {"fast": 0.01, "slow": 0.01}, 4, 1.0, now=late)
    assert [hop.peer_id for hop in second.session.hops] == ["slow"]
    assert book.admit_ready(late) == ["s2"]


def test_r_hysteresis():
    assert not r_changed(8, 9, 0.25) and r_changed(8, 10, 0.25)
    assert r_changed(1, 2, 0.25) and not r_changed(3, 3, 0.25)


def test_unplaceable_servers_and_spans():
    core = core_with()
    records = dict(SERVERS)
    records["pinned"] = info(4 * BLOCK, 0.001, span=(0, 2), state=ServerState.ONLINE, managed=False)
    records["leaving"] = info(4 * BLOCK, 0.001, state=ServerState.OFFLINE)
    core.update_roster(records, 0.0)
    assert core.view.placeable() == sorted(SERVERS)
    assert core.view.live() == ["pinned"]
    assert core.view.live_spans(["pinned"]) == [Span(0, 2)]


def test_an_unreachable_server_is_shown_but_never_routed_to():
    """A server behind NAT without a relay stays on the status page, marked, and out of
    every route, even when it is the fastest; one served through a relay is routed as usual."""
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    servers = {
        "peer-fast": info(L * BLOCK + 4 * SLOT * L, 0.001),
        "peer-slow": info(L * BLOCK + 4 * SLOT * L, 0.004),
    }
    core.update_roster(servers, 0.0)
    core.review(0.1)
    records = serving(core.assignment, servers)
    assert all(records[peer].has_blocks for peer in records)
    records["peer-fast"] = records["peer-fast"].model_copy(update={"reachability": Reachability.UNREACHABLE})
    records["peer-slow"] = records["peer-slow"].model_copy(update={"reachability": Reachability.RELAY})
    core.update_roster(records, 0.2)
    decision = core.route(_request("client", {"peer-fast": 0.001, "peer-slow": 0.05}, 4, 6, 1, 10), now=1.0)
    assert [hop.peer_id for hop in decision.session.hops] == ["peer-slow"]
    shown = {server["peer_id"]: server["reachability"] for server in core.status(1.0)["servers"]}
    assert shown == {"peer-fast": "unreachable", "peer-slow": "relay"}


@pytest.mark.parametrize(
    "settings, message",
    [
        (lambda: CoreSettings(period=0), "--period must be positive"),
        (lambda: CoreSettings(lease=float("nan")), "--lease must be positive"),
        (lambda: CoreSettings(settle=-1), "--settle must be >= 0"),
        (lambda: PlanSettings(min_gain=1.0), "--min-gain must be in"),
        (lambda: PlanSettings(arrival_rate=float("inf")), "--arrival-rate must be a positive"),
        (lambda: PlanSettings(num_requests=0), "--num-requests must be at least 1"),
        (lambda: PlanSettings(policy="magic"), "--policy must be one of"),
        (lambda: SchedulerConfig([], "p", SHAPE, CoreSettings(), full_pass=0), "full pass must be positive"),
        (lambda: SchedulerConfig([], "p", SHAPE, CoreSettings(), port=70000), "--port must be in"),
    ],
)
def test_settings_built_in_code_check_their_values(settings, message):
    with pytest.raises(SwarmUserError, match=message):
        settings()


def test_the_book_follows_moved_compute_timings_and_measured_load_but_not_round_trip_jitter():
    """Same servers, same spans: WS-RR's state is rebuilt (its sessions kept) when a server's `tau`
    or `tau_prefill` moves by more than 10% (e.g. a prefill server now takes its prompts), and takes
    `tau_per_session` as measured at every refresh; a client's round trips are per query."""
    model = ModelSpec(num_blocks=2, block_bytes=10.0, cache_bytes=1.0)

    def specs(b_prefill: float, per_session: float | None = None, rtt: float = 0.01) -> list[ServerSpec]:
        return [
            ServerSpec(
                name,
                100.0,
                tau=0.001,
                tau_prefill=prefill,
                tau_per_session=per_session,
                rtt={"c": rtt},
                rtt_prefill={"c": rtt},
            )  # fmt: skip
            for name, prefill in (("a", 0.010), ("b", b_prefill))
        ]

    rtts = {"a": 0.01, "b": 0.01}
    book = SessionBook(lease_s=60.0, slot_tokens=10)
    book.set_servers(["a", "b"], specs(0.020), model, [Span(0, 2), Span(0, 2)], {})
    assert [hop.peer_id for hop in book.route("s1", "c", rtts, 4, 1.0, now=0.0).session.hops] == ["a"]
    book.set_servers(["a", "b"], specs(0.005), model, [Span(0, 2), Span(0, 2)], {})  # b's prompts moved
    assert [hop.peer_id for hop in book.route("s2", "c", rtts, 4, 1.0, now=0.0).session.hops] == ["b"]
    assert set(book.sessions) == {"s1", "s2"}  # both kept through the rebuild
    state = book._state
    book.set_servers(["a", "b"], specs(0.005, rtt=0.05), model, [Span(0, 2), Span(0, 2)], {})
    assert book._state is state  # round trips are no reason to rebuild
    # measured load, in place: a and b hold one session each, b's cheaper prompt wins s3; with two
    # on b, each adding 10 ms per block per token, a wins s4
    book.set_servers(["a", "b"], specs(0.005, per_session=0.01), model, [Span(0, 2), Span(0, 2)], {})
    assert book._state is state
    assert [hop.peer_id for hop in book.route("s3", "c", rtts, 4, 1.0, now=0.0).session.hops] == ["b"]
    assert [hop.peer_id for hop in book.route("s4", "c", rtts, 4, 1.0, now=0.0).session.hops] == ["a"]


def test_a_chain_session_is_routed_with_the_servers_announced_round_trips_to_each_other():
    """WS-RR prices a chain session (`RouteRequest.pushed`) with what servers announce of their round
    trips to the servers after them: a client 100 ms from everyone gets a and b, 4 ms apart, where
    hub-spoke (two round trips) takes the one slower server that holds every block."""
    settings = CoreSettings(plan=PlanSettings(num_requests=1), l_in=4, l_out=6, settle=0.0)
    core = SchedulerCore(SHAPE, settings, 0.0)
    memory = L * BLOCK + 4 * SLOT * L
    online = {"state": ServerState.ONLINE, "managed": False}
    servers = {
        "peer-a": info(memory, 0.001, span=(0, L // 2), **online),
        "peer-b": info(memory, 0.001, span=(L // 2, L), **online),
        "peer-whole": info(memory, 0.004, span=(0, L), **online),
    }
    servers = {peer: record.model_copy(update={"chain_push": True}) for peer, record in servers.items()}
    servers["peer-a"] = servers["peer-a"].model_copy(update={"next_rtts": {"peer-b": 0.004}})
    core.update_roster(servers, 0.0)
    core.review(0.1)
    rtts = dict.fromkeys(servers, 0.1)
    hub = core.route(_request("client", rtts, 4, 6, 1, 10), now=1.0)
    assert [hop.peer_id for hop in hub.session.hops] == ["peer-whole"]
    pushed = dataclasses.replace(_request("client", rtts, 4, 6, 1, 10), pushed=True)
    chain = core.route(pushed, now=1.0)
    assert [hop.peer_id for hop in chain.session.hops] == ["peer-a", "peer-b"]
    assert RouteRequest.from_proto(pushed.to_proto()).pushed  # the flag crosses the wire
