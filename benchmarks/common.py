"""What the benchmark scripts share: their command line, a loopback swarm's lifecycle, and how a result
table is printed and put into BENCHMARKS.md.

Each benchmark runs as a module from the repository's root (`python -m benchmarks.serving.latency`).
This module imports nothing heavy (no hivemind, no torch): `benchmarks.scheduling.algorithms` uses it
too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from benchmarks.markdown import ROOT, write_section
from llm_swarm.swarm.dht_keys import default_prefix

if TYPE_CHECKING:  # importing it pulls in hivemind, which takes seconds
    from benchmarks.netem.emulator import Emulation
    from harness.local_swarm import LocalSwarm


def bench_parser(doc: str, **defaults: int | str) -> argparse.ArgumentParser:
    """A parser whose `--help` shows the script's docstring `doc` as written, with a `--NAME` option for
    each of `defaults` (NAME=default), in that order, of the default's type."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return parser


def measuring_parser(
    doc: str, *required: str, shared: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.ArgumentParser:
    """The parser of a benchmark that runs its measuring client as a subprocess (e.g. inside an
    emulated site), with a `measure` subcommand for that client (see `run_measuring`), which takes
    `--initial-peers` and the `required` options. `shared(parser)` adds to both the options the
    benchmark passes on to its client."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command")
    inner = commands.add_parser("measure", help="(internal) the measuring client")
    for name in required:
        inner.add_argument(name, required=True)
    inner.add_argument("--initial-peers", nargs="+", required=True)
    if shared is not None:
        shared(parser)
        shared(inner)
    return parser


def run_measuring(
    parser: argparse.ArgumentParser,
    measure: Callable[[argparse.Namespace], None],
    benchmark: Callable[[argparse.Namespace], None],
) -> None:
    """Parses the command line of `measuring_parser`'s `parser`: its `measure` subcommand runs
    `measure(args)` (the measuring client, which the benchmark starts), anything else
    `benchmark(args)`."""
    args = parser.parse_args()
    (measure if args.command == "measure" else benchmark)(args)


def add_report_options(parser: argparse.ArgumentParser, keep_logs: bool = False) -> None:
    """`--write` (see `publish_table`) and, with `keep_logs`, `--keep-logs` (see `run_emulated`)."""
    parser.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md")
    if keep_logs:
        parser.add_argument("--keep-logs", help="copy the processes' logs to this folder at the end")


def add_mig_slice_delays(parser: argparse.ArgumentParser) -> None:
    """`--compute-delay` and `--compute-delay-per-token` of servers that emulate a GPU (a forward
    costs the larger of the two per block), by default each tiny block standing for 4 blocks of
    LLaMA-2-7B on Sun, He and Hou's MIG 3g.40gb slice (the simulator's profile: 1 ms launch overhead,
    3.4 us per prompt token per block)."""
    parser.add_argument("--compute-delay", type=float, default=0.004, help="s per block per forward")
    parser.add_argument(
        "--compute-delay-per-token", type=float, default=13.6e-6, help="s per block per token"
    )


def parse_positive(parser: argparse.ArgumentParser, *names: str) -> argparse.Namespace:
    """`parser`'s arguments, where each of the integer options `names` must be >= 1."""
    args = parser.parse_args()
    if any(getattr(args, name) < 1 for name in names):
        parser.error(" and ".join(f"--{name.replace('_', '-')}" for name in names) + " must be >= 1")
    return args


def parse_bench_args(doc: str, **defaults: int | str) -> argparse.Namespace:
    """The command line of a benchmark that reports one table: the options of `bench_parser(doc,
    **defaults)`, then `--write` (see `publish_table`)."""
    parser = bench_parser(doc, **defaults)
    add_report_options(parser)
    return parser.parse_args()


def rerun_command(script: str, args: argparse.Namespace) -> str:
    """The command, as BENCHMARKS.md quotes it, that reruns `script` (a module's path) with the options
    `args` of `parse_bench_args` (or `measuring_parser`: the subcommand is left out) and writes its
    section again."""
    options = " ".join(
        f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        for name, value in vars(args).items()
        if name not in ("write", "command") and value is not False  # a flag is named only when set
    )
    return f".venv/bin/python -m {module_name(script)} {options} --write"


