"""Benchmarks of llm-swarm, each a module run from the repository's root with its `--help`:

- `benchmarks.serving`: a session's path through real servers on loopback or emulated links
  (latency, batching, speculation, verification, failover, hand-offs, the API, training, scale);
- `benchmarks.families`: model families' blocks and caches (cache bytes at real shapes, a mixture
  of experts against a dense block, hardware and quantization, a decode step's profile);
- `benchmarks.scheduling`: placement, routing and planning against the simulator and traces;
- `benchmarks.roles`: prefill and decode roles on the emulated network;
- `benchmarks.table2`: Sun et al.'s Table 2 on the emulated network;
- `benchmarks.netem`: the emulator those runs use (docs/netem.md).

`--write` puts a benchmark's table into BENCHMARKS.md under its section, after the command that
reruns it (`benchmarks.common`, `benchmarks.markdown`).
"""
