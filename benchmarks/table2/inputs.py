"""The experiment's inputs: the scenario at a time scale, the tiny model's real costs on this CPU,
and each emulated server's plan (paper GPU, memory, compute delay)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from benchmarks.netem.scenario import Scenario, parse_scenario
from llm_swarm.scheduler.algorithms.problem import ModelSpec
from llm_swarm.scheduler.sim.profiles import GIB
from llm_swarm.swarm.cost import cache_bytes_per_block

PREFILL_TOKENS = 20  # what servers time their prefill on (ServerConfig.prefill_tokens)


@dataclasses.dataclass(frozen=True)
class Cell:
    rate: float  # paper-scale requests/s
    l_out: int
    requests: int


def scaled_scenario(raw: dict, scale: float) -> Scenario:
    """Every RTT (and jitter) times `scale`; bandwidths unchanged (hidden states are 256 bytes here)."""
    raw = json.loads(json.dumps(raw))
    links = raw.get("links", {})
    for spec in [links.get("within_group"), links.get("between_groups"), *links.get("pairs", [])]:
        if spec:
            spec["rtt_ms"] = spec["rtt_ms"] * scale
            if "jitter_ms" in spec:
                spec["jitter_ms"] = spec["jitter_ms"] * scale
    return parse_scenario(raw, f"table2 x{scale:g}")


@dataclasses.dataclass(frozen=True)
class TinyCosts:
    """What one block of the emulation's tiny model really costs on this CPU."""

    block_bytes: int
    cache_token_bytes: int
    tau_cpu: float  # decode, per block per token
    tau_prefill_cpu: float  # prefill of l_in tokens, per block


def measure_tiny(model_dir: Path, l_in: int) -> TinyCosts:
    """Per-block CPU costs of the tiny model, best of 3 (the least disturbed by other jobs)."""
    import torch

    from llm_swarm.server.throughput import measure_block_timings
    from llm_swarm.swarm.models import load_span

    torch.set_num_threads(1)
    span, _ = load_span(str(model_dir), 0, 8, dtype="float32")
    timings = [measure_block_timings(span, l_in) for _ in range(3)]
    return TinyCosts(
        block_bytes=span.block_bytes,
        cache_token_bytes=span.cache_bytes(num_tokens=1),
        tau_cpu=min(t.tau for t in timings),
        tau_prefill_cpu=min(t.tau_prefill for t in timings),
    )


def write_block_timings(model_dir: Path, tiny: TinyCosts, delays: set[float], cache_dir: Path) -> None:
    """The servers' timing cache (`server.throughput`), filled with this idle profile.

    Nine servers starting at once on two cores would each time their blocks while the others load
    theirs, and announce a tau up to 3x too high (and cache it). With the profile taken here, each
    announces `CPU time of an idle block + compute delay` = the paper GPU's tau x the time scale.
    """
    import torch

    from llm_swarm.server.throughput import timings_cache_key
    from llm_swarm.swarm.models import load_span

    torch.set_num_threads(1)  # the servers run with --torch-threads 1: part of the key
    span, _ = load_span(str(model_dir), 0, 1, dtype="float32")
    if PREFILL_TOKENS != 20:
        raise AssertionError("the prefill profile below is for 20 tokens")
    entries = {
        timings_cache_key(span, PREFILL_TOKENS, delay): {
            "tau": tiny.tau_cpu + delay,
            "tau_prefill": tiny.tau_prefill_cpu + delay,
            "prefill_tokens": PREFILL_TOKENS,
        }
        for delay in delays
    }
    cache_dir.mkdir(parents=True, exist_ok=True)
    (cache_dir / "block_timings.json").write_text(json.dumps(entries, indent=1))


@dataclasses.dataclass(frozen=True)
class ServerPlan:
    name: str
    site: str
    kind: str
    memory_paper: float  # bytes
    tau_paper: float  # seconds per block per token on the paper's GPU
    compute_delay: float  # seconds per block per step, at the emulation's scale


def paper_model(scenario_raw: dict, l_in: int, l_out: int) -> ModelSpec:
    model = scenario_raw["paper_model"]
    return ModelSpec(
        num_blocks=model["num_blocks"],
        block_bytes=model["block_bytes"],
        cache_bytes=cache_bytes_per_block(model["kv_dim"], l_in + l_out, model["dtype_bytes"]),
        hidden_size=model["hidden_size"],
        kv_dim=model["kv_dim"],
        dtype_bytes=model["dtype_bytes"],
    )


def server_plans(scenario: Scenario, raw: dict, scale: float, tiny: TinyCosts) -> list[ServerPlan]:
    kinds = raw["server_kinds"]
    plans = []
    for proc in scenario.processes_of("server"):
        kind = kinds[proc.options["kind"]]
        tau = kind["tau_ms"] / 1e3
        plans.append(
            ServerPlan(
                name=proc.name,
                site=proc.site,
                kind=proc.options["kind"],
                memory_paper=kind["memory_gib"] * GIB,
                tau_paper=tau,
                compute_delay=round(max(tau * scale - tiny.tau_cpu, 0.0), 6),
            )
        )
    return plans
