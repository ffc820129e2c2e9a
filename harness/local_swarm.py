"""Start a real swarm (a DHT peer and server processes) on this machine, and stop exactly that.

Used by the tests, the benchmarks and the experiments. Each process starts in its own session
(process group), so stopping it also stops what it spawned (hivemind's DHT process and p2pd)
without touching anything else on the machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Collection
from pathlib import Path

from hivemind.dht import DHT

from harness import preloaded_launcher
from harness.preloaded_launcher import Process
from llm_swarm.swarm.dht_peer import open_identity, start_dht
from llm_swarm.swarm.dht_records import fetch_servers
from llm_swarm.swarm.identity import ensure_key_files
from llm_swarm.swarm.server_info import ServerInfo, ServerState

PYTHON = sys.executable
CHILD_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",  # many processes share few cores: no thread oversubscription
    "TOKENIZERS_PARALLELISM": "false",
}


# --- the roles' command lines and start-up signals (shared with benchmarks/netem's emulated swarm) -----
def dht_argv(maddr_file: Path, host: str | None = None) -> list[str]:
    """`swarm-dht`, writing its multiaddrs to `maddr_file` once it listens (on `host`, or loopback)."""
    where = ["--host", host, "--port", "0"] if host else []
    return [PYTHON, "-m", "llm_swarm.swarm.cli.dht", *where, "--maddr-file", str(maddr_file)]


def server_argv(
    model_dir: Path,
    initial_peers: list[str],
    blocks: str | None,
    memory: str | int,
    public_name: str,
    scheduler_key: str,
    *extra: str,
    host: str | None = None,
    announce_period: float = 2,
    module: tuple[str, ...] = ("llm_swarm.server.cli",),
) -> list[str]:
    """`swarm-server` for `blocks` ("0:3"), or managed by the scheduler of `scheduler_key` when None.
    One torch thread (many servers share few cores) and no per-peer cache share: one test client or
    load generator often drives every session. `module`: what runs it (a wrapper of `server.cli`).
    Float32 unless `extra` names a `--dtype`: on a GPU, `--dtype auto` would pick a 16-bit dtype, and
    tests compare with float32 transformers (on a CPU auto is float32 anyway)."""
    dtype = [] if "--dtype" in extra else ["--dtype", "float32"]
    return [
        PYTHON, "-m", *module, str(model_dir), "--initial-peers", *initial_peers,
        *(["--blocks", blocks] if blocks is not None else ["--scheduler-key", scheduler_key]),
        "--memory", str(memory), *(["--host", host] if host else []), "--public-name", public_name,
        "--announce-period", f"{announce_period:g}", "--torch-threads", "1",
        "--max-peer-cache-fraction", "1", *dtype,
        *extra,
    ]  # fmt: skip


def scheduler_argv(
    model_dir: Path, initial_peers: list[str], address_file: Path, identity_path: Path, *extra: str
) -> list[str]:
    """`swarm-scheduler` with the swarm's scheduler key, writing "host:port" to `address_file`."""
    return [
        PYTHON, "-m", "llm_swarm.scheduler.service.cli", "--initial-peers", *initial_peers,
        "--model-dir", str(model_dir), "--address-file", str(address_file),
        "--identity-path", str(identity_path), *extra,
    ]  # fmt: skip


