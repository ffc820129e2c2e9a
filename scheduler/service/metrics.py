"""Prometheus metrics of the scheduler (scraped at `/metrics` of its web server).

Gauges mirror the status; counters and histograms are fed by the events the gRPC API sees.
A registry per service keeps tests (several schedulers in one process) apart.
"""

from __future__ import annotations

from llm_swarm.swarm.prometheus_metrics import PrometheusMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SchedulerMetrics(PrometheusMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.servers = self.gauge("swarm_servers", "Servers known to the scheduler, by state", ["state"])
        self.sessions = self.gauge("swarm_sessions", "Sessions the scheduler tracks, by kind", ["kind"])
        self.num_requests = self.gauge(
            "swarm_guaranteed_sessions", "R: concurrent sessions the placement guarantees"
        )
        self.bound = self.gauge("swarm_bound_seconds", "Eq. 17 guaranteed per-token time (-1 unknown)")
        self.epoch = self.gauge("swarm_placement_epoch", "Version of the adopted placement")
        self.uncovered = self.gauge("swarm_uncovered_blocks", "Blocks no online server holds")
        self.placements = self.counter("swarm_placements", "Placements adopted")
        self.routes = self.counter("swarm_routes", "Routing queries, by outcome", ["outcome"])
        self.slo_misses = self.counter(
            "swarm_routes_slo_miss", "Routes expected to miss --slo-ttft/--slo-tpot (the client was told)"
        )
        self.ended = self.counter("swarm_sessions_ended", "Sessions ended by their clients")
        self.wait = self.histogram(
            "swarm_admission_wait_seconds", "Time from routing to admission", LATENCY_BUCKETS
        )
        self.ttft = self.histogram(
            "swarm_request_ttft_seconds", "Time to first token reported by clients", LATENCY_BUCKETS
        )
        self.tpot = self.histogram(
            "swarm_request_tpot_seconds", "Mean time per later token reported by clients", LATENCY_BUCKETS
        )
        self.refresh = self.gauge(
            "swarm_roster_refresh_seconds",
            "Last refresh: reading the roster keys due from the DHT, and reviewing the placement",
            ["part"],
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
