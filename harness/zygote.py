"""A pre-imported Python interpreter that forks real processes for `python -m MODULE ARGS...`.

Every swarm process (`swarm-server`, `swarm-scheduler`, `swarm-dht`, `swarm-api`) spends seconds of CPU
importing torch, transformers and hivemind before it does anything. A test suite starts hundreds of
them on a 2-core machine, so `harness.preloaded_launcher` can run them from this zygote instead (as
Android does): it imports those modules once, then forks a child per request. The child is an
ordinary process in its own session, running the module's `__main__` exactly as `python -m` would:
its own signals, exit code, log file and process group. Only the import is shared.

Protocol, one JSON object per line: the parent writes `{"argv": [...], "log": PATH, "cwd": DIR}` on
the zygote's stdin; the zygote answers `{"pid": N}` (or `{"error": "..."}`) on its stdout, and later
`{"exit": N, "code": C}` when that child exits (C as `subprocess.Popen.returncode`: negative for a
signal). The zygote exits when its stdin closes. It starts no threads, so forking it is safe.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import sys
import traceback

REAP_INTERVAL_S = 0.05  # how late an exit may be reported at most (the zygote polls; no SIGCHLD handler)


def _send(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _run_child(argv: list[str], log_path: str, cwd: str) -> None:
    """In the forked child: become `python -m MODULE ARGS` in a new session; never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(cwd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # the parent created it
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        module, args = argv[0], argv[1:]
        sys.argv = ["-m", *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 130
        except BaseException:  # noqa: BLE001  (what an interpreter does with an uncaught exception)
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what interpreter shutdown would run: multiprocessing joins, cleanups
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(modules: list[str]) -> None:
    for module in modules:
        importlib.import_module(module)
    sys.stdout.flush()
    children: set[int] = set()
    pending = b""
    _send({"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([0], [], [], REAP_INTERVAL_S)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            break  # the parent is gone or done: children live on until they are stopped
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = json.loads(line)
                argv, log_path, cwd = list(request["argv"]), str(request["log"]), str(request["cwd"])
            except (ValueError, KeyError, TypeError) as error:
                _send({"error": f"bad request: {error}"})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(argv, log_path, cwd)
            children.add(pid)
            _send({"pid": pid})


if __name__ == "__main__":
    serve(sys.argv[1:])
