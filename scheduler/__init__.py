"""The scheduler: placement and routing algorithms, the simulator, and the scheduler service."""

import llm_swarm.swarm  # noqa: F401  (sets gRPC's fork option before any scheduler module imports grpc)
