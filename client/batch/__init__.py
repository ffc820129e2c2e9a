"""`swarm-batch`: offline batch generation packed onto the swarm's disjoint chains (Pang et al.'s offline
half): `records` (the prompts file and result lines), `results` (the resumable results file),
`chains` and `plan` (pure: chains, speeds, makespan planning and its lower bound), `queues` (the lanes'
queues and work stealing), `discover`, `pinned`, `probe` and `execute` (talking to the swarm), `report`
and `cli` (the command)."""
