"""The run's best held-out evaluation and when to stop early (config `best`, docs/training.md).

Every held-out evaluation after step 0 is ranked by `best.metric` (the evaluation before
training measures the base models: nothing was trained to keep). The best is the first
evaluation no later one beats (ties keep the earlier step: as good, fewer updates). `stale`
counts the evaluations since the last that beat the best by more than `best.min_delta`, as
Hugging Face's EarlyStoppingCallback counts. Both are committed in every checkpoint's
state.json, so `--resume` continues them where the checkpoint left them, never recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mas_trainer.config import BestConfig, ConfigError

__all__ = ["Selection"]


@dataclass
class Selection:
    cfg: BestConfig
    best: dict[str, Any] | None = None  # state.json's "best": step, metric, mode, value, kept (its weights in best/)
    stale: int = 0

    @classmethod
    def restored(cls, cfg: BestConfig, state: dict[str, Any] | None, where: str) -> Selection:
        """The selection a checkpoint's state committed; refused when it ranked by another metric or mode."""
        if state is None:
            return cls(cfg)
        best = state.get("best")
        if best is not None and (best["metric"], best["mode"]) != (cfg.metric, cfg.mode):
            raise ConfigError(f"{where}: the run's best is ranked by best.metric={best['metric']} best.mode={best['mode']}, "
                              f"this config says {cfg.metric} {cfg.mode}; resume with the run's, or train into a new --output")
        return cls(cfg, best, state.get("stale", 0))

    @property
    def key(self) -> str:
        return self.cfg.metric.removeprefix("val/")

    def value(self, row: dict[str, Any]) -> float | None:
        v = row.get(self.key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        return float(v)

    def better(self, value: float, than: float, by: float = 0.0) -> bool:
        return value > than + by if self.cfg.mode == "max" else value < than - by

    def observe(self, row: dict[str, Any]) -> bool:
        """Rank one held-out row (it gets `best/step` and `best/value`); True when it is the new best.
        A value that is missing (every held-out rollout failed) does not improve."""
        if row["step"] == 0:  # the base models: checked, not ranked
            if self.key not in row:
                known = ", ".join(f"val/{k}" for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
                raise ConfigError(f"best.metric={self.cfg.metric}: the held-out rows have no {self.key!r}; they have {known}")
            return False
        value = self.value(row)
        previous = None if self.best is None else self.best["value"]
        if value is not None and (previous is None or self.better(value, previous, self.cfg.min_delta)):
            self.stale = 0
        else:
            self.stale += 1
        improved = value is not None and (previous is None or self.better(value, previous))
        if improved:
            self.best = {"step": row["step"], "metric": self.cfg.metric, "mode": self.cfg.mode, "value": value,
                         "kept": self.cfg.keep}
        if self.best is not None:
            row.update({"best/step": self.best["step"], "best/value": self.best["value"]})
        return improved

    def stop_reason(self) -> str | None:
        """Why the run has learned enough (best.target, best.patience), else None."""
        c, best = self.cfg, self.best
        if c.target is not None and best is not None and not self.better(c.target, best["value"]):
            return f"held-out {c.metric} {best['value']:.4g} at step {best['step']} reached best.target={c.target:g}"
        if c.patience is not None and self.stale >= c.patience:
            return (f"{self.stale} held-out evaluations without an improvement of more than {c.min_delta:g} on the best "
                    f"(best.patience={c.patience})")
        return None

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "stale": self.stale}

    def describe(self) -> str:
        """The best in words, for the run's last line."""
        b = self.best
        if b is None:
            return "no held-out evaluation after step 0 ranked"
        kept = f"kept in best/step_{b['step']:06d}" if b["kept"] else "not kept (best.keep=false)"
        return f"best: step {b['step']}, {b['metric']} {b['value']:.4g} ({kept})"
