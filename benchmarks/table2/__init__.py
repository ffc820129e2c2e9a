"""Sun et al.'s Table 2 on the emulated network (`benchmarks/table2/run.py`): its inputs, the
placement of each policy, the simulator's prediction and the report, one module each."""
