"""Start `python -m MODULE ...` processes from a pre-imported zygote (`harness.zygote`), when enabled.

The test suite enables it (tests/conftest.py): its swarms start hundreds of servers, schedulers and
DHT peers, and each would otherwise spend seconds of CPU importing torch, transformers and hivemind on
a 2-core machine. A process started this way is real: its own PID, session and process group, log
file, signals and exit code; `ZygoteProcess` answers like `subprocess.Popen` (pid, poll, wait,
send_signal, returncode). Processes not of the form `python -m MODULE`, and every process while the
launcher is not enabled (the demo, benchmarks, operators), start as ordinary subprocesses.

This module imports nothing heavy, so enabling it costs nothing until a swarm starts.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

PRELOADED_MODULES = (
    "llm_swarm.server.cli",
    "llm_swarm.scheduler.service.cli",
    "llm_swarm.swarm.cli.dht",
    "llm_swarm.client.api.cli",
)
READY_TIMEOUT_S = 120.0

_enabled = False
_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def enable() -> None:
    """Start later swarm processes from the zygote (tests only; see the module docstring)."""
    global _enabled
    _enabled = True


def disable() -> None:
    """Start later processes as fresh interpreters again (the zygote, if started, stays until `shutdown`)."""
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled


class ZygoteProcess:
    """A child of the zygote, with the part of `subprocess.Popen`'s interface the swarm code uses."""

    def __init__(self, args: Sequence[str], pid: int, zygote: _Zygote):
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class _Zygote:
    def __init__(self, env: Mapping[str, str]):
        self._env = dict(env)  # what its children get: a launch with another environment needs another zygote
        # the zygote is a module of this checkout, whatever the working directory of its parent
        paths = (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", ""))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "harness.zygote", *PRELOADED_MODULES],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**self._env, "PYTHONPATH": os.pathsep.join(path for path in paths if path)},
        )
        self._children: dict[int, ZygoteProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._replies: list[dict] = []
        self._reply_ready = threading.Condition()
        self._request_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        self._await_reply("ready", READY_TIMEOUT_S)

    def matches(self, env: Mapping[str, str]) -> bool:
        return dict(env) == self._env and self._process.poll() is None

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            if "exit" in message:
                with self._reply_ready:
                    child = self._children.pop(message["exit"], None)
                    if child is None:
                        self._early_exits[message["exit"]] = message["code"]
                if child is not None:
                    child._set_exit(message["code"])
                continue
            with self._reply_ready:
                self._replies.append(message)
                self._reply_ready.notify_all()
        with self._reply_ready:  # the zygote died: nothing will report these children any more
            self._replies.append({"error": "the zygote exited"})
            self._reply_ready.notify_all()

    def _await_reply(self, key: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._reply_ready:
            while not self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the zygote did not answer within {timeout:.0f} s")
                self._reply_ready.wait(left)
            reply = self._replies.pop(0)
        if key not in reply:
            raise RuntimeError(f"the zygote refused: {reply.get('error', reply)}")
        return reply

    def spawn(self, argv: Sequence[str], log_path: Path) -> ZygoteProcess:
        log_path.write_bytes(b"")  # exists once we return, as with Popen (callers read it at once)
        request = {"argv": list(argv[2:]), "log": str(log_path), "cwd": os.getcwd()}
        with self._request_lock:
            assert self._process.stdin is not None
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
            pid = self._await_reply("pid", 30.0)["pid"]
            child = ZygoteProcess(argv, pid, self)
            with self._reply_ready:
                early = self._early_exits.pop(pid, None)
                if early is None:
                    self._children[pid] = child
            if early is not None:
                child._set_exit(early)
        return child

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


Process = subprocess.Popen | ZygoteProcess  # what `launch` returns


def _preloadable(argv: Sequence[str]) -> bool:
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"


def prepare(env: Mapping[str, str]) -> None:
    """Start the zygote now, if enabled (so it is not counted as a process a test started later)."""
    if _enabled:
        _get_zygote(env)


def _get_zygote(env: Mapping[str, str]) -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.matches(env):
            if _zygote is not None:
                _zygote.close()
            _zygote = _Zygote(env)
            logger.info(
                "zygote %d started with %s preloaded", _zygote._process.pid, ", ".join(PRELOADED_MODULES)
            )
        return _zygote


def launch(argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> Process:
    """Run `argv` with stdout and stderr to `log_path`, in its own session."""
    if _enabled and _preloadable(argv):
        return _get_zygote(env).spawn(argv, log_path)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )


def shutdown() -> None:
    """Stop the zygote (its children are stopped by whoever started them)."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None
