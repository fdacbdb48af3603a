"""`runtime.share_gpus`: every policy's worker group on the same GPUs, taking turns. Between
its turns a group must hold nothing on the GPU: the actor's and the critic's shards and
optimizer states leave it, also after a checkpoint (issue 24, point 13).

The GPU moves are verl's `TrainingWorker.to`; what is tested is which workers the policy's
worker moves when. The stand-in for verl's worker moves a CPU module to the GPU on
`save_checkpoint` and leaves it there, as verl's FSDP engine does (checked on its source).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("verl")

from mas_trainer.learners.verl_learner import VerlLearner  # noqa: E402
from mas_trainer.policy.verl_rank import PolicyWorker  # noqa: E402


class _Worker:
    """Where a verl TrainingWorker's parameters are, as its methods move them."""

    def __init__(self) -> None:
        self.where = "cpu"
        self.saved_on: list[str] = []

    def to(self, device: str) -> None:
        assert device in ("cpu", "device")
        self.where = device

    def save_checkpoint(self, path: str) -> None:
        self.saved_on.append(self.where)
        self.where = "device"  # verl: load_fsdp_model_to_gpu when the module is on the CPU, and no offload after

    load_checkpoint = lambda self, path, del_local_after_load=False: self.to("device")  # noqa: E731


def test_verls_save_leaves_an_offloaded_module_on_the_gpu():
    """The fact the stand-in models, read from verl's FSDP engine."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    src = inspect.getsource(FSDPEngine.save_checkpoint)
    assert 'origin_module_device == "cpu"' in src and "load_fsdp_model_to_gpu(self.module)" in src
    assert "if self._is_offload_param:\n            offload_fsdp_model_to_cpu" in src


def _worker(offload: bool) -> PolicyWorker:
    w = PolicyWorker.__new__(PolicyWorker)  # no verl engines: only the moves are under test
    learner = VerlLearner.__new__(VerlLearner)
    learner.offload, learner.actor, learner.critic, learner.updates = offload, _Worker(), _Worker(), 0
    w.learner, w.sink = learner, SimpleNamespace(before_save=lambda learner: None)
    w._rank = 1
    return w


def test_shared_gpus_hold_actor_and_critic_only_during_the_update():
    w = _worker(offload=True)
    with w.learner.on_device():
        assert (w.learner.actor.where, w.learner.critic.where) == ("device", "device")
    assert (w.learner.actor.where, w.learner.critic.where) == ("cpu", "cpu")


def test_a_checkpoint_on_shared_gpus_leaves_nothing_on_them(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.distributed.barrier", lambda: None)
    w = _worker(offload=True)
    PolicyWorker.save(w, str(tmp_path / "hf"), str(tmp_path / "learner"))
    actor, critic = w.learner.actor, w.learner.critic
    assert (actor.where, critic.where) == ("cpu", "cpu")
    assert actor.saved_on == ["device"] and critic.saved_on == ["device"]


def test_without_shared_gpus_nothing_moves():
    w = _worker(offload=False)
    w.learner.actor.where = w.learner.critic.where = "device"
    with w.learner.on_device():
        pass
    assert (w.learner.actor.where, w.learner.critic.where) == ("device", "device")
