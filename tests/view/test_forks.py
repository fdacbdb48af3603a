"""The viewer's fork tree: for a rollout trained with counterfactual credit, each credited turn
with the continuations forked before and after it, their returns, V before and after, and the
credit; built from `Trajectory.forks` as the forking step writes it, and drawn in headless Chromium.
A record from a run directory is data, not markup: hostile strings stay text, wrong types and
huge lists are left out or cut."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mas_trainer.view import ViewSource, page, write_html
from mas_trainer.view.data import fork_tree

HOSTILE = '<img src=x onerror="document.body.setAttribute(\'data-pwned\', 1)">'


def _record(role: str = "picker") -> dict[str, Any]:
    """The planner's turn at superstep 1 (checkpoints of steps 0 and 1), the solver's at 2, K = 2."""
    return {"k": 2,
            "segments": [{"role": role, "before": 0, "after": 1, "calls": ["c0"]},
                         {"role": "solver", "before": 1, "after": 2, "calls": ["c1"]}],
            "values": {"0": {"checkpoint_id": "ck0", "value": 0.5, "returns": {"f0": 1.0, "f1": 0.0}},
                       "1": {"checkpoint_id": "ck1", "value": 1.0, "returns": {"f2": 1.0, "f3": None}, "failed": {"f3": "error"}},
                       # f5 timed out and counts as reward.on_failure (0.5 here)
                       "2": {"checkpoint_id": "ck2", "value": 0.75, "returns": {"f4": 1.0, "f5": 0.5}, "failed": {"f5": "timeout"}}},
            "skipped": {"c9": "its node's superstep is unknown"}}


def test_the_tree_has_each_turns_checkpoints_returns_values_and_credit():
    tree = fork_tree(_record())
    assert tree is not None and tree["k"] == 2 and tree["cut"] == 0 and tree["skipped"] == {"c9": "its node's superstep is unknown"}
    picker, solver = tree["segments"]
    assert (picker["role"], picker["calls"], picker["before"]["step"], picker["after"]["step"]) == ("picker", ["c0"], 0, 1)
    assert [r["value"] for r in picker["before"]["returns"]] == [1.0, 0.0] and picker["before"]["value"] == 0.5
    assert [r["value"] for r in picker["after"]["returns"]] == [1.0, None]  # a failed continuation, dropped: no return
    assert [r["failed"] for r in picker["after"]["returns"]] == [None, "error"]
    assert [(r["value"], r["failed"]) for r in solver["after"]["returns"]] == [(1.0, None), (0.5, "timeout")]  # counted, marked
    assert picker["credit"] == pytest.approx(0.5) and solver["credit"] == pytest.approx(-0.25)
    assert picker["after"]["checkpoint_id"] == "ck1"


def test_a_rollout_without_forks_has_no_tree():
    assert fork_tree(None) is None and fork_tree({}) is None and fork_tree({"k": 4, "segments": []}) is None


def test_a_hostile_record_is_typed_bounded_and_never_raises():
    assert fork_tree("not a record") is None and fork_tree([1, 2]) is None
    broken = {"k": "four", "segments": [{"role": "x", "before": "0", "after": True},  # steps of the wrong type: left out
                                       "not a segment", {"role": ["r"], "before": 0, "after": 1, "calls": "c"}],
              "values": {"0": {"value": "NaN", "returns": {"a": "1.0", "b": float("inf")}}, "1": "nope"}}
    tree = fork_tree(broken)
    assert tree is not None and tree["k"] is None and len(tree["segments"]) == 1
    seg = tree["segments"][0]
    assert seg["calls"] == [] and seg["before"]["value"] is None and seg["credit"] is None
    assert [r["value"] for r in seg["before"]["returns"]] == [None, None]  # strings and infinities are not returns
    huge = {"k": 1, "segments": [{"role": "r" * 10_000, "before": 0, "after": 1, "calls": ["c"] * 1000}] * 500,
            "values": {"0": {"value": 0.0, "returns": {f"f{i}": 0.0 for i in range(5000)}}}}
    tree = fork_tree(huge)
    assert tree is not None and len(tree["segments"]) == 64 and tree["cut"] == 436
    seg = tree["segments"][0]
    assert len(seg["role"]) == 200 and len(seg["calls"]) == 64
    assert len(seg["before"]["returns"]) == 64 and seg["before"]["cut"] == 5000 - 64


def _rollout(rid: str, role: str, forks: dict[str, Any] | None) -> dict[str, Any]:
    nodes = [{"id": f"{rid}-n0", "name": "picker", "step": 1, "parent_id": None, "status": "ok"},
             {"id": f"{rid}-n1", "name": "solver", "step": 2, "parent_id": None, "status": "ok"}]
    calls = [{"id": cid, "node_id": f"{rid}-n{i}", "node": n, "role": n, "policy": "p", "messages": [], "output_text": "x",
              "prompt_ids": [1], "response_ids": [2], "response_logprobs": [-0.1], "finish_reason": "stop"}
             for i, (cid, n) in enumerate((("c0", "picker"), ("c1", "solver")))]
    return {"rollout_id": rid, "task": {"q": role}, "status": "ok", "nodes": nodes, "llm_calls": calls, "tool_calls": [],
            "rewards": {"trajectory": 1.0, "roles": {}, "turns": {"c0": 0.5, "c1": -0.25}}, "forks": forks}


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "reward/mean": 1.0}) + "\n")
    rows = [_rollout("s000001-t00000-r0", HOSTILE, _record(HOSTILE)), _rollout("s000001-t00000-r1", "plain", None)]
    (run / "trajectories" / "step_000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_step_data_carries_the_tree_of_forked_rollouts_only(tmp_path):
    step = ViewSource(_run(tmp_path)).step("step_000001")
    assert step is not None
    forked, plain = step["rollouts"]
    assert forked["forks"]["segments"][0]["role"] == HOSTILE and plain["forks"] is None


def test_a_steps_continuations_file_is_listed_as_its_forks(tmp_path):
    run = _run(tmp_path)
    cont = _rollout("s000001-t00000-r0-cf0-k0", "picker", None)
    (run / "trajectories" / "step_000001_forks.jsonl").write_text(json.dumps(cont) + "\n")
    steps = {s.name: (s.step, s.kind) for s in ViewSource(run).step_files()}
    assert steps == {"step_000001": (1, "train"), "step_000001_forks": (1, "forks")}
    forks = ViewSource(run).step("step_000001_forks")
    assert forks is not None and [r["rollout_id"] for r in forks["rollouts"]] == ["s000001-t00000-r0-cf0-k0"]


# Runs after the viewer's script: reads every fork tree the page drew.
PROBE = r"""
;(function () {
  'use strict';
  function read() {
    const trees = Array.from(document.querySelectorAll('.rollout')).map((card) => ({
      id: card.getAttribute('data-rollout'),
      segments: Array.from(card.querySelectorAll('.forktree')).map((t) => ({
        role: t.querySelector('.frole').textContent, credit: t.querySelector('.credit').textContent,
        branches: Array.from(t.querySelectorAll('li.branch')).map((b) => ({
          label: b.querySelector('.blabel').textContent, v: b.querySelector('.v').textContent,
          returns: Array.from(b.querySelectorAll('.returns .badge')).map((x) => x.textContent) })) })),
      images: card.querySelectorAll('img').length }));
    document.body.setAttribute('data-probe', JSON.stringify({ trees: trees, pwned: document.body.hasAttribute('data-pwned') }));
  }
  function wait() { if (document.querySelector('.rollout')) setTimeout(read, 100); else setTimeout(wait, 50); }
  wait();
})();
"""


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")),
                    reason="headless Chromium not installed (Debian: apt-get install chromium; scripts/setup.sh installs it)")
def test_the_page_draws_the_fork_tree_as_text(tmp_path, monkeypatch):
    static = page._static
    monkeypatch.setattr(page, "_static", lambda name: static(name) + (PROBE if name == "view.js" else ""))
    out = write_html(ViewSource(_run(tmp_path)), tmp_path / "page.html")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    proc = subprocess.run([str(browser), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1000", "--virtual-time-budget=8000",
                           "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r'<body[^>]*\sdata-probe="([^"]*)"', proc.stdout)
    assert m, "the probe did not report: " + proc.stdout[-2000:]
    got = json.loads(html.unescape(m.group(1)))
    assert not got["pwned"]
    forked, plain = got["trees"]
    assert plain["segments"] == []  # not forked: no tree
    assert forked["images"] == 0  # the hostile role is text
    picker, solver = forked["segments"]
    assert picker["role"] == HOSTILE and picker["credit"] == "credit +0.5" and solver["credit"] == "credit -0.25"
    before, after = picker["branches"]
    assert before == {"label": "before (checkpoint of step 0)", "v": "V = 0.5", "returns": ["1", "0"]}
    assert after == {"label": "after (checkpoint of step 1)", "v": "V = 1", "returns": ["1", "failed"]}
    assert solver["branches"][1]["returns"] == ["1", "0.5 failed"]  # a failed continuation counted at on_failure's return
