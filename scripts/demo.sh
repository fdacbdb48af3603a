#!/usr/bin/env bash
# The main job on the embedded default: train the RAG QA example (query rewriter -> BM25
# retriever tool -> answerer) on the bundled SmolLM2-135M-Instruct on CPU. The answerer is the
# trained policy, the rewriter stays the base model. Training rollouts sample at temperature
# 0.7; groups whose samples all scored the same are left out and more tasks drawn while fewer
# than 4 of 8 have spread (rollout.filter_groups, rollout.min_groups). The 52 held-out questions
# are answered greedily before training and every 5 steps; the run stops once it has learned:
# held-out F1 0.98 reached, or 3 evaluations (15 steps) without a gain of 0.01 (best.*; the best
# evaluation's weights are kept in runs/demo/best/ and served, exported and evaluated by default).
# At the end their exact match and F1 (mean, standard deviation, standard error) are printed
# before -> after, and plotted. About 20-29 minutes on 2 cores (at most 40 steps). Writes runs/demo/ (metrics.jsonl, trajectories/, checkpoint/,
# rewards.png, heldout_em_f1.png, heldout_scores.json). Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RAG=examples/langgraph_apps/rag_qa
rm -rf runs/demo
start=$(date +%s)
.venv/bin/mas-trainer fit "$RAG/app.py:graph_answerer" \
  --data "$RAG/train.jsonl" --val-data "$RAG/heldout.jsonl" --model default --output runs/demo \
  steps=40 rollout.tasks_per_step=8 rollout.n=4 rollout.temperature=0.7 rollout.val_temperature=0 \
  rollout.filter_groups=true rollout.min_groups=4 eval_every=5 save_every=10 learner.lr=2e-5 learner.mini_batch_size=16 \
  learner.share_prompts=true learner.skip_zero_advantage=true runtime.execution=local runtime.max_batch_size=32 \
  best.target=0.98 best.patience=3 best.min_delta=0.01 "$@"
echo "fit wall time: $(( $(date +%s) - start )) s"
exec .venv/bin/python "$RAG/report.py" runs/demo --json runs/demo/heldout_scores.json
