"""Scenarios: servers (memory, tau, tau_prefill) and client RTTs (Sun et al., section 4.1; Sun, He and
Hou, section 4.1).

- `clustered`: Sun et al., Table 2. Cluster 0 holds only clients, cluster 1 two A100 servers, cluster 2
  seven MIG servers; RTT 5 ms / 1 Gbit/s inside a cluster, 100 ms / 100 Mbit/s between clusters.
- `topology_zoo`: Sun et al., Table 3. C servers on random nodes of a Topology Zoo graph, a fraction
  eta of them A100s; the client sits on a random node without a server; RTT = 2 x shortest-path
  delay, links of 1 Gbit/s.
- `ripe_atlas`: Sun, He and Hou, section 4. RTTs between an orchestrator (one of the RIPE Atlas
  measurement origins) and servers placed on random EU anchors; 3 x MIG 3g.40gb + 6 x 2g.20gb.

Per-token round trip (docs/reference.md 2, `t_cj`): ping RTT + per-message overhead + the transfer of
one hidden state each way; the prefill round trip (`t_prefill_cj`) sends `l_in` of them. PETALS' router uses
the raw ping RTT (docs/reference.md 3.3), which every scenario keeps in `ping_rtt`.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec
from llm_swarm.scheduler.sim import profiles
from llm_swarm.scheduler.sim.data_dir import DATA_DIR
from llm_swarm.scheduler.sim.prefill import PrefillModel, affine_prefill
from llm_swarm.scheduler.sim.profiles import GpuProfile, ModelProfile
from llm_swarm.scheduler.sim.topology import load_graph, rtt_matrix

TOPOLOGY_FILES = {"abovenet": "Abvt.graph", "bellcanada": "Bellcanada.graph", "gtsce": "GtsCe.graph"}
# Table 5 deployments: AboveNet the 9-GPU one (2 A100 + 7 MIG), the larger graphs the 26-GPU one.
TABLE5_SERVERS = {"abovenet": (9, 2 / 9), "bellcanada": (26, 5 / 26), "gtsce": (26, 5 / 26)}
TOPOLOGY_NODES = {"abovenet": 23, "bellcanada": 48, "gtsce": 149}  # Table 3
CLIENT = "client"
TOPOLOGY_LINK_BPS = 1e9  # Sun et al., Table 3: every link 1 Gbit/s


@dataclass(frozen=True)
class Scenario:
    """Everything the policies and the engine need about a deployment.

    `servers[j].rtt[CLIENT]` / `.rtt_prefill[CLIENT]` are `t_cj` / `t_prefill_cj(l_in)`;
    `ping_rtt[j]` is the raw RTT PETALS' router sees; `prefill` gives both prefill terms at any
    input length (the servers' values are its lines at the nominal `l_in`).
    `roles` (prefill / decode / both per server; None: all both) and `server_links[a][b]` (the link
    between servers a and b) matter only to the contended model's hand-offs (`scheduler.sim.contended_roles`).
    """

    name: str
    model: ModelSpec
    servers: tuple[ServerSpec, ...]
    ping_rtt: tuple[float, ...]
    gpu_names: tuple[str, ...]
    l_in: int
    l_out: int
    prefill: PrefillModel
    roles: tuple[str, ...] | None = None
    server_links: tuple[tuple[Link, ...], ...] | None = None


@dataclass(frozen=True)
class Link:
    """A client <-> server path: ping RTT in seconds, bottleneck bandwidth in bit/s (inf: ignore)."""

    rtt: float
    bandwidth_bps: float = math.inf


def build_model_spec(model: ModelProfile, l_in: int, l_out: int) -> ModelSpec:
    return ModelSpec(
        num_blocks=model.num_blocks,
        block_bytes=model.block_bytes,
        cache_bytes=model.cache_bytes(l_in, l_out),
        hidden_size=model.hidden_size,
        kv_dim=model.kv_dim,
        dtype_bytes=model.dtype_bytes,
    )


def build_scenario(
    name: str,
    model: ModelProfile,
    gpus: Sequence[GpuProfile],
    links: Sequence[Link],
    l_in: int,
    l_out: int,
) -> Scenario:
    """Servers with the per-token and prefill round trips of docs/reference.md 2 to the (single) client."""
    if l_in < 1 or l_out < 1:
        raise ValueError(f"l_in and l_out must be >= 1, got {l_in}, {l_out}")
    message_bits = 8 * model.embedding_bytes()
    servers = []
    tau_lines, rtt_lines = [], []
    for j, (gpu, link) in enumerate(zip(gpus, links, strict=True)):
        base = link.rtt + profiles.MESSAGE_OVERHEAD_S
        token_rtt = base + 2 * message_bits / link.bandwidth_bps
        # the prefill round trip sends l_in hidden states; its transfer is the per-token slope
        slope = 2 * message_bits / link.bandwidth_bps
        rtt_lines.append((base, slope))
        tau_lines.append((gpu.prefill_base, gpu.prefill_per_token))
        prefill_rtt = base + slope * l_in
        servers.append(
            ServerSpec(
                name=f"s{j}-{gpu.name}",
                memory_bytes=gpu.memory_bytes,
                tau=gpu.tau,
                tau_prefill=gpu.tau_prefill(l_in),
                rtt={CLIENT: token_rtt},
                rtt_prefill={CLIENT: prefill_rtt},
            )
        )
    return Scenario(
        name,
        build_model_spec(model, l_in, l_out),
        tuple(servers),
        tuple(link.rtt for link in links),
        tuple(gpu.name for gpu in gpus),
        l_in,
        l_out,
        affine_prefill(tau_lines, rtt_lines),
    )


# -- Sun et al., clustered (Table 2) ----------------------------------------------------------------

INTRA_CLUSTER = Link(0.005, 1e9)
INTER_CLUSTER = Link(0.100, 100e6)


def clustered(client_cluster: int, l_in: int, l_out: int) -> Scenario:
    """Table 2: 2 A100s in cluster 1, 7 MIGs in cluster 2, the client in `client_cluster` (0, 1 or 2)."""
    if client_cluster not in (0, 1, 2):
        raise ValueError(f"client cluster must be 0, 1 or 2, got {client_cluster}")
    server_clusters = [1, 1] + [2] * 7
    gpus = [profiles.A100] * 2 + [profiles.MIG_1G] * 7
    links = [INTRA_CLUSTER if c == client_cluster else INTER_CLUSTER for c in server_clusters]
    return build_scenario(f"clustered-c{client_cluster}", profiles.BLOOM_176B, gpus, links, l_in, l_out)


# -- Sun et al., scattered (Topology Zoo graphs, Table 3) -----------------------------------------------


def topology_rtts(topology: str, data_dir: Path = DATA_DIR) -> np.ndarray:
    if topology not in TOPOLOGY_FILES:
        raise ValueError(f"unknown topology {topology!r}; choose from {sorted(TOPOLOGY_FILES)}")
    return rtt_matrix(load_graph(data_dir / "topologies" / TOPOLOGY_FILES[topology]))


def topology_zoo(
    topology: str,
    rtts: np.ndarray,
    rng: np.random.Generator,
    num_servers: int | None,
    fast_fraction: float | None,
    l_in: int,
    l_out: int,
) -> Scenario:
    """C servers on random nodes (distinct while C <= #nodes), round(eta*C) of them A100s, rest MIGs."""
    default_servers, default_eta = TABLE5_SERVERS[topology]
    count = default_servers if num_servers is None else num_servers
    eta = default_eta if fast_fraction is None else fast_fraction
    if count < 1 or not 0 <= eta <= 1:
        raise ValueError(f"need >= 1 server and 0 <= eta <= 1, got {count}, {eta}")
    nodes = len(rtts)
    server_nodes = rng.choice(nodes, size=count, replace=count > nodes)
    free_nodes = np.setdiff1d(np.arange(nodes), server_nodes)
    client_node = int(rng.choice(free_nodes if len(free_nodes) else np.arange(nodes)))
    fast = set(rng.choice(count, size=round(eta * count), replace=False).tolist())
    gpus = [profiles.A100 if j in fast else profiles.MIG_1G for j in range(count)]
    links = [Link(float(rtts[client_node, node]), TOPOLOGY_LINK_BPS) for node in server_nodes]
    return build_scenario(topology, profiles.BLOOM_176B, gpus, links, l_in, l_out)


# -- Sun, He and Hou, RIPE Atlas (Table 1) ----------------------------------------------------------------

RIPE_ORIGINS = ("latency_m1", "latency_m2", "latency_m3", "latency_m4")
RIPE_GPUS = (profiles.MIG_3G,) * 3 + (profiles.MIG_2G,) * 6


def ripe_latencies(path: Path = DATA_DIR / "ripe_atlas_eu_rtt.csv") -> np.ndarray:
    """RTTs (seconds) from the 4 measurement origins (columns) to every EU anchor (rows)."""
    rows = []
    with path.open(newline="") as handle:
        for record in csv.DictReader(handle):
            try:
                values = [float(record[column]) * 1e-3 for column in RIPE_ORIGINS]
            except (KeyError, ValueError):
                continue  # readers skip malformed rows
            if all(math.isfinite(v) and v > 0 for v in values):
                rows.append(values)
    if not rows:
        raise ValueError(f"no usable RTT rows in {path}")
    return np.array(rows)


def ripe_atlas(latencies: np.ndarray, rng: np.random.Generator, l_in: int, l_out: int) -> Scenario:
    """Sun, He and Hou, Table 1 deployment: the orchestrator at a random origin, servers on random anchors."""
    origin = int(rng.integers(latencies.shape[1]))
    anchors = rng.choice(len(latencies), size=len(RIPE_GPUS), replace=False)
    links = [Link(float(latencies[a, origin])) for a in anchors]
    return build_scenario("ripe", profiles.LLAMA_2_7B, RIPE_GPUS, links, l_in, l_out)


def scale_compute(scenario: Scenario, factor: float) -> Scenario:
    """Every per-block time (decode `tau`, prefill) times `factor`; network terms unchanged.

    A sensitivity knob: Sun, He and Hou measures ~7 s mean service on its testbed (Table 1) where its
    footnote 11 profile predicts ~2 s, so runtime overheads the model omits are per-block compute.
    """
    if factor <= 0:
        raise ValueError(f"compute scale must be positive, got {factor}")
    if factor == 1:
        return scenario
    servers = tuple(
        dataclasses.replace(s, tau=s.tau * factor, tau_prefill=s.tau_prefill * factor)
        for s in scenario.servers
    )
    prefill = dataclasses.replace(
        scenario.prefill,
        tau_base=tuple(b * factor for b in scenario.prefill.tau_base),
        tau_per_token=tuple(p * factor for p in scenario.prefill.tau_per_token),
    )
    return dataclasses.replace(scenario, servers=servers, prefill=prefill)
