"""User-space link delay for kernels without `sch_netem`: hold queued packets, then let them go.

In every site namespace, one iptables rule per destination site sends the packets this site
*originates* toward that destination (mangle/OUTPUT, so kernel-made replies such as ICMP echo
replies and TCP ACKs too) to NFQUEUE number = the destination's site index. This one process
owns all those queues: it enters each namespace just long enough to open and bind its netlink
socket (a socket stays in the namespace it was created in), then serves every queue from a
single `select` loop. Each packet gets its verdict (ACCEPT) once `one_way_delay` (+ jitter) has
passed since it was queued; packets then continue to the HTB rate limit on the site's veth.

Why this keeps the link honest:
- Order: all packets of one (source, destination) pair share one queue and one constant delay,
  so releasing each queue in arrival order never reorders a flow. With jitter the release time is
  clamped to be no earlier than the previous packet's (FIFO per pair, like a real link).
- Loss: a packet is dropped with the pair's probability instead of being released.
- Only metadata is copied to user space (COPY_META): the payload stays in the kernel.
- Precision: release times are met within the scheduling latency of this process (typically
  0.05-0.3 ms on an idle machine, more on a loaded one); `--stats` records the lateness of every
  release so a run can report it. Packets wait in the kernel, so a slow or stopped delayer
  delays packets more, never less, and if it dies the queued packets are dropped (no silent
  "fast" network; TCP retransmits once the emulator notices and tears down).

Usage (the emulator starts it): `python delayer.py SPEC.json` with
`{"sites": [{"netns": "/run/netns/NAME", "queues": [{"num": 3, "delay_s": 0.05, "jitter_s": 0,
"loss": 0}]}], "ready_file": "...", "stats_file": "..."}`. SIGTERM/SIGINT: release everything
held, unbind, write the stats, exit 0.
"""

from __future__ import annotations

import collections
import ctypes
import heapq
import json
import os
import random
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field

# the emulator runs this file as a script (topology.DELAYER), so this folder is sys.path[0]
from spec_args import read_spec_args

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MAX_QUEUED = 200_000  # packets per queue the kernel may hold for us (default 1024 is far too few)
SOCKET_BUFFER = 16 * 1024 * 1024
# Release a packet this much before its due time: the trip to user space and back (read, verdict)
# plus the wake-up costs about as much, so the delay the packet sees is centred on the target.
EARLY_S = 0.0002
RT_PRIORITY = 10
STATS_PERIOD_S = 10.0  # SCHED_FIFO: wake-ups stay prompt while the swarm's processes load the CPU

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def setns(path: str) -> None:
    """Move this (single-threaded) process into the network namespace at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


@dataclass
class QueueState:
    delay: float
    jitter: float
    loss: float
    held: collections.deque = field(default_factory=collections.deque)  # (release_at, packet)
    last_release: float = 0.0
    packets: int = 0
    dropped: int = 0


@dataclass
class Lateness:
    """How late releases were (seconds past their due time), for the run's report."""

    count: int = 0
    total: float = 0.0
    worst: float = 0.0
    over_1ms: int = 0

    def add(self, late: float) -> None:
        self.count += 1
        self.total += late
        self.worst = max(self.worst, late)
        self.over_1ms += late > 1e-3


