"""The viewer's layout, measured in headless Chromium: the side-by-side rollout cards show the
whole graph and every rollout (nothing cut off at a card's or the comparison's edge), and the
`#group=N` fragment uses the numbers the page shows.

A small hand-written run (a few seconds): groups of 4 rollouts whose graphs are wider than a
card (a long chain of supersteps, Send branches, a nested subgraph, long names). The page is
written by `write_html` with a probe appended to the viewer's script (so the page's own
Content-Security-Policy, which allows that script by hash, lets it run); the probe measures the
laid-out page and leaves its findings in `body[data-probe]`, read back from `--dump-dom`.
"""

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

CHAIN = 12  # top-level supersteps: far wider than a card
N = 4  # rollouts per group: more than fit side by side in 1280 px at the cards' minimum width
GROUPS = 3


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


chromium = pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (Debian: apt-get install chromium; "
                                                          "scripts/setup.sh installs it)")

# Runs after the viewer's script; waits for the rollouts, measures, clicks the last group's row
# and reads the address again.
PROBE = r"""
;(function () {
  'use strict';
  function rect(e) { const r = e.getBoundingClientRect(); return { l: r.left, t: r.top, r: r.right, b: r.bottom }; }
  function box(e) { return { rect: rect(e), scroll: e.scrollWidth, client: e.clientWidth }; }
  function selected() {
    const sel = document.querySelector('table.groups tr.sel');
    const h = Array.from(document.querySelectorAll('#step-body h3')).map((x) => x.textContent).filter((t) => /^Task /.test(t));
    return { label: sel ? sel.firstChild.textContent : null, task: sel ? sel.children[1].textContent : null,
             heading: h.length ? h[0] : null, hash: location.hash };
  }
  function measure() {
    const out = { viewport: document.documentElement.clientWidth, page: document.documentElement.scrollWidth, first: selected() };
    const compare = document.getElementById('compare');
    out.compare = box(compare);
    out.cards = Array.from(compare.querySelectorAll(':scope > .rollout')).map((c) => Object.assign(box(c), {
      id: c.getAttribute('data-rollout'),
      graphs: Array.from(c.querySelectorAll('.graph')).map(box),
      nodes: Array.from(c.querySelectorAll('.graph .node')).map((n) => ({ name: n.getAttribute('data-node'), rect: rect(n) })),
    }));
    const rows = document.querySelectorAll('table.groups tr[data-group]');
    rows[rows.length - 1].click();
    setTimeout(() => {
      out.clicked = selected();
      document.body.setAttribute('data-probe', JSON.stringify(out));
    }, 100);
  }
  function wait() { if (document.getElementById('compare')) setTimeout(measure, 100); else setTimeout(wait, 50); }
  wait();
})();
"""


def _lines(*rows: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _rollout(rid: str, task: int, k: int) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    turns: dict[str, float] = {}

    def node(name: str, step: int, parent: str | None = None, **extra: Any) -> str:
        nid = f"{rid}-n{len(nodes)}"
        nodes.append({"id": nid, "name": name, "step": step, "parent_id": parent, "attempt": 1, "status": "ok",
                      "start_time": 1.0, "end_time": 2.5, **extra})
        cid = f"{nid}-c"
        calls.append({"id": cid, "node_id": nid, "node": name, "role": name, "policy": "a_rather_long_policy_name_" + str(step % 2),
                      "messages": [{"role": "user", "content": f"task {task}: " + "word " * 60}],
                      "output_text": "answer " + "x" * 300, "prompt_ids": list(range(20)), "response_ids": list(range(100, 140)),
                      "response_logprobs": [-0.1 * (i % 30) for i in range(40)], "finish_reason": "stop"})
        turns[cid] = 0.1 * k
        return nid

    step = 0
    for i in range(CHAIN):
        step += 1
        if i == 3:  # Send branches of one node in one superstep
            for _ in range(3):
                node("worker_with_a_long_name", step)
        elif i == 6:  # a subgraph node holding its own supersteps
            parent = node("research", step)
            for j in range(5):
                node(f"research:sub_step_{j}_of_the_research_subgraph", j + 1, parent)
        else:
            node(f"agent_step_{i}", step)
    return {"rollout_id": rid, "task": {"q": f"task number {task}"}, "status": "ok", "duration_s": 1.5, "nodes": nodes,
            "llm_calls": calls, "tool_calls": [], "final_state": {"done": True},
            "rewards": {"trajectory": 0.1 * k, "roles": {}, "turns": turns}}


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("layout") / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(_lines({"kind": "train", "step": 1, "reward/mean": 0.5}))
    rows = [_rollout(f"s000001-t{t:05d}-r{k}", t, k) for t in range(GROUPS) for k in range(N)]
    (run / "trajectories" / "step_000001.jsonl").write_text(_lines(*rows))
    return run


def _probe(run: Path, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, width: int = 1280) -> dict[str, Any]:
    static = page._static
    monkeypatch.setattr(page, "_static", lambda name: static(name) + (PROBE if name == "view.js" else ""))
    out = write_html(ViewSource(run), tmp_path / "page.html")
    proc = subprocess.run([_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},1000", "--virtual-time-budget=8000",
                           "--dump-dom", out.as_uri() + fragment],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r'<body[^>]*\sdata-probe="([^"]*)"', proc.stdout)
    assert m, "the probe did not report: " + proc.stdout[-2000:]
    return json.loads(html.unescape(m.group(1)))


