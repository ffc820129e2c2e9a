"""The scheduler: placement and routing algorithms, the simulator, and the scheduler service."""

import swarm  # noqa: F401  (sets gRPC's fork option before any scheduler module imports grpc)