class Delayer:
    def __init__(self, spec: dict, seed: int = 0):
        self.early = float(spec.get("early_s", EARLY_S))
        from netfilterqueue import COPY_META, NetfilterQueue  # installed by system.ensure_netfilterqueue

        self.random = random.Random(seed)
        # select(2) takes microsecond timeouts; epoll's are whole milliseconds (up to 1 ms late)
        self.selector = selectors.SelectSelector()
        self.queues: list[QueueState] = []
        self.handles: list[NetfilterQueue] = []
        self.due: list[tuple[float, int]] = []  # heap of (next release time, queue index)
        self.lateness = Lateness()
        self.enobufs = 0
        home = f"/proc/{os.getpid()}/ns/net"
        home_fd = os.open(home, os.O_RDONLY)
        try:
            for site in spec["sites"]:
                setns(site["netns"])
                try:
                    for queue in site["queues"]:
                        index = len(self.queues)
                        state = QueueState(
                            float(queue["delay_s"]),
                            float(queue.get("jitter_s", 0)),
                            float(queue.get("loss", 0)),
                        )
                        handle = NetfilterQueue()
                        handle.bind(
                            int(queue["num"]),
                            self._callback(index),
                            max_len=MAX_QUEUED,
                            mode=COPY_META,
                            range=0,
                            sock_len=SOCKET_BUFFER,
                        )
                        self.queues.append(state)
                        self.handles.append(handle)
                        self.selector.register(handle.get_fd(), selectors.EVENT_READ, index)
                finally:
                    if _libc.setns(home_fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "could not return to the original namespace")
        finally:
            os.close(home_fd)

    def _callback(self, index: int):
        def on_packet(packet) -> None:
            queue = self.queues[index]
            now = time.monotonic()
            queue.packets += 1
            if queue.loss and self.random.random() < queue.loss:
                queue.dropped += 1
                packet.drop()
                return
            release = now + queue.delay
            if queue.jitter:
                release += self.random.uniform(-queue.jitter, queue.jitter)
            release = max(release, queue.last_release)  # FIFO per pair: never overtake
            queue.last_release = release
            if not queue.held:
                heapq.heappush(self.due, (release, index))
            queue.held.append((release, packet))

        return on_packet

    def _release_due(self, now: float) -> None:
        horizon = now + self.early
        while self.due and self.due[0][0] <= horizon:
            _, index = heapq.heappop(self.due)
            held = self.queues[index].held
            while held and held[0][0] <= horizon:
                release, packet = held.popleft()
                packet.accept()
                self.lateness.add(now - release)
            if held:
                heapq.heappush(self.due, (held[0][0], index))

    def serve(self, stop: list[bool], stats_file: str | None = None) -> None:
        parent = os.getppid()
        next_stats = time.monotonic() + STATS_PERIOD_S
        while not stop[0]:
            if stats_file and time.monotonic() >= next_stats:  # progress for long runs
                next_stats = time.monotonic() + STATS_PERIOD_S
                write_stats(stats_file, self.stats())
            now = time.monotonic()
            self._release_due(now)
            timeout = 0.2 if not self.due else max(self.due[0][0] - self.early - time.monotonic(), 0.0)
            for key, _ in self.selector.select(min(timeout, 0.2)):
                try:
                    self.handles[key.data].run(False)
                except OSError as error:  # ENOBUFS: the kernel dropped queued packets; TCP recovers
                    self.enobufs += 1
                    if self.enobufs <= 3:
                        print(f"delayer: queue {key.data}: {error}", file=sys.stderr, flush=True)
            if os.getppid() != parent:  # the emulator died without stopping us: release and go
                break

    def close(self) -> None:
        for queue in self.queues:
            while queue.held:
                queue.held.popleft()[1].accept()
        for handle in self.handles:
            try:
                handle.unbind()
            except OSError:
                pass

    def stats(self) -> dict:
        late = self.lateness
        return {
            "packets": sum(q.packets for q in self.queues),
            "dropped": sum(q.dropped for q in self.queues),
            "released": late.count,
            "lateness_mean_ms": late.total / late.count * 1e3 if late.count else 0.0,
            "lateness_max_ms": late.worst * 1e3,
            "released_over_1ms_late": late.over_1ms,
            "enobufs": self.enobufs,
        }


def write_stats(path: str, stats: dict) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump(stats, handle, indent=1)
    os.replace(temporary, path)  # readers never see half a file


def main(argv: list[str] | None = None) -> int:
    parsed = read_spec_args(argv, 1, "usage: delayer.py SPEC.json")
    if parsed is None:
        return 2
    spec, _ = parsed
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # never outlive the emulator
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
    except (OSError, AttributeError) as error:  # not permitted: ordinary scheduling, less precise
        print(f"delayer: no real-time priority ({error})", file=sys.stderr, flush=True)
    stop = [False]

    def request_stop(*_):
        stop[0] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    delayer = Delayer(spec, seed=int(spec.get("seed", 0)))
    if spec.get("ready_file"):
        with open(spec["ready_file"], "w") as handle:
            handle.write(str(os.getpid()))
    try:
        delayer.serve(stop, spec.get("stats_file"))
    finally:
        delayer.close()
        if spec.get("stats_file"):
            write_stats(spec["stats_file"], delayer.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
