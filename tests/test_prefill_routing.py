"""The scheduler's plan for sessions' prompts (scheduler/service/prefill_routing.py): per hop of the
routed chain, a `--role prefill` server when its queue, prefill and hand-off beat the decode server's
own prefill; prompts spread over prefill servers by earliest finish."""

from __future__ import annotations

import pytest

from llm_swarm.scheduler.service.prefill_routing import PrefillPlanner
from llm_swarm.scheduler.service.view import ModelShape, SwarmView
from llm_swarm.swarm.handoff_wire import HandOff
from llm_swarm.swarm.prefill_cost import hop_prefill_costs, streamed_seconds
from llm_swarm.swarm.route_request import RouteHop
from llm_swarm.swarm.server_info import ServerInfo, ServerRole, ServerState
from llm_swarm.swarm.wire import decode_metadata, encode

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

L_IN = 1000


def record(role: str, tau_prefill: float, start: int = 0, end: int = 8, links=None, room: int = 10**9):
    return ServerInfo(
        state=ServerState.ONLINE,
        start=start,
        end=end,
        memory_bytes=1 << 34,
        block_bytes=1 << 20,
        cache_token_bytes=1000,
        cache_bytes_left=room,
        cache_slots_left=10,
        slot_tokens=2048,
        max_length=4096,
        tau=0.001,
        tau_prefill=tau_prefill,  # per block, for L_IN tokens
        prefill_tokens=L_IN,
        links=links or {},
        role=ServerRole(role),
    )


FAST_LINK = {"decode": 1e9}  # bytes/s: a 1,000-token cache of 8 blocks (8 MB) moves in 8 ms
CHAIN = (RouteHop("decode", 0, 8),)


def test_a_prompt_goes_to_the_prefill_server_that_finishes_first():
    records = {
        "decode": record("decode", 0.1),  # 0.8 s for the prompt itself
        "p1": record("prefill", 0.01, links=FAST_LINK),  # 0.08 s + 8 ms
        "p2": record("prefill", 0.01, links=FAST_LINK),
    }
    planner = PrefillPlanner()
    first = planner.plan(CHAIN, records, L_IN, 1, start_at=0.0)
    second = planner.plan(CHAIN, records, L_IN, 1, start_at=0.0)
    assert {first[0].peer_id, second[0].peer_id} == {"p1", "p2"}  # spread, not both on p1
    assert first[0].start == 0 and first[0].end == 8
    # ten prompts at once: the prefill servers' queues grow until the decode server's own prefill
    # (0.8 s) is as early: from then on prompts stay on their decode server
    plans = [planner.plan(CHAIN, records, L_IN, 1, start_at=0.0) for _ in range(20)]
    assert any(plan == () for plan in plans)
    assert max(planner.busy_until[p] for p in ("p1", "p2")) <= 0.8 + 0.08 + 1e-9
    # later, once their queues are past, the prefill servers take prompts again
    assert planner.plan(CHAIN, records, L_IN, 1, start_at=100.0)


def test_a_slow_or_unknown_link_and_a_full_server_decide_as_the_client_would():
    slow = {"decode": 1e6}  # 8 MB at 1 MB/s: 8 s, more than the decode server's 0.8 s
    records = {"decode": record("decode", 0.1), "p": record("prefill", 0.01, links=slow)}
    assert PrefillPlanner().plan(CHAIN, records, L_IN, 1, 0.0) == ()
    records["p"] = record("prefill", 0.01)  # unmeasured: the hand-off's own limit bounds the loss
    assert PrefillPlanner().plan(CHAIN, records, L_IN, 1, 0.0)[0].peer_id == "p"
    records["p"] = record("prefill", 0.01, links=FAST_LINK, room=0)
    assert PrefillPlanner().plan(CHAIN, records, L_IN, 1, 0.0) == ()
    records["p"] = record("prefill", 0.01, start=0, end=4, links=FAST_LINK)  # does not hold the hop
    assert PrefillPlanner().plan(CHAIN, records, L_IN, 1, 0.0) == ()
    records["p"] = record("both", 0.01, links=FAST_LINK)  # not started for prompts only
    assert PrefillPlanner().plan(CHAIN, records, L_IN, 1, 0.0) == ()
    records["p"] = record("prefill", 0.01, links=FAST_LINK)
    assert PrefillPlanner().plan(CHAIN, records, 1, 1, 0.0) == ()  # a one-token prompt: a decode step


