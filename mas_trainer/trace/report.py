"""Human view of trajectories: a tree of node calls with their LLM and tool calls, and a
table of LLM calls per role and policy."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from mas_trainer.trace.schema import Trajectory

__all__ = ["print_trajectories"]

_STATUS = {"ok": "green", "error": "red", "timeout": "yellow", "cancelled": "yellow", "interrupted": "cyan"}


def _short(text: str | None, width: int = 60) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def trajectory_tree(t: Trajectory) -> Tree:
    color = _STATUS.get(t.status, "white")
    label = f"[bold]rollout {t.rollout_id[:12]}[/] [{color}]{t.status}[/]"
    if t.error:
        label += f" [red]{_short(t.error, 80)}[/]"
    root = Tree(label)
    branches: dict[str | None, Tree] = {None: root}
    calls = defaultdict(list)
    for c in t.llm_calls:
        calls[c.node_id].append(c)
    tools = defaultdict(list)
    for tc in t.tool_calls:
        tools[tc.node_id].append(tc)
    for node in t.nodes:  # parents are opened before their children
        parent = branches.get(node.parent_id, root)
        ncolor = _STATUS.get(node.status, "white")
        attempt = f" attempt {node.attempt}" if node.attempt > 1 else ""
        branch = parent.add(f"[bold]{node.name}[/] step {node.step}{attempt} [{ncolor}]{node.status}[/]")
        branches[node.id] = branch
        for c in calls.pop(node.id, []):
            tag = "" if c.trainable else " (frozen)"
            branch.add(
                f"[magenta]llm[/] {c.role} → [cyan]{c.policy}[/]{tag}: {len(c.prompt_ids)}+{len(c.response_ids)} tok,"
                f" {c.finish_reason}, {_short(c.output_text or str(c.tool_calls))!r}"
            )
        for tc in tools.pop(node.id, []):
            branch.add(f"[blue]tool[/] {tc.name} {tc.status}: {_short(str(tc.output))!r}")
    for c in [c for cs in calls.values() for c in cs]:  # calls made outside any node
        root.add(f"[magenta]llm[/] {c.role} → [cyan]{c.policy}[/] (no node): {_short(c.output_text)!r}")
    return root


def role_table(trajs: Iterable[Trajectory]) -> Table:
    stats: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in trajs:
        for c in t.llm_calls:
            s = stats[(c.role, c.policy)]
            s[0] += 1
            s[1] += len(c.prompt_ids)
            s[2] += len(c.response_ids)
    table = Table(title="LLM calls by role and policy")
    for col in ("role", "policy", "calls", "prompt tokens", "response tokens"):
        table.add_column(col, justify="right" if "tok" in col or col == "calls" else "left")
    for (role, policy), (n, p, r) in sorted(stats.items()):
        table.add_row(role, policy, str(n), str(p), str(r))
    return table


def print_trajectories(trajs: list[Trajectory], console: Console | None = None, *, max_trees: int = 8) -> None:
    console = console or Console()
    for t in trajs[:max_trees]:
        console.print(trajectory_tree(t))
    if len(trajs) > max_trees:
        console.print(f"… {len(trajs) - max_trees} more rollouts in the output file")
    console.print(role_table(trajs))
    by_status: defaultdict[str, int] = defaultdict(int)
    for t in trajs:
        by_status[t.status] += 1
    console.print("rollouts: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())))
