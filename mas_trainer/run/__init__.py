"""The run directory (`rundir.py`: one layout, one atomic rename per checkpoint), its
trackers (`tracking.py`), the progress display (`progress.py`), and checkpoint files vetted
before a library unpickles them (`untrusted.py`)."""
