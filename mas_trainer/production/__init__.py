"""The production loop: served runs recorded with their feedback (`record.py`,
`client.py`), traces imported from other instrumentations (`otel_import.py`) and scored where
they lie (`scoring.py`, the `feedback` verb), datasets built from them (`curate.py`, the `data`
verb), the supervised warm start (`warm_start.py`) and `export`."""
