"""Rollout replicas: policies served by vLLM (or the embedded engine, `torch-replica`) through
verl's rollout machinery, with weights synced from the learner after each update.

`config.py` and `engine.py` are torch-free; `fleet.py` (Ray, verl), `torch_replica.py` and
`gloo_sync.py` (torch) are imported where a run uses them.
"""
