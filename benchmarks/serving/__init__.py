"""Benchmarks of a session's path through real servers, on loopback or on emulated links."""
