"""What the scheduler knows about the swarm, turned into the algorithms' inputs (pure, no I/O).

Servers are known from their DHT records (`ServerInfo`); clients' round trips from their routing
queries. This module maps both to `ModelSpec`/`ServerSpec` (docs/reference.md sections 2-3) and to the
`swarm-plan` problem document, so a placement the service computes can be reproduced exactly with
`swarm-plan place` from the document it publishes.

Choices made here (the cost model does not fix them):
- `s_m` is the largest `block_bytes` servers announce (all serve the same model; the largest
  is the safe one when dtypes differ), `s_c = cache_token_bytes * (l_in + l_out)` per block of
  full attention; a block of sliding attention keeps only its ring (`swarm.cost.ring_capacity`), so
  `s_c` is the mean over the model's blocks (the cost model takes one `s_c` for every block).
- A client that has not measured some server (it may not have existed when the client asked) is
  assumed to see it at the median of its other round trips; with no client known at all, a
  virtual client `"any"` with zero round trips stands in, so eq. 14 and eq. 17 reduce to compute.
- `tau_prefill` is announced for the server's own `prefill_tokens`; it is scaled linearly to
  the scheduler's `l_in`, and `t_prefill_cj` is taken equal to `t_cj` (hidden states of a short
  prompt are small next to a round trip).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llm_swarm.scheduler.algorithms.placing import PlanProblem
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.swarm.cost import cached_positions
from llm_swarm.swarm.models.family import family_for
from llm_swarm.swarm.server_info import ServerInfo, ServerRole, ServerState

VIRTUAL_CLIENT = "any"


@dataclass(frozen=True)
class ModelShape:
    """What the scheduler knows of the model without loading it (from its config)."""

    num_blocks: int
    hidden_size: int
    kv_dim: int
    # each block's sliding attention window (None: full attention); empty: every block attends fully
    block_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (`swarm.models.checkpoint.load_config`)."""
        family = family_for(config)
        num_blocks = family.num_blocks(config)
        return cls(
            num_blocks=num_blocks,
            hidden_size=family.hidden_size(config),
            kv_dim=family.kv_dim(config),
            block_windows=tuple(family.layer_window(config, index) for index in range(num_blocks)),
        )

    def cache_tokens_per_block(self, num_tokens: int) -> int:
        """Positions one block keeps, on average over the model's blocks, for a session of
        `num_tokens` positions (rounded up)."""
        kept = cached_positions(self.block_windows, 0, self.num_blocks, num_tokens)
        return -(-kept // self.num_blocks)


@dataclass
class ClientRtts:
    """One client's latest reported round trips (seconds) by server peer id."""

    rtts: dict[str, float]
    reported_at: float


@dataclass
class SwarmView:
    """Servers by peer id (their latest DHT records) and clients' reported round trips."""

    shape: ModelShape
    l_in: int
    l_out: int
    records: dict[str, ServerInfo] = field(default_factory=dict)
    clients: dict[str, ClientRtts] = field(default_factory=dict)

    # --- who is who -------------------------------------------------------------------------------
    def placeable(self) -> list[str]:
        """Managed servers the scheduler places: measured, not leaving, in peer id order (stable)."""
        return sorted(
            peer
            for peer, info in self.records.items()
            if info.managed and info.state != ServerState.OFFLINE and _measured(info)
        )

    def live(self) -> list[str]:
        """Servers that serve blocks now (what routes go through), in peer id order."""
        return sorted(
            peer
            for peer, info in self.records.items()
            if info.routable and info.has_blocks and _measured(info)
        )

    def live_spans(self, peers: Sequence[str]) -> list[Span | None]:
        spans = []
        for peer in peers:
            info = self.records.get(peer)
            spans.append(Span(info.start, info.end) if info is not None and info.has_blocks else None)
        return spans

    # --- clients ----------------------------------------------------------------------------------
    def report_rtts(self, client_id: str, rtts: Mapping[str, float], now: float) -> None:
        usable = {peer: rtt for peer, rtt in rtts.items() if math.isfinite(rtt) and rtt >= 0}
        self.clients[client_id] = ClientRtts(usable, now)

    def forget_clients(self, older_than: float) -> None:
        for client_id in [c for c, report in self.clients.items() if report.reported_at < older_than]:
            del self.clients[client_id]

    def client_rtt(self, client_id: str, peer: str) -> float:
        """A client's round trip to a server: measured, else its median (module docstring)."""
        report = self.clients[client_id]
        if peer in report.rtts:
            return report.rtts[peer]
        return statistics.median(report.rtts.values()) if report.rtts else 0.0

    # --- the algorithms' inputs -------------------------------------------------------------------
    def model_spec(self) -> ModelSpec | None:
        """`L`, `s_m`, `s_c` from the announcements; None until some server announced its sizes."""
        sizes = [(info.block_bytes, info.cache_token_bytes) for info in self.records.values()]
        block_bytes = max((size[0] for size in sizes), default=0)
        token_bytes = max((size[1] for size in sizes), default=0)
        if block_bytes <= 0 or token_bytes <= 0:
            return None
        return ModelSpec(
            num_blocks=self.shape.num_blocks,
            block_bytes=block_bytes,
            cache_bytes=token_bytes * self.shape.cache_tokens_per_block(self.l_in + self.l_out),
            hidden_size=self.shape.hidden_size,
            kv_dim=self.shape.kv_dim,
            dtype_bytes=max(token_bytes // (2 * self.shape.kv_dim), 1),
        )

    def server_specs(self, peers: Sequence[str]) -> list[ServerSpec]:
        """Specs of `peers` with every known client's round trips (the virtual client if none)."""
        clients = sorted(self.clients)
        specs = []
        for peer in peers:
            info = self.records[peer]
            rtt = {client: self.client_rtt(client, peer) for client in clients} or {VIRTUAL_CLIENT: 0.0}
            tau_prefill = prefill_time(info, self.l_in)
            # Sun, He and Hou's per-request times for GBP-CR: the farthest client's traffic, compute per block
            worst = max(rtt.values())
            specs.append(
                ServerSpec(
                    name=peer,
                    memory_bytes=float(info.memory_bytes),
                    tau=info.tau,
                    tau_prefill=tau_prefill,
                    tau_per_session=info.tau_per_session,
                    rtt=rtt,
                    rtt_prefill=dict(rtt),
                    tau_c=worst * self.l_out,
                    tau_p=tau_prefill + (self.l_out - 1) * info.tau,
                )
            )
        return specs

    def routing_specs(self, peers: Sequence[str]) -> list[ServerSpec]:
        """`server_specs` as WS-RR should see them: a server's prefill is where its sessions' prompts
        run. Where a `--role prefill` server holds a server's whole span and prefills faster, the
        prompt goes there (`prefill_routing`), so the server's own prefill time says nothing about
        the session: routed by it, every long prompt went to the decode server that measured its own
        (unused) prefill 2% faster, 23 of 30 sessions to one of two alike decode servers (netem,
        BENCHMARKS.md "Prefill/decode roles on the emulated swarm"). The hand-off's transfer is left
        to the per-session plan: it depends on the prompt and on links that change at every probe."""
        specs = self.server_specs(peers)
        prefill = [
            info
            for info in self.records.values()
            if info.routable and info.has_blocks and info.role == ServerRole.PREFILL and _measured(info)
        ]
        if not prefill:
            return specs
        routed = []
        for spec in specs:
            info = self.records[spec.name]
            faster = [
                prefill_time(other, self.l_in)
                for other in prefill
                if other.start <= info.start and info.end <= other.end
            ]
            if spec.tau_prefill is not None and faster and min(faster) < spec.tau_prefill:
                tau_prefill = min(faster)
                spec = dataclasses.replace(
                    spec, tau_prefill=tau_prefill, tau_p=tau_prefill + (self.l_out - 1) * (info.tau or 0.0)
                )
            routed.append(spec)
        return routed

    def plan_problem(
        self,
        peers: Sequence[str],
        num_requests: int | None = None,
        capacity: int | str | None = None,
        arrival_rate: float | None = None,
    ) -> PlanProblem:
        """Placing `peers` as the algorithms see it: the announced model and server specs, this
        swarm's `l_out`, and the policy's parameters (R for CG-BP; c and lambda for GBP-CR)."""
        model = self.model_spec()
        if model is None:
            raise ValueError("no server has announced its block and cache sizes yet")
        return PlanProblem(
            model,
            tuple(self.server_specs(peers)),
            num_requests=num_requests,
            arrival_rate=arrival_rate,
            l_out=self.l_out,
            capacity=capacity,
        )

    def used_units(self, peer: str, model: ModelSpec) -> float:
        """Cache slots (units of `s_c`, a fraction) the server says are in use, from its free cache
        bytes."""
        info = self.records.get(peer)
        if info is None or not info.has_blocks:
            return 0.0
        total = info.memory_bytes - model.block_bytes * info.num_blocks
        return max((total - info.cache_bytes_left) / model.cache_bytes, 0.0)


def prefill_time(info: ServerInfo, l_in: int) -> float:
    """Per-block prefill time for `l_in` tokens, scaled from the announced measurement."""
    if info.tau_prefill is None or info.prefill_tokens <= 0:
        return (info.tau or 0.0) * l_in
    return info.tau_prefill * l_in / info.prefill_tokens


def _measured(info: ServerInfo) -> bool:
    return info.tau is not None and info.block_bytes > 0 and info.cache_token_bytes > 0