def _inside(inner: dict[str, float], outer: dict[str, float], slack: float = 0.5) -> bool:
    return inner["l"] >= outer["l"] - slack and inner["r"] <= outer["r"] + slack


@chromium
@pytest.mark.parametrize("width", [1280, 800])
def test_side_by_side_cards_show_the_whole_graph_and_every_rollout(wide_run, tmp_path, monkeypatch, width):
    got = _probe(wide_run, "", tmp_path, monkeypatch, width=width)
    cards, compare = got["cards"], got["compare"]
    assert [c["id"] for c in cards] == [f"s000001-t00000-r{k}" for k in range(N)]
    # every card, the last one too, lies inside the comparison's visible area and the window
    assert compare["scroll"] <= compare["client"], compare
    assert got["page"] <= got["viewport"], (got["page"], got["viewport"])
    for card in cards:
        assert _inside(card["rect"], compare["rect"]) and card["rect"]["r"] <= got["viewport"], (card["id"], card["rect"], compare)
        assert card["scroll"] <= card["client"], (card["id"], card["scroll"], card["client"])  # nothing spills out of the card
    last = cards[-1]
    assert last["rect"]["r"] - last["rect"]["l"] >= min(400, width - 60)  # a card, not a sliver
    # the whole graph: no hidden part to scroll to, every node call inside its graph and its card
    for card in cards:
        assert len(card["nodes"]) == CHAIN - 2 + 3 + 1 + 5
        for graph in card["graphs"]:
            assert graph["scroll"] <= graph["client"], (card["id"], graph)
            assert _inside(graph["rect"], card["rect"])
        graph_rect = card["graphs"][0]["rect"]
        for n in card["nodes"]:
            assert _inside(n["rect"], graph_rect), (card["id"], n, graph_rect)
            assert graph_rect["t"] - 0.5 <= n["rect"]["t"] and n["rect"]["b"] <= graph_rect["b"] + 0.5, (card["id"], n, graph_rect)


@chromium
def test_group_fragment_uses_the_numbers_the_page_shows(wide_run, tmp_path, monkeypatch):
    got = _probe(wide_run, "#step=step_000001&group=2", tmp_path, monkeypatch)
    first = got["first"]
    assert first["label"] == "2" and first["task"] == '{ "q": "task number 1" }', first  # the second row: label 2
    assert first["heading"].startswith("Task 2:"), first
    assert "group=2" in first["hash"].split("&"), first  # the address keeps the number shown
    assert [c["id"] for c in got["cards"]] == [f"s000001-t00001-r{k}" for k in range(N)]
    # clicking the row labelled 3 puts group=3 in the address
    assert got["clicked"]["label"] == str(GROUPS) and f"group={GROUPS}" in got["clicked"]["hash"].split("&"), got["clicked"]


@chromium
@pytest.mark.parametrize("fragment", ["#group=0", "#group=9", "#group=x", ""])
def test_group_fragment_out_of_range_shows_the_first_group(wide_run, tmp_path, monkeypatch, fragment):
    first = _probe(wide_run, fragment, tmp_path, monkeypatch)["first"]
    assert first["label"] == "1" and first["heading"].startswith("Task 1:") and "group=1" in first["hash"].split("&"), first
