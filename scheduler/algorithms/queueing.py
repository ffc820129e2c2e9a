"""Mean response time bounds for JFFC over composed chains (Sun, He and Hou, Theorem 3.7;
docs/reference.md 3.4).

With chains sorted by service rate (fastest first), the number of jobs in the system behaves like a
birth-death process with birth rate lambda and a death rate between `nu_lo(n)` (the n jobs sit on
the slowest job servers) and `nu_hi(n)` (on the fastest); beyond `C = sum c_l` jobs every job server
is busy and the death rate is `nu = sum c_l*mu_l`. Solving both processes bounds the mean occupancy,
and Little's law turns it into a response time. Products of `lambda/d(i)` over thousands of states
overflow, so the stationary weights are computed in log space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def job_server_rates(chains: Sequence[tuple[float, int]]) -> np.ndarray:
    """One service rate per job server (chain l contributes `c_l` copies of `mu_l`), fastest first."""
    rates = np.array([rate for rate, _ in chains], dtype=float)
    capacities = np.array([capacity for _, capacity in chains], dtype=np.int64)
    return np.sort(np.repeat(rates, capacities))[::-1]


def mean_occupancy(arrival_rate: float, death_rates: np.ndarray, total_rate: float) -> float:
    """Mean number of jobs of the birth-death process of Theorem 3.7 (eq. 30-32).

    `death_rates[n-1]` is the death rate with n jobs for n = 1..C; above C it is `total_rate`.
    `E[Z] = sum_{n<C} n*phi_n + phi_C*(rho/(1-rho)^2 + C/(1-rho))`; inf when unstable.
    """
    capacity = len(death_rates)
    if capacity == 0 or arrival_rate >= total_rate:
        return math.inf
    rho = arrival_rate / total_rate
    # log of prod_{i<=n} lambda/d(i) for n = 0..C
    log_weight = np.concatenate(([0.0], np.cumsum(np.log(arrival_rate) - np.log(death_rates))))
    # State C stands for all n >= C: its geometric tail adds the factor nu/(nu - lambda).
    log_tail = log_weight[capacity] + math.log(total_rate / (total_rate - arrival_rate))
    shift = max(log_weight.max(), log_tail)
    weights = np.exp(log_weight - shift)
    normalizer = weights[:capacity].sum() + math.exp(log_tail - shift)
    phi = weights / normalizer
    states = np.arange(capacity)
    return float(
        (states * phi[:capacity]).sum() + phi[capacity] * (rho / (1 - rho) ** 2 + capacity / (1 - rho))
    )


def response_time_bounds(chains: Sequence[tuple[float, int]], arrival_rate: float) -> tuple[float, float]:
    """Theorem 3.7 + Little's law: (lower, upper) bound on JFFC's mean response time.

    `chains` are (service rate mu_l, capacity c_l) pairs in any order. `nu_hi` (jobs on the fastest
    job servers) gives the lower bound, `nu_lo` (on the slowest) the upper. (inf, inf) if unstable.
    """
    if arrival_rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {arrival_rate}")
    fastest_first = job_server_rates(chains)
    total_rate = float(fastest_first.sum())
    nu_hi = np.cumsum(fastest_first)
    nu_lo = np.cumsum(fastest_first[::-1])
    lower = mean_occupancy(arrival_rate, nu_hi, total_rate) / arrival_rate
    upper = mean_occupancy(arrival_rate, nu_lo, total_rate) / arrival_rate
    return lower, upper
