"""Nothing in a run directory runs code on resume: verl's checkpoint files are vetted before
verl unpickles them (with weights_only=False)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mas_trainer.errors import UserError
from mas_trainer.run.untrusted import refuse_code_in_checkpoints

verl_ckpt = pytest.importorskip("verl.utils.checkpoint.checkpoint_manager")


def _verl_like_folders(*folders):
    """What verl's FSDP checkpoint manager writes, built with its own RNG-state function and
    real DTensor shards (one gloo rank, in a child so this process keeps no process group)."""
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor, Shard
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(4, 4)
        shards = {{k: distribute_tensor(v.detach(), mesh, [Shard(0)]) for k, v in model.state_dict().items()}}
        optim = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 4)).sum().backward()
        optim.step()
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
        for folder in {[str(f) for f in folders]!r}:
            torch.save(shards, os.path.join(folder, "model_world_size_1_rank_0.pt"))
            torch.save(optim.state_dict(), os.path.join(folder, "optim_world_size_1_rank_0.pt"))
            torch.save({{"lr_scheduler": sched.state_dict(), "rng": BaseCheckpointManager.get_rng_state()}},
                       os.path.join(folder, "extra_state_world_size_1_rank_0.pt"))
        dist.destroy_process_group()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_verl_checkpoint_files_pass_and_a_planted_pickle_is_refused_unrun(tmp_path):
    learner = tmp_path / "learner"
    (learner / "critic").mkdir(parents=True)
    _verl_like_folders(learner, learner / "critic")
    refuse_code_in_checkpoints(learner)  # verl's own files: shards, optimizer, scheduler, RNG

    marker = tmp_path / "ran"
    torch.save({"lr_scheduler": {}, "rng": _Payload(marker)}, learner / "critic" / "extra_state_world_size_1_rank_0.pt")
    with pytest.raises(UserError) as err:
        refuse_code_in_checkpoints(learner)
    message = str(err.value)
    assert "\n" not in message and "critic/extra_state_world_size_1_rank_0.pt" in message and "system" in message
    assert "could run code" in message
    assert not marker.exists()
    torch.load(learner / "critic" / "extra_state_world_size_1_rank_0.pt", weights_only=False)  # what verl would do
    assert marker.exists(), "the payload is real: an unrestricted load runs it"


def test_a_damaged_checkpoint_file_is_one_line(tmp_path):
    good = tmp_path / "optim_world_size_1_rank_0.pt"
    torch.save({"state": {}}, good)
    good.write_bytes(good.read_bytes()[:40])
    with pytest.raises(UserError, match=r"not a readable torch checkpoint .*restore the run's checkpoint folder") as err:
        refuse_code_in_checkpoints(tmp_path)
    assert "\n" not in str(err.value)
