"""Geo-distributed swarm emulation on one machine: network namespaces, per-pair delay and rate.

Run `python -m benchmarks.netem --help` from the repository's root; docs/netem.md says how to use it.
"""
