"""`eval` and `export`: what a user does with a run once `fit` is done."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mas_trainer.config import ConfigError, RewardConfig, load_config
from mas_trainer.rewards import RewardSpec, assign_rewards
from mas_trainer.runtime.rundir import RunDir
from mas_trainer.runtime.session import Session, lazy_backend, torch_backend
from mas_trainer.runtime.trainer import summarize

__all__ = ["evaluate", "export"]


def _trained_folders(run_dir: str | Path | None) -> dict[str, Path]:
    if run_dir is None:
        return {}
    run = RunDir(run_dir)
    if run.load_state() is None:
        raise ConfigError(f"{run_dir} has no checkpoint (is it a `mas-trainer fit` run directory?)")
    return {p.name: p for p in (run.checkpoint / "policies").iterdir() if p.is_dir()}


def evaluate(app_ref: Any, tasks: list[dict], *, run_dir: str | Path | None = None, model: str | None = None,
             n: int = 1, seed: int = 0, max_tokens: int = 64, max_in_flight: int = 64,
             temperature: float | None = None) -> dict[str, Any]:
    """Mean reward of the app on `tasks`, overall and per role, with the run's trained
    policies (`run_dir`) or the base models. `temperature` replaces the one every LLM call
    asks for (0: greedy)."""
    trained = _trained_folders(run_dir)
    reward_cfg = load_config(Path(run_dir) / "config.yaml").reward if run_dir else RewardConfig()

    def backend(policy: str, base: str) -> Any:
        return torch_backend(str(trained[policy]) if policy in trained else base, seed=seed)

    with Session(model=model, max_in_flight=max_in_flight, default_max_tokens=max_tokens) as session:
        app = session.load_app(app_ref, start_engines=False)
        for p, pol in app.spec.policies.items():
            if pol.trainable:
                session.attach(p, backend(p, pol.base_model))
            else:  # frozen: the base model, loaded only if a node calls it
                session.attach(p, lazy_backend(p, lambda m=pol.base_model: torch_backend(m, seed=seed)))
        session.gateway.reseed(seed, temperature=temperature)
        trajs = session.run(tasks, n=n)
        spec = RewardSpec(app.spec.spec.reward, app.spec.spec.role_rewards, app.spec.spec.turn_rewards)
        for t in trajs:
            assign_rewards(t, spec, allocator=reward_cfg.allocator, weights=reward_cfg.weights,
                           on_failure=reward_cfg.on_failure, options=reward_cfg.options)
    used = {p: str(trained.get(p, pol.base_model)) for p, pol in app.spec.policies.items()}
    return {"policies": used, **summarize(trajs)}


def export(run_dir: str | Path, out_dir: str | Path) -> Path:
    """One Hugging Face folder per trained policy plus `mas-trainer.json` (role -> model)."""
    run = RunDir(run_dir)
    folders = _trained_folders(run_dir)
    app = json.loads((run.root / "app.json").read_text()) if (run.root / "app.json").exists() else {}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for policy, folder in folders.items():
        shutil.copytree(folder, out / policy, dirs_exist_ok=True)
    mapping = {
        "roles": app.get("roles", {}),
        "frozen": app.get("frozen", []),
        "policies": {p: {"path": p, "base_model": app.get("policies", {}).get(p, {}).get("base_model")} for p in folders},
        "step": run.load_state()["step"],
    }
    (out / "mas-trainer.json").write_text(json.dumps(mapping, indent=1))
    return out
