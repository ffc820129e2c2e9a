"""A server of the swarm as the simulator's one client sees it."""

from __future__ import annotations

from llm_swarm.scheduler.algorithms.problem import ServerSpec
from llm_swarm.scheduler.sim.scenarios import CLIENT


def seen_by_client(server: ServerSpec, rtt: float, rtt_prefill: float) -> ServerSpec:
    """`server`'s memory and timings with `rtt` and `rtt_prefill` as its round trips to `CLIENT`.

    The other fields (`tau_c`, `tau_p`, `tau_per_session`, other clients' round trips) stay unset:
    the simulated swarm is built from the name, the memory and these timings alone."""
    return ServerSpec(
        name=server.name,
        memory_bytes=server.memory_bytes,
        tau=server.tau,
        tau_prefill=server.tau_prefill,
        rtt={CLIENT: rtt},
        rtt_prefill={CLIENT: rtt_prefill},
    )
