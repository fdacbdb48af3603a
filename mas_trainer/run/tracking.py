"""Experiment trackers: every metrics row of `fit` to TensorBoard, MLflow and W&B, offline.

`logger` (config key) lists the trackers, as verl's `trainer.logger` does: `console` (the
readable step line, `progress.py`), `tensorboard`, `mlflow`, `wandb`. Each gets every
numeric field of every row `fit` writes to `metrics.jsonl`, under the same name, at the
row's step; held-out rows (kind `val`) under `val/` (`val/reward/mean`). Nothing needs a
network: every tracker writes into the run directory.

```
RUN_DIR/tensorboard/   TensorBoard event files        tensorboard --logdir RUN_DIR/tensorboard
RUN_DIR/mlflow.db      MLflow's local SQLite store    mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db
RUN_DIR/wandb/         W&B offline runs               wandb sync RUN_DIR/wandb/offline-run-*
RUN_DIR/trackers.json  the MLflow and W&B run ids `--resume` continues
```

`MLFLOW_TRACKING_URI` (a server, another database) and `WANDB_MODE=online` send there
instead, as they do for verl.

**Resume** continues the same tracker run, each step once. `fit --resume` discards the rows
written after the checkpoint and runs those steps again, so each tracker forgets them too:
TensorBoard through `purge_step` (the new event file tells readers to drop the old file's
events from that step on), MLflow's local store by deleting those steps' points from the
run (SQLite: its `metrics` and `latest_metrics` tables). Where a tracker's history cannot be
edited (W&B, whose history is append-only; MLflow on a server) the steps it already has are
not sent again: there they keep the values of the first attempt. A tracker that the run did
not have before (added to `logger` at `--resume`) gets the rows up to the checkpoint first.

verl's `verl.utils.tracking.Tracking` is not used as such: its console tracker prints
full-precision floats, its TensorBoard adapter has no `purge_step` (a resumed run repeats
steps), MLflow resumes only through the process environment (`MLFLOW_RUN_ID`) and retries
with 5-second sleeps, and W&B starts a new run each time. The trackers' own clients are
configured here as verl configures them (same names, MLflow keys sanitised the same way).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import struct
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

from mas_trainer.config import check_trackers

__all__ = ["Trackers", "flatten", "tracker_values", "wandb_history"]

log = logging.getLogger(__name__)

TRACKERS_FILE = "trackers.json"


def tracker_values(row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row, as trackers get them: held-out rows under `val/`."""
    prefix = "val/" if row.get("kind") == "val" else ""
    return {prefix + k: float(v) for k, v in row.items()
            if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool)}


# --- the run ids `--resume` continues ----------------------------------------------------------
_RUN_ID = re.compile(r"[\w-]{1,128}")  # the MLflow and W&B run ids `fit` writes (hex)


def _load_ids(root: Path) -> dict[str, Any]:
    """trackers.json; a damaged one (not JSON, not run ids) is set aside with a warning: the
    trackers then start new runs, which get every row up to the checkpoint."""
    path = root / TRACKERS_FILE
    try:
        ids = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("%s is damaged (%s): the trackers start new runs", path, str(exc).splitlines()[0] if str(exc) else exc)
        return {}
    ok = isinstance(ids, dict) and all(isinstance(v, str) for v in ids.values()) and all(
        _RUN_ID.fullmatch(ids[k]) for k in ("mlflow_run_id", "wandb_run_id") if k in ids)
    if not ok:
        log.warning("%s is damaged (not the run ids `fit` writes): the trackers start new runs", path)
        return {}
    return ids


def _save_ids(root: Path, ids: dict[str, Any]) -> None:
    tmp = root / (TRACKERS_FILE + ".tmp")
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    os.replace(tmp, root / TRACKERS_FILE)


@contextlib.contextmanager
def _quiet(*names: str, level: int = logging.WARNING) -> Iterator[None]:
    """Hold libraries' INFO chatter (MLflow creating its tables, alembic) while a tracker opens."""
    loggers = [logging.getLogger(n) for n in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.level))
    try:
        yield
    finally:
        for lg, lv in zip(loggers, before):
            lg.setLevel(lv)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- TensorBoard --------------------------------------------------------------------------------
