"""The loop from production back to training, end to end, on the RAG QA app.

    serve the base graph --record  ->  users ask, and score what they got (feedback)
    -> mas-trainer data (tasks, per-role supervised data from runs that scored well, held-out)
    -> mas-trainer fit --warm-start (a supervised phase, then RL)  ->  serve the trained run

and the held-out score of the *served* graph before and after. Every step is the command a
user would run (`mas-trainer serve`, `data`, `fit` as subprocesses); this script only plays
the users: it invokes the unedited app against the server, as a production app would, and
posts feedback with `mas_trainer.production.client.feedback`.

The simulated users know each question's reference answer (the dataset's `answer`): their
feedback score is the token F1 of the app's prediction, and they send the reference along in
the graph input (the graph ignores it), so the tasks `data` builds carry what `fit`'s reward
reads. In production the reference would come from labels, or the reward from a judge.

    python examples/closed_loop/loop.py --seed 1 [--model default|tiny] [--users 96] [--steps 5] --out runs/loop

Writes OUT/seed_S/{served_base,served_after}/ (records), data/, run/, and OUT/seed_S/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
RAG = ROOT / "examples" / "langgraph_apps" / "rag_qa"
APP = f"{RAG / 'app.py'}:graph_answerer"  # answer trained, rewrite frozen (the README's demo)
CLI = [sys.executable, "-m", "mas_trainer.cli"]
# the RL options of the RAG QA demo (scripts/demo.sh, docs/results/rag_qa.md: each measured there)
DEMO = ["rollout.tasks_per_step=8", "rollout.n=4", "rollout.temperature=0.7", "rollout.filter_groups=true",
        "rollout.min_groups=4", "learner.lr=2e-5", "learner.mini_batch_size=16", "learner.share_prompts=true",
        "learner.skip_zero_advantage=true", "runtime.execution=local", "runtime.max_batch_size=32"]


def _rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (RAG / name).read_text().splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(source: str, port: int, key: str, env: dict[str, str], record: Path | None = None,
           model: str | None = None) -> Iterator[str]:
    """`mas-trainer serve SOURCE` in a subprocess until the block ends; yields its base URL."""
    cmd = [*CLI, "serve", source, "--port", str(port), "--route", "gpt-4o-mini=answerer"]
    if ":" in source and model:  # an app: its base policies, on the model asked for
        cmd += ["--model", model]
    if record is not None:
        cmd += ["--record", str(record)]
    proc = subprocess.Popen(cmd, env={**env, "MAS_TRAINER_API_KEY": key}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "serving ... at URL (...)" once the engines are up
        if "serving" not in line:
            raise SystemExit(f"serve {source} did not start (exit {proc.wait()}): {line}")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def play(graph: Any, rows: list[dict[str, Any]], base_url: str, key: str, *, feedback: bool) -> list[tuple[float, float]]:
    """Each row asked once through the served graph; the (exact match, F1) each user saw (and,
    with `feedback`, the F1 sent back as the run's score)."""
    from rag_qa.metrics import exact_match, f1  # type: ignore[import-not-found]

    from mas_trainer.adapters.langgraph.serving import serving_runs
    from mas_trainer.production.client import feedback as send_feedback

    scores = []
    for row in rows:
        run = uuid.uuid4()  # the graph invocation's LangChain run id is the recorded run's id
        state = graph.invoke({"question": row["question"], "answer": row["answer"]}, config={"run_id": run})
        em, score = float(exact_match(state.get("prediction"), row["answer"])), f1(state.get("prediction"), row["answer"])
        if feedback:
            send_feedback(base_url, run.hex, score=score, api_key=key)
        scores.append((em, score))
    serving_runs().flush()  # the graph inputs are sent in the background: before the server stops
    return scores


def _mean(scores: list[tuple[float, float]], i: int) -> float:
    return sum(s[i] for s in scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default="default", help="every policy's base model (default: the bundled SmolLM2-135M)")
    ap.add_argument("--users", type=int, default=96, help="training questions the users ask the base graph")
    ap.add_argument("--heldout", type=int, default=52, help="held-out questions scored before and after")
    ap.add_argument("--steps", type=int, default=10, help="RL steps after the warm start")
    ap.add_argument("--min-score", type=float, default=0.5,
                    help="calls of runs the users scored at least this become supervised data (a short, partly right "
                         "answer teaches the format the base model lacks)")
    ap.add_argument("--out", default="runs/closed_loop")
    ap.add_argument("fit_overrides", nargs="*", help="more key=value for fit")
    args = ap.parse_args(argv)

    out = Path(args.out) / f"seed_{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    users = rng.sample(_rows("train.jsonl"), args.users)
    heldout = _rows("heldout.jsonl")[: args.heldout]
    key, port = secrets.token_hex(16), _free_port()
    # the app's clients are built at import and keep this URL: every server below takes this port
    env = dict(os.environ)
    os.environ.update({"OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": key})
    sys.path.insert(0, str(RAG.parent))
    from mas_trainer.apps import load_object

    graph = load_object(APP)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    with served(APP, port, key, env, model=args.model) as url:  # the base graph, nothing recorded: held-out score before
        before = play(graph, heldout, url, key, feedback=False)
    with served(APP, port, key, env, record=out / "served_base", model=args.model) as url:  # production traffic, recorded
        seen = play(graph, users, url, key, feedback=True)
    timings["serve_base_s"] = time.perf_counter() - t0
    data = out / "data"
    subprocess.run([*CLI, "data", str(out / "served_base"), "--out", str(data), "--min-score", str(args.min_score),
                    "--val-fraction", "0.1", "--seed", str(args.seed), "--force"], check=True, env=env)
    t1 = time.perf_counter()
    subprocess.run([*CLI, "fit", APP, "--data", str(data / "tasks.jsonl"), "--output", str(out / "run"),
                    "--warm-start", str(data / "sft.jsonl"), "--model", args.model,
                    f"steps={args.steps}", f"seed={args.seed}", *DEMO, "eval_every=1000", "save_every=1000",
                    "logger=[console]", *args.fit_overrides],
                   check=True, env=env)
    timings["fit_s"] = time.perf_counter() - t1
    with served(str(out / "run"), port, key, env) as url:  # the trained run, served: held-out score after
        after = play(graph, heldout, url, key, feedback=False)
    report = json.loads((data / "report.json").read_text())
    result = {"seed": args.seed, "model": args.model, "users": args.users, "steps": args.steps,
              "users_f1": _mean(seen, 1), "heldout_em_before": _mean(before, 0), "heldout_em_after": _mean(after, 0),
              "heldout_f1_before": _mean(before, 1), "heldout_f1_after": _mean(after, 1),
              "data": report, "timings": timings, "wall_s": time.perf_counter() - t0}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "data"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