def module_name(script: str) -> str:
    """`benchmarks.area.name` of the benchmark at path `script`."""
    relative = Path(script).resolve().relative_to(ROOT).with_suffix("")
    return ".".join(relative.parts)


def publish_table(script: str, args: argparse.Namespace, lines: list[str], header: str, text: str) -> None:
    """Prints the Markdown table `lines`; with `--write`, also makes it the BENCHMARKS.md section `header`
    (its `## ...` line), after the command that reruns `script` with `args` and the paragraph `text`
    that says what was measured and how."""
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_section(header, f"{header}\n\nCommand: `{rerun_command(script, args)}`\n\n{text}\n\n{table}\n")


def write_timed_section(header: str, command: str, wall: float, parts: list[str], notes: Path) -> None:
    """Makes `parts` (paragraphs and tables, in order) the BENCHMARKS.md section `header`, after the
    `command` that reruns it and the `wall` seconds it took, and before the text of `notes` where that
    file exists (what the runs showed, written by hand)."""
    findings = notes.read_text() if notes.exists() else ""
    lead = f"{header}\n\nCommand (wall time {wall:.0f} s on this 2-core machine): `{command}`"
    write_section(header, "\n\n".join([lead, *parts, findings]))


_T = TypeVar("_T")


def run_emulated(prefix: str, keep_logs: str | None, run: Callable[[Path], _T]) -> _T:
    """`run(work)` in a scratch folder that is removed afterwards; with `keep_logs`, the emulation's
    logs (`work/netem`) are copied there first, also when the run fails."""
    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        try:
            return run(Path(work))
        finally:
            if keep_logs:
                shutil.copytree(Path(work) / "netem", keep_logs, dirs_exist_ok=True)


def run_measuring_client(
    emulation: Emulation, argv: list[str], out: Path, watch: list[str] | None = None
) -> dict:
    """Runs a benchmark's measuring client `argv` (its `measure` subcommand) in the client's site until
    it ends, checking meanwhile that the emulation's processes (`watch`; default: all) and its packet
    delayer are alive; returns the JSON it wrote to `out`."""
    process = emulation.start("measure", "client", argv)
    while process.poll() is None:
        emulation.check_alive(watch)
        time.sleep(1.0)
    if process.returncode != 0:
        raise SystemExit(f"the measuring client failed:\n{emulation.log('measure')[-3000:]}")
    return json.loads(out.read_text())


def run_concurrently(work: list[Callable[[], None]]) -> float:
    """Runs each callable of `work` in a thread of its own, all at once, and returns the seconds from
    starting them to the last one's end. Once all have ended, the first exception any of them raised
    is raised here (a benchmark with a failed client measured nothing)."""
    errors: list[BaseException] = []

    def guarded(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as error:  # raised below, in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(call,)) for call in work]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


@contextlib.contextmanager
def serving_swarm(
    swarm: LocalSwarm, model_dir: Path, servers: dict[str, str], num_blocks: int, *server_args: str
) -> Iterator[LocalSwarm]:
    """`swarm` (a fresh `LocalSwarm`) with its DHT and `servers` (name: blocks, "0:3") of the model in
    `model_dir`, which has `num_blocks` blocks, started and online; `server_args` follow the blocks in
    every `start_server` call (the memory, then extra flags). Should the setup or the body fail, the
    processes' log tails go to stderr first (the cause is usually in a server's log); on the way out,
    every process is stopped."""
    try:
        swarm.start_dht()
        for name, blocks in servers.items():
            swarm.start_server(name, model_dir, blocks, *server_args)
        swarm.wait_online(default_prefix(str(model_dir)), num_blocks, list(servers))
        yield swarm
    except BaseException:
        print(swarm.log_tails(), file=sys.stderr)
        raise
    finally:
        swarm.close()


class LogLines(logging.Handler):
    """Keeps the messages of the records it handles: how a benchmark's measuring client reads what
    the client code logged (moves, hand-offs) without parsing a log file."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
