"""Benchmarks of model families' blocks and caches."""
