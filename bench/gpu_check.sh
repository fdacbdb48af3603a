#!/usr/bin/env bash
# The prepared GPU check (run it whenever a session is lent the device machine).
#
# The device machine has Python 3.12 with torch (CUDA), transformers, accelerate and peft, but
# no ray, verl or LangGraph, reaches no package index, and takes at most 64 MiB per call. So:
#
#   bash bench/gpu_check.sh prepare      # here: wheels for Python 3.12 + the tokenizer, packed
#                                        # into .gpu-check/part-*.tar (each < 56 MiB); fails on a
#                                        # missing wheel; the packed set: bench/gpu_wheels.py
#   bash bench/gpu_check.sh prove        # here: that set alone imports verl's TrainingWorker
#   then one device `run` per part, carrying ".gpu-check/part-NN.tar" and running
#       bash bench/gpu_check.sh stash .gpu-check/part-NN.tar        # parts 1 .. N-1
#   and for the last part (timeout_s 600)
#       bash bench/gpu_check.sh run .gpu-check/part-NN.tar          # installs, then bench/gpu_check.py
#
# The machine must stay warm between the calls (30 s idle): make them back to back.
# What it measures: bench/gpu_check.py (a few `fit` steps per case: the torch learner, the verl
# learner with GRPO and with GAE, and an NCCL weight sync to an embedded replica on 2+ GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=.gpu-check
STASH=/tmp/mas-gpu-check
case "${1:-}" in
  prepare)
    rm -rf "$WORK" && mkdir -p "$WORK/wheels" "$WORK/tokenizer"
    # everything the project's venv has, less what the device image has and what the check
    # never imports: the one list is bench/gpu_wheels.py (tests/bench/test_gpu_check.py checks it)
    .venv/bin/pip freeze --exclude-editable | .venv/bin/python bench/gpu_wheels.py > "$WORK/requirements.txt"
    # wheels for CPython 3.12 where the index has them; pure-Python sdists built into wheels here
    fetch() {
      .venv/bin/pip download -q --no-deps --dest "$WORK/wheels" --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any "$1" 2>/dev/null \
      || .venv/bin/pip wheel -q --no-deps --wheel-dir "$WORK/wheels" "$1" >/dev/null 2>&1 \
      || { echo "gpu_check prepare: no wheel for $1 (Python 3.12, manylinux x86_64)" >&2; return 1; }
    }
    export -f fetch; export WORK
    # a missing wheel fails the whole step: the device would fail later, far from the cause
    xargs -P 4 -I{} bash -c 'fetch "$@"' _ {} < "$WORK/requirements.txt" \
      || { echo "gpu_check prepare: stopped, see the missing wheels above" >&2; exit 1; }
    # the tokenizer alone (tokenizer_dir() may be the whole converted model's folder)
    .venv/bin/python -c "from transformers import AutoTokenizer; from mas_trainer.engines.models import tokenizer_dir; AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained('$WORK/tokenizer')"
    tar -C "$WORK" -cf "$WORK/all.tar" wheels tokenizer
    split -b 56m -d -a 2 "$WORK/all.tar" "$WORK/part-" && rm "$WORK/all.tar"
    for p in "$WORK"/part-*; do mv "$p" "$p.tar"; done
    grep -qx "/$WORK/" .git/info/exclude 2>/dev/null || echo "/$WORK/" >> .git/info/exclude
    ls -l "$WORK"/part-*.tar
    ;;
  prove)
    # the packed set is enough: a clean venv (no system packages) holding only what the device
    # image brings (torch and the rest of bench/gpu_wheels.py's DEVICE_IMAGE, at this venv's
    # versions) and the packed requirements, all --no-deps, must import verl's TrainingWorker
    # and the fit path. Python 3.11 here (these machines have no 3.12): the same distributions.
    mkdir -p "$WORK" && rm -rf "$WORK/prove" && python3 -m venv "$WORK/prove"
    .venv/bin/pip freeze --exclude-editable > "$WORK/freeze.txt"
    .venv/bin/python bench/gpu_wheels.py --device-side < "$WORK/freeze.txt" > "$WORK/device-side.txt"
    .venv/bin/python bench/gpu_wheels.py < "$WORK/freeze.txt" > "$WORK/packed.txt"
    "$WORK/prove/bin/pip" install -q --no-deps -r "$WORK/device-side.txt" -r "$WORK/packed.txt"
    "$WORK/prove/bin/pip" install -q --no-deps --no-build-isolation .
    (cd / && "$OLDPWD/$WORK/prove/bin/python" -c "from verl.workers.engine_workers import TrainingWorker; import mas_trainer.runtime.trainer, mas_trainer.runtime.verl_group, mas_trainer.rollout.fleet, mas_trainer.rollout.torch_replica, mas_trainer.adapters.langgraph; print('prove: the packed set imports TrainingWorker and the fit path')")  # not from the checkout
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
    sed -n 2,19p "$0"; exit 2
    ;;
esac