class _TensorBoard:
    def __init__(self, root: Path, after_step: int, kept: list[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = root / "tensorboard"
        resumed = self.dir.is_dir() and any(self.dir.glob("events.out.tfevents.*"))
        # purge_step: readers drop the earlier files' events from that step on (the steps run again)
        self.writer = SummaryWriter(str(self.dir), purge_step=after_step + 1 if resumed else None, flush_secs=30)
        if not resumed:
            for row in kept:
                self.log(row)

    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for key, value in tracker_values(row).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a killed run keeps every row written before it: none of them runs again

    def close(self, failed: bool) -> None:
        self.writer.close()


# --- MLflow -------------------------------------------------------------------------------------
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")  # the characters MLflow accepts in a key (as verl sanitises them)


def _mlflow_key(key: str) -> str:
    return _MLFLOW_BAD.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


class _MLflow:
    def __init__(self, root: Path, after_step: int, kept: list[dict[str, Any]], ids: dict[str, Any],
                 params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        with _quiet("mlflow", "alembic"):  # after the import: it sets mlflow's own logger to INFO
            self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"
            self.client = MlflowClient(tracking_uri=self.uri)
            run_id = ids.get("mlflow_run_id") if ids.get("mlflow_tracking_uri") == self.uri else None
            if run_id is not None:
                try:
                    self.client.get_run(run_id)
                except MlflowException:
                    run_id = None
            self.skip: dict[str, int] = {"train": -1, "val": -1}
            if run_id is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "mas-trainer")
                exp = self.client.get_experiment_by_name(name)
                exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                    name, artifact_location=(root / "mlartifacts").resolve().as_uri() if "MLFLOW_TRACKING_URI" not in os.environ else None)
                run_id = self.client.create_run(exp_id, run_name=root.resolve().name, tags={"mas_trainer.run_dir": str(root.resolve())}).info.run_id
                flat = [Param(_mlflow_key(k)[:250], str(v)[:6000]) for k, v in params.items()]
                for i in range(0, len(flat), 100):
                    self.client.log_batch(run_id, params=flat[i:i + 100])
                ids.update(mlflow_run_id=run_id, mlflow_tracking_uri=self.uri)
                self.run_id = run_id
                for row in kept:
                    self.log(row)
            else:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                if not self._prune(after_step):  # history not editable here: do not send its steps again
                    for kind, key in (("train", "time/step_s"), ("val", "val/time/eval_s")):
                        self.skip[kind] = max((m.step for m in self.client.get_metric_history(run_id, key)), default=-1)

    def _prune(self, after_step: int) -> bool:
        """Delete the run's points of steps after the checkpoint (they run again), in a local
        SQLite store; False where the store is another kind."""
        if not self.uri.startswith("sqlite:///"):
            return False
        import sqlite3

        path = self.uri[len("sqlite:///"):]
        try:
            with contextlib.closing(sqlite3.connect(path)) as db, db:
                db.execute("DELETE FROM metrics WHERE run_uuid = ? AND step > ?", (self.run_id, after_step))
                db.execute("DELETE FROM latest_metrics WHERE run_uuid = ?", (self.run_id,))
                # latest = the point of the highest (step, timestamp, value), as MLflow keeps it
                db.execute(
                    "INSERT OR REPLACE INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                    "SELECT key, value, timestamp, step, is_nan, run_uuid FROM metrics m WHERE run_uuid = ? AND NOT EXISTS ("
                    " SELECT 1 FROM metrics n WHERE n.run_uuid = m.run_uuid AND n.key = m.key AND (n.step > m.step OR "
                    " (n.step = m.step AND (n.timestamp > m.timestamp OR (n.timestamp = m.timestamp AND n.value > m.value)))))",
                    (self.run_id,))
        except sqlite3.Error as exc:
            log.warning("MLflow store %s: cannot remove the steps after %d (%s); steps it has are not sent again",
                        self.uri, after_step, exc)
            return False
        return True

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if int(row["step"]) <= self.skip["val" if row.get("kind") == "val" else "train"]:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, int(row["step"])) for k, v in tracker_values(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


# --- W&B ----------------------------------------------------------------------------------------
def _wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B transaction log (`run-ID.wandb`): a 7-byte W&B header, then
    LevelDB's log format (32 KiB blocks of chunks: crc32c, length, type, data)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        return
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:  # cut by a kill mid-write
            return
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def wandb_history(root: str | Path, run_id: str) -> list[dict[str, Any]]:
    """The history rows (`_step` and values) W&B wrote to the offline logs of run `run_id`
    under `root/wandb`, every attempt in order: what `wandb sync` would upload."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(Path(root, "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for raw in _wandb_records(path):
            rec = pb.Record()  # type: ignore[attr-defined]  # protobuf-generated: wandb ships no stubs for it
            try:
                rec.ParseFromString(raw)
            except Exception:  # noqa: BLE001 - a damaged record ends what can be read
                break
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def _next_second(root: Path, run_id: str, limit_s: float = 2.0) -> None:
    """Wait until no offline log folder of run `run_id` is named after this second. W&B names
    each attempt's folder `offline-run-YYYYmmdd_HHMMSS-ID` (local time): an attempt resumed within
    the second of the one before would write into that one's folder, and the earlier attempt's
    history (or this one's) would be lost to `wandb sync` and to `wandb_history`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now = time.time()
        stamps = {time.strftime("%Y%m%d_%H%M%S", time.localtime(now)), time.strftime("%Y%m%d_%H%M%S", time.gmtime(now))}
        if not any((Path(root, "wandb") / f"offline-run-{stamp}-{run_id}").exists() for stamp in stamps):
            return
        time.sleep(1.0 - now % 1.0 + 0.01)


class _WandB:
    def __init__(self, root: Path, after_step: int, kept: list[dict[str, Any]], ids: dict[str, Any],
                 params: dict[str, Any]) -> None:
        import wandb

        run_id = ids.get("wandb_run_id")
        new = run_id is None
        run_id = run_id or uuid.uuid4().hex[:12]
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.skip = {"train": -1, "val": -1}
        if not new and mode == "offline":  # the steps earlier attempts already wrote: not again
            try:
                for row in wandb_history(root, run_id):
                    for kind, key in (("train", "time/step_s"), ("val", "val/time/eval_s")):
                        if key in row:
                            self.skip[kind] = max(self.skip[kind], int(row.get("_step", -1)))
            except Exception as exc:  # noqa: BLE001 - an unreadable log: send every step again
                log.warning("cannot read W&B's offline logs of run %s (%s): every step after the checkpoint is sent again", run_id, exc)
        if not new:
            _next_second(root, run_id)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                                  x_save_requirements=False, disable_git=True, save_code=False)
        # (WANDB_DISABLE_WEAVE: no advertisement for W&B Weave because openai is imported)
        with _env(WANDB_DISABLE_WEAVE=os.environ.get("WANDB_DISABLE_WEAVE", "true")):
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mas-trainer"), name=root.resolve().name, id=run_id,
                                  resume="allow", mode=mode,  # type: ignore[arg-type]  # WANDB_MODE as set; wandb checks it
                                  dir=str(root), config=params, settings=settings)
        if mode != "offline" and self.run.resumed:  # online W&B knows its last step: earlier ones would be refused
            self.skip = {k: max(v, self.run.step - 1) for k, v in self.skip.items()}
        if new:
            ids["wandb_run_id"] = run_id
            for row in kept:
                self.log(row)

    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        if step <= self.skip["val" if row.get("kind") == "val" else "train"]:
            return
        self.run.log({k: v for k, v in tracker_values(row).items() if not math.isnan(v)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackers:
    """The file-writing trackers of one `fit` (`console` is the trainer's own line)."""

    def __init__(self, names: Sequence[str], root: str | Path, *, after_step: int = -1,
                 kept: list[dict[str, Any]] | None = None, config: dict[str, Any] | None = None) -> None:
        """`after_step`: the checkpoint's step (-1: none); rows after it are run again and
        replace what the trackers had. `kept`: the rows up to it, for a tracker new to the run.
        `config`: the resolved config (MLflow params, flattened; W&B config)."""
        check_trackers(names)
        self.root = Path(root)
        self.trackers: dict[str, _TensorBoard | _MLflow | _WandB] = {}
        ids = _load_ids(self.root)
        kept, config = kept or [], config or {}
        try:
            for name in names:
                if name == "tensorboard":
                    self.trackers[name] = _TensorBoard(self.root, after_step, kept)
                elif name == "mlflow":
                    self.trackers[name] = _MLflow(self.root, after_step, kept, ids, flatten(config))
                elif name == "wandb":
                    self.trackers[name] = _WandB(self.root, after_step, kept, ids, config)
        except BaseException:
            self.close(failed=True)
            raise
        if ids:
            _save_ids(self.root, ids)

    def log(self, row: dict[str, Any]) -> None:
        for tracker in self.trackers.values():
            tracker.log(row)

    def close(self, failed: bool = False) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.close(failed)
            except Exception as exc:  # noqa: BLE001 - one tracker failing to close must not hide the others
                log.warning("closing tracker %s: %s", name, exc)
        self.trackers = {}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (the config as tracker parameters)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
