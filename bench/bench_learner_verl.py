"""verl's training worker against the embedded torch learner: update tokens/s on one batch.

This decides whether the project keeps one learner or two (issue: "one learner or two is
decided by a benchmark"). Both learners train the bundled SmolLM2-135M on the same batch
(4 sequences x 256 tokens: 128 prompt + 128 response, random ids, random advantages), bf16
compute with fp32 weights and AdamW, as `fit` runs them:

- torch: `TorchLearner.update(turns)` in this process (all cores), old log-probs the engine's;
- verl, world size W (1 and 2 on a 2-core machine): one `train` call of the policy's verl
  worker group exactly as `fit` makes it (old log-probs from verl's `infer_batch`, verl's
  `ppo_loss` through `train_mini_batch` on the FSDP2 shards, then the full parameters
  gathered into rank 0's engine); `train_mini_batch` alone is reported too.

    python bench/bench_learner_verl.py [--model default|tiny|PATH] [--reps 3] [--worlds 1,2]

Prints one line per measurement, the ratios verl/torch (goal for a single learner: >= 0.9)
and a final JSON line. Median of `--reps` timed updates after one warm-up update each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

__all__ = ["main"]


def make_turns(vocab: int, batch: int, prompt: int, response: int, seed: int = 0) -> tuple[list, list]:
    from mas_trainer.algo.advantages import TurnRecord
    from mas_trainer.learners import Turn

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (batch, prompt + response), generator=g)
    rewards = torch.rand(batch, generator=g)
    turns = [Turn(f"t{b}", ids[b, :prompt].tolist(), ids[b, prompt:].tolist(), [0.0] * response, 0.0) for b in range(batch)]
    records = [TurnRecord(f"t{b}", f"r{b}", 0, "role", "p", response, float(rewards[b])) for b in range(batch)]
    return turns, records


def time_torch(model_ref: str, turns: list, records: list, reps: int) -> list[float]:
    from dataclasses import replace

    from mas_trainer.algo.advantages import compute_policy_advantages
    from mas_trainer.algo.config import AdvantageConfig
    from mas_trainer.engines.models import load_model
    from mas_trainer.learners import LearnerConfig, TorchLearner

    model, _ = load_model(model_ref)
    adv = compute_policy_advantages(records, AdvantageConfig()).per_turn()
    learner = TorchLearner(model, LearnerConfig(lr=1e-7, mini_batch_size=len(turns), micro_batch_size=len(turns), shuffle=False))
    # old log-probs the engine would have returned (fp32): PPO ratios near 1, as in training
    old = TorchLearner(model, LearnerConfig(bf16=False)).log_probs(turns)
    trained = [replace(t, old_logprobs=o.tolist(), advantages=adv[t.id].advantages.tolist()) for t, o in zip(turns, old)]
    learner.update(trained)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        learner.update(trained)
        out.append(time.perf_counter() - t0)
    del learner, model
    return out


def time_verl(model_ref: str, world: int, turns: list, records: list, reps: int) -> tuple[list[float], list[float]]:
    import ray
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    from mas_trainer.learners.verl_cpu import worker_env
    from mas_trainer.config import Resources
    from mas_trainer.policy.contract import WorkerPlan
    from mas_trainer.policy.turns import BufferedTurn
    from mas_trainer.policy.verl_rank import PolicyWorker

    n = len(turns)
    plan = WorkerPlan(policy="p", model=model_ref, learner={"lr": 1e-7, "mini_batch_size": n, "micro_batch_size": n // world,
                                                              "shuffle": False},
                      advantage={}, critic={}, resources=Resources(procs_per_node=world),
                      torch_threads=max(1, (os.cpu_count() or 1) // world))
    pool = RayResourcePool(process_on_nodes=[world], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(PolicyWorker), plan=plan),
                           device_name="cpu", worker_env=worker_env())
    # the turns come with the records, as rollout replicas send them
    payload = {t.id: BufferedTurn(list(t.prompt_ids), list(t.response_ids), list(t.old_logprobs)) for t in turns}

    whole, inner = [], []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        [metrics, *_] = ray.get(group.train(records, payload))
        seconds = time.perf_counter() - t0
        if rep:  # the first is a warm-up
            whole.append(seconds)
            inner.append(metrics.get("time/train_mini_batch_s", float("nan")))
    ray.get(group.close())
    for w in group.workers:
        ray.kill(w)
    for pg in pool.pgs:  # the next world size needs these CPUs
        ray.util.remove_placement_group(pg)
    return whole, inner


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worlds", default="1,2", help="verl world sizes to measure")
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from mas_trainer.engines.models import materialize

    vocab = AutoConfig.from_pretrained(materialize(args.model)).vocab_size
    turns, records = make_turns(vocab, args.batch, args.prompt, args.response)
    tokens = args.batch * (args.prompt + args.response)
    results: dict = {"model": args.model, "tokens_per_update": tokens, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}

    t = statistics.median(time_torch(args.model, turns, records, args.reps))
    results["torch_s"] = t
    print(f"{'torch learner':>26}: {t:6.2f} s/update  {tokens / t:7.1f} tokens/s", flush=True)

    import ray
    from verl.plugin.platform.platform_manager import set_platform

    from mas_trainer.learners.verl_cpu import PlatformCPU, worker_env

    set_platform(PlatformCPU())
    worlds = [int(w) for w in args.worlds.split(",")]
    ray.init(num_cpus=max(os.cpu_count() or 1, max(worlds)), include_dashboard=False, runtime_env={"env_vars": worker_env()},
             log_to_driver=False)
    for world in worlds:
        whole, inner = time_verl(args.model, world, turns, records, args.reps)
        v, vi = statistics.median(whole), statistics.median(inner)
        results[f"verl_w{world}_s"] = v
        results[f"verl_w{world}_train_mini_batch_s"] = vi
        results[f"ratio_verl_w{world}_over_torch"] = t / v
        print(f"{f'verl learner, world {world}':>26}: {v:6.2f} s/update  {tokens / v:7.1f} tokens/s  "
              f"(train_mini_batch alone {vi:.2f} s)  verl/torch = {t / v:.2f}", flush=True)
    ray.shutdown()
    best = max(results[f"ratio_verl_w{w}_over_torch"] for w in worlds)
    results["verdict"] = "one learner (verl)" if best >= 0.9 else "two learners (verl is more than 10% slower here)"
    print(f"best verl/torch = {best:.2f}: {results['verdict']}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