def wait_for_file(path: Path, process: Process, what: str, log: Callable[[], str], timeout: float) -> str:
    """The text a starting process writes to `path` when it is ready (its addresses); raises with the
    end of its log if it exits or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{log()[-3000:]}")
        time.sleep(0.1)
    return path.read_text().strip()


def stop_groups(
    processes: list[Process],
    sig: int = signal.SIGTERM,
    timeout: float = 20.0,
    whole_groups: Collection[Process] = (),
) -> None:
    """Signal every process at once (servers drain and announce OFFLINE in parallel), wait up to
    `timeout`, then SIGKILL what is left of each one's process group. `whole_groups`: those whose
    every group member gets the signal, not only the leader (a leader that does not pass signals
    on; ours stop their own children, whose orderly stop they may still need)."""
    for process in processes:
        if process.poll() is None:
            if process in whole_groups:
                _signal_group(process, sig)
            else:
                process.send_signal(sig)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(10)
    for process in processes:
        _signal_group(process, signal.SIGKILL)  # whatever the leader left behind in its group


class LocalSwarm:
    """The processes it started; `close()` stops them all and reports any that left something behind."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.processes: dict[str, Process] = {}
        preloaded_launcher.prepare(CHILD_ENV)
        self.initial_peers: list[str] = []
        self._observer: DHT | None = None
        self._scheduler_key: str | None = None
        self._peers: list[DHT] = []  # DHT peers of this process made for tests, besides the observer

    @property
    def scheduler_key(self) -> str:
        """The public key of this swarm's schedulers (made on first use): managed servers get it, and
        clients that should use the scheduler need it in `ClientOptions(scheduler_key=...)`."""
        if self._scheduler_key is None:
            self._scheduler_key = ensure_key_files(self.scheduler_identity, self.log_dir / "scheduler.pub")
        return self._scheduler_key

    @property
    def scheduler_identity(self) -> Path:
        return self.log_dir / "scheduler.id"

    def scheduler_dht(self) -> DHT:
        """A DHT peer holding the scheduler's key, for tests that publish a scheduler record themselves
        (a scripted or rogue scheduler): what they store is signed as the trusted scheduler's."""
        _ = self.scheduler_key
        identity = open_identity(str(self.scheduler_identity))
        dht = start_dht(self.initial_peers, identity=identity)
        self._peers.append(dht)  # shut down by close()
        return dht

    def start(self, name: str, argv: list[str]) -> Process:
        process = preloaded_launcher.launch(argv, self.log_dir / f"{name}.log", CHILD_ENV)
        self.processes[name] = process
        return process

    def start_dht(self) -> list[str]:
        maddr_file = self.log_dir / "dht.maddrs"
        maddr_file.unlink(missing_ok=True)  # never read an address left by an earlier swarm
        process = self.start("dht", dht_argv(maddr_file))
        self.initial_peers = wait_for_file(
            maddr_file, process, "the DHT", lambda: self.log("dht"), 60
        ).split()
        return self.initial_peers

    def start_server(
        self,
        name: str,
        model_dir: Path,
        blocks: str | None,
        memory: str = "1GB",
        *extra: str,
        module: tuple[str, ...] = ("llm_swarm.server.cli",),
    ) -> Process:
        """A server of `blocks` ("0:3"), or managed by this swarm's scheduler when `blocks` is None
        (`server_argv`)."""
        key = self.scheduler_key if blocks is None else ""
        argv = server_argv(model_dir, self.initial_peers, blocks, memory, name, key, *extra, module=module)
        return self.start(name, argv)

    def start_scheduler(self, name: str, model_dir: Path, *extra: str, timeout: float = 60.0) -> str:
        """Start `swarm-scheduler`; returns its gRPC address once it serves."""
        address_file = self.log_dir / f"{name}.address"
        address_file.unlink(missing_ok=True)
        _ = self.scheduler_key  # the key files exist before the scheduler reads them
        # tests react to the roster at once (like servers' 2 s announcements); `extra` may override it
        quick = ["--roster-read-period", "0.5", "--full-pass", "1"]
        argv = scheduler_argv(
            model_dir, self.initial_peers, address_file, self.scheduler_identity, *quick, *extra
        )
        process = self.start(name, argv)
        return wait_for_file(address_file, process, "the scheduler", lambda: self.log(name), timeout)

    def start_api(self, name: str, model_dir: Path, *extra: str, timeout: float = 120.0) -> str:
        """A `swarm-api` process on a free port of loopback; returns its base URL (http://host:port)."""
        argv = [
            PYTHON,
            "-m",
            "llm_swarm.client.api.cli",
            str(model_dir),
            "--initial-peers",
            *self.initial_peers,
        ]
        process = self.start(name, [*argv, "--port", "0", *extra])
        deadline = time.monotonic() + timeout
        while not (match := re.search(r"API at (http://[\d.]+:\d+)/v1", self.log(name))):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {self.log(name)[-3000:]}")
            time.sleep(0.2)
        return match.group(1)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def metrics(self, name: str, timeout: float = 30.0) -> str:
        """The Prometheus text of server `name` (started with `--metrics-port 0`: the port is logged)."""
        deadline = time.monotonic() + timeout
        while not (match := re.search(r"metrics at http://([\d.]+):(\d+)/metrics", self.log(name))):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} logged no metrics endpoint: {self.log(name)[-2000:]}")
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://{match.group(1)}:{match.group(2)}/metrics", timeout=10) as reply:
            return reply.read().decode()

    def log_tails(self, max_chars: int = 3000) -> str:
        """The end of every process's log: what a failed benchmark prints before its logs go away."""
        return "\n".join(f"--- {name}.log ---\n{self.log(name)[-max_chars:]}" for name in self.processes)

    # --- observing the swarm through its DHT -----------------------------------------------------
    @property
    def observer(self) -> DHT:
        if self._observer is None:
            self._observer = start_dht(self.initial_peers)
        return self._observer

    def servers(self, prefix: str, num_blocks: int) -> dict[str, ServerInfo]:
        return fetch_servers(self.observer, prefix, num_blocks)

    def wait_for(
        self, prefix: str, num_blocks: int, condition, timeout: float = 120.0, what: str = "servers"
    ):
        """Poll the DHT until `condition(online_servers_by_name)` holds; returns that mapping."""
        deadline = time.monotonic() + timeout
        while True:
            online = {
                info.public_name: info
                for info in self.servers(prefix, num_blocks).values()
                if info.state == ServerState.ONLINE
            }
            if condition(online):
                return online
            for name, process in self.processes.items():
                if process.poll() is not None and name != "dht" and process.returncode not in (0, -9, -15):
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout} s; online: {sorted(online)}")
            time.sleep(0.3)

    def wait_online(self, prefix: str, num_blocks: int, names: list[str], timeout: float = 120.0):
        return self.wait_for(
            prefix, num_blocks, lambda online: set(names) <= set(online), timeout, str(names)
        )

    # --- stopping -----------------------------------------------------------------------------------
    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal the process (as an operator would); after it exits, kill what is left of its group."""
        process = self.processes[name]
        stop_groups([process], sig, timeout)
        return process.returncode

    def close(self) -> list[str]:
        """Stop everything; returns the names of process groups that still had members (leaks)."""
        if self._observer is not None:
            self._observer.shutdown()
            self._observer = None
        for peer in self._peers:
            peer.shutdown()
        self._peers.clear()
        # everyone but the DHT bootstrap peer at once (each server's shutdown announces that it left,
        # which needs the DHT), then the bootstrap peer
        running = [name for name in self.processes if self.processes[name].poll() is None]
        stop_groups([self.processes[name] for name in running if name != "dht"])
        if "dht" in running:
            self.stop("dht")
        deadline = time.monotonic() + 10  # killed members may take a moment to be reaped
        leaked = [name for name, process in self.processes.items() if _group_alive(process)]
        while leaked and time.monotonic() < deadline:
            time.sleep(0.2)
            leaked = [name for name in leaked if _group_alive(self.processes[name])]
        for name in leaked:
            _signal_group(self.processes[name], signal.SIGKILL)
        return leaked


def _signal_group(process: Process, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _group_alive(process: Process) -> bool:
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def process_table() -> dict[int, list[str]]:
    """Every process's `/proc/PID/stat` fields after the command name (state, ppid, pgrp, ...; utime
    and stime are [11] and [12]); processes that exit while being read are left out."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            table[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
    return table


def cpu_seconds_by_group() -> dict[int, float]:
    """CPU time (user + system) used so far by the live processes of each process group."""
    ticks = os.sysconf("SC_CLK_TCK")
    by_group: dict[int, float] = {}
    for fields in process_table().values():
        group = int(fields[2])
        by_group[group] = by_group.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return by_group


def child_pids() -> set[int]:
    """Live descendants of this process (e.g. a client's DHT process and its p2pd)."""
    children: dict[int, list[int]] = {}
    for pid, fields in process_table().items():
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(pid)
    found, frontier = set(), [os.getpid()]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add(child)
            frontier.append(child)
    return found


def prometheus_sample(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus' text format (0 if absent)."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
