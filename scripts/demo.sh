#!/usr/bin/env bash
# The main job on the embedded default: trace an example multi-agent app on the bundled
# SmolLM2-135M-Instruct (CPU), write trajectories and print the node / LLM call tree.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mas-trainer trace examples/langgraph_apps/map_reduce.py:graph \
  --data examples/langgraph_apps/data/map_reduce.jsonl --model default \
  --output runs/demo/trajectories.jsonl "$@"