def test_each_hop_is_planned_on_its_own_and_memory_stays_bounded():
    links = {"d1": 1e9, "d2": 1e9}
    records = {
        "d1": record("decode", 0.1, 0, 4),
        "d2": record("both", 0.001, 4, 8),  # prefills fast itself
        "p": record("prefill", 0.01, 0, 8, links=links),
    }
    chain = (RouteHop("d1", 0, 4), RouteHop("d2", 4, 8))
    planner = PrefillPlanner()
    assert planner.plan(chain, records, L_IN, 1, 0.0) == (RouteHop("p", 0, 4),)
    del records["p"]
    planner.plan(chain, records, L_IN, 1, 1000.0)
    assert set(planner.busy_until) <= set(records)


def test_a_prefill_server_that_streams_counts_its_hand_off_as_overlapped_with_its_prompt():
    """A server announcing the chunks its prompts run in (`ServerInfo.prefill_chunk`) streams each
    chunk's cache while the next computes: its estimate is the pipeline's, not prompt + transfer; one
    that predates streaming (0) is charged both in turn."""
    slow_link = {"decode": 8e6}  # the 8 MB cache in 1 s
    old = record("prefill", 0.5, links=slow_link)  # 4 s for the prompt's 8 blocks
    new = old.model_copy(update={"prefill_chunk": 250})  # the 1,000-token prompt in 4 chunks
    costs = hop_prefill_costs(CHAIN[0], {"old": old, "new": new}, L_IN, 1)
    assert costs["old"] == pytest.approx(4.0 + 1.0)
    assert costs["new"] == pytest.approx(streamed_seconds(4.0, 1.0, 4)) == pytest.approx(4.25)


def test_a_plain_hand_off_leaves_the_follow_field_out_for_servers_that_predate_it():
    order = dict(
        handoff_id="h", target_peer="p", target_session="s" * 8, token="0" * 32, length=4, max_seconds=1.0
    )
    assert "follow" not in decode_metadata(encode(HandOff(**order)).metadata)
    assert decode_metadata(encode(HandOff(**order, follow=True)).metadata)["follow"] is True


def test_ws_rr_sees_a_decode_servers_prefill_where_its_prompts_run():
    """A decode server whose whole span a faster prefill server holds is routed with that server's
    prefill time, not its own (which its sessions' prompts never use): alike decode servers then
    compete on decoding alone. A server the prefill server does not cover keeps its own."""
    records = {
        "decode_a": record("decode", 0.50),
        "decode_b": record("decode", 0.49),  # its own prefill 2% faster: irrelevant with "rich" there
        "other_span": record("both", 0.50, start=4, end=12),
        "rich": record("prefill", 0.10),
    }
    view = SwarmView(
        ModelShape(num_blocks=12, hidden_size=64, kv_dim=64), l_in=L_IN, l_out=16, records=records
    )
    peers = ["decode_a", "decode_b", "other_span"]
    own = {spec.name: spec for spec in view.server_specs(peers)}
    routed = {spec.name: spec for spec in view.routing_specs(peers)}
    assert routed["decode_a"].tau_prefill == routed["decode_b"].tau_prefill == pytest.approx(0.10)
    assert routed["decode_a"].tau_p == pytest.approx(0.10 + 15 * 0.001)
    assert routed["other_span"] == own["other_span"]
    del records["rich"]
    assert view.routing_specs(peers) == view.server_specs(peers)
