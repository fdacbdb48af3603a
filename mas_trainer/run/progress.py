"""What `fit` shows while it runs: one line per training step and per held-out evaluation,
with rounded figures, and a live bar with the ETA on a terminal.

```
step 3/20  reward 0.563 (critic 0.563, planner 1.090, writer 0.563)  7.86 rollouts/s  283 tok/s  rollout 1.0s  update 0.2s  ETA 41s
held-out at step 10: reward 0.612 (critic 0.612, planner 1.120, writer 0.612)  16 rollouts in 4.2s
```

The lines are the `console` tracker (`logger`); the bar is drawn only where the output is a
terminal (piped into a file or CI log, only the lines are written). Full-precision figures
are in `metrics.jsonl` and the other trackers.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

__all__ = ["FitProgress", "duration", "eta_seconds", "number", "output_console", "step_line", "val_line", "warm_start_lines"]

PIPED_WIDTH = 200


def output_console(*, stderr: bool = False) -> Console:
    """The verbs' console. Piped into a file or a CI log, rich would lay tables out for 80
    columns and wrap their rows; there a log has no width, so rows are laid out for
    `PIPED_WIDTH` (COLUMNS, when set, still wins). On a terminal, the terminal's width."""
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=PIPED_WIDTH)
    return console


def number(value: float | None) -> str:
    """A figure rounded for reading: 3 significant digits, no exponent below a million."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    v = float(value)
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    if abs(v) >= 0.01:
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
    return f"{v:.2g}"


def _reward(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def duration(seconds: float | None) -> str:
    """`0.4s`, `12s`, `3m05s`, `1h02m`."""
    if seconds is None or math.isnan(seconds) or seconds < 0:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _rewards(row: dict[str, Any]) -> str:
    roles = [f"{k.split('/', 2)[2]} {_reward(v)}" for k, v in row.items() if k.startswith("reward/role/")]
    return f"reward {_reward(row.get('reward/mean'))}" + (f" ({', '.join(roles)})" if roles else "")


def _failed(row: dict[str, Any]) -> str:
    bad = {k.split("/", 1)[1]: v for k, v in row.items() if k in ("rollouts/error", "rollouts/timeout") and v}
    dropped = row.get("rollouts/dropped") or 0
    parts = [f"{v} {k}" for k, v in bad.items()] + ([f"{dropped} dropped"] if dropped else [])
    return f" ({', '.join(parts)})" if parts else ""


def _ahead(row: dict[str, Any]) -> str:
    """rollout.max_staleness: rollouts that ran during the last update, and the wait left after it."""
    return f" (ahead, waited {duration(row.get('time/rollout_wait_s'))})" if row.get("rollout/overlapped") else ""


def step_line(row: dict[str, Any], steps: int, eta_s: float | None) -> str:
    """One training step, every figure rounded."""
    groups = (f"  groups {row['rollout/groups_kept']}/{row['rollout/groups']} kept"  # rollout.filter_groups
              if row.get("rollout/groups") is not None else "")
    forks = (f"  forks {int(row['forks/runs'])} in {duration(row.get('time/fork_s'))}"  # reward.allocator=counterfactual
             if row.get("forks/runs") else "")
    return (f"step {row['step']}/{steps}  {_rewards(row)}{groups}{forks}  "
            f"{number(row.get('perf/rollouts_per_s'))} rollouts/s{_failed(row)}  {number(row.get('perf/tokens_per_s'))} tok/s  "
            f"rollout {duration(row.get('time/rollout_s'))}{_ahead(row)}  update {duration(row.get('time/update_s'))}  "
            f"ETA {duration(eta_s) if row['step'] < steps else '0s'}")


def val_line(row: dict[str, Any]) -> str:
    """One held-out evaluation."""
    return (f"held-out at step {row['step']}: {_rewards(row)}  "
            f"{row.get('rollouts', 0)} rollouts{_failed(row)} in {duration(row.get('time/eval_s'))}")


def eta_seconds(elapsed_s: float, done: int, remaining: int) -> float | None:
    """Time left at the mean pace of the steps this process ran (evaluations and checkpoints
    included, as they recur)."""
    return elapsed_s / done * remaining if done > 0 else None


class _Eta(ProgressColumn):
    """The ETA of the last step line, counting down between steps."""

    def render(self, task: Task) -> Text:
        deadline = task.fields.get("deadline")
        if task.finished:
            return Text("ETA 0s")
        return Text("ETA " + (duration(max(0.0, deadline - time.perf_counter())) if deadline is not None else "?"))


class _SinceLaunch(ProgressColumn):
    """Time since `fit` was launched (start-up included), not since the bar appeared."""

    def render(self, task: Task) -> Text:
        return Text(duration(time.perf_counter() - task.fields["launched"]))


def warm_start_lines(row: dict[str, Any]) -> list[str]:
    """One line per policy of a warm-start row: its steps, turns and loss, first step -> last."""
    policies = sorted({k.split("/")[1] for k in row if k.startswith("policy/") and k.endswith("/sft_loss")})
    def n(p: str, key: str, word: str) -> str:
        value = int(row[f"policy/{p}/{key}"])
        return f"{value} {word}{'s' * (value != 1)}"

    return [f"warm start {p}: {n(p, 'sft_steps', 'step')} on {n(p, 'sft_examples', 'turn')}, "
            f"sft_loss {row[f'policy/{p}/sft_loss_first']:.3f} -> {row[f'policy/{p}/sft_loss']:.3f}" for p in policies]


class FitProgress:
    """The step lines (when `lines`) and, on a terminal, a live bar; `show(row)` for each
    metrics row `fit` records. `launched`: the `time.perf_counter()` of the launch, where the
    bar's clock starts."""

    def __init__(self, console: Console, steps: int, start_step: int = 0, lines: bool = True,
                 launched: float | None = None) -> None:
        self.console, self.steps, self.start_step, self.lines = console, steps, start_step, lines
        self._t0 = time.perf_counter()
        self._bar = Progress(TextColumn("[bold]fit"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                             _SinceLaunch(), _Eta(), console=console, transient=True, disable=not console.is_terminal)
        self._task = self._bar.add_task("fit", total=steps, completed=start_step, info="", deadline=None,
                                        launched=self._t0 if launched is None else launched)

    def __enter__(self) -> "FitProgress":
        self._t0 = time.perf_counter()
        self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.stop()

    def eta(self, step: int) -> float | None:
        return eta_seconds(time.perf_counter() - self._t0, step - self.start_step, self.steps - step)

    def print(self, line: str) -> None:
        self._bar.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def show(self, row: dict[str, Any]) -> None:
        if row.get("kind") in ("warm_start", "val"):
            if self.lines:
                for line in warm_start_lines(row) if row["kind"] == "warm_start" else [val_line(row)]:
                    self.print(line)
            return
        step = int(row["step"])
        eta = self.eta(step)
        self._bar.update(self._task, completed=step, info=f"reward {_reward(row.get('reward/mean'))}",
                         deadline=None if eta is None else time.perf_counter() + eta)
        if self.lines:
            self.print(step_line(row, self.steps, eta))
