"""Geo-distributed emulation with network namespaces (benchmarks/netem).

The end-to-end tests need root and `ip netns`: as root they run (installing iproute2, iptables,
ping and the NFQUEUE binding when missing), and they skip only where namespaces cannot work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.netem.cli import prepare_model, run_clients, start_swarm
from benchmarks.netem.emulator import Emulation
from benchmarks.netem.scenario import LinkSpec, ScenarioError, load_scenario, parse_scenario
from benchmarks.netem.system import netns_works
from benchmarks.netem.topology import cleanup, list_netns, netns_pids
from harness.local_swarm import child_pids

ROOT = Path(__file__).resolve().parents[1]

SCENARIOS = ROOT / "benchmarks" / "netem" / "scenarios"
CI_SMALL = SCENARIOS / "ci_small.json"
NAT = SCENARIOS / "nat.json"


@pytest.fixture(scope="module")
def netns():
    reason = netns_works()
    if reason is not None:
        pytest.skip(reason)


def _root_veths() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


# --- scenario files (no root needed) ----------------------------------------------------------------


def test_scenarios_parse_and_resolve_every_pair():
    small = load_scenario(CI_SMALL)
    assert [s.name for s in small.sites] == ["s0", "s1", "s2"]
    assert len(small.processes_of("server")) == 3
    assert small.link("s2", "s0").rtt_ms == 40 and small.link("s1", "s2").bandwidth_mbit == 20
    table2 = load_scenario(SCENARIOS / "table2.json")
    servers = table2.processes_of("server")
    assert len(servers) == 9
    assert {p.site: p.options["kind"] for p in servers} == {
        "a100a": "fast", "a100b": "fast", **{f"mig{i}": "slow" for i in range(1, 8)}
    }  # fmt: skip
    assert table2.link("client0", "a100a") == LinkSpec(100, 100)  # across clusters
    assert table2.link("a100a", "a100b") == LinkSpec(5, 1000)  # inside a cluster
    assert table2.link("mig1", "mig7") == LinkSpec(5, 1000) and table2.link("a100b", "mig3").rtt_ms == 100
    assert {s.group for s in table2.sites if s.name.startswith("client")} == {
        "cluster0",
        "cluster1",
        "cluster2",
    }
    assert len({s.address for s in table2.sites}) == len(table2.sites)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda raw: raw.update(subnet="127.0.0.0/16"), "not loopback"),
        (lambda raw: raw["links"]["pairs"].pop(), "no link given"),
        (lambda raw: raw["links"]["pairs"][0].update(rtt_ms=-1), "rtt_ms >= 0"),
        (lambda raw: raw["sites"][0]["processes"].append({"role": "dht", "name": "dht2"}), "at most one dht"),
        (lambda raw: raw["sites"].append({"name": "s0"}), "duplicate site"),
        (lambda raw: raw["sites"][0]["processes"].append({"role": "gpu"}), "role must be one of"),
    ],
)
def test_malformed_scenarios_are_refused_with_the_reason(change, message):
    raw = json.loads(CI_SMALL.read_text())
    change(raw)
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(raw)


# --- the emulated network (root) ----------------------------------------------------------------------


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.swarm
def test_nat_scenario_rtts_relay_generation_and_clean_teardown(netns, tmp_path):
    """nat.json, the emulator's end-to-end check. The network: every pair's RTT by ping within 15%
    (three different RTTs, one of them to a site behind NAT); the home machine reaches out, nothing
    reaches in. The swarm: srv-home sits behind a masquerading router with no port mapped; its
    dial-back check fails, it reserves a slot on the bootstrap peer's relay and announces RELAY; the
    client in a third site generates through srv-pub -> srv-home exactly as local transformers
    does, and its round trip to srv-home is that of the relay path (away -> pub -> home: 40 + 20
    ms), not the direct 30 ms. srv-dark, in the same home with --relay never and the fastest for its
    blocks, announces UNREACHABLE: nobody routes to it and the client never even dials it.
    Afterwards nothing is left: namespaces, veths, processes."""
    scenario = load_scenario(NAT)
    namespaces_before, veths_before, children_before = set(list_netns()), _root_veths(), child_pids()
    started: list[int] = []
    with Emulation(scenario, tmp_path / "run") as emulation:
        tag = emulation.network.tag
        home = scenario.site("home")
        ours = {emulation.network.netns(s.name) for s in scenario.sites} | {emulation.network.hub}
        ours.add(emulation.network.lan_netns("home"))
        assert ours <= set(list_netns())
        pings = emulation.check_rtts(tolerance=0.15)  # raises with the whole table if a pair is off
        assert {(p.source, p.target) for p in pings} == {("pub", "home"), ("pub", "away"), ("home", "away")}
        for result in pings:
            assert result.replies >= 4 and result.error <= 0.15, result
        inbound = subprocess.run(
            [*emulation.network.exec_prefix("away"), "ping", "-c", "1", "-W", "1", home.lan_address],
            capture_output=True,
            text=True,
        )
        assert inbound.returncode != 0
        model_dir = prepare_model(scenario, tmp_path)
        servers = start_swarm(emulation, model_dir)
        results = run_clients(emulation, model_dir, timeout=120)
        logs = {name: emulation.log(name) for name in ("srv-home", "srv-dark")}
        started = [process.pid for _, process in emulation.processes.values()]
        assert any(netns_pids(name) for name in ours)
    assert {name: (info["start"], info["end"], info["reachability"]) for name, info in servers.items()} == {
        "srv-pub": (0, 2, "direct"),
        "srv-home": (2, 4, "relay"),
        "srv-dark": (0, 2, "unreachable"),
    }
    assert "/p2p-circuit" in logs["srv-home"] and "UNREACHABLE" in logs["srv-dark"]
    client = results["client"]
    assert client["returncode"] == 0, emulation.log("client")[-3000:]
    assert client["matches_local"] is True
    assert len(client["tokens"]) > len(client["prompt"].split())
    pinged = client["rtts"]
    assert servers["srv-dark"]["peer_id"] not in pinged  # skipped on its record alone
    assert set(pinged) == {servers["srv-pub"]["peer_id"], servers["srv-home"]["peer_id"]}
    # the client measured its round trips through the emulated links: 40 ms to the data centre,
    # 40 + 20 ms home through the relay (a direct path home would be 30 ms)
    assert 0.040 <= servers["srv-pub"]["rtt_info_s"] < 0.057
    assert pinged[servers["srv-home"]["peer_id"]] >= 0.058 and servers["srv-home"]["rtt_info_s"] >= 0.058
    # nothing left: namespaces, veths in this namespace, processes
    assert emulation.teardown_report == []
    assert not [name for name in list_netns() if tag in name]
    assert set(list_netns()) <= namespaces_before
    assert _root_veths() <= veths_before
    for pid in started:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"process {pid} survived"
    deadline = time.monotonic() + 10
    while child_pids() - children_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child_pids() - children_before, "the emulation left child processes behind"
    stats = emulation.network.delayer_stats()
    if emulation.network.mode == "nfqueue":
        assert stats is not None and stats["released"] > 0 and stats["dropped"] == 0


@pytest.mark.swarm
def test_ctrl_c_tears_everything_down(netns, tmp_path):
    """`netem up` interrupted with SIGINT (Ctrl-C) removes its namespaces and its delayer."""
    run_dir = tmp_path / "up"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.netem",
            "up",
            str(CI_SMALL),
            "--no-check",
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "up").exists():
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the network did not come up"
            time.sleep(0.1)
        tag = (run_dir / "up").read_text()
        assert [name for name in list_netns() if tag in name]
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)  # the emulator dumps its threads' stacks
            time.sleep(2)
            process.kill()
            output, _ = process.communicate()
            raise AssertionError(f"netem up did not exit within 60 s of Ctrl-C:\n{output}") from None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, output
    assert "torn down" in output
    assert not [name for name in list_netns() if tag in name]
    delayer_pid = (run_dir / "delayer.ready").read_text() if (run_dir / "delayer.ready").exists() else ""
    if delayer_pid:
        assert not Path(f"/proc/{delayer_pid}").exists() or _is_zombie(int(delayer_pid))


@pytest.mark.swarm
def test_cleanup_removes_leftovers_of_dead_runs_only(netns):
    """`--cleanup` deletes namespaces (and their processes) whose owner died, keeps live runs'."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover, live = f"lsw-{dead.pid}-1-s0", f"lsw-{os.getppid()}-1-s0"
    for name in (leftover, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not netns_pids(leftover) and time.monotonic() < deadline:
            time.sleep(0.05)
        removed, kept = cleanup()
        assert leftover in removed and live in kept
        assert leftover not in list_netns() and live in list_netns()
        assert sleeper.wait(10) != 0  # killed by the clean-up
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        subprocess.run(["ip", "netns", "del", live], check=False)
        subprocess.run(["ip", "netns", "del", leftover], check=False)
