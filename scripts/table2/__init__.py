"""Sun et al.'s Table 2 on the emulated network (`scripts/experiment.py`): its inputs, the
placement of each policy, the simulator's prediction and the report, one module each."""
