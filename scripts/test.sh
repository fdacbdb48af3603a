#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite (tiny model, fake upstreams,
# and one end-to-end test on the bundled SmolLM2 model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
