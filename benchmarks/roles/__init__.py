"""Prefill and decode roles on the emulated network: the run, its simulation and its report."""
