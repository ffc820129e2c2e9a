"""CPU-only discrete-event simulator of a swarm (docs/reference.md 1).

Modules, one job each:

- `profiles`: profiled GPU and model constants (Sun et al., section 4.1, Sun, He and Hou, section 4).
- `topology`: Repetita `.graph` parsing and shortest-path RTT matrices (Sun et al., Table 3).
- `scenarios`: servers, clients and RTTs of a named scenario (clustered / Topology Zoo / RIPE Atlas).
- `workload`: request arrivals (Poisson or Azure trace replay).
- `prefill`: per-request prefill terms of eq. 1, so replayed requests pay for their own `l_in`.
- `policies`: placement + routing policies composed from `scheduler.algorithms` (no second copy).
- `engine`: the event loop: admission, cache slots per eq. 2, waiting, completion.
- `contended` (with `server_costs`, `host_cpu`, `roles`, `hetero`,
  `contended_run`, `roles_goodput`): `--contended`, the servers' own iteration loops, prefill/decode
  roles and cache hand-offs (docs/simulator.md, "Contended servers").
- `metrics`: the per-run summary of docs/reference.md 6, SLO attainment and goodput on probed rates.
- `goodput`: the rate search behind `swarm-sim --goodput`.
- `goodput_plan` (with `plan_runs`, `planning_swarm`): `swarm-plan goodput`, the policy and parameter
  with the highest simulated goodput under SLOs, and how many servers a higher rate needs.
- `runner`: one cell averaged over Monte Carlo seeds; `sweeps`/`plots`: figure sweeps.

Pure simulation code never prints nor touches files; I/O lives in `sweeps.write_*`, `plots`,
`scheduler.sim.cli` and `benchmarks/scheduling/paper_tables.py`.
"""
