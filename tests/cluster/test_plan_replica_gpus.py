"""The run plan counts the GPUs of rollout replicas that run beside the learner, whichever
engine serves them (issue 43, point 4b): a torch replica on GPUs takes one of its own, as a
vLLM replica takes `tensor_parallel_size`; a joined cluster is asked for their pools as verl
places them (`RolloutReplica.init_standalone`)."""

import pytest

import mas_trainer.cluster.plan as plan_module
from mas_trainer.cluster.plan import Machine, check_cluster_fits, placement_asks, resolve_plan
from mas_trainer.config import ConfigError, load_config


@pytest.fixture(autouse=True)
def _vllm_installed(monkeypatch):
    monkeypatch.setattr(plan_module, "require_vllm", lambda: None)  # the plan is read, never started


def _plan(*overrides: str, gpus: int):
    return resolve_plan(load_config(overrides=["runtime.learner=verl", "learner.mini_batch_size=2", *overrides]),
                        {"solo": ("tiny", "tiny")}, machine=Machine(gpus=gpus, cpus=8))


def test_torch_replicas_on_gpus_are_counted_one_gpu_each():
    replicas = ["runtime.engine=torch-replica", "runtime.replica.replicas=2"]
    assert _plan(*replicas, gpus=3).gpus_needed == 3  # the learner's rank and two replicas
    with pytest.raises(ConfigError, match=r"needs 3 GPU\(s\) here \(solo: 3\), and torch sees 2"):
        _plan(*replicas, gpus=2)


def test_a_joined_cluster_is_asked_for_the_replicas_gpu_pools():
    torch_replicas = placement_asks(_plan("runtime.engine=torch-replica", "runtime.replica.replicas=2", gpus=3))
    # verl's standalone pool: max_colocate_count=2, so two CPUs beside each GPU
    assert torch_replicas == [("solo", {"CPU": 1.0, "GPU": 1.0})] + [("solo", {"CPU": 2.0, "GPU": 1.0})] * 2
    with pytest.raises(ConfigError, match="policy solo"):
        check_cluster_fits(torch_replicas, [{"CPU": 16.0, "GPU": 2.0}], "auto")  # the learner's GPU and one replica's
    check_cluster_fits(torch_replicas, [{"CPU": 16.0, "GPU": 3.0}], "auto")
    vllm = placement_asks(_plan("runtime.engine=vllm", "runtime.replica.tensor_parallel_size=2", gpus=3))
    assert vllm == [("solo", {"CPU": 1.0, "GPU": 1.0}), ("solo", {"CPU": 4.0, "GPU": 2.0})]  # its two GPUs on one node
    colocated = _plan("runtime.engine=vllm", "runtime.replica.placement=colocated", "runtime.resources.procs_per_node=2", gpus=2)
    assert placement_asks(colocated) == [("solo", {"CPU": 2.0, "GPU": 2.0})] and colocated.gpus_needed == 2  # the learner's GPUs
