"""Build and tear down the emulated network: one namespace per site, a bridge, per-pair shaping.

Layout for a run with tag T (namespaces are named `lsw-T-<site>`, the bridge lives in `lsw-T-hub`,
so nothing is created in the machine's own namespace and deleting the namespaces removes every
veth with them):

    lsw-T-s0 [eth0 10.213.0.1] --veth-- p0 \
    lsw-T-s1 [eth0 10.213.0.2] --veth-- p1 -- br0 (in lsw-T-hub)
    lsw-T-s2 [eth0 10.213.0.3] --veth-- p2 /

Each site shapes what it *sends* to each other site, so the pair (a, b) gets `rtt/2` in each
direction and the pair's rate in each direction:

- rate: an HTB root on eth0 with one class per destination (u32 match on the destination
  address), rate = ceil = the pair's bandwidth; unmatched traffic (ARP) bypasses HTB;
- delay, jitter, loss: with `sch_netem` in the kernel, a netem qdisc as that class's leaf; without
  it, an iptables NFQUEUE rule per destination and the user-space `delayer.py` (see there).

A site with `nat` is a home network behind a router: `lsw-T-<site>` is then the router (its eth0
on the bridge holds the site's public address, and the shaping above lives there) and the site's
processes run in `lsw-T-<site>.lan`, a second namespace on a private 100.64.i.0/24 link behind it:

    lsw-T-home.lan [eth0 100.64.i.2] --veth-- [lan0 100.64.i.1] lsw-T-home [eth0 10.213.0.k] -- br0

The router forwards and masquerades what the LAN sends (iptables MASQUERADE), lets in only replies
(conntrack ESTABLISHED/RELATED) and forwards nothing new from outside: no port is mapped, so like a
typical home router nothing on the emulated internet can open a connection to the LAN's machine.

The tag starts with the owner's PID, so `cleanup()` can tell leftovers of dead runs from a run
that is still going.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .scenario import LinkSpec, Scenario
from .system import SetupError, ensure_commands, ensure_netfilterqueue, kernel_has_netem, run

logger = logging.getLogger(__name__)

PREFIX = "lsw-"
_TAG_RE = re.compile(r"^lsw-(\d+)-(\d+)-(.+)$")
HTB_QUANTUM = 60000
DELAYER = Path(__file__).with_name("delayer.py")
_counter = [0]


def new_tag() -> str:
    """`<pid>-<n>`: unique among this process's runs, and tells cleanup() who owns the namespaces."""
    _counter[0] += 1
    return f"{os.getpid()}-{_counter[0]}"


@dataclass(frozen=True)
class PingResult:
    source: str
    target: str
    configured_ms: float
    measured_ms: float  # median of the replies
    replies: int

    @property
    def error(self) -> float:
        if self.configured_ms == 0:
            return 0.0 if self.measured_ms < 1.0 else float("inf")
        return abs(self.measured_ms - self.configured_ms) / self.configured_ms


