"""Every command of ours stops on SIGTERM in bounded time, whatever its DHT process is doing.

hivemind runs a DHT peer in a forked process with a p2pd daemon below it. Here each command (`swarm-dht`,
`swarm-server`, `swarm-scheduler`, `swarm-api`, `swarm-health`) runs for real against a bootstrap peer;
then its DHT process is frozen (SIGSTOP), or its p2pd is, which leaves the DHT process alive but stuck
waiting for the daemon when asked to stop. SIGTERM to the command must end it, with exit code 0 (an
orderly stop), and every process it started, within STOP_BOUND seconds; the log says what was forced.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from harness.local_swarm import PYTHON, LocalSwarm, dht_argv, wait_for_file
from llm_swarm.swarm.stop_deadline import STOP_DEADLINE

pytestmark = pytest.mark.swarm  # every test here starts processes

# the bound we promise: the stop deadline (which a server extends by its drain timeout), plus exiting
SERVER_DRAIN = 1.0
STOP_BOUND = STOP_DEADLINE + SERVER_DRAIN + 4.0
START_TIMEOUT = 120.0
FORCED = re.compile(r"DHT process \d+ did not stop within")


# what each command's stop is tested against: its DHT process frozen (SIGSTOP), or its p2pd frozen,
# which leaves the DHT process alive but stuck waiting for the daemon; the second kind for the two
# commands that differ most, the bootstrap peer and the server (which also drains)
FROZEN = {
    "swarm-dht": "dht-process",
    "swarm-server": "dht-process",
    "swarm-health": "dht-process",
    "swarm-scheduler": "dht-process",
    "swarm-api": "dht-process",
    "swarm-dht-stuck": "p2pd",
    "swarm-server-stuck": "p2pd",
}


def _start_commands(swarm: LocalSwarm, model_dir: Path) -> dict[str, psutil.Process]:
    """Every command of `FROZEN`, started together and waited for; each one's process."""
    peers = swarm.initial_peers
    log_dir = swarm.log_dir
    ready_files = {"swarm-health": log_dir / "health.url"}
    for name in ("swarm-dht", "swarm-dht-stuck"):
        ready_files[name] = log_dir / f"{name}.maddrs"
        swarm.start(name, [*dht_argv(ready_files[name]), "--initial-peers", *peers])
    for name in ("swarm-server", "swarm-server-stuck"):
        swarm.start_server(name, model_dir, "0:2", "1GB", "--drain-timeout", f"{SERVER_DRAIN:g}")
    health = [PYTHON, "-m", "llm_swarm.scheduler.service.health_cli", "--initial-peers", *peers]
    health += [
        "--model-dir",
        str(model_dir),
        "--port",
        "0",
        "--address-file",
        str(ready_files["swarm-health"]),
    ]
    swarm.start("swarm-health", health)
    swarm.start_scheduler("swarm-scheduler", model_dir, timeout=START_TIMEOUT)
    swarm.start_api("swarm-api", model_dir, timeout=START_TIMEOUT)
    for name, path in ready_files.items():
        wait_for_file(path, swarm.processes[name], name, lambda n=name: swarm.log(n), START_TIMEOUT)
    deadline = time.monotonic() + START_TIMEOUT
    for name in ("swarm-server", "swarm-server-stuck"):
        while "online: serving" not in swarm.log(name):
            assert time.monotonic() < deadline and swarm.processes[name].poll() is None, swarm.log(name)[
                -3000:
            ]
            time.sleep(0.2)
    return {name: psutil.Process(process.pid) for name, process in swarm.processes.items() if name != "dht"}


def _dht_process(command: psutil.Process) -> tuple[psutil.Process, psutil.Process]:
    """The command's DHT process (the child with a p2pd of its own) and that p2pd."""
    for child in command.children():
        daemons = [grandchild for grandchild in child.children() if grandchild.name() == "p2pd"]
        if daemons:
            return child, daemons[0]
    raise AssertionError(f"no DHT process below {command.cmdline()}")


def _describe(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:200]
    except psutil.Error:
        return "?"


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_sigterm_stops_every_command_and_what_it_started_in_bounded_time(llama_dir, tmp_path):
    swarm = LocalSwarm(tmp_path)
    try:
        swarm.start_dht()
        commands = _start_commands(swarm, llama_dir)
        started = {name: command.children(recursive=True) for name, command in commands.items()}
        for name, command in commands.items():
            dht_process, p2pd = _dht_process(command)
            (dht_process if FROZEN[name] == "dht-process" else p2pd).send_signal(signal.SIGSTOP)
        # let each command's loop call its frozen DHT first (the scheduler reads its roster every 2 s):
        # a stop asked during a DHT call that never returns must be bounded too (it once was not)
        time.sleep(2.5)
        asked = time.monotonic()
        for command in commands.values():
            command.send_signal(signal.SIGTERM)
        exited = {}
        for name in commands:
            try:
                code = swarm.processes[name].wait(max(STOP_BOUND - (time.monotonic() - asked), 0.1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} running {STOP_BOUND:.0f} s after SIGTERM:\n{swarm.log(name)[-3000:]}")
            exited[name] = f"{time.monotonic() - asked:.1f} s"
            assert code == 0, f"{name} exited with {code}:\n{swarm.log(name)[-3000:]}"
            assert FORCED.search(swarm.log(name)), f"{name} logged nothing forced:\n{swarm.log(name)[-2000:]}"
        # what torch started for the DHT's shared futures (torch_shm_manager) leaves once its clients did
        while any(_alive(p) for ps in started.values() for p in ps) and time.monotonic() - asked < STOP_BOUND:
            time.sleep(0.2)
        left = [f"{name}: {p.pid} {_describe(p)}" for name, ps in started.items() for p in ps if _alive(p)]
        assert not left, f"still running {STOP_BOUND:.0f} s after their command was asked to stop: {left}"
        print(f"exited after SIGTERM: {exited}; all they started gone after {time.monotonic() - asked:.1f} s")
    finally:
        for processes in locals().get("started", {}).values():
            for process in processes:  # never leave a stopped process behind, even on failure
                if _alive(process):
                    os.kill(process.pid, signal.SIGKILL)
        assert not swarm.close()
