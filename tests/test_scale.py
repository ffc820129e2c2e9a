"""A swarm of hundreds of servers should cost a client no more than a swarm of three."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hivemind.dht import DHT
from transformers import AutoModelForCausalLM

from harness.local_swarm import LocalSwarm
from harness.standin_records import (
    StandInSigner,
    new_keys,
    peer_id,
    publish_standins,
    standin_info,
    start_standin_dht,
)
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.client.connection import SwarmConnection, run_sync
from llm_swarm.client.routing import probe_shortlist
from llm_swarm.scheduler.service.status_page import SERVERS_PER_PAGE, render_status_page
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.dht_records import fetch_servers_covering, finish_covering_read
from llm_swarm.swarm.identity import load_identity
from llm_swarm.swarm.record_validator import SwarmRecordValidator
from llm_swarm.swarm.server_info import Reachability, ServerInfo
from tests.conftest import NUM_BLOCKS
from tests.test_record_validation import server_record
from tests.test_trust import BOUND_S, NEW_TOKENS, PROMPT


def _server(start: int, end: int, tau: float, room: bool = True) -> ServerInfo:
    return ServerInfo.from_wire(
        server_record(start=start, end=end, tau=tau, cache_bytes_left=10**8 if room else 0)
    )


def test_the_probe_shortlist_grows_with_the_spans_not_with_the_replicas():
    # 3 spans x 50 replicas: the client pings 4 per block, the fastest announced with room
    servers = {
        f"peer-{span}-{replica:02d}": _server(2 * span, 2 * span + 2, tau=1e-3 * (1 + replica))
        for span in range(3)
        for replica in range(50)
    }
    chosen = probe_shortlist(servers, {}, 0, 6, per_block=4)
    assert chosen == sorted(f"peer-{span}-{replica:02d}" for span in range(3) for replica in range(4))
    # servers already measured come first (their ping is cached), so routing again pings nobody new,
    # and among them the best estimated time wins (a near but slow server loses to faster ones)
    measured = {"peer-0-40": 0.01, **{peer: 0.02 for peer in chosen}}
    assert probe_shortlist(servers, measured, 0, 6, 4) == chosen
    measured["peer-0-40"] = 0.0
    servers["peer-0-40"] = _server(0, 2, tau=1e-6)
    assert "peer-0-40" in probe_shortlist(servers, measured, 0, 6, 4)
    # a sub-range asks only about its blocks; a server without cache room comes after those with it
    servers["peer-1-00"] = _server(2, 4, tau=1e-6, room=False)
    assert probe_shortlist(servers, {}, 2, 4, 2) == ["peer-1-01", "peer-1-02"]
    # wide enough, it is everyone holding a block of the range
    assert len(probe_shortlist(servers, {}, 0, 6, 10**6)) == 150
    # among unmeasured servers, those that answered our DHT node (alive) come before the rest
    live = {"peer-0-45", "peer-2-49"}
    chosen = probe_shortlist(servers, {}, 0, 6, 4, live)
    assert live <= set(chosen) and len(chosen) == 12


def _start_three_servers(swarm: LocalSwarm, llama_dir: Path) -> tuple[str, dict[str, ServerInfo]]:
    """A DHT and three real servers (0:2, 2:4, 4:6), online: the model's prefix and their records."""
    swarm.start_dht()
    for name, blocks in (("a", "0:2"), ("b", "2:4"), ("c", "4:6")):
        swarm.start_server(name, llama_dir, blocks, "256MB")
    prefix = default_prefix(str(llama_dir))
    return prefix, swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b", "c"])


def _generate_exactly_within_bound(
    llama_dir: Path, swarm: LocalSwarm, past: str, check: Callable[[SwarmConnection], None] | None = None
) -> dict[str, float]:
    """A new client generates exactly what transformers does, its start included within `BOUND_S`;
    `check` looks at its connection before it shuts down. Returns the round trips it measured."""
    started = time.monotonic()
    client = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
    try:
        output = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        pinged = client.backend.connection.probes.measured()
        if check is not None:
            check(client.backend.connection)
    finally:
        client.shutdown()
    elapsed = time.monotonic() - started
    reference = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    assert torch.equal(output, reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False))
    print(f"generated past {past} in {elapsed:.1f} s, pinged {len(pinged)} servers")
    assert elapsed < BOUND_S
    return pinged


