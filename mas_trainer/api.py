"""The Python API: what `mas-trainer fit`, `eval` and `export` do, from a script or a notebook.

```python
import mas_trainer
from app import graph                       # an @trainable StateGraph (or "app.py:graph")

run = mas_trainer.fit(graph, "tasks.jsonl", output="runs/mine", overrides={"steps": 20, "learner.lr": 1e-5})
run.held_out[-1]["reward/mean"]             # every metrics row is there; run.output holds the run directory
mas_trainer.evaluate(graph, "held_out.jsonl", run=run.output)
mas_trainer.export(run.output, "exported/")
```

`trace` (rollouts without training, scored with the app's rewards), `serve` and `view` are
here too (as `mas_trainer.api.trace` and so on: `mas_trainer.trace`, `.serve` and `.view` name
the packages that implement them). The CLI's verbs call these functions with what they parsed,
so the two cannot drift apart:
data is a path (JSONL or JSON), `hf:NAME[:CONFIG]:SPLIT` or a list of dicts; configuration
is a YAML file, a mapping, or `key=value` strings, checked as `fit --help` documents them.
Each call blocks until done, also inside a running event loop (a Jupyter notebook's cell):
the rollouts then run on a loop in a thread of their own (`Session.complete`).
Like the CLI, they keep third-party progress bars (Hugging Face weight loads and writes) off
stderr; HF_HUB_DISABLE_PROGRESS_BARS=0 keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from mas_trainer.tasks import load_tasks
from mas_trainer.errors import UserError
from mas_trainer.loop.quiet import quiet_libraries

if TYPE_CHECKING:
    import threading

    from rich.console import Console

    from mas_trainer.config import FitConfig
    from mas_trainer.trace.schema import Trajectory

__all__ = ["FitResult", "TraceResult", "evaluate", "export", "fit", "fit_config", "serve", "trace", "view"]


@dataclass
class FitResult:
    """A finished (or resumed and finished) run: its directory and every metrics row."""

    output: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def train(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == "train"]

    @property
    def held_out(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == "val"]

    @property
    def policies(self) -> dict[str, Path]:
        """policy -> its trained Hugging Face folder, what `export`, `serve` and `evaluate` load: the
        best checkpoint where the run kept one, else the last ({} before the first checkpoint)."""
        from mas_trainer.config import ConfigError
        from mas_trainer.run.rundir import trained_checkpoint

        try:
            return trained_checkpoint(self.output).policies
        except ConfigError:  # no checkpoint yet
            return {}

    @property
    def best(self) -> dict[str, Any] | None:
        """The best held-out evaluation the last checkpoint committed (step, metric, mode, value,
        kept: its weights in `output/best/step_N`), None without one."""
        from mas_trainer.run.rundir import RunDir

        state = RunDir(self.output).load_state()
        return state["best"] if state else None


def fit_config(config: str | Path | Mapping[str, Any] | FitConfig | None = None,
               overrides: Mapping[str, Any] | Iterable[str] = (), *, model: str | None = None) -> FitConfig:
    """The checked configuration from a YAML file or a mapping, then `overrides`
    (`{"learner.lr": 1e-5}` or `["learner.lr=1e-5"]`); `model` as `fit --model`."""
    from mas_trainer.config import FitConfig, load_config

    # a mapping's values are Python values, applied after the file (dotted keys, in order)
    items = [] if isinstance(overrides, Mapping) else list(overrides)
    base = {**(dict(overrides) if isinstance(overrides, Mapping) else {}), **({"model": model} if model else {})}
    if isinstance(config, FitConfig):
        if not items and not base:
            return config
        return load_config(None, items, base={**config.model_dump(mode="json"), **base})
    if isinstance(config, Mapping):
        return load_config(None, items, base={**config, **base})
    return load_config(config, items, base=base)


def fit(app: Any, data: str | Path | Iterable[dict[str, Any]], *, output: str | Path = "runs/fit",
        config: str | Path | Mapping[str, Any] | FitConfig | None = None, overrides: Mapping[str, Any] | Iterable[str] = (),
        model: str | None = None, val_data: str | Path | Iterable[dict[str, Any]] | None = None, resume: bool = False,
        console: Console | None = None, started_at: float | None = None) -> FitResult:
    """Train `app` (an @trainable graph, or `"file.py:attr"` / `"pkg.mod:attr"`) on `data`;
    progress goes to `console` (default: the terminal). Raises UserError (one line) on bad
    input, before anything starts where it can be known then. `started_at` (a
    `time.perf_counter()` reading, default: now) is where the run's clock starts: the CLI
    passes its launch, so start-up counts."""
    import time

    from mas_trainer.loop.trainer import fit as run_fit

    quiet_libraries()  # no third-party progress bars, as from the CLI
    started_at = time.perf_counter() if started_at is None else started_at
    cfg = fit_config(config, overrides, model=model)
    tasks = load_tasks(data)
    val = load_tasks(val_data) if val_data is not None else None
    rows = run_fit(app, tasks, cfg, output, val_tasks=val, resume=resume, console=console, started_at=started_at)
    return FitResult(Path(output), rows)


def evaluate(app: Any, data: str | Path | Iterable[dict[str, Any]], *, run: str | Path | None = None,
             compare: str | None = None, **options: Any) -> dict[str, Any]:
    """Mean reward of `app` on `data`, overall and per role, with the trained policies of `run`
    (else the base models); `options` as `mas-trainer eval`'s (n, seed, max_tokens, temperature,
    max_in_flight, timeout_s, model; checkpoint: "best" or "last" of `run`). `compare="base"`
    (`eval --compare base`) measures `run`'s trained policies and their base models on the same
    tasks with the same seeds and returns both, each task's rewards and the paired difference
    with its spread (`mas_trainer.loop.evaluate.compare`)."""
    from mas_trainer.loop.evaluate import compare as run_compare, evaluate as run_evaluate

    quiet_libraries()  # no third-party progress bars, as from the CLI
    if compare is None:
        return run_evaluate(app, load_tasks(data), run_dir=run, **options)
    return run_compare(app, load_tasks(data), run_dir=run, against=compare, **options)


def export(run: str | Path, out_dir: str | Path, *, adapter: bool | None = None, checkpoint: str | None = None) -> Path:
    """One Hugging Face folder per trained policy of `run`, plus `mas-trainer.json`: the
    `export` verb's. `adapter`: None writes a shared base's policies as the base once plus one
    adapter each and other LoRA policies merged; True every LoRA policy as its adapter; False
    every one merged (docs/shared_base.md). `checkpoint`: "best" or "last" (default: the best
    where the run kept one)."""
    from mas_trainer.production.export import export as run_export

    quiet_libraries()  # no third-party progress bars, as from the CLI
    return run_export(run, out_dir, adapter=adapter, checkpoint=checkpoint)


@dataclass
class TraceResult:
    """What `trace` ran: the trajectories (rewards in them when scored) and what went wrong.

    `reward_errors`: one per rollout whose reward raised (it names the reward's FILE:LINE, the
    level and the rollout; that rollout is left unscored); `judge_error`: a group reward (an
    LLM judge) that refused the whole batch."""

    trajectories: list[Trajectory]
    elapsed_s: float
    has_rewards: bool
    scored: bool
    reward_errors: list[UserError] = field(default_factory=list)
    judge_error: UserError | None = None
    output: Path | None = None

    @property
    def failed(self) -> UserError | None:
        """The one-line error when every rollout failed (what `mas-trainer trace` exits 2 with)."""
        from mas_trainer.loop.evaluate import every_rollout_failed

        return every_rollout_failed(self.trajectories, f"the trajectories: {self.output}" if self.output else "")


def trace(app: Any, data: str | Path | Iterable[dict[str, Any]], *, n: int = 1, model: str | None = None,
          output: str | Path | None = None, rewards: bool = True, max_in_flight: int | None = None,
          timeout_s: float | None = 300.0, max_tokens: int = 256, otel_exporter: str | None = None,
          recursion_limit: int | None = None, console: Console | None = None) -> TraceResult:
    """Run `app` on `data` (`n` rollouts a task) without training and score the rollouts with
    its rewards as `fit` would (with fit's default reward settings; `rewards=False` skips them).
    `recursion_limit` (`trace --recursion-limit`) replaces the app's own (None: it stands).
    Writes one trajectory a line to `output` when given; prints the app and the gateway to
    `console` when given."""
    import time

    from mas_trainer.config import load_config
    from mas_trainer.rewards import RewardSpec
    from mas_trainer.loop.evaluate import score_rollouts
    from mas_trainer.loop.session import Session

    quiet_libraries()  # no third-party progress bars, as from the CLI
    tasks = load_tasks(data)
    with Session(model=model, max_in_flight=max_in_flight, timeout_s=timeout_s, otel_exporter=otel_exporter,
                 default_max_tokens=max_tokens) as session:
        loaded = session.load_app(app, recursion_limit=recursion_limit, recursion_limit_from="--recursion-limit")
        if console is not None:
            console.print(f"[bold]{app if isinstance(app, str) else 'app'}[/]: {len(loaded.spec.nodes)} nodes; policies "
                          f"{loaded.spec.describe_policies()}; recursion limit {loaded.describe_recursion_limit()}")
            console.print(f"gateway {session.describe_gateway()}", markup=False, soft_wrap=True)
        start = time.perf_counter()
        trajs = session.run(tasks, n=n)
        elapsed = time.perf_counter() - start
        # scored while the session is up: a reward may call the app's own services
        spec = RewardSpec.of(loaded.spec.declared)
        result = TraceResult(trajs, elapsed, has_rewards=any(x is not None for x in (spec.trajectory, spec.roles, spec.turns)),
                             scored=False, output=Path(output) if output is not None else None)
        if rewards and result.has_rewards:
            try:
                _, errors = score_rollouts(spec, trajs, load_config().reward, keep_going=True)
            except UserError as exc:  # a group reward (an LLM judge) refused the whole batch
                result.judge_error = exc
            else:
                result.scored, result.reward_errors = True, list(errors)
    if result.output is not None:
        result.output.parent.mkdir(parents=True, exist_ok=True)
        with result.output.open("w") as f:
            for t in trajs:
                f.write(t.to_json() + "\n")
    return result


def serve(run: str | Path, *, host: str = "127.0.0.1", port: int = 8000, routes: Mapping[str, str] | None = None,
          api_key: str | None = None, engine: str = "embedded", ready: threading.Event | None = None,
          stop: threading.Event | None = None, record: str | Path | None = None, record_file_mb: float = 64,
          record_max_mb: float = 1024, redact: str | Callable[[str], str] | None = None, model: str | None = None,
          checkpoint: str | None = None) -> None:
    """Serve the trained policies of `run` (a run directory; or an app, "file.py:attr", on its
    base policies, `model` replacing their base model) behind one OpenAI-compatible endpoint until SIGINT or
    SIGTERM (or until `stop` is set; `ready` is set once it accepts requests). `routes` maps
    a client's model name to a policy; `api_key` is required of every request when given.
    `record`: a folder where each served run is kept (rotated at `record_file_mb`, at most
    `record_max_mb` in all), its texts passed through `redact` (a function or "module:function")
    first; feedback on those runs is then taken at POST /v1/feedback (docs/serving.md). `checkpoint`: the
    run's "best" or "last" (default: the best where the run kept one)."""
    from mas_trainer.serve import serve as run_serve

    quiet_libraries()  # no third-party progress bars, as from the CLI
    run_serve(run, host=host, port=port, routes=routes, api_key=api_key, engine=engine, ready=ready, stop=stop,
              record=record, record_file_mb=record_file_mb, record_max_mb=record_max_mb, redact=redact, model=model,
              checkpoint=checkpoint)


def view(path: str | Path, *, port: int = 8765, html: str | Path | None = None, steps: str | None = None,
         tokenizer: str | None = None) -> Path | None:
    """Browse a run directory (or one trajectories file): serve the viewer on 127.0.0.1:`port`
    until Ctrl-C, or with `html` write one self-contained page (the `steps` chosen) and return it."""
    from mas_trainer.view import ViewSource, serve_view, write_html

    source = ViewSource(path, tokenizer=tokenizer)
    if html is not None:
        return write_html(source, html, steps=steps)
    if steps:
        raise UserError("steps chooses what html embeds; the server shows every step")
    serve_view(source, port=port)
    return None
