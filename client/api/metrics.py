"""Prometheus metrics of the API: requests by route and status, tokens, TTFT, time per output token."""

from __future__ import annotations

import time

from llm_swarm.client.api.generation import GenerationResult
from llm_swarm.swarm.prometheus_metrics import PrometheusMetrics

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ApiMetrics(PrometheusMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.requests = self.counter(
            "swarm_api_requests", "Requests answered, by route and status", ["route", "status"]
        )
        self.tokens = self.counter(
            "swarm_api_tokens", "Tokens processed, by kind (prompt, completion)", ["kind"]
        )
        self.ttft = self.histogram(
            "swarm_api_ttft_seconds", "Time from admission to the first token", SECONDS
        )
        self.tpot = self.histogram(
            "swarm_api_time_per_output_token_seconds",
            "Mean time per token after the first, per request",
            SECONDS,
        )
        self.in_flight = self.gauge("swarm_api_requests_in_flight", "Requests running or waiting for a slot")

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe(
        self, route: str, prompt_tokens: int, results: list[GenerationResult], started: float
    ) -> None:
        """One answered request and its choices' tokens and timings (TTFT: the first choice's first)."""
        self.count(route, 200)
        self.tokens.labels(kind="prompt").inc(prompt_tokens)
        self.tokens.labels(kind="completion").inc(sum(result.completion_tokens for result in results))
        firsts = [result.first_token_at for result in results if result.first_token_at is not None]
        if firsts:
            self.ttft.observe(min(firsts) - started)
        for result in results:
            if result.first_token_at is not None and result.completion_tokens > 1:
                finished = result.finished_at or time.monotonic()
                self.tpot.observe((finished - result.first_token_at) / (result.completion_tokens - 1))