@pytest.mark.swarm
def test_a_client_generates_exactly_past_dozens_of_dead_and_unreachable_servers(llama_dir, tmp_path):
    """Three real servers (0:2, 2:4, 4:6) among 36 correctly signed records of servers that do not
    exist (30, each announcing itself ten times faster than the real ones) or that announce
    themselves unreachable (6): a new client still generates exactly what transformers does,
    within a bounded time (widening its shortlist past the dead ones), never dialing an unreachable one."""
    swarm = LocalSwarm(tmp_path)
    forger = None
    try:
        prefix, real = _start_three_servers(swarm, llama_dir)
        fastest_real = min(info.tau for info in real.values())
        keys = new_keys(36)
        dead = [
            (key, standin_info(2 * (i % 3), 2 * (i % 3) + 2, fastest_real / 10))
            for i, key in enumerate(keys[:30])
        ]
        dark = [
            (key, standin_info(0, NUM_BLOCKS, fastest_real / 100, Reachability.UNREACHABLE))
            for key in keys[30:]
        ]
        forger = start_standin_dht(swarm.initial_peers, keys)
        assert publish_standins(forger, prefix, dead + dark) == 36
        assert len(swarm.servers(prefix, NUM_BLOCKS)) == 39

        def reads(connection: SwarmConnection) -> None:
            # a first read may stop once every block has enough routable holders, and its searches then
            # complete the roster without searching again; asked for more holders than exist, with no
            # patience limit (0.1 s by default, which a loaded host can run out of), it reads everything
            early = fetch_servers_covering(connection.dht, prefix, NUM_BLOCKS, per_block=1, read_id="early")
            enough, _, _ = run_sync(early)
            assert all(any(i.routable and i.start <= b < i.end for i in enough.values()) for b in range(6))
            rest = run_sync(finish_covering_read(connection.dht, prefix, NUM_BLOCKS, "early"))
            everyone, complete, _ = run_sync(
                fetch_servers_covering(connection.dht, prefix, NUM_BLOCKS, 99, patience=math.inf)
            )
            assert complete and len(everyone) == 39 and enough.items() <= everyone.items()
            assert rest.keys() == everyone.keys()

        pinged = _generate_exactly_within_bound(llama_dir, swarm, "36 dead/unreachable records", reads)
        assert not {peer_id(key) for key, _ in dark} & set(pinged)  # never dialed
        assert {
            peer for peer, info in swarm.servers(prefix, NUM_BLOCKS).items() if info.public_name in real
        } <= set(pinged)
    finally:
        if forger is not None:
            forger.shutdown()
        swarm.close()


def _status_of(servers: int) -> dict:
    rows = [
        {
            "peer_id": f"peer-{i:04d}", "public_name": f"srv-{i:04d}", "state": "online", "managed": False,
            "start": 0, "end": 6, "assigned_start": -1, "assigned_end": -1, "memory_bytes": 1e9, "tau": 1e-3,
            "tau_prefill": 4e-3, "cache_slots": 10, "slots_in_use": 0, "active_sessions": 0,
            "reachability": "unreachable" if i % 40 == 0 else "relay" if i % 10 == 0 else "direct",
        }
        for i in range(servers)
    ]  # fmt: skip
    return {"servers": rows, "num_blocks": 6, "coverage": [servers] * 6, "uncovered_blocks": []}


@pytest.mark.swarm
def test_live_dht_peers_announcing_every_block_and_serving_nothing_do_not_stop_a_client(llama_dir, tmp_path):
    """Four full DHT peers (they answer the client's DHT node, so its first read counts them live) each
    announce, under their own identity, every block at 100x the real servers' speed, and serve
    nothing. They hold every block 4 times over, so a new client's first read may end with them alone
    and its whole shortlist may be theirs: it still generates exactly what transformers does, within
    a bounded time, after their pings failed."""
    (tmp_path / "swarm").mkdir()
    swarm = LocalSwarm(tmp_path / "swarm")
    liars: list[DHT] = []
    try:
        prefix, real = _start_three_servers(swarm, llama_dir)
        fastest_real = min(info.tau for info in real.values())
        for index in range(4):
            key = load_identity(tmp_path / f"liar-{index}.key")
            liar = DHT(
                initial_peers=swarm.initial_peers,
                client_mode=False,  # a full DHT node: it answers searches, as a live server's node does
                identity_path=str(tmp_path / f"liar-{index}.key"),
                check_if_identity_free=False,
                record_validators=[StandInSigner([key]), SwarmRecordValidator()],
                start=True,
            )
            liars.append(liar)
            assert liar.peer_id.to_base58() == peer_id(key)
            assert (
                publish_standins(liar, prefix, [(key, standin_info(0, NUM_BLOCKS, fastest_real / 100))]) == 1
            )
        assert len(swarm.servers(prefix, NUM_BLOCKS)) == 7

        pinged = _generate_exactly_within_bound(llama_dir, swarm, "4 live liars")
        # the liars rank first among unmeasured live servers: some were asked (which ones depends on how
        # far the first read had got), and none answered
        asked = [pinged[liar.peer_id.to_base58()] for liar in liars if liar.peer_id.to_base58() in pinged]
        assert asked and all(rtt == float("inf") for rtt in asked)
    finally:
        for liar in liars:
            liar.shutdown()
        swarm.close()


def test_the_status_page_of_hundreds_of_servers_is_a_summary_and_pages():
    status = _status_of(120)
    first = render_status_page(status, "swarm")
    assert first.count('class="span"') == SERVERS_PER_PAGE  # map rows: this page's servers only
    assert "srv-0049" in first and "srv-0050" not in first
    assert "servers 1&ndash;50 of 120" in first and 'href="?page=2"' in first
    assert 'data-count="120"' in first  # the coverage row counts everyone
    assert "120 / 120" in first and "9 / 3" in first  # online; via relay / unreachable
    last = render_status_page(status, "swarm", page=2)
    assert last.count('class="span"') == 20 and "srv-0119" in last and "srv-0099" not in last
    assert render_status_page(status, "swarm", page=99) == last  # clamped
    small = render_status_page(_status_of(3), "swarm")
    assert 'class="pager"' not in small and small.count('class="span"') == 3
