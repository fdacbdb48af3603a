"""The threads an in-process engine computes with: the cores this process may use shared among the
engines started in it, or `runtime.torch_threads`; never torch's default of every core per engine,
and never a count that moves while a run goes on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from mas_trainer.config import RuntimeConfig, load_config  # noqa: E402
from mas_trainer.engines import threads  # noqa: E402
from mas_trainer.engines.threads import RUNNING  # noqa: E402
from mas_trainer.engines.base import SamplingParams  # noqa: E402
from mas_trainer.loop.backends import policy_backends  # noqa: E402
from mas_trainer.spec import PolicySpec  # noqa: E402

CORES = 3  # this process's cores as the tests pretend: shares (3, 1) other than torch's default on CI's 2 cores


@pytest.fixture
def cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: CORES)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


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


def backends(runtime: RuntimeConfig, policies: dict[str, bool]) -> dict:
    """The verbs' engines (serve, trace, eval and the Python API build theirs here); policies: name -> trainable."""
    return policy_backends({n: PolicySpec(n, "tiny", trainable=t) for n, t in policies.items()}, runtime)


def test_the_engines_started_share_the_cores_and_a_frozen_policys_takes_its_share_only_when_it_loads(cores):
    got = backends(RuntimeConfig(), {"trained": True, "frozen": False})
    try:
        trained = got["trained"].engine
        assert threads_while_generating(trained) == CORES  # the frozen policy's engine has not started
        frozen = got["frozen"].engine.get().engine  # its first call starts it
        assert threads_while_generating(frozen) == CORES // 2  # the share of both
        assert threads_while_generating(trained) == CORES  # unchanged: a run's sums do not depend on when it loaded
    finally:
        for backend in got.values():
            backend.engine.close()


def test_runtime_torch_threads_sets_each_engines_threads(cores):
    (backend,) = backends(RuntimeConfig(torch_threads=1), {"a": True}).values()
    try:
        assert threads_while_generating(backend.engine) == 1  # not its share (3), nor torch's default
        assert "with 1 torch thread(s) (runtime.torch_threads)" in RUNNING.summary()  # what serve prints
    finally:
        backend.engine.close()
    assert "(runtime.torch_threads)" not in RUNNING.summary()


def test_omp_num_threads_is_honoured_when_set(cores, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (backend,) = backends(RuntimeConfig(), {"a": True}).values()
    try:
        assert threads_while_generating(backend.engine) == 1
    finally:
        backend.engine.close()


def test_fit_in_process_policies_share_the_cores_by_the_plan(cores):
    """runtime.execution=local: each trained policy's engine (and the learner on its thread) gets its share."""
    from mas_trainer.cluster.plan import Machine, resolve_plan
    from mas_trainer.policy.local import LocalPolicy

    cfg = load_config(overrides=["runtime.execution=local", "runtime.learner=torch"])
    plan = resolve_plan(cfg, {"solo": ("tiny", "tiny")}, machine=Machine(gpus=0, cpus=CORES))
    group = LocalPolicy(plan.workers["solo"])
    try:
        assert threads_while_generating(group.engine) == CORES
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


def test_the_count_is_set_after_vllm_replaced_torchs_setter(cores, monkeypatch):
    """Once a vLLM engine ran in a process, vLLM's CPU worker has replaced `torch.set_num_threads`
    with a no-op that logs (in the suite, through a handler on a closed stream: a traceback in a
    later test's output). The engine still gets its count, and never calls the replacement."""
    replaced: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", replaced.append)  # what vLLM's cpu_worker does
    (backend,) = backends(RuntimeConfig(torch_threads=1), {"a": True}).values()
    try:
        assert threads_while_generating(backend.engine) == 1
    finally:
        backend.engine.close()
    assert replaced == []


def test_a_count_set_holds_when_another_thread_sets_its_own_before_the_first_op():
    """torch sizes a thread's pool at its first op from the count set last anywhere in the
    process: an engine's count, set as its thread starts, must survive a neighbour engine
    setting another before the first one computes anything."""
    import threading

    mine, theirs = threading.Event(), threading.Event()
    seen: list[int] = []

    def engine() -> None:
        threads.set_torch_threads(3)
        mine.set()
        theirs.wait(60)
        seen.append(torch.get_num_threads())

    def neighbour() -> None:
        mine.wait(60)
        threads.set_torch_threads(1)
        theirs.set()

    workers = [threading.Thread(target=engine), threading.Thread(target=neighbour)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert seen == [3]
