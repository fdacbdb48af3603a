"""`mas-trainer`: one console script, one verb per stage of the product."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from mas_trainer.errors import RunStopped, UserError
from mas_trainer.loop.quiet import quiet_libraries

__all__ = ["main"]


class UsageError(UserError):
    """Bad input from the command line: printed as one line, exit status 2."""


def _load_tasks(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.input is not None:
        try:
            task = json.loads(args.input)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--input is not valid JSON: {exc}") from exc
        if not isinstance(task, dict):
            raise UsageError("--input must be a JSON object, e.g. '{\"question\": \"...\"}'")
        return [task]
    from mas_trainer.tasks import load_tasks

    return load_tasks(args.data)


def _check_model(model: str | None) -> None:
    if model is None or model in ("tiny", "default"):
        return
    if not Path(model).exists() and ("/" not in model or model.startswith((".", "/"))):
        raise UsageError(f"--model {model!r}: no such folder; use tiny, default, a local model folder or a Hugging Face hub id")


def cmd_trace(args: argparse.Namespace) -> int:
    from mas_trainer.run.progress import output_console

    from mas_trainer.api import trace
    from mas_trainer.trace.report import print_trajectories, reward_table

    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError(f"--concurrency {args.concurrency}: run at least 1 rollout at once")
    _check_recursion_limit(args.recursion_limit)
    tasks = _load_tasks(args)
    _check_model(args.model)
    console = output_console()
    result = trace(args.app, tasks, n=args.n, model=args.model, output=args.output, rewards=args.rewards,
                   max_in_flight=args.concurrency, timeout_s=args.timeout, max_tokens=args.max_tokens,
                   otel_exporter=args.otel, recursion_limit=args.recursion_limit, console=console)
    trajs = result.trajectories
    print_trajectories(trajs, console)
    if not args.rewards:
        console.print("rewards: not run (--no-rewards)")
    elif not result.has_rewards:
        console.print("rewards: the app defines none (trainable(..., reward=, role_rewards=, turn_rewards=)): "
                      "fit would give every call 0", markup=False, soft_wrap=True)
    else:
        console.print(reward_table(trajs))
    where = result.output if result.output is not None else "not written (--output FILE keeps them)"
    console.print(f"{len(trajs)} rollouts in {result.elapsed_s:.1f} s → {where}", markup=False, soft_wrap=True)
    if result.failed is not None:
        raise result.failed
    if result.judge_error is not None:
        raise result.judge_error
    if result.reward_errors:  # the first names the reward, its file and line, the level and the rollout
        first = result.reward_errors[0]
        kept = f"the trajectories: {result.output}" if result.output is not None else "--output FILE keeps the trajectories"
        raise type(first)(f"{str(first).splitlines()[0]}; {len(result.reward_errors)} of {len(trajs)} "
                          f"rollouts not scored ({kept})")
    return 0


def _no_held_out(val_fraction: float, train: int, val: int, without_task: int) -> str:
    """Why `data` wrote no held-out task, when it wrote none: no task at all is not a matter of the seed."""
    if not val_fraction or val:
        return ""
    if not train:
        return (f": no run had a task ({without_task} without one); a served run gets it from the app's graph record, an "
                "imported one from its root span's input (OpenInference's input.value, OpenLLMetry's traceloop.entity.input)")
    return ": none fell on the held-out side; try another --seed"


_LAUNCHED: float | None = None


def cmd_fit(args: argparse.Namespace) -> int:
    from mas_trainer.run.progress import output_console

    from mas_trainer import api

    cfg = api.fit_config(args.config, args.overrides, model=args.model)
    if args.warm_start is not None:  # a path as given, not read as YAML (as a key=value override would be)
        cfg = cfg.model_copy(update={"warm_start": cfg.warm_start.model_copy(update={"data": args.warm_start})})
    _check_model(cfg.model)
    console = output_console()
    # the Session says where its gateway listens and whom it answers, at INFO
    session_log = logging.getLogger("mas_trainer.loop.session")
    if session_log.getEffectiveLevel() > logging.INFO:
        session_log.setLevel(logging.INFO)
    try:
        rows = api.fit(args.app, args.data, output=args.output, config=cfg, val_data=args.val_data, resume=args.resume,
                       console=console, started_at=_LAUNCHED).rows
    except KeyboardInterrupt as exc:  # __context__: a second Ctrl-C came while the first waited for an update
        return _interrupted_fit(args.output, forced=isinstance(exc.__context__, KeyboardInterrupt))
    vals = [r for r in rows if r.get("kind") == "val"]
    if vals:
        first, last = vals[0], vals[-1]
        def mean(row: dict[str, Any]) -> str:
            return "-" if row.get("reward/mean") is None else f"{row['reward/mean']:.3f}"

        best = f"; best step {last['best/step']}: served, exported and evaluated by default" if "best/step" in last else ""
        console.print(f"held-out reward: step {first['step']} {mean(first)} -> step {last['step']} {mean(last)}{best}",
                      markup=False, highlight=False, soft_wrap=True)
    trackers = [f"{name}/" for name in cfg.logger if name in ("tensorboard", "wandb")] + (["mlflow.db"] if "mlflow" in cfg.logger else [])
    kept = ", best/" if (Path(args.output) / "best").is_dir() else ""
    console.print(f"run directory: {args.output} (metrics.jsonl, trajectories/, checkpoint/{kept}, rewards.png"
                  f"{''.join(', ' + t for t in trackers)})", markup=False, highlight=False, soft_wrap=True)
    return 0


def _kept(output: str) -> str:
    """What a stopped `fit` left to resume from, in words."""
    from mas_trainer.run.rundir import RunDir

    try:
        state = RunDir(output).load_state()
    except Exception:  # a run directory cut mid-write is not worth a traceback here
        state = None
    return (f"its last checkpoint, step {state['step']}, is kept: add --resume to continue from it"
            if state else "no checkpoint was written yet")


def _interrupted_fit(output: str, *, forced: bool) -> int:
    """Ctrl-C in `fit`: one line saying what was kept; exit status 130. Everything kept was
    committed by an atomic rename (run/rundir.py), so a step cut short is neither kept nor
    counted. After a second Ctrl-C the engine threads may still be inside torch, which aborts at
    interpreter exit: then Ray is shut down and the process leaves at once."""
    print(f"mas-trainer fit: interrupted; {output}: {_kept(output)}", file=sys.stderr, flush=True)
    if not forced:
        return 130
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    os._exit(130)


def _check_recursion_limit(limit: int | None) -> None:
    from mas_trainer.config import MAX_RECURSION

    if limit is not None and not 1 <= limit <= MAX_RECURSION:
        raise UsageError(f"--recursion-limit {limit}: give the LangGraph supersteps a rollout may take, 1 to {MAX_RECURSION} "
                         "(default: the app's own limit)")


def cmd_eval(args: argparse.Namespace) -> int:
    from mas_trainer.run.progress import output_console
    from rich.table import Table

    from mas_trainer.api import evaluate
    from mas_trainer.loop.evaluate import comparison_table, timeout_warning

    _check_model(args.model)
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise UsageError(f"--max-in-flight {args.max_in_flight}: run at least 1 rollout at once")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: give the seconds a rollout may run, more than 0")
    _check_recursion_limit(args.recursion_limit)
    tasks = _load_tasks(argparse.Namespace(input=None, data=args.data))
    if args.checkpoint is not None and args.run is None:
        raise UsageError(f"--checkpoint {args.checkpoint} chooses among the checkpoints of --run: give --run RUN_DIR")
    result = evaluate(args.app, tasks, run=args.run, checkpoint=args.checkpoint, compare=args.compare, model=args.model,
                      n=args.n, seed=args.seed, max_tokens=args.max_tokens, temperature=args.temperature,
                      max_in_flight=args.max_in_flight, timeout_s=args.timeout, recursion_limit=args.recursion_limit)
    console = output_console(stderr=True)
    if args.compare:
        console.print(comparison_table(result, args.run))
        warnings = [f"{side}: {w}" for side in ("base", "trained") if (w := timeout_warning(result[side]))]
    else:
        table = Table(title=f"reward on {len(tasks)} tasks x {args.n} ({'trained: ' + args.run if args.run else 'base models'})")
        table.add_column("")
        for column in ("mean reward", "rollouts scored", "timed out (not scored)"):
            table.add_column(column, justify="right")
        timed_out = result.get("rollouts/timeout", 0)
        table.add_row("overall", f"{result['reward/mean']:.4f}" if result["reward/mean"] is not None else "-",
                      str(result["rollouts"] - timed_out), str(timed_out))
        for key, value in result.items():
            if key.startswith("reward/role/"):
                table.add_row(f"role {key.split('/', 2)[2]}", f"{value:.4f}", "", "")
        console.print(table)
        warnings = [w for w in (timeout_warning(result),) if w]
    for warning in warnings:
        console.print(warning, markup=False, highlight=False, soft_wrap=True)
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mas_trainer.api import export

    # None: each LoRA policy as it was trained (a shared base's as base + adapters, the others merged)
    adapter = True if args.adapter else False if args.merged else None
    out = export(args.run_dir, args.out_dir, adapter=adapter, checkpoint=args.checkpoint)
    manifest = Path(out) / "mas-trainer.json"
    mapping = json.loads(manifest.read_text()) if manifest.is_file() else {}
    bases = mapping.get("bases", {})
    if bases:
        kind = (f"{', '.join(bases)} (the shared base, written once) and one peft adapter folder per policy trained on it"
                if len(bases) == 1 else f"the shared bases {', '.join(bases)} once each and one peft adapter folder per policy")
    else:
        kind = "LoRA adapters kept as adapters" if args.adapter else "one Hugging Face folder per policy"
    print(f"exported the {mapping.get('checkpoint', 'last')} checkpoint (step {mapping.get('step')}) to {out}: {kind} and "
          "mas-trainer.json (role -> model)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mas_trainer.api import serve
    from mas_trainer.serve import resolve_api_key

    routes = _pairs(args.route, "--route", "MODEL=POLICY (e.g. gpt-4o-mini=planner)")
    serve(args.run_dir, host=args.host, port=args.port, routes=routes, api_key=resolve_api_key(args.api_key, args.api_key_file),
          engine=args.engine, record=args.record, record_file_mb=args.record_file_mb, record_max_mb=args.record_max_mb,
          redact=args.redact, model=args.model, checkpoint=args.checkpoint)
    return 0


def _pairs(items: list[str], flag: str, example: str) -> dict[str, str]:
    bad = next((i for i in items if "=" not in i or i.startswith("=") or i.endswith("=")), None)
    if bad is not None:
        raise UsageError(f"{flag} {bad!r} must look like {example}")
    return dict(i.split("=", 1) for i in items)


def cmd_import_traces(args: argparse.Namespace) -> int:
    from mas_trainer.production.otel_import import Receiver, Unmapped, import_traces

    roles = _pairs(args.role, "--role", "KEY=ROLE (e.g. researcher=writer)")
    policies = _pairs(args.policy, "--policy", "ROLE=POLICY")
    if bool(args.files) == bool(args.listen):
        raise UsageError("give FILE... or --listen [HOST:]PORT (one of them)")
    if not args.listen:
        if args.host is not None or args.api_key is not None or args.api_key_file is not None:
            raise UsageError("--host, --api-key and --api-key-file apply to --listen; files are read as they are")
        try:
            report = import_traces(args.files, args.out, roles=roles, policies=policies, strict=args.strict,
                                   input_key=args.input_key)
        except Unmapped as exc:
            print("\n".join(["mas-trainer import-traces: --strict: nothing written", *exc.report.lines()[1:]]), file=sys.stderr)
            return 1
        print("\n".join(report.lines()))
        return 0
    # --listen: until Ctrl-C or SIGTERM; then what is held is written and the report printed
    import signal
    import threading

    from mas_trainer.serve import resolve_api_key
    from mas_trainer.view.server import serve_until_interrupted

    host, _, port = args.listen.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit():
        raise UsageError(f"--listen {args.listen!r}: give PORT or HOST:PORT, e.g. 4318 (on --host, 127.0.0.1 by default)")
    if host and args.host is not None and host != args.host:
        raise UsageError(f"--listen {args.listen} names host {host} and --host {args.host}: give the host once")
    if args.strict:
        raise UsageError("--strict applies to FILE imports; --listen writes each trace as it completes")
    receiver = Receiver(args.out, roles=roles, policies=policies, api_key=resolve_api_key(args.api_key, args.api_key_file),
                        input_key=args.input_key)
    host = host or args.host or "127.0.0.1"
    try:
        server = receiver.server(host, int(port))
    except OSError as exc:
        raise UsageError(f"--listen {host}:{port}: {exc.strerror}; choose another port or --host") from None
    print(f"receiving OTLP/HTTP JSON traces at {server.url} into {args.out} ({receiver.protection()}); "
          "Ctrl-C or SIGTERM to stop", file=sys.stderr, flush=True)
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM ends it as Ctrl-C does: nothing held is lost
        previous = signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        serve_until_interrupted(server)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print("\n".join(receiver.close().lines()), flush=True)
    return 0


def cmd_feedback(args: argparse.Namespace) -> int:
    from mas_trainer.production.scoring import add_feedback, feedback_from_file, score_with_reward

    one = {"--score": args.score, "--label": args.label, "--turn": args.turn, "--comment": args.comment}
    if sum(x is not None for x in (args.run_id, args.from_file, args.reward)) != 1:
        raise UsageError("give RUN_ID --score S (or --label L), --from FILE.jsonl, or --reward APP (one of them)")
    if args.run_id is None and any(v is not None for v in one.values()):
        raise UsageError(f"{', '.join(k for k, v in one.items() if v is not None)}: only with RUN_ID (a --from file's "
                         "lines carry their own; a --reward gives scores)")
    if args.run_id is not None:
        add_feedback(args.folder, args.run_id, score=args.score, label=args.label, turn=args.turn, comment=args.comment)
        print(f"wrote feedback on run {args.run_id} in {args.folder}")
    elif args.from_file is not None:
        done = feedback_from_file(args.folder, args.from_file)
        print(f"wrote {done.entries} feedback entries on {done.runs} runs from {args.from_file} into {args.folder}")
    else:
        done = score_with_reward(args.folder, args.reward)
        spread = f": min {min(done.scores):.4g}, mean {sum(done.scores) / len(done.scores):.4g}, max {max(done.scores):.4g}" \
            if done.scores else ""
        print(f"scored {done.runs} of {done.runs_read} runs in {args.folder} with {args.reward} (trajectory level){spread}; "
              f"not scored: {done.not_applicable} the reward returned None for, {done.not_ok} that failed, "
              f"{done.already} a reward scored before")
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from mas_trainer.api import view

    if args.steps and not args.html:
        raise UsageError("--steps chooses what --html embeds; the server shows every step")
    out = view(args.path, port=args.port, html=args.html or None, steps=args.steps, tokenizer=args.tokenizer)
    if out is not None:
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): one self-contained page, open it in any browser")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from mas_trainer.run.progress import output_console

    from mas_trainer.production.curate import make_datasets

    data = make_datasets(args.folders, args.out, force=args.force, min_score=args.min_score, label=args.label,
                         val_fraction=args.val_fraction, seed=args.seed, roles=args.role)
    r = data.report
    roles = ", ".join(f"{role} {n}" for role, n in sorted(r.sft_by_role.items())) or "none"
    dropped = ", ".join(f"{why} {n}" for why, n in sorted(r.calls_dropped.items())) or "none"
    console = output_console()
    for line in (f"read {r.runs_read} runs ({r.calls_read} LLM calls) from {len(r.folders)} folder(s); "
                 f"{r.runs_without_task} without a task, {r.tasks_duplicate} repeating a task",
                 f"tasks: {r.tasks_train} train, {r.tasks_val} held out (val_fraction {args.val_fraction:g}, seed {args.seed})"
                 + _no_held_out(args.val_fraction, r.tasks_train, r.tasks_val, r.runs_without_task),
                 f"sft: {r.sft_lines} lines from {r.sft_runs} runs (by role: {roles}); calls dropped: {dropped}",
                 *([] if r.runs_scored or not r.runs_read else [
                     "no run has a score or a label, so no call is SFT data: score them with `mas-trainer feedback DIR RUN_ID "
                     "--score S`, `--from FILE.jsonl` or `--reward APP` (imported runs), or POST /v1/feedback while serving"]),
                 f"wrote {args.out}: tasks.jsonl, val.jsonl, sft.jsonl, report.json"):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    lines, files = sum(r.lines_skipped.values()), sum(r.files_skipped.values())
    if lines or files or r.records_unknown_fields:  # what was not read, so it is not taken for all of the input
        def why(counts: dict[str, int]) -> str:
            return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()) if n) or "none"

        console.print(f"skipped: {lines} lines ({why(r.lines_skipped)}), {files} files ({why(r.files_skipped)}); "
                      f"{r.records_unknown_fields} records with fields this version does not know (those fields ignored)",
                      markup=False, highlight=False, soft_wrap=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mas-trainer", description="Train LangGraph multi-agent apps with multi-agent RL.")
    sub = parser.add_subparsers(dest="verb", required=True)

    p = sub.add_parser("trace", help="dry run: run the app on tasks, score them, write trajectories, print node/LLM call trees",
                       description="Run APP on tasks with every LLM call routed to its role's policy, and score the rollouts "
                                   "with the app's rewards as fit would; no training.")
    p.add_argument("app", metavar="APP", help="path/to/file.py:attr or package.module:attr (graph, builder or function)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="one task as a JSON object")
    src.add_argument("--data", help="tasks: JSON lines, a .json list, or hf:NAME[:CONFIG]:SPLIT (a Hugging Face dataset)")
    p.add_argument("--model", default=None, help="base model of every policy: tiny | default | PATH (default: as the app says)")
    p.add_argument("--output", default=None, help="write the trajectories here (JSON lines; default: printed only, "
                                                  "nothing written)")
    p.add_argument("--n", type=int, default=1, help="rollouts per task")
    p.add_argument("--concurrency", type=int, default=None, help="rollouts in flight at once (default: the engine's "
                                                                   "max batch size, so the tool's own load does not "
                                                                   "time rollouts out)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a rollout is stopped (status timeout)")
    p.add_argument("--recursion-limit", type=int, default=None, help="LangGraph supersteps a rollout may take (default: "
                                                                       "the app's own limit, else LangGraph's)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens for requests that set none")
    p.add_argument("--otel", choices=["none", "console", "otlp"], default=None, help="also export spans (otlp: OTEL_EXPORTER_OTLP_* env)")
    p.add_argument("--rewards", action=argparse.BooleanOptionalAction, default=True,
                   help="run the app's reward functions (trajectory, role, turn) on the rollouts as fit would, print them "
                        "and write them into each trajectory's `rewards` (default); --no-rewards skips them")
    p.set_defaults(func=cmd_trace)

    from mas_trainer.config import describe_keys
    from mas_trainer.run.rundir import CHECKPOINTS

    checkpoint_help = ("which of the run's checkpoints: best (the best held-out evaluation by best.metric; the default where "
                       "the run kept one) or last")

    p = sub.add_parser(
        "fit", help="train the app's policies with multi-agent RL",
        description="Run APP on tasks, score rollouts, and update every trainable policy (verl estimators and losses).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (YAML file and/or key=value overrides) with their defaults:\n" + "\n".join(describe_keys()),
    )
    p.add_argument("app", metavar="APP", help="path/to/file.py:attr or package.module:attr")
    p.add_argument("--data", required=True, help="training tasks: JSON lines, a .json list, or hf:NAME[:CONFIG]:SPLIT")
    p.add_argument("--val-data", default=None, help="held-out tasks, same forms (default: val_fraction of --data, if set)")
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("--model", default=None, help="base model of every policy: tiny | default | PATH")
    p.add_argument("--output", default="runs/fit", help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in --output from its last checkpoint")
    p.add_argument("--warm-start", default=None, metavar="FILE", help="supervised turns (JSONL, `mas-trainer data`) each "
                   "policy trains on before RL, in a fresh run (sets warm_start.data; docs/training.md)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. learner.lr=1e-5 rollout.n=8")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("eval", help="reward of the app on tasks, with the base or a run's trained policies",
                       description="Run APP on tasks and report the mean reward overall and per role (table on stderr, JSON on stdout).")
    p.add_argument("app", metavar="APP", help="path/to/file.py:attr or package.module:attr")
    p.add_argument("--data", required=True, help="tasks: JSON lines, a .json list, or hf:NAME[:CONFIG]:SPLIT")
    p.add_argument("--run", default=None, help="a fit run directory: its trained policies, engine settings, allocator "
                                                "and rollout settings (default: base models, fit's defaults)")
    p.add_argument("--model", default=None, help="base model of policies not trained in --run: tiny | default | PATH "
                                                  "(default: the run's, else as the app says)")
    p.add_argument("--n", type=int, default=1, help="rollouts per task")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens for requests that set none (default: the run's rollout.max_tokens, else 64)")
    p.add_argument("--temperature", type=float, default=None, help="temperature of every LLM call (0: greedy; default: the run's "
                                                                    "rollout.val_temperature, else the app's own)")
    p.add_argument("--max-in-flight", type=int, default=None, help="rollouts running at once (default: the run's "
                                                                    "rollout.max_in_flight, else runtime.max_batch_size)")
    p.add_argument("--timeout", type=float, default=None, help="seconds a rollout may run; longer ones are counted as timed "
                                                                "out, not scored (default: the run's rollout.timeout_s, else 300)")
    p.add_argument("--recursion-limit", type=int, default=None, help="LangGraph supersteps a rollout may take (default: "
                                                                       "the run's rollout.recursion_limit, else the app's own)")
    p.add_argument("--compare", default=None, metavar="base", help="also run --run's base models on the same tasks with the "
                   "same seeds: both sides' mean rewards, the paired difference and its spread over the tasks (docs/training.md)")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default=None, help=checkpoint_help)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="one Hugging Face folder per trained policy, plus role -> model",
                       description="Copy a run's trained policies out as Hugging Face folders (transformers, vllm serve) into "
                                   "OUT_DIR (new or empty), with mas-trainer.json (role -> policy -> folder). A policy trained "
                                   "with learner.lora_rank is written merged into its base (a plain folder); policies trained "
                                   "as adapters of one shared base (learner.shared_base) are written as they trained: the base "
                                   "once (OUT_DIR/base, a plain folder) and one peft adapter folder per policy naming it "
                                   "(vllm serve OUT_DIR/base --enable-lora --lora-modules NAME=OUT_DIR/NAME ...).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--adapter", action="store_true",
                     help="policies trained with learner.lora_rank: write the peft adapter (small; PeftModel.from_pretrained, "
                          "vllm --enable-lora), its base named by its folder on this machine, instead of base + adapter "
                          "merged into one plain folder (a shared base's adapters: the default already)")
    how.add_argument("--merged", action="store_true",
                     help="every LoRA policy, a shared base's too, as base + adapter merged into one plain folder "
                          "(transformers' from_pretrained, vllm serve FOLDER), no base folder")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default=None, help=checkpoint_help)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="serve a run's trained policies behind one OpenAI-compatible endpoint",
                       description="Serve RUN_DIR's policies (or APP's base policies, APP being path.py:graph); the unedited "
                                   "@trainable app pointed here (OPENAI_BASE_URL) gets each node's answer from the policy it "
                                   "was trained as.")
    p.add_argument("run_dir", metavar="RUN_DIR|APP")
    p.add_argument("--model", default=None, help="with APP: every policy's base model (tiny | default | PATH | hub id)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this bearer token (401 otherwise); visible to local users in "
                                                    "the process list: prefer --api-key-file or $MAS_TRAINER_API_KEY")
    p.add_argument("--api-key-file", default=None, help="read the bearer token from the first line of this file")
    p.add_argument("--route", action="append", default=[], metavar="MODEL=POLICY",
                   help="serve requests that name no node and ask for MODEL with POLICY (repeatable)")
    p.add_argument("--engine", choices=["embedded", "vllm", "torch-replica"], default="embedded",
                   help="what answers the trained policies: the embedded torch engine, vLLM replicas (GPUs, docs/vllm.md), "
                        "or the embedded engine as replicas")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="keep each served run (its LLM calls) as JSON lines under DIR and accept POST /v1/feedback on them; "
                        "off by default: nothing is written without it")
    p.add_argument("--record-file-mb", type=float, default=64, metavar="MB", help="start a new runs file past this size")
    p.add_argument("--record-max-mb", type=float, default=1024, metavar="MB",
                   help="delete the oldest runs files past this total of recorded calls and graph records (their "
                        "runs can no longer get feedback); feedback is bounded apart, at most a quarter of it")
    p.add_argument("--redact", default=None, metavar="MODULE:FUNCTION",
                   help="a str -> str function applied to every recorded text before it reaches disk")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default=None, help=checkpoint_help)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("data", help="datasets from served runs: tasks for fit, held-out tasks, per-role SFT lines",
                       description="Read record folders (serve --record) and write OUT/tasks.jsonl (train-side graph inputs), "
                                   "val.jsonl (held-out ones), sft.jsonl (the LLM calls of well-scored runs) and report.json; "
                                   "see docs/serving.md.")
    p.add_argument("folders", nargs="+", metavar="RECORD_DIR", help="folders written by `mas-trainer serve --record`")
    p.add_argument("--out", required=True, help="output folder (new or empty, unless --force)")
    p.add_argument("--min-score", type=float, default=None, help="keep calls scored at least this (run score, or the "
                                                                  "call's own; default 1.0 unless --label is given)")
    p.add_argument("--label", default=None, help="keep calls labelled this (the call's own labels, else its run's)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of tasks held out in val.jsonl (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="which tasks are held out (a hash of seed and task)")
    p.add_argument("--role", action="append", default=None, help="only these roles' calls in sft.jsonl (repeatable)")
    p.add_argument("--force", action="store_true", help="replace the datasets in a non-empty --out")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("import-traces", help="OTel GenAI spans of an app traced elsewhere (OTLP JSON) -> a record folder",
                       description="Read OTLP/JSON trace exports (one request per file, or one per line), map each trace "
                                   "with LLM spans under LangGraph nodes to a run, and append the runs to DIR in serve "
                                   "--record's format. What cannot be mapped is reported, never guessed (docs/serving.md).")
    p.add_argument("files", nargs="*", metavar="FILE", help="OTLP JSON files (one export request, or one per line)")
    p.add_argument("--listen", default=None, metavar="[HOST:]PORT", help="instead of files, receive OTLP/HTTP JSON at "
                                                                          "POST /v1/traces (e.g. 4318) until Ctrl-C or SIGTERM")
    p.add_argument("--host", default=None, help="with --listen: address to bind (default 127.0.0.1)")
    p.add_argument("--api-key", default=None, help="with --listen: require this bearer token (401 otherwise); visible to "
                                                    "local users in the process list: prefer --api-key-file or $MAS_TRAINER_API_KEY")
    p.add_argument("--api-key-file", default=None, help="with --listen: read the bearer token from the first line of this file")
    p.add_argument("--out", required=True, metavar="DIR", help="record folder to append to (runs already in it are skipped)")
    p.add_argument("--role", action="append", default=[], metavar="KEY=ROLE",
                   help="the role of the calls KEY names: a node's path or name, or an agent's name (default: the node's "
                        "path, a sub-agent's name; repeatable)")
    p.add_argument("--policy", action="append", default=[], metavar="ROLE=POLICY", help="the policy of a role's calls "
                                                                                         "(default: the role; repeatable)")
    p.add_argument("--strict", action="store_true", help="anything that cannot be imported is an error (exit 1, nothing written)")
    p.add_argument("--input-key", default=None, metavar="FIELD", help="a root input that is plain text is the graph input's "
                                                                      "FIELD (OpenInference writes a one-field input as its text)")
    p.set_defaults(func=cmd_import_traces)

    p = sub.add_parser("feedback", help="scores and labels for the runs of a record folder (imported traces): one run, a file, "
                                        "or a reward function",
                       description="Give feedback on the runs of RECORD_DIR (import-traces --out, or a stopped serve --record) "
                                   "as POST /v1/feedback gives it while serving, so `data` can choose among them: one run's "
                                   "score or label, a JSON-lines file of them, or a reward function's scores (all or nothing; "
                                   "docs/serving.md).")
    p.add_argument("folder", metavar="RECORD_DIR", help="a record folder no server is writing")
    p.add_argument("run_id", nargs="?", default=None, metavar="RUN_ID", help="the run (32 hex: the trace id) to score")
    p.add_argument("--score", type=float, default=None, help="with RUN_ID: a finite number")
    p.add_argument("--label", default=None, help="with RUN_ID: a label (e.g. good)")
    p.add_argument("--turn", default=None, help="with RUN_ID: one of its calls' ids, to score that call alone")
    p.add_argument("--comment", default=None, help="with RUN_ID: a note kept with it")
    p.add_argument("--from", dest="from_file", default=None, metavar="FILE.jsonl",
                   help='one POST /v1/feedback body a line: {"run_id": ..., "score": ..., "label": ..., "turn": ...}')
    p.add_argument("--reward", default=None, metavar="APP|FILE.py:FUNCTION",
                   help="score each run with a function (task, final_state, trajectory) -> float | None, or an app's "
                        "@trainable(reward=...); runs a reward scored before are left as they are")
    p.set_defaults(func=cmd_feedback)

    p = sub.add_parser("view", help="look at a run in the browser: curves, graphs of node calls, tokens, rewards",
                       description="Serve a local page (127.0.0.1 only) showing RUN_DIR's reward and held-out curves and, per step, "
                                   "each rollout's node calls, LLM calls (tokens coloured by log-prob or advantage), tool calls "
                                   "and rewards; the rollouts of one task side by side. --html writes the same page as one file.")
    p.add_argument("path", metavar="RUN_DIR|TRAJECTORIES.jsonl", help="a fit run directory, or one trajectories file (fit, trace)")
    p.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default 8765; 0: any free port)")
    p.add_argument("--html", metavar="OUT", default=None, help="write one self-contained HTML file instead of serving")
    p.add_argument("--steps", default=None, help="with --html: all (default), last, or a comma list of step numbers / "
                                                 "file names (e.g. 1,10,step_000010_val)")
    p.add_argument("--tokenizer", default=None, help="decode response tokens with this tokenizer (tiny | default | PATH | HF id; "
                                                     "default: each policy's checkpoint, else its base model)")
    p.set_defaults(func=cmd_view)
    return parser


LOG_ENV = "MAS_TRAINER_LOG"


class _StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a record comes, not as it was when the handler was
    made: `main` may run again in one process (the Python API, tests) with stderr replaced in
    between, and a handler holding the old, closed stream printed a traceback for every record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201  (logging's own attribute)
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def _configure_logging(levels: str) -> None:
    """`MAS_TRAINER_LOG`: a level for all of mas-trainer and/or LOGGER=LEVEL pairs, comma
    separated (`INFO`, `mas_trainer.gateway=DEBUG`); WARNING by default. The handler sits on
    the `mas_trainer` logger only: other libraries' logging is left as it was."""
    top = logging.getLogger("mas_trainer")
    if not any(isinstance(h, _StderrHandler) for h in top.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        top.addHandler(handler)
    top.setLevel(logging.WARNING)
    for item in filter(None, (part.strip() for part in levels.split(","))):
        name, _, level = item.rpartition("=")
        if level.upper() not in logging.getLevelNamesMapping():
            raise UsageError(f"{LOG_ENV}={levels!r}: {level!r} is not a level; write e.g. INFO or INFO,mas_trainer.gateway=DEBUG")
        logging.getLogger(name or "mas_trainer").setLevel(level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    global _LAUNCHED
    _LAUNCHED = time.perf_counter()  # fit's clock starts here, start-up included
    parser = _parser()
    # key=value overrides may come before or after options; argparse alone cannot mix them
    args, extra = parser.parse_known_args(argv)
    if args.verb == "fit":
        args.overrides = [*args.overrides, *(e for e in extra if "=" in e and not e.startswith("-"))]
        extra = [e for e in extra if e not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _configure_logging(os.environ.get(LOG_ENV, ""))
        quiet_libraries()  # every verb: no third-party progress bars (model loads in eval, serve, trace)
        return args.func(args)
    except RunStopped as exc:  # not the user's input: exit 1, and what is kept to resume from
        kept = f"; {args.output}: {_kept(args.output)}" if args.verb == "fit" else ""
        print(f"mas-trainer {args.verb}: error: {str(exc).splitlines()[0]}{kept}", file=sys.stderr)
        return 1
    except UserError as exc:
        print(f"mas-trainer {args.verb}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
