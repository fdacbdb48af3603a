#!/usr/bin/env bash
# The main job on the embedded default: train the RAG QA example (query rewriter -> BM25
# retriever tool -> answerer) on the bundled SmolLM2-135M-Instruct on CPU. The answerer is the
# trained policy, the rewriter stays the base model. The 52 held-out questions are answered
# greedily before training and every 10 steps; at the end their exact match and F1 (mean,
# standard deviation, standard error) are printed before -> after, and plotted.
# About 18 minutes on 2 cores. Writes runs/demo/ (metrics.jsonl, trajectories/, checkpoint/,
# rewards.png, heldout_em_f1.png, heldout_scores.json). Extra arguments are config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RAG=examples/langgraph_apps/rag_qa
rm -rf runs/demo
start=$(date +%s)
.venv/bin/mas-trainer fit "$RAG/app.py:graph_answerer" \
  --data "$RAG/train.jsonl" --val-data "$RAG/heldout.jsonl" --model default --output runs/demo \
  steps=55 rollout.tasks_per_step=8 rollout.n=4 rollout.val_temperature=0 eval_every=10 save_every=10 \
  learner.lr=2e-5 learner.mini_batch_size=16 runtime.backend=local runtime.max_batch_size=32 "$@"
echo "fit wall time: $(( $(date +%s) - start )) s"
exec .venv/bin/python "$RAG/report.py" runs/demo --json runs/demo/heldout_scores.json
