#!/usr/bin/env bash
# The prepared GPU check (run it whenever a session is lent the device machine).
#
# The device machine has Python 3.12 with torch (CUDA), transformers, accelerate and peft, but
# no ray, verl or LangGraph, reaches no package index, and takes at most 64 MiB per call. So:
#
#   bash bench/gpu_check.sh prepare      # here: wheels for CPython 3.12 (manylinux x86_64) of the
#                                        # set bench/gpu_wheels.py picks and of vLLM 0.24's list
#                                        # (bench/gpu_vllm_wheels.py: vllm --no-deps, stripped, and
#                                        # what it adds), + the tokenizer, packed into
#                                        # .gpu-check/part-NN.tar, each as large as a call carries
#                                        # beside the working tree (64 MiB in all): the fewest calls.
#                                        # Stops, naming the package, on a wheel it cannot fetch or a
#                                        # requirement the device image's version breaks
#   bash bench/gpu_check.sh prove        # here (about 2.5 min): that set alone imports verl's
#                                        # TrainingWorker and the fit path in a clean venv (also
#                                        # MAS_TRAINER_SLOW=1 pytest tests/bench/test_gpu_check.py -m slow)
#   then one device `run` per part, back to back (the machine stays warm 30 s after a call),
#   each with carry [".gpu-check/part-NN.tar"]:
#       bash bench/gpu_check.sh stash .gpu-check/part-NN.tar        # parts 00 .. N-2
#   and for the last part (timeout_s 540; the log also lands in $OUT/gpu_check.log):
#       bash bench/gpu_check.sh run .gpu-check/part-NN.tar [gpu_check.py options]
#   The default cases start with vllm-colocated; if vLLM does not import there, the log names
#   the import that failed and the embedded cases still run. Commit the log as
#   docs/results/gpu_check_<date>.log.
#
# What it measures: bench/gpu_check.py (a few `fit` steps per case: vLLM rollouts colocated with
# the verl learner beside the same fit on the embedded engine, the torch learner, the verl
# learner with GRPO and with GAE, the learner's MFU on a batch that loads the GPU, and an NCCL
# weight sync to an embedded replica on 2+ GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=.gpu-check
STASH=/tmp/mas-gpu-check
case "${1:-}" in
  prepare)
    rm -rf "$WORK" && mkdir -p "$WORK/wheels" "$WORK/wheels-vllm" "$WORK/tokenizer"
    # everything the project's venv has, less what the device image has and what the check
    # never imports: the one list is bench/gpu_wheels.py (tests/bench/test_gpu_check.py checks it)
    .venv/bin/pip freeze --exclude-editable > "$WORK/freeze.txt"
    .venv/bin/python bench/gpu_wheels.py < "$WORK/freeze.txt" > "$WORK/requirements.txt"
    # a packed distribution that needs another version of one left to the device image stops here
    .venv/bin/python bench/gpu_wheels.py --check < "$WORK/freeze.txt" \
      || { echo "gpu_check prepare: stopped: the device image breaks the requirements above" >&2; exit 1; }
    bash "$0" wheels "$WORK/requirements.txt" "$WORK/wheels"
    # the second list: vLLM 0.24 (verl 0.9.1's pin) itself, --no-deps and stripped, and what its
    # requirements add to the first list, resolved for the device from vLLM's own metadata
    vllm=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'bench'); import gpu_vllm_wheels as v; print(v.VLLM)")
    mkdir -p "$WORK/vllm-download"
    bash "$0" wheels <(echo "$vllm") "$WORK/vllm-download"
    unzip -p "$WORK"/vllm-download/vllm-*.whl '*.dist-info/METADATA' > "$WORK/vllm-METADATA"
    .venv/bin/python bench/gpu_vllm_wheels.py resolve "$WORK/vllm-METADATA" "$WORK/requirements.txt" \
      > "$WORK/requirements-vllm.txt"
    # in a folder of their own: the run installs them to a site of their own, which the check takes
    # off the path for the other cases if vLLM does not import (verl imports vLLM where it finds it)
    bash "$0" wheels <(tail -n +2 "$WORK/requirements-vllm.txt") "$WORK/wheels-vllm"
    .venv/bin/python bench/gpu_vllm_wheels.py strip "$WORK"/vllm-download/vllm-*.whl "$WORK/wheels-vllm" >/dev/null
    rm -rf "$WORK/vllm-download"
    # the tokenizer alone (tokenizer_dir() may be the whole converted model's folder)
    .venv/bin/python -c "from transformers import AutoTokenizer; from mas_trainer.engines.models import tokenizer_dir; AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained('$WORK/tokenizer')"
    tar -C "$WORK" -cf "$WORK/all.tar" wheels wheels-vllm tokenizer
    # each part as large as a call carries beside the working tree (what travels besides: tracked
    # and untracked files git does not ignore)
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    size=$(.venv/bin/python bench/gpu_vllm_wheels.py part-size "$tree")
    split -b "$size" -d -a 2 "$WORK/all.tar" "$WORK/part-" && rm "$WORK/all.tar"
    for p in "$WORK"/part-*; do mv "$p" "$p.tar"; done
    grep -qx "/$WORK/" .git/info/exclude 2>/dev/null || echo "/$WORK/" >> .git/info/exclude
    echo "gpu_check prepare: $(ls "$WORK"/wheels/*.whl | wc -l) + $(ls "$WORK"/wheels-vllm/*.whl | wc -l) (vLLM) wheels, $(du -cb "$WORK"/part-*.tar | tail -1 | cut -f1) bytes in $(ls "$WORK"/part-*.tar | wc -l) parts of at most $size (working tree $tree bytes)"
    ls -l "$WORK"/part-*.tar
    ;;
  wheels)
    # wheels REQUIREMENTS DEST: a wheel for CPython 3.12 on manylinux x86_64 of each line, from
    # the index, else built here from its sdist if that gives a pure-Python wheel; anything else
    # stops the step with the package's name (the device would fail later, far from the cause)
    reqs=$2 dest=$3
    mkdir -p "$dest"
    fetch() {
      local err tmp whl
      err=$(.venv/bin/pip download -q --no-deps --dest "$2" --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any "$1" 2>&1 >/dev/null) && return 0
      tmp=$(mktemp -d)
      if .venv/bin/pip wheel -q --no-deps --wheel-dir "$tmp" "$1" >/dev/null 2>&1; then
        for whl in "$tmp"/*.whl; do
          case "$whl" in
            *-py3-none-any.whl|*.py3-none-any.whl) mv "$whl" "$2/" && rm -rf "$tmp" && return 0 ;;
          esac
          echo "gpu_check prepare: $1 has no wheel for CPython 3.12 and builds only $(basename "$whl") here" >&2
        done
      fi
      rm -rf "$tmp"
      echo "gpu_check prepare: no wheel for $1 (CPython 3.12, manylinux x86_64): $(grep -m1 '^ERROR' <<< "$err")" >&2
      return 1
    }
    export -f fetch
    # every line is tried; xargs exits non-zero when any one failed
    grep -v '^\s*$' "$reqs" | xargs -P 4 -I{} bash -c 'fetch "$1" "$2"' _ {} "$dest" \
      || { echo "gpu_check prepare: stopped: the wheels named above are missing" >&2; exit 1; }
    ;;
  prove)
    # the packed set is enough: a clean venv (no system site packages) holding only what the
    # device image brings (torch and the rest of bench/gpu_wheels.py's DEVICE_IMAGE, at this
    # venv's versions; torch is the local CPU build) and the packed requirements, all --no-deps,
    # must import verl's TrainingWorker and the fit path. On this machine's python3, 3.11: the
    # same distributions at the same versions as the 3.12 wheels `prepare` fetches (a pyenv 3.12
    # may be here, but the index's only torch for 3.12 is the CUDA build, whose nvidia-*
    # libraries run to GBs). Where a python3.12 and prepare's wheels are both here, the packed
    # files themselves are checked too: one version of each, every one installable on 3.12.
    mkdir -p "$WORK" && rm -rf "$WORK/prove" "$WORK/prove-312" && python3 -m venv "$WORK/prove"
    .venv/bin/pip freeze --exclude-editable > "$WORK/freeze.txt"
    .venv/bin/python bench/gpu_wheels.py --check < "$WORK/freeze.txt"
    .venv/bin/python bench/gpu_wheels.py --device-side < "$WORK/freeze.txt" > "$WORK/device-side.txt"
    .venv/bin/python bench/gpu_wheels.py < "$WORK/freeze.txt" > "$WORK/packed.txt"
    "$WORK/prove/bin/pip" install -q --no-compile --no-deps -r "$WORK/device-side.txt" -r "$WORK/packed.txt"
    "$WORK/prove/bin/pip" install -q --no-compile --no-deps --no-build-isolation .
    (cd / && "$OLDPWD/$WORK/prove/bin/python" -c "
from verl.workers.engine_workers import TrainingWorker
import mas_trainer.loop.trainer, mas_trainer.policy.verl_rank, mas_trainer.policy.local
import mas_trainer.replicas.fleet, mas_trainer.replicas.torch_replica, mas_trainer.replicas.gloo_sync
import mas_trainer.adapters.langgraph, mas_trainer.learners.torch_learner, mas_trainer.learners.verl_learner
import mas_trainer.run.tracking
print('prove: the packed set imports TrainingWorker and the fit path')")  # not from the checkout
    py312=$(for p in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
              "$p" -c "" 2>/dev/null && echo "$p" && break; done || true)
    if [ -n "$py312" ] && compgen -G "$WORK/wheels/*.whl" > /dev/null; then
      "$py312" -m pip install -q --dry-run --ignore-installed --no-index --no-deps --target "$WORK/prove-312" \
        "$WORK"/wheels/*.whl "$WORK"/wheels-vllm/*.whl \
        && echo "prove: prepare's $(ls "$WORK"/wheels/*.whl "$WORK"/wheels-vllm/*.whl | wc -l) wheels install on $("$py312" -V)"
    fi
    ;;
  stash)
    mkdir -p "$STASH" && cp "$2" "$STASH/" && ls -l "$STASH"
    ;;
  run)
    mkdir -p "$STASH" && cp "$2" "$STASH/"
    cat "$STASH"/part-*.tar > "$STASH/all.tar" && mkdir -p "$STASH/x" && tar -C "$STASH/x" -xf "$STASH/all.tar"
    # not a venv: the device's python3 is itself a venv (/opt/torch/.venv), and a venv made from it
    # with --system-site-packages sees the base interpreter's packages, not torch (2026-12-04). The
    # packed set goes to a folder ahead of the image's site-packages on PYTHONPATH (Ray's workers
    # inherit it), so the packed versions shadow the image's (transformers at verl's cap).
    # --no-compile: the device's seconds are scarce, and only the imported modules need byte code
    python3 -m pip install -q --no-compile --no-index --no-deps --target "$STASH/site" "$STASH"/x/wheels/*.whl
    # the vLLM list (bench/gpu_vllm_wheels.py) in a site of its own: MAS_TRAINER_GPU_VLLM_SITE
    # tells gpu_check.py which path to drop if vLLM does not import
    python3 -m pip install -q --no-compile --no-index --no-deps --target "$STASH/site-vllm" "$STASH"/x/wheels-vllm/*.whl
    # VLLM_USE_FLASHINFER_SAMPLER=0: vLLM 0.24's top-p/top-k sampler imports FlashInfer unless it
    # is 0 (FlashInfer is not packed: bench/gpu_vllm_wheels.py); Ray's workers inherit it
    export PYTHONPATH="$STASH/site:$STASH/site-vllm" MAS_TRAINER_GPU_TOKENIZER="$STASH/x/tokenizer" PYTHONUNBUFFERED=1 \
      VLLM_USE_FLASHINFER_SAMPLER=0 MAS_TRAINER_GPU_VLLM_SITE="$STASH/site-vllm"
    # the project too (its package-dir maps mas_trainer.adapters), built with the packed setuptools
    python3 -m pip install -q --no-compile --no-deps --no-build-isolation --target "$STASH/site" .
    here=$PWD
    (cd /tmp && python3 "$here/bench/gpu_check.py" "${@:3}") 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2
    ;;
esac
