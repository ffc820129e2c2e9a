"""A base for a component's Prometheus metrics: a registry of its own and short ways to add to it.

One registry per metrics object (not prometheus_client's global one) keeps several components of
the same kind in one process (tests, a local swarm) apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class PrometheusMetrics:
    """Holds `registry`; subclasses create their metrics in it with `counter`, `gauge`, `histogram`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """A counter `name` in this object's registry, with these label names."""
        return Counter(name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        """A gauge `name` in this object's registry, with these label names."""
        return Gauge(name, documentation, labels, registry=self.registry)

    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        """A histogram `name` with these bucket bounds in this object's registry."""
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def exposition(self) -> bytes:
        """Every metric of the registry in Prometheus' text format (what `/metrics` serves)."""
        return generate_latest(self.registry)
