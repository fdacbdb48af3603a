"""One policy's worker group: its contract (`contract.py`), the step written once (`step.py`),
the turns it keeps (`turns.py`), and its hosts: `local.py` (the torch learner in one process)
and `verl_rank.py` (verl's ranks, with their weight sinks)."""
