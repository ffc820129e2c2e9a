"""`swarm-plan`: placement, routing and goodput plans for a problem file, without a swarm."""