class Network:
    """The namespaces, links and shaping of one scenario; `teardown()` removes all of it."""

    def __init__(self, scenario: Scenario, run_dir: Path, delay_mode: str = "auto", tag: str | None = None):
        if delay_mode not in ("auto", "netem", "nfqueue"):
            raise ValueError(f"delay_mode must be auto, netem or nfqueue, got {delay_mode!r}")
        if any(site.name == "hub" for site in scenario.sites):
            raise SetupError("'hub' is reserved for the bridge namespace: rename that site")
        self.scenario = scenario
        self.run_dir = run_dir
        self.requested_mode = delay_mode
        self.mode: str | None = None
        self.tag = tag or new_tag()
        self.delayer: subprocess.Popen | None = None
        self.created: list[str] = []  # namespaces, in creation order

    # --- names ------------------------------------------------------------------------------------
    def netns(self, site: str) -> str:
        return f"{PREFIX}{self.tag}-{site}"

    @property
    def hub(self) -> str:
        return f"{PREFIX}{self.tag}-hub"

    def lan_netns(self, site: str) -> str:
        """The namespace a NAT site's processes run in (behind its router `netns(site)`)."""
        return f"{self.netns(site)}.lan"

    def process_netns(self, site: str) -> str:
        return self.lan_netns(site) if self.scenario.site(site).nat else self.netns(site)

    def exec_prefix(self, site: str) -> list[str]:
        """Prepend to an argv to run it inside `site` (ip netns exec execs, so the PID is the program's);
        behind NAT, on the LAN machine."""
        return ["ip", "netns", "exec", self.process_netns(site)]

    def address(self, site: str) -> str:
        """The site's address on the emulated internet (behind NAT: its router's)."""
        return self.scenario.site(site).address

    def listen_address(self, site: str) -> str:
        """The address the site's processes bind to (behind NAT: a private one)."""
        return self.scenario.site(site).lan_address

    # --- building ---------------------------------------------------------------------------------
    def build(self) -> None:
        """Create everything; on any failure, remove what was created and re-raise."""
        self.mode = self._choose_mode()
        ensure_commands(with_nfqueue=self.mode == "nfqueue")
        if self.mode == "nfqueue":
            ensure_netfilterqueue()
        try:
            self._add_netns(self.hub)
            ip_hub = ["ip", "-n", self.hub]
            run([*ip_hub, "link", "add", "br0", "type", "bridge"])
            run([*ip_hub, "link", "set", "br0", "up"])
            prefix_len = self.scenario.subnet.split("/")[1]
            for site in self.scenario.sites:
                ns = self.netns(site.name)
                self._add_netns(ns)
                port = f"p{site.index}"
                run([*ip_hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
                run([*ip_hub, "link", "set", port, "master", "br0", "up"])
                run(["ip", "-n", ns, "addr", "add", f"{site.address}/{prefix_len}", "dev", "eth0"])
                run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                run(["ip", "-n", ns, "link", "set", "lo", "up"])
            for site in self.scenario.sites:
                if site.nat:
                    self._add_home_network(site.name)
            for site in self.scenario.sites:
                self._shape(site.name)
            if self.mode == "nfqueue":
                self._start_delayer()
                for site in self.scenario.sites:
                    self._queue_rules(site.name)
        except BaseException:
            self.teardown()
            raise
        logger.info("network %s up: %d sites, delay by %s", self.tag, len(self.scenario.sites), self.mode)

    def _add_home_network(self, site: str) -> None:
        """The LAN machine behind `site`'s router, and the router's masquerading without port maps."""
        router, lan = self.netns(site), self.lan_netns(site)
        spec = self.scenario.site(site)
        gateway, host = spec.lan_network[1], spec.lan_network[2]
        prefix = spec.lan_network.prefixlen
        self._add_netns(lan)
        run(["ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", lan])
        run(["ip", "-n", router, "addr", "add", f"{gateway}/{prefix}", "dev", "lan0"])
        run(["ip", "-n", router, "link", "set", "lan0", "up"])
        run(["ip", "-n", lan, "addr", "add", f"{host}/{prefix}", "dev", "eth0"])
        run(["ip", "-n", lan, "link", "set", "eth0", "up"])
        run(["ip", "-n", lan, "link", "set", "lo", "up"])
        run(["ip", "-n", lan, "route", "add", "default", "via", str(gateway)])
        in_router = ["ip", "netns", "exec", router]
        run([*in_router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        iptables = [*in_router, "iptables", "-w"]
        run([*iptables, "-t", "nat", "-A", "POSTROUTING", "-s", str(spec.lan_network), "-o", "eth0",
             "-j", "MASQUERADE"])  # fmt: skip
        run([*iptables, "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT"])  # fmt: skip
        run([*iptables, "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-j", "DROP"])

    def _choose_mode(self) -> str:
        if self.requested_mode != "auto":
            if self.requested_mode == "netem" and not kernel_has_netem():
                raise SetupError("this kernel has no sch_netem (tc qdisc netem); use --delay nfqueue")
            return self.requested_mode
        return "netem" if kernel_has_netem() else "nfqueue"

    def _add_netns(self, name: str) -> None:
        run(["ip", "netns", "add", name])
        self.created.append(name)

    def _destinations(self, site: str) -> list[tuple[int, str, LinkSpec]]:
        return [
            (other.index, other.address, self.scenario.link(site, other.name))
            for other in self.scenario.sites
            if other.name != site
        ]

    def _shape(self, site: str) -> None:
        """HTB class per destination (rate); with netem, the class's leaf adds delay/jitter/loss."""
        tc = ["tc", "-n", self.netns(site)]
        run([*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb"])  # no default: ARP bypasses
        for index, address, link in self._destinations(site):
            classid = f"1:{index + 10:x}"
            rate = f"{link.bandwidth_mbit}mbit"
            # burst: 2 ms at line rate, at least two 64 KB TSO segments (else HTB under-delivers)
            burst = max(int(link.bandwidth_mbit * 1e6 / 8 * 0.002), 2 * 65536)
            run(
                [*tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", classid, "htb",
                 "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst),
                 "quantum", str(HTB_QUANTUM)]
            )  # fmt: skip
            run(
                [*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                 "u32", "match", "ip", "dst", f"{address}/32", "flowid", classid]
            )  # fmt: skip
            if self.mode == "netem":
                netem = ["delay", f"{link.one_way_s * 1e3:.3f}ms"]
                if link.jitter_ms:
                    netem.append(f"{link.jitter_ms:.3f}ms")
                if link.loss_pct:
                    netem += ["loss", f"{link.loss_pct}%"]
                run(
                    [*tc, "qdisc", "add", "dev", "eth0", "parent", classid, "handle", f"{index + 10:x}:",
                     "netem", *netem, "limit", "100000"]
                )  # fmt: skip

    def _queue_rules(self, site: str) -> None:
        """At the *receiving* site, packets from each source go to that source's queue.

        Delaying on the sender (OUTPUT) would keep each packet charged to its socket while it
        waits, and TCP small queues then throttle a flow to ~1 ms of data per RTT (0.5 Mbit/s over
        100 ms). A packet that crossed the veth is orphaned, so holding it at ingress is free for
        the sender, exactly like propagation delay on a wire.
        """
        for index, address, link in self._destinations(site):
            if link.one_way_s > 0 or link.loss_pct > 0:
                run(
                    ["ip", "netns", "exec", self.netns(site), "iptables", "-w", "-t", "mangle", "-A",
                     "PREROUTING", "-s", f"{address}/32", "-j", "NFQUEUE", "--queue-num", str(index)]
                )  # fmt: skip

    def _start_delayer(self) -> None:
        spec = {
            "sites": [
                {
                    "netns": f"/run/netns/{self.netns(site.name)}",
                    "queues": [
                        {
                            "num": index,
                            "delay_s": link.one_way_s,
                            "jitter_s": link.jitter_ms / 1e3,
                            "loss": link.loss_pct / 100,
                        }
                        for index, _, link in self._destinations(site.name)
                        if link.one_way_s > 0 or link.loss_pct > 0
                    ],
                }
                for site in self.scenario.sites
            ],
            "ready_file": str(self.run_dir / "delayer.ready"),
            "stats_file": str(self.run_dir / "delayer.stats.json"),
        }
        spec_path = self.run_dir / "delayer.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        ready = Path(spec["ready_file"])
        ready.unlink(missing_ok=True)
        log = open(self.run_dir / "delayer.log", "w")  # noqa: SIM115  (the child owns it)
        self.delayer = subprocess.Popen(
            [sys.executable, str(DELAYER), str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.delayer.poll() is not None or time.monotonic() > deadline:
                raise SetupError(
                    "the NFQUEUE delayer did not start:\n"
                    + (self.run_dir / "delayer.log").read_text()[-2000:]
                )
            time.sleep(0.05)

    def delayer_alive(self) -> bool:
        return self.mode != "nfqueue" or (self.delayer is not None and self.delayer.poll() is None)

    def delayer_stats(self) -> dict | None:
        path = self.run_dir / "delayer.stats.json"
        return json.loads(path.read_text()) if path.exists() else None

    # --- checking ---------------------------------------------------------------------------------
    def ping(self, source: str, target: str, count: int = 10, interval: float = 0.1) -> PingResult:
        """Median RTT of `count` pings from `source` to `target` (inside the namespaces)."""
        link = self.scenario.link(source, target)
        result = run(
            [*self.exec_prefix(source), "ping", "-U", "-n", "-c", str(count), "-i", str(interval), "-W", "3",
             self.address(target)],
            check=False,
            timeout=count * interval + 15,
        )  # fmt: skip
        times = [float(m) for m in re.findall(r"time=([\d.]+) ms", result.stdout)]
        measured = statistics.median(times) if times else float("inf")
        return PingResult(source, target, link.rtt_ms, measured, len(times))

    def throughput_mbit(self, source: str, target: str, seconds: float = 3.0, port: int = 5299) -> float:
        """Goodput of one TCP stream `source` -> `target` (Mbit/s), measured by the receiver over the
        last two thirds of the transfer (after slow start)."""
        receiver = subprocess.Popen(
            [*self.exec_prefix(target), sys.executable, "-c", _RECEIVER, self.address(target), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(0.5)  # let it listen
            run(
                [*self.exec_prefix(source), sys.executable, "-c", _SENDER, self.address(target), str(port),
                 str(seconds)],
                timeout=seconds + 30,
            )  # fmt: skip
            out, err = receiver.communicate(timeout=30)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        if receiver.returncode != 0:
            raise SetupError(f"throughput receiver failed: {err.strip()}")
        return float(out.strip())

    def ping_all(self, count: int = 5, workers: int = 16) -> list[PingResult]:
        """Every pair once (from the first-listed site), pinged in parallel."""
        pairs = [(a.name, b.name) for a, b, _ in self.scenario.pairs()]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda pair: self.ping(*pair, count=count), pairs))

    # --- tearing down -----------------------------------------------------------------------------
    def teardown(self) -> list[str]:
        """Stop the delayer and every process left in our namespaces, delete the namespaces.

        Returns what could not be removed (empty when clean). Safe to call more than once.
        """
        problems = []
        for name in reversed(self.created):
            problems += kill_netns_processes(name)
        if self.delayer is not None:
            if self.delayer.poll() is None:
                self.delayer.send_signal(signal.SIGTERM)
                try:
                    self.delayer.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.delayer.pid, signal.SIGKILL)
                    self.delayer.wait(5)
            self.delayer = None
        for name in reversed(self.created):
            result = run(["ip", "netns", "del", name], check=False)
            if result.returncode != 0 and name in list_netns():
                problems.append(f"could not delete namespace {name}: {result.stderr.strip()}")
        self.created = [name for name in self.created if name in list_netns()]
        return problems


_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
server.settimeout(20)
conn, _ = server.accept()
marks = []
total = 0
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    total += len(data)
    marks.append((time.monotonic(), total))
start = marks[len(marks) // 3]
print((marks[-1][1] - start[1]) * 8 / max(marks[-1][0] - start[0], 1e-9) / 1e6)
"""

_SENDER = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20)
chunk = b"x" * 65536
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    conn.sendall(chunk)
conn.close()
"""


def list_netns() -> list[str]:
    result = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    result = run(["ip", "netns", "pids", name], check=False)
    return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def kill_netns_processes(name: str, grace: float = 5.0) -> list[str]:
    """SIGTERM, then SIGKILL, every process inside namespace `name`; returns survivors, if any."""
    pids = netns_pids(name)
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = netns_pids(name)
    for pid in pids:
        _kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = netns_pids(name)
    return [f"process {pid} still in {name}" for pid in pids]


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(all_runs: bool = False) -> tuple[list[str], list[str]]:
    """Remove namespaces (and the processes in them) left by emulator runs whose owner is gone.

    With `all_runs`, also those of runs that are still going. Returns (removed, kept).
    """
    removed, kept = [], []
    for name in list_netns():
        match = _TAG_RE.match(name)
        if not (name.startswith(PREFIX) and match) and not name.startswith(f"{PREFIX}probe-"):
            continue
        owner = int(match.group(1)) if match else int(name.rsplit("-", 1)[1])
        if not all_runs and owner != os.getpid() and _owner_alive(owner):
            kept.append(name)
            continue
        kill_netns_processes(name)
        run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    # delayers of dead runs die with their owner (PR_SET_PDEATHSIG); stragglers are found by argv
    for pid, argv in _delayer_processes():
        owner = _parent(pid)
        if all_runs or owner in (0, 1) or not _owner_alive(owner):
            _kill(pid, signal.SIGKILL)
            removed.append(f"delayer process {pid} ({' '.join(argv[-1:])})")
    return removed, kept


def _delayer_processes() -> list[tuple[int, list[str]]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [part.decode(errors="replace") for part in argv if part]
        if any(part.endswith("netem/delayer.py") for part in argv):
            found.append((int(entry.name), argv))
    return found


def _parent(pid: int) -> int:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0
