"""What `mas-trainer view` shows, assembled from a run directory or one trajectories file.

Everything the page needs is plain JSON built here, so it can be tested without a browser:

- :meth:`ViewSource.index`: the run's curves (from ``metrics.jsonl``, plus reward per policy
  from the trajectory files), the policy map (``app.json``), the reward and advantage
  settings (``config.yaml``) and the list of trajectory files ("steps");
- :meth:`ViewSource.step`: one trajectory file: its rollouts grouped by task (the n rollouts
  of one task in one step are a group), each with its node calls, LLM calls (messages, answer,
  response tokens decoded piece by piece with the policy's tokenizer, their log-probs and
  advantages), tool calls and rewards at the three levels with the allocator's audit trail.

Advantages are those ``fit`` recorded for each trained call (``rewards.detail.calls[ID].advantages``,
one per response token); the viewer never recomputes them, since only training knew the values
it trained on. Where a file records none the page says why and colours by allocated reward.

Nothing here trusts the files' contents: the page renders every string as text. Numbers that
JSON cannot carry (NaN, infinities) become the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.
Nothing here trusts the run directory's layout either: every file is read through
:meth:`ViewSource.inside`, which follows links and refuses what ends up outside the run. A line
that cannot be read (not JSON, not an object, nested deeper than :data:`MAX_DEPTH`) is skipped
and named in the payload's ``warnings`` (and logged once), never an error of the whole page.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import statistics
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from mas_trainer.errors import UserError, nested_too_deep
from mas_trainer.rewards.allocators import rollout_reward

__all__ = ["ViewSource", "build_charts", "token_pieces", "finite_json", "fork_tree", "read_jsonl", "STEP_NAME", "MAX_DEPTH"]

log = logging.getLogger(__name__)

STEP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")  # what a step name (a file stem) may look like
# fit's trajectory files: a training step, a held-out evaluation, counterfactual credit's continuations of a step
_STEP_FILE = re.compile(r"^step_(\d+)(_val|_forks)?$")
# fit's ids: s000001-t00005-r0, and s000001d1-t00005-r0 for a later draw of rollout.filter_groups
_ROLLOUT_ID = re.compile(r"^(?P<group>[sv]\d+(?:d\d+)?-t(?P<task>\d+))-r(?P<k>\d+)$")
# far deeper than anything fit writes, far shallower than what the recursive code downstream
# (finite_json, the JSON encoders, the page) survives at Python's recursion limit
MAX_DEPTH = 100
_MAX_LISTED = 10  # unreadable lines named one by one per file; the rest are counted


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by a string JSON can carry."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if value is None or isinstance(value, (str, int)):
        return value
    return str(value)  # what YAML can make that JSON cannot carry (dates, sets)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# --- curves ------------------------------------------------------------------------------------
def _series(name: str, points: list[list[float]], style: str = "train") -> dict[str, Any]:
    return {"name": name, "style": style, "points": points}


def _points(rows: list[dict[str, Any]], key: str) -> list[list[float]]:
    out = []
    for r in rows:
        step, v = _num(r.get("step")), _num(r.get(key))
        if step is not None and v is not None:
            out.append([step, v])
    return out


def build_charts(rows: list[dict[str, Any]], per_policy: dict[str, dict[str, list[list[float]]]] | None = None
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(main charts, more charts) from metrics rows; `per_policy[kind][policy]` = [[step, mean reward]].

    Main: reward per role in training, held-out reward per role, reward per policy (train solid,
    held-out dashed). More: every other numeric metric, one chart per metric, `policy/NAME/X`
    gathered into one chart "X" with a line per policy.
    """
    train = [r for r in rows if r.get("kind", "train") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    main: list[dict[str, Any]] = []

    def roles_of(rs: list[dict[str, Any]]) -> list[str]:
        return sorted({k[len("reward/role/"):] for r in rs for k in r if k.startswith("reward/role/")})

    for kind, rs, title in (("train", train, "reward per role (training)"), ("val", val, "held-out reward per role")):
        if not rs:
            continue
        series = [_series("trajectory mean", _points(rs, "reward/mean"), kind)]
        series += [_series(f"role {role}", _points(rs, f"reward/role/{role}"), kind) for role in roles_of(rs)]
        main.append({"id": f"reward-{kind}", "title": title, "y": "reward", "series": [s for s in series if s["points"]]})

    # reward per policy: metrics rows carry it as reward/policy/NAME when the trainer writes it,
    # otherwise the mean allocated reward of the policy's calls, read from the trajectory files
    pol_series = []
    for kind, rs in (("train", train), ("val", val)):
        names = {k[len("reward/policy/"):] for r in rs for k in r if k.startswith("reward/policy/")}
        found = {p: _points(rs, f"reward/policy/{p}") for p in names} if names else (per_policy or {}).get(kind, {})
        pol_series += [_series(f"{p} ({'held-out' if kind == 'val' else 'train'})", pts, kind) for p, pts in sorted(found.items())]
    pol_series = [s for s in pol_series if s["points"]]
    if pol_series:
        main.append({"id": "reward-policy", "title": "reward per policy (mean allocated reward of its calls)", "y": "reward",
                     "series": pol_series})

    shown = {"step", "kind", "reward/mean"}
    more: dict[str, dict[str, Any]] = {}
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and _num(v) is not None and k not in shown and not k.startswith(("reward/role/", "reward/policy/")):
                keys.append(k)
    for k in sorted(keys):
        parts = k.split("/")
        if parts[0] == "policy" and len(parts) >= 3:
            metric = "/".join(parts[2:])
            chart = more.setdefault(f"policy:{metric}", {"id": f"m-policy-{metric}", "title": f"{metric} per policy", "y": metric, "series": []})
            chart["series"].append(_series(parts[1], _points(train, k), "train"))
        else:
            chart = more.setdefault(k, {"id": f"m-{k}", "title": k, "y": k, "series": []})
            chart["series"] += [_series("train", _points(train, k), "train"), _series("held-out", _points(val, k), "val")]
    for chart in more.values():
        chart["series"] = [s for s in chart["series"] if s["points"]]
    return main, [chart for chart in more.values() if chart["series"]]


# --- reading files ---------------------------------------------------------------------------------
def _parse_row(line: str) -> tuple[dict[str, Any] | None, str]:
    """One JSON-lines row, or why it cannot be one."""
    try:
        row = json.loads(line)
    except RecursionError:
        return None, f"nested deeper than {MAX_DEPTH} levels"
    except ValueError as exc:  # JSONDecodeError, and integers longer than int() accepts
        return None, f"not valid JSON ({str(exc)[:100]})"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    if nested_too_deep(row, MAX_DEPTH):
        return None, f"nested deeper than {MAX_DEPTH} levels"
    return row, ""


def read_jsonl(path: Path, label: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The file's rows (JSON objects) and a warning per line skipped: ``LABEL line N: why; skipped``."""
    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    skipped = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row, why = _parse_row(line)
            if row is not None:
                rows.append(row)
                continue
            skipped += 1
            if skipped <= _MAX_LISTED:
                warnings.append(f"{label} line {n}: {why}; skipped")
    if skipped > _MAX_LISTED:
        warnings.append(f"{label}: {skipped - _MAX_LISTED} more unreadable line(s) skipped")
    return rows, warnings


# --- tokens ------------------------------------------------------------------------------------
def token_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text each response token adds, so that the pieces join to the decoded response.

    Incremental detokenisation (as vLLM streams): a token that ends inside a multi-byte
    character adds "" and the character comes with the token that completes it; leading
    spaces of SentencePiece-style vocabularies come out right because each piece is the
    difference of two decodes that share the previous token as context.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = tokenizer if backend is None else backend

    def decode(xs: list[int]) -> str:
        return decoder.decode(xs, skip_special_tokens=False)

    pieces: list[str] = []
    prefix = read = 0
    for i in range(len(ids)):
        before = decode(ids[prefix:read])
        after = decode(ids[prefix:i + 1])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    if read < len(ids) and ids:  # a broken character at the very end: show what decode makes of it
        pieces[-1] = decode(ids[prefix:])[len(decode(ids[prefix:read])):]
    return pieces


# --- the source --------------------------------------------------------------------------------
class _StepFile:
    """`path`: the file once links are followed; `label`: where it is listed (``trajectories/NAME.jsonl``)."""

    def __init__(self, name: str, path: Path, label: str, step: int | None, kind: str) -> None:
        self.name, self.path, self.label, self.step, self.kind = name, path, label, step, kind


class ViewSource:
    """A run directory or one trajectories file, read on demand (files may grow while `fit` runs).

    `tokenizer`: the model whose tokenizer every policy uses (tiny | default | PATH | HF id); by default each
    policy's checkpoint folder in the run, else its base model from ``app.json``.
    """

    def __init__(self, path: str | Path, *, tokenizer: str | None = None) -> None:
        p = Path(path).expanduser()
        if not p.exists():
            raise UserError(f"{path}: no such run directory or trajectories file")
        self.path = p
        self.tokenizer_model = tokenizer
        self._lock = threading.RLock()
        self._tokenizers: dict[str, tuple[Any, str]] = {}
        # (size, mtime) of the file -> what was built from it (`_cached`)
        self._summaries: dict[str, Any] = {}
        self._steps: dict[str, Any] = {}
        self._trees: dict[str, Any] = {}
        self._said: set[str] = set()
        if p.is_dir():
            if not ((p / "trajectories").is_dir() or (p / "metrics.jsonl").is_file()):
                raise UserError(f"{path}: not a run directory of `mas-trainer fit` (no metrics.jsonl or trajectories/); "
                                "give a run directory or a trajectories .jsonl file")
            self.root: Path | None = p
            self.single: Path | None = None
        else:
            self.single = p
            parent = p.parent
            run = parent.parent if parent.name == "trajectories" else None
            self.root = run if run is not None and ((run / "app.json").is_file() or (run / "metrics.jsonl").is_file()) else None
        # the one file named on the command line is the user's choice, wherever its links lead
        self._given = self.single.resolve() if self.single is not None else None
        self._base = self.root.resolve() if self.root is not None else None

    # --- paths ---------------------------------------------------------------------------------
    def _label(self, path: Path) -> str:
        if self.root is not None and path.is_relative_to(self.root):
            return path.relative_to(self.root).as_posix()
        return path.name

    def _warn(self, message: str, warnings: list[str] | None) -> None:
        """Into `warnings` (the payload) every time; into the log once per message."""
        if warnings is not None:
            warnings.append(message)
        with self._lock:
            if message in self._said:
                return
            if len(self._said) > 10_000:  # a file rewritten over and over: forget, do not grow
                self._said.clear()
            self._said.add(message)
        log.warning("%s", message)

    def inside(self, path: Path, *, folder: bool = False, warnings: list[str] | None = None) -> Path | None:
        """`path` with every link followed, if that is a regular file (`folder`: a folder) inside
        the run directory, or the trajectories file the viewer was started on; else None.

        Every file the viewer reads or serves comes through here: a link out of the run, or a
        `..` that climbs out of it, is refused with a warning; a path that does not exist is
        just absent (metrics.jsonl before the first step).
        """
        if not (path.exists() or path.is_symlink()):
            return None
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):  # a dangling link, a loop of links
            self._warn(f"{self._label(path)}: a broken link; skipped", warnings)
            return None
        if real != self._given and not (self._base is not None and real.is_relative_to(self._base)):
            self._warn(f"{self._label(path)}: leads out of the run directory; skipped", warnings)
            return None
        if not (real.is_dir() if folder else real.is_file()):
            self._warn(f"{self._label(path)}: not a {'folder' if folder else 'regular file'}; skipped", warnings)
            return None
        return real

    def _all_inside(self, folder: Path) -> bool:
        """Whether everything under `folder` (links followed) passes `inside`: the tokenizer
        loader reads files of its choosing there (vocabulary, merges, templates, config.json), so
        one file that links out of the run, is not a regular file (a FIFO would stall the load),
        or is a broken link refuses the whole folder, with the warning `inside` gives."""
        seen = 0
        for dirpath, dirs, files in os.walk(folder, followlinks=True):
            for name in [*dirs, *files]:
                seen += 1
                if seen > _MAX_FOLDER_ENTRIES:  # links in a loop, or not a policy folder
                    self._warn(f"{self._label(folder)}: over {_MAX_FOLDER_ENTRIES} files; its tokenizer is not used", None)
                    return False
                if self.inside(Path(dirpath) / name, folder=name in dirs) is None:
                    return False
        return True

    # --- files ---------------------------------------------------------------------------------
    def step_files(self, warnings: list[str] | None = None) -> list[_StepFile]:
        if self.single is not None:
            files = [self.single]
        else:
            assert self.root is not None
            folder = self.inside(self.root / "trajectories", folder=True, warnings=warnings)
            files = sorted((self.root / "trajectories").glob("*.jsonl")) if folder is not None else []
        out = []
        for f in files:
            stem = f.stem if f.suffix == ".jsonl" else f.name
            if not STEP_NAME.match(stem):
                continue
            real = self.inside(f, warnings=warnings)
            if real is None:
                continue
            found = _STEP_FILE.match(stem)
            step = int(found.group(1)) if found else None
            kind = {None: "train", "_val": "val", "_forks": "forks"}[found.group(2)] if found else "trace"
            label = f"trajectories/{f.name}" if self.single is None else f.name
            out.append(_StepFile(stem, real, label, step, kind))
        order = {"val": 0, "train": 1, "forks": 2, "trace": 3}
        out.sort(key=lambda s: (s.step if s.step is not None else -1, order[s.kind], s.name))
        return out

    def find_step(self, name: str) -> _StepFile | None:
        if not isinstance(name, str) or not STEP_NAME.match(name):
            return None
        return next((s for s in self.step_files() if s.name == name), None)

    def raw_files(self) -> dict[str, Path]:
        """Relative path -> file (links followed, inside the run), for the files the server may hand out as they are."""
        out: dict[str, Path] = {}
        if self.root is not None:
            for rel in ("metrics.jsonl", "app.json", "config.yaml", "rewards.png"):
                real = self.inside(self.root / rel)
                if real is not None:
                    out[rel] = real
        for s in self.step_files():
            out[s.label] = s.path
        return out

    def title(self) -> str:
        return (self.root or self.path).name if self.single is None else self.path.name

    def app(self, warnings: list[str] | None = None) -> dict[str, Any] | None:
        return self._tree("app.json", warnings)

    def config(self, warnings: list[str] | None = None) -> dict[str, Any] | None:
        return self._tree("config.yaml", warnings)

    def _tree(self, rel: str, warnings: list[str] | None) -> dict[str, Any] | None:
        """app.json or config.yaml as a dict, or None with a warning saying why not."""
        path = self.inside(self.root / rel, warnings=warnings) if self.root is not None else None
        if path is None:
            return None
        # parsed once per version of the file: every request reads both, and a hostile
        # config.yaml can take PyYAML seconds to refuse
        tree, why = self._cached(self._trees, rel, path, lambda: self._parse_tree(path, rel))
        if why:
            self._warn(f"{rel}: {why}; ignored", warnings)
        return tree

    @staticmethod
    def _parse_tree(path: Path, rel: str) -> tuple[dict[str, Any] | None, str]:
        """(the file as a dict, "") or (None, why not)."""
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            tree = yaml.safe_load(text) if rel.endswith(".yaml") else json.loads(text)
        except RecursionError:
            return None, f"nested deeper than {MAX_DEPTH} levels"
        except (OSError, ValueError, yaml.YAMLError) as exc:
            return None, f"not readable ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
        if not isinstance(tree, dict):
            return None, "not a mapping"
        if nested_too_deep(tree, MAX_DEPTH):
            return None, f"nested deeper than {MAX_DEPTH} levels"
        return tree, ""

    def metrics(self, warnings: list[str] | None = None) -> list[dict[str, Any]]:
        path = self.inside(self.root / "metrics.jsonl", warnings=warnings) if self.root is not None else None
        return self._rows(path, "metrics.jsonl", warnings) if path is not None else []

    def _rows(self, path: Path, label: str, warnings: list[str] | None) -> list[dict[str, Any]]:
        rows, problems = read_jsonl(path, label)
        for message in problems:
            self._warn(message, warnings)
        return rows

    def _cached(self, store: dict[str, Any], key: str, path: Path, build: Callable[[], Any], keep: int | None = None) -> Any:
        """`build()`, kept in `store` under `key` until the file at `path` changes (size, mtime);
        `keep`: at most that many entries, the oldest dropped first."""
        st = path.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = store.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        value = build()
        with self._lock:
            store[key] = (stamp, value)
            while keep is not None and len(store) > keep:
                store.pop(next(iter(store)))
        return value

    # --- index ---------------------------------------------------------------------------------
    def _summary(self, s: _StepFile) -> dict[str, Any]:
        return self._cached(self._summaries, s.name, s.path, lambda: self._build_summary(s))

    def _build_summary(self, s: _StepFile) -> dict[str, Any]:
        warnings: list[str] = []
        trajs = self._rows(s.path, s.label, warnings)
        per_policy: dict[str, list[float]] = defaultdict(list)
        rewards = []
        for t in trajs:
            turns = _dict(_dict(t.get("rewards")).get("turns"))
            for c in _list(t.get("llm_calls")):
                c = _dict(c)
                v = _num(turns.get(str(c.get("id"))))
                if v is not None:
                    per_policy[str(c.get("policy"))].append(v)
            r = _traj_reward(t)
            if r is not None:
                rewards.append(r)
        return {"name": s.name, "step": s.step, "kind": s.kind, "rollouts": len(trajs), "warnings": warnings,
                "groups": len({_group_key(t) for t in trajs}),
                "mean_reward": statistics.fmean(rewards) if rewards else None,
                "errors": sum(1 for t in trajs if t.get("status") != "ok"),
                "policy_reward": {p: statistics.fmean(v) for p, v in per_policy.items()}}

    def index(self) -> dict[str, Any]:
        """Everything but the trajectories: curves, policy map, settings, list of steps, and
        `warnings`: every file or line that was skipped, and why."""
        warnings: list[str] = []
        steps = [self._summary(s) for s in self.step_files(warnings)]
        per_policy: dict[str, dict[str, list[list[float]]]] = {"train": defaultdict(list), "val": defaultdict(list)}
        for s in steps:
            if s["kind"] in per_policy and s["step"] is not None:
                for p, v in sorted(s["policy_reward"].items()):
                    per_policy[s["kind"]][p].append([s["step"], v])
        rows = self.metrics(warnings)
        charts, more = build_charts(rows, per_policy)
        app, cfg = self.app(warnings), self.config(warnings) or {}
        reward_cfg = cfg.get("reward") if isinstance(cfg.get("reward"), dict) else None
        notes = []
        if self.root is None:
            notes.append("a trajectories file outside a run directory: no curves, no policy map, no advantages")
        elif not rows:
            notes.append("metrics.jsonl has no rows yet")
        warnings += [w for s in steps for w in s["warnings"]]
        return finite_json({
            "title": self.title(), "source": str(self.path), "kind": "file" if self.single is not None else "run",
            "app": app, "reward_config": reward_cfg, "advantage_config": self._advantage_settings(),
            "charts": charts, "more_charts": more, "steps": steps, "notes": notes,
            "warnings": list(dict.fromkeys(warnings)), "raw_files": sorted(self.raw_files()),
        })

    # --- advantages ----------------------------------------------------------------------------
    def _advantage_settings(self) -> dict[str, Any]:
        """Each trained policy's `advantage` settings as config.yaml has them (fit writes every key)."""
        cfg = self.config() or {}
        out = {}
        for p, rec in sorted(_dict(_dict(self.app()).get("policies")).items()):
            if _dict(rec).get("trainable"):
                a = {**_dict(cfg.get("advantage")), **_dict(_dict(_dict(cfg.get("policies")).get(p)).get("advantage"))}
                if isinstance(a.get("estimator"), str):
                    out[p] = {k: a.get(k) for k in ("estimator", "norm_adv_by_std_in_grpo", "rollout_norm", "gamma", "lam")}
        return out

    def _advantages(self, s: _StepFile, trajs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[float | None]]]:
        """(status, call id -> per-token advantages) as the file records them."""
        recorded = {cid: adv for t in trajs for cid, adv in _recorded_advantages(t).items()}
        if recorded:
            return {"status": "recorded", "note": "as fit recorded them; a call without any was not trained on (a frozen "
                                                  "policy, a dropped rollout, a group rollout.filter_groups left out)"}, recorded
        if s.kind == "train" and trajs and all(_dict(_dict(t.get("rewards")).get("detail")).get("left_out") for t in trajs):
            why = "rollout.filter_groups left every group out"
        else:
            why = _NO_ADVANTAGES.get(s.kind if self.root is not None else "trace", _NO_ADVANTAGES["trace"])
        return {"status": "none", "note": f"no advantages: {why}; colours show each call's allocated reward"}, {}

    # --- tokenizers ----------------------------------------------------------------------------
    def _tokenizer(self, policy: str) -> tuple[Any, str]:
        with self._lock:
            if policy in self._tokenizers:
                return self._tokenizers[policy]
        candidates: list[tuple[str, str]] = []
        if self.tokenizer_model:
            candidates.append((self.tokenizer_model, f"--tokenizer {self.tokenizer_model}"))
        elif self.root is not None:
            # the policy name comes from the trajectory: a plain name, a folder inside the run
            folder = self.inside(self.root / "checkpoint" / "policies" / policy, folder=True) if STEP_NAME.match(policy) else None
            if (folder is not None and any((folder / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json"))
                    and self._all_inside(folder)):
                candidates.append((str(folder), f"checkpoint/policies/{policy}"))
            base = _dict(_dict(_dict(self.app()).get("policies")).get(policy)).get("base_model")
            if isinstance(base, str) and base:
                candidates.append((base, f"base model {base}"))
        found: tuple[Any, str] = (None, "no tokenizer found (pass --tokenizer): token ids shown")
        for model, label in candidates:
            try:
                found = (_load_tokenizer(model), label)
                break
            except Exception as exc:  # noqa: BLE001
                found = (None, f"tokenizer of {label} not loadable ({type(exc).__name__}): token ids shown")
        with self._lock:
            self._tokenizers[policy] = found
        return found

    # --- one step ------------------------------------------------------------------------------
    def step(self, name: str) -> dict[str, Any] | None:
        s = self.find_step(name)
        return None if s is None else self._cached(self._steps, name, s.path, lambda: self._build_step(s), keep=16)

    def _build_step(self, s: _StepFile) -> dict[str, Any]:
        warnings: list[str] = []
        trajs = self._rows(s.path, s.label, warnings)
        adv_status, advantages = self._advantages(s, trajs)
        tokenizers: dict[str, str] = {}
        groups: dict[str, dict[str, Any]] = {}
        rollouts = []
        for i, t in enumerate(trajs):
            key = _group_key(t)
            g = groups.setdefault(key, {"key": key, "task": t.get("task"), "rollouts": []})
            g["rollouts"].append(i)
            # rollout.filter_groups: why the group was not trained on ("no spread")
            g["left_out"] = g.get("left_out") or _dict(_dict(t.get("rewards")).get("detail")).get("left_out")
            rollouts.append(self._rollout(t, advantages, tokenizers))
        for g in groups.values():
            rs = [r for r in (_traj_reward(trajs[i]) for i in g["rollouts"]) if r is not None]
            g["mean_reward"] = statistics.fmean(rs) if rs else None
        return finite_json({"name": s.name, "step": s.step, "kind": s.kind, "file": s.label,
                         "advantages": adv_status, "tokenizers": tokenizers, "groups": list(groups.values()),
                         "rollouts": rollouts, "warnings": warnings})

    def _rollout(self, t: dict[str, Any], advantages: dict[str, list[float | None]], tokenizers: dict[str, str]) -> dict[str, Any]:
        rewards = _dict(t.get("rewards"))
        turns = _dict(rewards.get("turns"))
        detail_calls = _dict(_dict(rewards.get("detail")).get("calls"))
        calls = []
        for c in _list(t.get("llm_calls")):
            c = _dict(c)
            cid = str(c.get("id"))
            ids = [x for x in _list(c.get("response_ids")) if isinstance(x, int)]
            logprobs = _list(c.get("response_logprobs"))
            policy = str(c.get("policy"))
            tok, label = self._tokenizer(policy) if ids else (None, "")
            if ids:
                tokenizers.setdefault(policy, label)
            pieces = None
            if tok is not None:
                with contextlib.suppress(Exception):  # ids out of this vocabulary: show ids
                    pieces = token_pieces(tok, ids)
            adv = advantages.get(cid)
            calls.append({
                "id": cid, "node_id": c.get("node_id"), "node": c.get("node"), "role": c.get("role"),
                "policy": policy, "trainable": c.get("trainable", True), "model": c.get("model"),
                "messages": c.get("messages"), "output_text": c.get("output_text"), "tool_calls": c.get("tool_calls") or [],
                "finish_reason": c.get("finish_reason"), "prompt_tokens": len(_list(c.get("prompt_ids"))),
                "response_ids": ids, "logprobs": logprobs, "pieces": pieces,
                "advantages": adv, "reward": turns.get(cid), "reward_detail": detail_calls.get(cid),
                "start_time": c.get("start_time"), "end_time": c.get("end_time"),
            })
        return {
            "rollout_id": t.get("rollout_id"), "group": _group_key(t), "task": t.get("task"), "status": t.get("status"),
            "error": t.get("error"), "duration_s": t.get("duration_s"), "trace_id": t.get("trace_id"),
            "nodes": _list(t.get("nodes")), "llm_calls": calls, "tool_calls": _list(t.get("tool_calls")),
            "rewards": {"trajectory": rewards.get("trajectory"), "roles": _dict(rewards.get("roles")), "turns": turns,
                        "detail": {k: v for k, v in _dict(rewards.get("detail")).items() if k != "calls"}},
            "reward": _traj_reward(t), "final_state": t.get("final_state"), "forks": fork_tree(t.get("forks")),
        }

    def all_steps(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        wanted = list(names) if names is not None else [s.name for s in self.step_files()]
        return {n: self.step(n) for n in wanted}


# --- helpers -----------------------------------------------------------------------------------
_MAX_FOLDER_ENTRIES = 10_000  # files and folders checked in a policy folder before its tokenizer is loaded
_TOKENIZERS: dict[tuple[str, int], Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _load_tokenizer(model: str) -> Any:
    """`load_tokenizer(model)`, once per process (a folder: again when its tokenizer file changes)."""
    from mas_trainer.engines.models import load_tokenizer

    path = Path(model).expanduser()
    stamp = 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (path / name).is_file():
            stamp = (path / name).stat().st_mtime_ns
            break
    key = (str(path.resolve()) if path.exists() else model, stamp)
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = load_tokenizer(model)
        return _TOKENIZERS[key]


_MAX_SEGMENTS, _MAX_RETURNS, _MAX_TEXT = 64, 64, 200  # a page, not a dump: what is cut is counted


def fork_tree(record: Any) -> dict[str, Any] | None:
    """A rollout's counterfactual record (`Trajectory.forks`) as the fork tree the page draws:
    per credited segment (one role's turns between two checkpoints) the checkpoint before and
    after it, each with its continuations' returns (None: failed and dropped; a failed one's status
    in `failed`, its return reward.on_failure's) and V (their mean,
    as the allocator used it), and the credit V(after) - V(before). Anything of the wrong type
    is left out, long lists are cut and counted; None when the rollout was not forked."""
    record = _dict(record)
    segments = _list(record.get("segments"))
    if not segments:
        return None
    values = _dict(record.get("values"))

    def point(step: Any) -> dict[str, Any] | None:
        if isinstance(step, bool) or not isinstance(step, int):
            return None
        v = _dict(values.get(str(step)))
        rets = list(_dict(v.get("returns")).items())
        failed = _dict(v.get("failed"))  # a failed continuation's return is reward.on_failure's (or None: dropped)
        return {"step": step, "value": _num(v.get("value")), "cut": max(0, len(rets) - _MAX_RETURNS),
                "checkpoint_id": str(v["checkpoint_id"])[:_MAX_TEXT] if v.get("checkpoint_id") is not None else None,
                "returns": [{"id": str(k)[:_MAX_TEXT], "value": _num(r),
                             "failed": str(failed[k])[:_MAX_TEXT] if k in failed else None} for k, r in rets[:_MAX_RETURNS]]}

    out = []
    for seg in segments[:_MAX_SEGMENTS]:
        seg = _dict(seg)
        before, after = point(seg.get("before")), point(seg.get("after"))
        if before is None or after is None:
            continue
        credit = None if before["value"] is None or after["value"] is None else after["value"] - before["value"]
        out.append({"role": str(seg.get("role"))[:_MAX_TEXT], "calls": [str(c)[:_MAX_TEXT] for c in _list(seg.get("calls"))[:_MAX_RETURNS]],
                    "before": before, "after": after, "credit": credit})
    k = record.get("k")
    return {"k": k if isinstance(k, int) and not isinstance(k, bool) else None, "segments": out,
            "cut": max(0, len(segments) - _MAX_SEGMENTS),
            "skipped": {str(c)[:_MAX_TEXT]: str(why)[:_MAX_TEXT] for c, why in list(_dict(record.get("skipped")).items())[:_MAX_RETURNS]}}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


_NO_ADVANTAGES = {
    "val": "held-out rollouts are not trained on",
    "forks": "forked continuations are trained on only with reward.counterfactual.train_forks",
    "train": "none recorded (a run written before fit recorded advantages, or nothing here was trained)",
    "trace": "this file records none",
}


def _recorded_advantages(t: dict[str, Any]) -> dict[str, list[float | None]]:
    """Call id -> the advantage of each response token that `t` records. Untrusted: a value that is
    no finite number shows as None, a list is cut to the call's response, one with no number is none."""
    sizes = {_dict(c).get("id"): len(_list(_dict(c).get("response_ids"))) for c in _list(t.get("llm_calls"))}
    out = {}
    for cid, item in _dict(_dict(_dict(t.get("rewards")).get("detail")).get("calls")).items():
        item, n = _dict(item), sizes.get(cid, 0)
        given = item.get("advantages")
        adv = [_num(x) for x in given[:n]] if isinstance(given, list) else [_num(item.get("advantage"))] * n
        if any(a is not None for a in adv):
            out[cid] = adv
    return out


def _group_key(t: dict[str, Any]) -> str:
    """The n rollouts of one task in one step share a key: fit's rollout id without `-rK`, else the task."""
    m = _ROLLOUT_ID.match(str(t.get("rollout_id", "")))
    if m:
        return m.group("group")
    return "task " + json.dumps(t.get("task"), sort_keys=True, default=str)[:500]


def _traj_reward(t: dict[str, Any]) -> float | None:
    """The rollout's reward as `fit`'s metrics count it: the trajectory level, else the mean call reward."""
    rewards = _dict(t.get("rewards"))
    turns = [x for x in map(_num, _dict(rewards.get("turns")).values()) if x is not None]
    return rollout_reward(_num(rewards.get("trajectory")), turns, bool(_dict(rewards.get("detail")).get("dropped")))
