"""An emulated geo-distributed swarm: the network of a scenario plus processes started in its sites.

    with Emulation(scenario, run_dir) as emulation:          # builds the network (or raises)
        emulation.check_rtts()                               # ping every pair, within tolerance
        peers = emulation.start_dht("s0")
        emulation.start_server("a", "s1", model_dir, blocks="0:3")
        emulation.wait_online("s0", model_dir, ["a"])
        ...
    # leaving the block (normally, by an exception, Ctrl-C or SIGTERM) stops every process and
    # removes every namespace; `teardown_report` says whether anything was left behind.

Processes run as `ip netns exec <site namespace> <argv>`, each in its own session (process group),
logging to `<run_dir>/<name>.log`. Stopping is SIGTERM to our own Python programs (servers drain,
announce OFFLINE through their DHT process, then stop it and its daemon) and to the whole group of any
other command, SIGKILL to whatever is left of each group, then a sweep of every PID still inside our
namespaces.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.local_swarm import (
    CHILD_ENV,
    _group_alive,
    cpu_seconds_by_group,
    dht_argv,
    scheduler_argv,
    server_argv,
    stop_groups,
    wait_for_file,
)
from llm_swarm.swarm.identity import ensure_key_files

from .scenario import Scenario
from .system import SetupError
from .topology import Network, PingResult

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]  # so `python -m benchmarks.netem.swarm_tools` works in children
RTT_TOLERANCE = 0.15
RTT_FLOOR_MS = 0.6  # absolute slack for very short links (see check_rtts)


class Terminated(BaseException):
    """SIGTERM/SIGHUP arrived: unwind like Ctrl-C so that teardown runs."""


class Emulation:
    def __init__(self, scenario: Scenario, run_dir: Path, delay_mode: str = "auto"):
        self.scenario = scenario
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.network = Network(scenario, self.run_dir, delay_mode)
        self.processes: dict[str, tuple[str, subprocess.Popen]] = {}
        self.python_programs: set[str] = set()  # names whose program is ours (it stops its own children)
        self.initial_peers: list[str] = []
        self.teardown_report: list[str] = []
        self._previous_handlers: dict[int, object] = {}
        # the scheduler's key, made up front: managed servers and clients trust only it
        self.scheduler_identity = self.run_dir / "scheduler.id"
        self.scheduler_key = ensure_key_files(self.scheduler_identity, self.run_dir / "scheduler.pub")

    # --- lifetime ---------------------------------------------------------------------------------
    def __enter__(self) -> Emulation:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, _raise_terminated)
        try:
            self.network.build()
        except BaseException:
            self._restore_handlers()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.close()
        finally:
            self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def close(self) -> list[str]:
        """Stop every process, then the network. Idempotent. The DHT bootstrap peer stops last: each
        server's shutdown announces that it left, which needs the DHT (without it, each waits out its
        announcement's time limit)."""
        problems = self.stop_many([name for name in self.processes if name != "dht"])
        if "dht" in self.processes:
            problems += self.stop_many(["dht"])
        problems += self.network.teardown()
        self.teardown_report = problems
        if problems:
            logger.warning("teardown left things behind: %s", problems)
        return problems

    # --- processes ------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return {**CHILD_ENV, "PYTHONPATH": path}

    def start(self, name: str, site: str, argv: list[str]) -> subprocess.Popen:
        if name in self.processes and self.processes[name][1].poll() is None:
            raise ValueError(f"a process named {name} is running")
        if not self.network.delayer_alive():
            raise SetupError("the delayer process died: the network no longer has its delays")
        log = open(self.run_dir / f"{name}.log", "w")  # noqa: SIM115  (the child owns it)
        process = subprocess.Popen(
            [*self.network.exec_prefix(site), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )
        log.close()
        self.processes[name] = (site, process)
        if argv[0] == sys.executable:
            self.python_programs.add(name)
        else:
            self.python_programs.discard(name)
        return process

    def stop(self, name: str, timeout: float = 20.0) -> list[str]:
        return self.stop_many([name], timeout)

    def stop_many(self, names: list[str], timeout: float = 20.0) -> list[str]:
        """SIGTERM every group at once (servers drain and announce OFFLINE in parallel), wait up to
        `timeout`, then SIGKILL what is left of each group."""
        processes = [(name, self.processes[name][1]) for name in names]
        # our programs get the signal alone: a group SIGTERM would also end their DHT processes and
        # daemons, which their orderly stop still needs; another command may not pass it on
        others = [process for name, process in processes if name not in self.python_programs]
        stop_groups([process for _, process in processes], signal.SIGTERM, timeout, whole_groups=others)
        deadline = time.monotonic() + 10
        while any(_group_alive(p) for _, p in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [f"process group of {name} still alive" for name, p in processes if _group_alive(p)]

    def stop_all(self) -> list[str]:
        """Stop every process but keep the network (between runs of one experiment); the DHT
        bootstrap peer last, as in `close`."""
        problems = self.stop_many([name for name in self.processes if name != "dht"])
        if "dht" in self.processes:
            problems += self.stop_many(["dht"])
        self.processes.clear()
        return problems

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) used so far by each started process and its group (p2pd
        daemons included): where a run's CPU went."""
        by_group = cpu_seconds_by_group()
        return {name: by_group.get(process.pid, 0.0) for name, (_, process) in self.processes.items()}

    def log(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self, names: list[str] | None = None) -> None:
        """Raise if a swarm process died (with the end of its log)."""
        for name, (_, process) in self.processes.items():
            if names is not None and name not in names:
                continue
            if process.poll() is not None and process.returncode != 0:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
        if not self.network.delayer_alive():
            raise RuntimeError("the delayer died:\n" + self.log("delayer")[-2000:])

    def python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    # --- the swarm's roles --------------------------------------------------------------------------
    def start_dht(self, site: str, name: str = "dht", timeout: float = 60.0) -> list[str]:
        maddr_file = self.run_dir / f"{name}.maddrs"
        maddr_file.unlink(missing_ok=True)
        address = self.network.address(site)
        process = self.start(name, site, dht_argv(maddr_file, host=address))
        addresses = wait_for_file(maddr_file, process, "the DHT", lambda: self.log(name), timeout)
        self.initial_peers = [m for m in addresses.split() if f"/ip4/{address}/" in m]
        return self.initial_peers

    def start_scheduler(self, site: str, model_dir: Path, *extra: str, name: str = "scheduler") -> str:
        address_file = self.run_dir / f"{name}.address"
        address_file.unlink(missing_ok=True)
        where = ["--host", self.network.address(site), "--port", "0", "--http-port", "-1"]
        argv = scheduler_argv(
            model_dir, self.initial_peers, address_file, self.scheduler_identity, *where, *extra
        )
        process = self.start(name, site, argv)
        return wait_for_file(address_file, process, "the scheduler", lambda: self.log(name), timeout=90)

    def start_server(
        self,
        name: str,
        site: str,
        model_dir: Path,
        blocks: str | None,
        memory: str | int = "1GB",
        compute_delay: float = 0.0,
        *extra: str,
    ) -> subprocess.Popen:
        argv = server_argv(
            model_dir,
            self.initial_peers,
            blocks,
            memory,
            name,
            self.scheduler_key,
            "--compute-delay",
            repr(compute_delay),
            *extra,
            host=self.network.listen_address(site),
            announce_period=5,
        )
        return self.start(name, site, argv)

    def wait_online(
        self, site: str, model_dir: Path, names: list[str], timeout: float = 180.0, pings: int = 5
    ) -> dict:
        """Block until the servers are ONLINE as seen from `site`; returns their records and RTTs."""
        out = self.run_dir / f"online-{site}.json"
        out.unlink(missing_ok=True)
        argv = self.python(
            "benchmarks.netem.swarm_tools", "wait-online", "--initial-peers", *self.initial_peers,
            "--model-dir", str(model_dir), "--names", ",".join(names), "--timeout", str(timeout),
            "--pings", str(pings), "--out", str(out),
        )  # fmt: skip
        name = f"wait-online-{site}"
        process = self.start(name, site, argv)
        deadline = time.monotonic() + timeout + 60
        while process.poll() is None:
            self.check_alive([n for n in self.processes if n != name])
            if time.monotonic() > deadline:
                self.stop(name)
                break
            time.sleep(0.5)
        if process.returncode != 0 or not out.exists():
            raise RuntimeError(f"servers {names} not online:\n{self.log(name)[-3000:]}")
        del self.processes[name]
        return json.loads(out.read_text())

    # --- the network's checks -------------------------------------------------------------------------
    def check_rtts(self, tolerance: float = RTT_TOLERANCE, count: int = 10) -> list[PingResult]:
        """Ping every pair; raise if a median RTT is off by more than `tolerance` (relative) and more
        than `RTT_FLOOR_MS`: a few-ms link (a time-scaled 5 ms cluster) would otherwise fail on
        the fixed ~0.3 ms the veths, the bridge and the delayer's wake-ups add to any ping."""

        def off(result: PingResult) -> bool:
            allowed = max(tolerance * result.configured_ms, RTT_FLOOR_MS)
            return result.replies == 0 or abs(result.measured_ms - result.configured_ms) > allowed

        results = self.network.ping_all(count=count, workers=4)
        # a pair that looks off is measured again on its own: other jobs on a small machine delay
        # ping's own wake-ups (it reports user-to-user time, -U), not the packets
        for index, result in enumerate(results):
            if off(result):
                results[index] = self.network.ping(result.source, result.target, count=2 * count)
        bad = [r for r in results if off(r)]
        lines = [
            f"{r.source}->{r.target}: configured {r.configured_ms:.2f} ms, measured {r.measured_ms:.2f} ms"
            f" ({r.error * 100:.1f}%)"
            for r in results
        ]
        (self.run_dir / "ping.txt").write_text("\n".join(lines) + "\n")
        if bad:
            raise SetupError(
                f"RTTs off by more than {tolerance:.0%} (and {RTT_FLOOR_MS} ms):\n" + "\n".join(lines)
            )
        return results


def _raise_terminated(signum, frame) -> None:
    raise Terminated(f"signal {signum}")
