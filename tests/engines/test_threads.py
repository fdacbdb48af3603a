"""The threads an in-process engine computes with: the cores this process may use shared among its
engines, or `runtime.torch_threads`; never torch's default of every core per engine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.config import RuntimeConfig, load_config  # noqa: E402
from mas_trainer.engines import threads, torch_engine  # noqa: E402
from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.loop.backends import policy_backends  # noqa: E402
from mas_trainer.spec import PolicySpec  # noqa: E402

CORES = 3  # this process's cores as the tests pretend: shares (1, then 3) other than torch's default on 2 cores


@pytest.fixture
def share(monkeypatch):
    """A fresh share of CORES cores for the engines this test starts (engines other tests left open stay out of it)."""
    fresh = threads.ProcessShare(cores=CORES)
    monkeypatch.setattr(torch_engine, "PROCESS", fresh)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return fresh


def threads_while_generating(engine) -> int:
    """torch's thread count on the thread that runs the model's forward during a generate."""
    seen: list[int] = []
    hook = engine.model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0)))
    finally:
        hook.remove()
    assert len(set(seen)) == 1, seen
    return seen[0]


def backends(runtime: RuntimeConfig, *names: str) -> dict:
    """The verbs' engines (serve, trace, eval and the Python API build theirs here): one per trainable policy."""
    return policy_backends({n: PolicySpec(n, "tiny", trainable=True) for n in names}, runtime)


def test_the_verbs_engines_share_the_cores_and_take_them_back_when_one_closes(share):
    got = backends(RuntimeConfig(), "a", "b")
    try:
        assert threads_while_generating(got["a"].engine) == threads_while_generating(got["b"].engine) == CORES // 2
        assert torch.get_num_threads() != CORES // 2  # not this (the test's) thread's count, nor torch's default here
        got["b"].engine.close()
        assert threads_while_generating(got["a"].engine) == CORES  # alone now: every core
        assert share.engines == 1 and share.summary().startswith(f"{CORES} torch thread(s) an engine ({CORES} core(s)")
    finally:
        for backend in got.values():
            backend.engine.close()
    assert share.engines == 0


def test_runtime_torch_threads_fixes_each_engines_threads(share):
    got = backends(RuntimeConfig(torch_threads=1), "a", "b")
    try:
        assert [threads_while_generating(b.engine) for b in got.values()] == [1, 1]
        assert share.engines == 0 and share.summary() == "1 torch thread(s) an engine (runtime.torch_threads)"  # no share taken
    finally:
        for backend in got.values():
            backend.engine.close()


def test_omp_num_threads_is_honoured_when_set(share, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    (backend,) = backends(RuntimeConfig(), "a").values()
    try:
        assert threads_while_generating(backend.engine) == 3
    finally:
        backend.engine.close()


def test_fit_in_process_policies_take_runtime_torch_threads(share):
    """runtime.execution=local: the trained policy's engine (and the learner on its thread) gets the key."""
    from mas_trainer.cluster.plan import Machine, resolve_plan
    from mas_trainer.policy.local import LocalPolicy

    cfg = load_config(overrides=["runtime.execution=local", "runtime.learner=torch", "runtime.torch_threads=3"])
    plan = resolve_plan(cfg, {"solo": ("tiny", "tiny")}, machine=Machine(gpus=0, cpus=2))
    group = LocalPolicy(plan.workers["solo"])
    try:
        assert threads_while_generating(group.engine) == 3
    finally:
        group.close()


def test_available_cores_follow_the_affinity_and_the_cgroup_quota(tmp_path, monkeypatch):
    pinned = subprocess.run([sys.executable, "-c", "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
                             "from mas_trainer.engines.threads import available_cores; print(available_cores())"],
                            capture_output=True, text=True, check=True)
    assert pinned.stdout.strip() == "1"
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: a quota cannot lower it")
    monkeypatch.setattr(threads, "CGROUP", tmp_path)  # a container limited to half a CPU (docker --cpus 0.5)
    for folder in (tmp_path, tmp_path / "cpu"):
        folder.mkdir(exist_ok=True)
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # cgroup v2
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # v1
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.available_cores() == 1
