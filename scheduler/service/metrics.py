"""Prometheus metrics of the scheduler (scraped at `/metrics` of its web server).

Gauges mirror the status; counters and histograms are fed by the events the gRPC API sees.
A registry per service keeps tests (several schedulers in one process) apart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.servers = Gauge(
            "swarm_servers", "Servers known to the scheduler, by state", ["state"], registry=r
        )
        self.sessions = Gauge(
            "swarm_sessions", "Sessions the scheduler tracks, by kind", ["kind"], registry=r
        )
        self.num_requests = Gauge(
            "swarm_guaranteed_sessions", "R: concurrent sessions the placement guarantees", registry=r
        )
        self.bound = Gauge("swarm_bound_seconds", "Eq. 17 guaranteed per-token time (-1 unknown)", registry=r)
        self.epoch = Gauge("swarm_placement_epoch", "Version of the adopted placement", registry=r)
        self.uncovered = Gauge("swarm_uncovered_blocks", "Blocks no online server holds", registry=r)
        self.placements = Counter("swarm_placements", "Placements adopted", registry=r)
        self.routes = Counter("swarm_routes", "Routing queries, by outcome", ["outcome"], registry=r)
        self.ended = Counter("swarm_sessions_ended", "Sessions ended by their clients", registry=r)
        self.wait = Histogram(
            "swarm_admission_wait_seconds",
            "Time from routing to admission",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "swarm_request_ttft_seconds",
            "Time to first token reported by clients",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "swarm_request_tpot_seconds",
            "Mean time per later token reported by clients",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.refresh = Gauge(
            "swarm_roster_refresh_seconds",
            "Last refresh: reading the roster keys due from the DHT, and reviewing the placement",
            ["part"],
            registry=r,
        )
        self._last_epoch = 0

    def update(self, status: dict) -> None:
        states: dict[str, int] = {"online": 0, "joining": 0, "moving": 0, "offline": 0}
        for server in status["servers"]:
            states[server["state"]] = states.get(server["state"], 0) + 1
        for state, count in states.items():
            self.servers.labels(state=state).set(count)
        self.sessions.labels(kind="active").set(status["active_sessions"])
        self.sessions.labels(kind="waiting").set(status["waiting_sessions"])
        self.num_requests.set(status["num_requests"])
        self.bound.set(status["bound"])
        self.epoch.set(status["epoch"])
        self.uncovered.set(len(status["uncovered_blocks"]))
        if status["epoch"] > self._last_epoch:
            self.placements.inc(status["epoch"] - self._last_epoch)
            self._last_epoch = status["epoch"]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
