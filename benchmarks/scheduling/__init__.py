"""Benchmarks of placement, routing and planning against the simulator and real traces."""
