#!/usr/bin/env bash
# The main job on the embedded default: train an example multi-agent app (planner ->
# Send-fanned workers -> reducer; 3 roles on 2 policies) on the bundled SmolLM2-135M-Instruct
# on CPU, with a held-out task evaluated before and after. Writes runs/demo/ (metrics,
# trajectories, checkpoints, rewards.png). A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rm -rf runs/demo
exec .venv/bin/mas-trainer fit examples/langgraph_apps/map_reduce.py:graph \
  --data examples/langgraph_apps/data/map_reduce.jsonl --model default --output runs/demo \
  steps=3 rollout.tasks_per_step=2 rollout.n=2 val_fraction=0.25 eval_every=3 save_every=3 \
  learner.lr=1e-5 "$@"
