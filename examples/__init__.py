"""Examples beyond the README, each run from the repository's root as `python -m examples.NAME`."""
