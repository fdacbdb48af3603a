"""The prepared GPU check, checked where there is no GPU: the wheel set it packs covers what
verl's TrainingWorker and the `fit` path import, its trackers need nothing unpacked, and its
MFU counts the train step's 6N per token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("verl")

# what the check imports on the device: verl's worker (which imports `datasets` through
# verl.workers.utils.losses -> verl.utils.dataset) and the fit path of every case
IMPORTS = """
import importlib.metadata as md, json, os, sys
from verl.workers.engine_workers import TrainingWorker
import mas_trainer.runtime.trainer, mas_trainer.runtime.verl_group, mas_trainer.runtime.worker_group
import mas_trainer.rollout.fleet, mas_trainer.rollout.torch_replica, mas_trainer.rollout.gloo_sync
import mas_trainer.adapters.langgraph, mas_trainer.learners.torch_learner, mas_trainer.learners.verl_learner
import mas_trainer.learners.verl_cpu, mas_trainer.runtime.tracking
dists = md.packages_distributions()
# each loaded module by where its file lies: Ray's vendored copies (ray/thirdparty_files) are Ray's
roots = [p for p in sys.path if p.endswith("site-packages")]
loaded = set()
for mod in list(sys.modules.values()):
    path = getattr(mod, "__file__", None) or ""
    root = next((r for r in roots if path.startswith(r + os.sep)), None)
    if root:
        loaded.add(os.path.relpath(path, root).split(os.sep)[0].split(".")[0])
print(json.dumps({m: dists[m] for m in loaded if m in dists}))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def freeze() -> list[str]:
    return subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                          text=True, check=True).stdout.splitlines()


def test_the_packed_set_covers_every_distribution_the_check_imports(load_bench, imported, freeze):
    wheels = load_bench("gpu_wheels")
    packed = {wheels.canonical(line.split("==")[0]) for line in wheels.requirements(freeze)}
    device = {wheels.canonical(line.split("==")[0]) for line in wheels.device_side(freeze)}
    missing = {module: dists for module, dists in imported.items()
               if not any(wheels.canonical(d) in packed | device | {"mas-trainer"} for d in dists)}
    assert not missing, f"imported on the device but neither packed nor in its image: {missing}"
    assert "datasets" in packed  # verl.utils.dataset imports it unguarded (point 8)


def test_what_is_left_out_is_in_the_device_image_or_never_imported(load_bench, imported):
    wheels = load_bench("gpu_wheels")
    never = {wheels.canonical(d) for dists in imported.values() for d in dists} & wheels.NEVER_IMPORTED
    assert never <= {"mas-trainer"}, f"listed as never imported, but imported: {never}"


def test_requirements_keep_order_and_drop_only_the_listed(load_bench):
    wheels = load_bench("gpu_wheels")
    lines = ["torch==2.13.0+cpu", "datasets==5.2.0", "nvidia-nccl-cu13==2.28", "Pandas==3.1.1", "pytest==9.0",
             "dill==0.4.1", "-e git+https://x#egg=y", "# comment"]
    assert wheels.requirements(lines) == ["datasets==5.2.0", "dill==0.4.1", *wheels.INSTALLER]
    assert wheels.device_side(lines) == ["torch==2.13.0+cpu", "nvidia-nccl-cu13==2.28", "Pandas==3.1.1"]


def test_mfu_counts_6n_per_trained_token_over_the_train_seconds(load_bench):
    check = load_bench("gpu_check")
    # 0.5B parameters, 10k tokens in 1 s on a 989 TFLOP/s GPU
    assert check.mfu(500_000_000, 10_000, 1.0, 989e12) == pytest.approx(6 * 5e8 * 1e4 / 989e12)
    assert check.mfu(500_000_000, 10_000, 2.0, 989e12) == pytest.approx(3 * 5e8 * 1e4 / 989e12)
    assert check.mfu(1, 1, 1.0, None) is None


def test_the_check_tracks_to_the_console_only(load_bench):
    """The device image's TensorBoard is not the check's business: its config loads with the
    console tracker alone (the default list includes tensorboard)."""
    from mas_trainer.config import load_config

    check = load_bench("gpu_check")
    for case in check.CASES:
        cfg = load_config(overrides=check.check_overrides(case, "cuda", 2, 2, 2, "tiny"))
        assert cfg.logger == ["console"]
    assert load_config(overrides=check.CASES["verl-gae"]).advantage.estimator == "gae"
    assert load_config(overrides=check.CASES["nccl-sync"]).runtime.replica.weight_sync == "nccl"


def test_the_nccl_case_is_skipped_with_its_reason_on_one_gpu(load_bench):
    import argparse

    check = load_bench("gpu_check")
    args = argparse.Namespace(device="cuda", steps=1, tasks=2, n=2)
    result = check.run_case("nccl-sync", args, model=None, params=0, peak=None, gpus=1)
    assert result["status"] == "skipped" and "two ranks on one GPU" in result["why"]
