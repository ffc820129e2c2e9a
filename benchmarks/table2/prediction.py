"""The simulator's prediction for one emulated run: the same spans, cache slots, announced times,
measured round trips and arrivals, through `scheduler.sim`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from llm_swarm.scheduler.algorithms.chains import gca, request_times
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.scheduler.algorithms.wsrr import RoutingState
from llm_swarm.scheduler.sim import workload
from llm_swarm.scheduler.sim.discrete_events import CLIENT, RetryAt, Service, simulate
from llm_swarm.scheduler.sim.metrics import Slo, per_request, summarize
from llm_swarm.scheduler.sim.policies import JffcRouting, PetalsRouting, WsRrRouting

from .inputs import ServerPlan

BATCH_WAIT_S = 0.002  # the servers' default --batch-wait-ms: a decode step may wait this long to batch


class ScaledPetalsRouting(PetalsRouting):
    """PETALS' client with the experiment's time scale applied to its backoff."""

    def __init__(self, *args, scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def on_arrival(self, request, now, attempt, free_slots):
        decision = super().on_arrival(request, now, attempt, free_slots)
        if isinstance(decision, RetryAt) and self.scale != 1.0:
            return RetryAt(now + (decision.time - now) * self.scale)
        return decision


def predict(
    policy: str,
    plans: list[ServerPlan],
    spans: list[Span | None],
    slots: list[int],
    online: dict,
    model: ModelSpec,
    requests: list[workload.Request],
    l_in: int,
    l_out: int,
    scale: float,
    setup: float,
    service_for: Callable[[list[ServerSpec]], Service] | None = None,
    slo: Slo | None = None,
    keep_requests: bool = False,
) -> dict:
    """The simulator on this very swarm: spans and cache slots as emulated, tau/tau_prefill as the
    servers announced them, t_cj = the client's measured info-RPC round trip + the batching wait,
    a per-session set-up of `setup` seconds (the idle probe), PETALS' backoff x the time scale;
    `chains`: GCA's chains on the emulated spans (times as the live scheduler computes them), JFFC.

    `service_for(servers)`: serve the sessions through that service (the contended model,
    `benchmarks/scheduling/sim_contended.py`), which runs the batching window itself: t_cj is then the
    round trip alone. `slo`: the summary also holds `slo_attainment` (fraction of requests
    within both targets). `keep_requests`: also each request's TTFT and TPOT under `per_request`
    (lists by request id), for attainment at other targets."""
    batch_wait = BATCH_WAIT_S if service_for is None else 0.0
    servers = []
    for plan in plans:
        info = online.get(plan.name)
        if info is None:  # not started (no blocks): never on a route
            servers.append(
                ServerSpec(
                    plan.name,
                    plan.memory_paper,
                    tau=1.0,
                    tau_prefill=1.0,
                    rtt={CLIENT: 1.0},
                    rtt_prefill={CLIENT: 1.0},
                )
            )
            continue
        rtt = info["rtt_info_s"] + batch_wait
        tau_prefill = (
            info["tau_prefill"] * l_in / info["prefill_tokens"] if info["prefill_tokens"] else info["tau"]
        )
        tau_c, tau_p = request_times(rtt, rtt, tau_prefill, info["tau"], l_out)
        servers.append(
            ServerSpec(
                plan.name,
                plan.memory_paper,
                tau=info["tau"],
                tau_prefill=tau_prefill,
                rtt={CLIENT: rtt},
                rtt_prefill={CLIENT: rtt},
                tau_c=tau_c,
                tau_p=tau_p,
            )
        )
    if policy == "petals":  # PETALS' router, fed the same measured round trips as the scheduler's
        dispatcher = ScaledPetalsRouting(servers, model, spans, slots, setup, scale=scale)
    elif policy == "chains":
        dispatcher = JffcRouting(gca(servers, model, spans), spans, setup)
    else:
        dispatcher = WsRrRouting(RoutingState(servers, model, spans), spans, setup)
    service = service_for(servers) if service_for is not None else None
    result = simulate(servers, model, dispatcher, requests, service=service)
    summary = summarize(result.records, slo)
    summary["hops_mean"] = float(np.mean([r.num_hops for r in result.records]))
    if keep_requests:
        ordered = sorted(result.records, key=lambda r: r.id)
        values = per_request(ordered)
        summary["per_request"] = {
            "id": [r.id for r in ordered],
            "ttft": [float(v) for v in values["ttft"]],
            "tpot": [float(v) for v in values["tpot"]],
        }
    return summary
