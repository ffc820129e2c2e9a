"""The PETALS baseline (docs/reference.md 3.3): block counts, join-order placement, its router and backoff."""

from __future__ import annotations

import math

import pytest

from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

GIB = 1024**3
BLOOM = ModelSpec(num_blocks=70, block_bytes=1.3234e9, cache_bytes=8486912, hidden_size=14336)


def test_block_counts_reproduce_paper_000_clustered_scenario():
    """PETALS placed 53 blocks on an A100 (79.13 GiB) and 4 on a MIG 1g slice (8.2 GiB)."""
    assert petals.autograd_reserve_bytes(BLOOM) == 2 * GIB
    assert petals.cache_bytes_per_block(BLOOM) == 2 * 14336 * 4096 * 2
    assert petals.block_count(ServerSpec("a100", 79.13 * GIB, tau=0.00322), BLOOM) == 53
    assert petals.block_count(ServerSpec("mig", 8.2 * GIB, tau=0.01625), BLOOM) == 4
    assert petals.block_count(ServerSpec("tiny", 1 * GIB, tau=0.01625), BLOOM) == 0


def test_gqa_models_reserve_a_longer_cache():
    llama70b = ModelSpec(80, 1e9, 1e6, hidden_size=8192, kv_dim=1024)
    assert petals.cache_bytes_per_block(llama70b) == 2 * 1024 * 16384 * 2
    assert petals.autograd_reserve_bytes(llama70b) == 2 * GIB * 8192 / 14336


def test_throughput_formula_and_defaults():
    assert petals.throughput(ServerSpec("a", 1.0, forward_rps=30.0, network_rps=100.0), 3) == 15.0
    assert petals.throughput(ServerSpec("a", 1.0, forward_rps=30.0, network_rps=10.0), 3) == 10.0
    assert petals.throughput(ServerSpec("a", 1.0, tau=0.01), 1) == 100.0  # forward_rps = 1/tau


def test_servers_join_in_order_on_the_least_served_window():
    model = ModelSpec(4, 1e9, 1e6, hidden_size=14336)
    per_block = model.block_bytes + petals.cache_bytes_per_block(model)

    def joining(name: str, blocks: int, forward_rps: float, network_rps: float | None = None) -> ServerSpec:
        memory = petals.autograd_reserve_bytes(model) + blocks * per_block + 1
        return ServerSpec(name, memory, forward_rps=forward_rps, network_rps=network_rps)

    servers = [
        joining("A", 2, 15.0),  # throughput 15 / 1.5 = 10 -> [10, 10, 0, 0]
        joining("B", 2, 6.0),  # 4, on the untouched blocks -> [10, 10, 4, 4]
        joining("C", 1, 1.0),  # 1, the lowest of the two 4s -> [10, 10, 5, 4]
        joining("D", 3, 2.0, network_rps=0.5),  # min(1, 0.5); [4, 5, 10] < [5, 10, 10]
        ServerSpec("E", 1e9, tau=0.01),  # too small: never joins
    ]
    result = petals.place(servers, model)
    assert result.spans == (Span(0, 2), Span(2, 4), Span(2, 3), Span(1, 4), None)
    assert result.order == (0, 1, 2, 3)
    assert result.block_throughput == (10.0, 10.5, 5.5, 4.5)
    assert result.feasible


def test_uncovered_blocks_are_reported():
    model = ModelSpec(4, 1e9, 1e6, hidden_size=14336)
    memory = petals.autograd_reserve_bytes(model) + 2 * (
        model.block_bytes + petals.cache_bytes_per_block(model)
    )
    result = petals.place([ServerSpec("a", memory, tau=0.01), ServerSpec("b", memory, tau=0.02)], model)
    assert result.spans == (Span(0, 2), Span(2, 4))
    result = petals.place([ServerSpec("a", memory, tau=0.01)], model)
    assert result.uncovered_blocks == (2, 3)


def test_router_weights_and_the_cache_penalty():
    # Each hosted block brings PETALS' fixed cache for 4 sessions' worth of s_c.
    model = ModelSpec(2, 1e9, 2 * 14336 * 4096 * 2 / 4, hidden_size=14336)
    servers = [
        ServerSpec("whole", 1e12, tau=0.01, rtt={"c1": 0.1}),  # 0.05 + 0.018 + 2*0.01 = 0.088
        ServerSpec("first", 1e12, tau=0.01, rtt={"c1": 0.02}),  # 0.01 + 0.018 + 0.01 = 0.038
        ServerSpec("second", 1e12, tau=0.01, rtt={"c1": 0.02}),  # 0.038 -> 0.076 in all
    ]
    placement = [Span(0, 2), Span(0, 1), Span(1, 2)]
    assert petals.cache_capacity_slots(servers[2], model, 1) == 4

    chain = petals.route(servers, model, placement, "c1", used_slots=[0, 0, 0])
    assert [hop.server for hop in chain.hops] == [1, 2]
    assert math.isclose(chain.cost, 2 * (0.02 / 2 + 0.018 + 0.01))

    chain = petals.route(servers, model, placement, "c1", used_slots=[0, 0, 4])  # "second" is full
    assert [hop.server for hop in chain.hops] == [0]
    chain = petals.route(servers, model, placement, "c1", used_slots=[8, 4, 4])  # everyone full: +10 s
    assert [hop.server for hop in chain.hops] == [0] and math.isclose(chain.cost, 10.088)
    assert petals.route(servers, model, placement, "c2", used_slots=[0, 0, 0]) is None


def test_retry_backoff_doubles_up_to_a_minute():
    assert [petals.retry_delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert petals.retry_delay(10_000) == 60
