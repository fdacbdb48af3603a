#!/usr/bin/env bash
# The test command: set up .venv, the static checks (ruff: pyflakes + bugbear over the whole
# repository; mypy over the package, as pyproject.toml names it), then the whole suite (tiny
# model, fake upstreams, and one end-to-end test on the bundled SmolLM2 model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check --output-format concise .
.venv/bin/mypy
# the slowest tests are listed at the end: what to look at first when the suite outgrows CI's budget
exec .venv/bin/python -m pytest -q --durations=25 "$@"
