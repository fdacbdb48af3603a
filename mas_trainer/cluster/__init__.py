"""Where the worker groups run: Ray started or joined (`ray_init.py`), the run plan
(`plan.py`), the Ray proxies of worker groups (`groups.py`), their start by learner kind and
the replicas in front of them (`workers.py`), and the watchdog (`watchdog.py`)."""
