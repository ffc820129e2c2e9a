"""The tests' process launcher (harness/zygote.py): a process forked from the pre-imported interpreter
behaves as `python -m MODULE` started by Popen would: its own session, log file, exit codes, signals."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from harness import preloaded_launcher
from harness.local_swarm import CHILD_ENV


@pytest.fixture(autouse=True)
def _preloading():
    """On for these tests even under SWARM_TESTS_PRELOAD=0, and as it was after them."""
    was_enabled = preloaded_launcher.enabled()
    preloaded_launcher.enable()
    yield
    if not was_enabled:
        preloaded_launcher.disable()


def _launch(tmp_path, name: str, *args: str):
    process = preloaded_launcher.launch([sys.executable, "-m", *args], tmp_path / f"{name}.log", CHILD_ENV)
    assert isinstance(process, preloaded_launcher.ZygoteProcess)
    assert (tmp_path / f"{name}.log").exists()  # at once, as with Popen: callers poll it right away
    return process


def test_a_forked_process_runs_the_module_with_its_own_session_log_and_exit_code(tmp_path):
    usage = _launch(tmp_path, "help", "llm_swarm.swarm.cli.dht", "--help")
    assert usage.wait(60) == 0
    assert "usage:" in (tmp_path / "help.log").read_text()
    refused = _launch(tmp_path, "bad", "llm_swarm.swarm.cli.dht", "--no-such-flag")
    assert refused.wait(60) == 2  # argparse's exit code, and its message in the log
    assert "unrecognized arguments" in (tmp_path / "bad.log").read_text()

    server = _launch(tmp_path, "http", "http.server", "--bind", "127.0.0.1", "0")
    deadline = time.monotonic() + 30
    while "Serving HTTP" not in (tmp_path / "http.log").read_text():
        assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "http.log").read_text()
        time.sleep(0.1)
    assert os.getpgid(server.pid) == server.pid  # its own process group: stopping it stops only it
    assert os.getsid(server.pid) == server.pid
    os.killpg(server.pid, signal.SIGTERM)
    assert server.wait(30) == -signal.SIGTERM  # as Popen.returncode reports a signal
    assert server.poll() == -signal.SIGTERM
