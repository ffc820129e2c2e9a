"""Geo-distributed swarm emulation on one machine: network namespaces, per-pair delay and rate.

Import with `scripts/` on `sys.path` (`import netem`), or run `python scripts/netem --help`.
See README.md beside this file.
"""
