"""The server: loads a span of blocks and serves them to clients over the swarm's DHT."""

import llm_swarm.swarm  # noqa: F401  (sets gRPC's fork option before the scheduler link imports grpc)
