"""Prometheus metrics of a server (`swarm-server --metrics-port`): sessions, cache, steps, errors, bytes.

The handler reports events; the gauges of the cache are read when scraped (a callback), so they
are never stale. One registry per server object keeps several servers in one process apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # every metric of this server goes into its own registry
        gauge, counter = partial(Gauge, registry=r), partial(Counter, registry=r)
        self.sessions = gauge("swarm_server_sessions", "Open inference sessions")
        self.sessions_opened = counter("swarm_server_sessions_opened", "Sessions opened")
        self.handoffs = counter(
            "swarm_server_handoffs", "Session caches pushed to another server (hand-offs)"
        )
        self.slots_free = gauge(
            "swarm_server_cache_slots_free", "Cache slots (sessions of slot_tokens on one block) free"
        )
        self.slots_total = gauge("swarm_server_cache_slots_total", "Cache slots in the whole budget")
        self.bytes_free = gauge("swarm_server_cache_bytes_free", "Cache bytes new sessions may reserve")
        self.steps = Histogram(
            "swarm_server_step_seconds", "Compute time of one step over the session's blocks", ["kind"],
            buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        # each kind's histogram, looked up once: a decode step's `labels()` call costs more than its
        # observation
        self.step_seconds = {
            kind: self.steps.labels(kind=kind)
            for kind in ("prefill", "decode", "replay", "forward", "backward")
        }
        self.errors = counter("swarm_server_errors", "Requests answered with an error, by code", ["code"])
        self.received = counter("swarm_server_bytes_received", "Request bytes received")
        self.sent = counter("swarm_server_bytes_sent", "Response bytes sent")
        self.wrong_output_reports = counter(
            "swarm_server_wrong_output_reports",
            "Clients' reports that this server's output was wrong (outvoted by replicas, or malformed)",
            ["reason"],
        )
        self.decode_batch = Histogram(
            "swarm_server_decode_batch_steps",
            "Session steps run together in one batched decode iteration",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.tau_per_session = gauge(
            "swarm_server_tau_per_session_seconds",
            "What each session decoding here at once adds to a token's time per block (0: not measured)",
        )
        self.span_changes = counter("swarm_server_span_changes", "Times the server moved to a new span")
        self.chained_steps = counter(
            "swarm_server_chained_steps",
            "Chain sessions' steps run from the predecessor's push (pushed), and the client's copies of "
            "them not run again (copy_dropped)",
            ["how"],
        )
        self.streams_opened = gauge(
            "swarm_server_streams_opened",
            "Streams this server opened to other servers (pushes, hand-offs, link probes), by path",
            ["path"],
        )
        self.direct_streams_served = gauge(
            "swarm_server_direct_streams_served", "Streams peers opened to this server directly (TLS)"
        )

    def watch_streams(self, opened: Callable[[str], int], served_directly: Callable[[], int]) -> None:
        """Read the stream counts when scraped: `opened(path)`, and the direct streams served."""
        for path in ("direct", "libp2p"):
            self.streams_opened.labels(path=path).set_function(partial(opened, path))
        self.direct_streams_served.set_function(served_directly)

    def watch_cache(
        self, free_slots: Callable[[], int], total_slots: Callable[[], int], free_bytes: Callable[[], int]
    ) -> None:
        """Read the cache gauges from the live budget whenever they are scraped."""
        self.slots_free.set_function(free_slots)
        self.slots_total.set_function(total_slots)
        self.bytes_free.set_function(free_bytes)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint in a daemon thread; returns its port (for port 0)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound = server.server_port
        logger.info("metrics at http://%s:%d/metrics", host, bound)
        return bound
