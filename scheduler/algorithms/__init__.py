"""Pure placement and routing algorithms (docs/reference.md section 3): no I/O, only numbers in and
decisions out.

- `problem`: servers, model, spans; `feasibility`: Lemma 3.1; `routing_graph`: feasible links and
  the shortest chain under any link cost; `windows`: block-window choice rules.
- `cgbp` (CG-BP, docs/reference.md 3.1), `wsrr` (WS-RR, 3.2), `petals` (the PETALS baseline, 3.3).
- `chains` (GBP-CR, GCA), `jffc` (JFFC), `queueing` (Theorem 3.7), `tuning` (c tuning), docs/reference.md 3.4.
"""

from llm_swarm.scheduler.algorithms.cgbp import CgBpResult, cg_bp, choose_num_requests, max_requests
from llm_swarm.scheduler.algorithms.chains import GbpCrPlacement, ServerChain, gbp_cr, gca
from llm_swarm.scheduler.algorithms.jffc import JffcDispatcher
from llm_swarm.scheduler.algorithms.problem import ModelSpec, Placement, ServerSpec, Span
from llm_swarm.scheduler.algorithms.queueing import response_time_bounds
from llm_swarm.scheduler.algorithms.routing_graph import Chain, ChainHop, RoutingGraph
from llm_swarm.scheduler.algorithms.tuning import Composition, compose, tune_capacity
from llm_swarm.scheduler.algorithms.wsrr import RoutingState, WsRrRoute

__all__ = [
    "CgBpResult",
    "Chain",
    "ChainHop",
    "Composition",
    "GbpCrPlacement",
    "JffcDispatcher",
    "ModelSpec",
    "Placement",
    "RoutingGraph",
    "RoutingState",
    "ServerChain",
    "ServerSpec",
    "Span",
    "WsRrRoute",
    "cg_bp",
    "choose_num_requests",
    "compose",
    "gbp_cr",
    "gca",
    "max_requests",
    "response_time_bounds",
    "tune_capacity",
]
