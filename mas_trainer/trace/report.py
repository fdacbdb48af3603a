"""Human view of trajectories: a tree of node calls with their LLM and tool calls, a table
of LLM calls per role and policy, and a table of each rollout's rewards at every level."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from mas_trainer.engines.chat import unparsed_tool_calls
from mas_trainer.trace.schema import LLMCall, Trajectory

__all__ = ["print_trajectories", "reward_table"]

_STATUS = {"ok": "green", "error": "red", "timeout": "yellow", "cancelled": "yellow", "interrupted": "cyan"}


def _short(text: str | None, width: int = 60) -> str:
    text = (text or "").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def _unparsed(c: LLMCall) -> int:
    return unparsed_tool_calls(c.output_text, c.tool_calls, c.tools)


def _unparsed_note(c: LLMCall) -> str:
    n = _unparsed(c)
    cut = " (cut by max_tokens)" if c.finish_reason == "length" else ""
    return f" [red]{n} tool call{'s' * (n > 1)} did not parse{cut}[/]" if n else ""


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
                f" {c.finish_reason}, {_short(c.output_text or str(c.tool_calls))!r}{_unparsed_note(c)}"
            )
        for tc in tools.pop(node.id, []):
            branch.add(f"[blue]tool[/] {tc.name} {tc.status}: {_short(str(tc.output))!r}")
    for c in [c for cs in calls.values() for c in cs]:  # calls made outside any node
        root.add(f"[magenta]llm[/] {c.role} → [cyan]{c.policy}[/] (no node): {_short(c.output_text)!r}{_unparsed_note(c)}")
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
    by_status = Counter(t.status for t in trajs)
    console.print("rollouts: " + ", ".join(f"{k} {v}" for k, v in sorted(by_status.items())))
    unparsed = [c for t in trajs for c in t.llm_calls if _unparsed(c)]
    if unparsed:  # the app got them with arguments that are not JSON, or as text: it may have gone on without them
        cut = sum(c.finish_reason == "length" for c in unparsed)
        console.print(f"[red]tool calls that did not parse: {sum(map(_unparsed, unparsed))}[/] in {len(unparsed)} LLM calls"
                      + (f", {cut} of them cut by max_tokens (raise the app's max_tokens)" if cut else ""))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _spread(values: list[float]) -> str:
    """``n × v`` when all equal, else ``min..max (mean m)``."""
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    if lo == hi:
        return f"{len(values)} × {_num(lo)}"
    return f"{_num(lo)}..{_num(hi)} (mean {_num(statistics.fmean(values))})"


def _turn_level(detail: dict[str, Any]) -> list[float]:
    """What the turn reward itself returned for each call (an allocator may credit a call with
    something else, e.g. turn_delta's improvement: its ``score`` is the raw value)."""
    out = []
    for call in (detail.get("calls") or {}).values():
        part = (call.get("parts") or {}).get("turn")
        if part is not None:
            out.append(float(part.get("score", part["value"])))
    return out


def reward_table(trajs: list[Trajectory], *, max_rows: int = 20) -> Table:
    """One row per rollout: the trajectory reward, each role's reward, what the turn reward
    returned for its calls, and the call rewards (what each call is trained with: the levels
    mixed by the allocator), those two summarised; ``n/a`` where a reward said "not applicable" (None). A failed rollout is not
    judged (its calls get reward.on_failure); one whose reward raised is not scored."""
    table = Table(title="rewards by level (as fit scores them)")
    for col in ("rollout", "status", "trajectory", "roles", "turn level", "call rewards"):
        table.add_column(col, justify="right" if col == "trajectory" else "left")
    for t in trajs[:max_rows]:
        r, rid = t.rewards, t.rollout_id[:12]
        failed = r.detail.get("failed")
        if t.status != "ok" or failed:
            fill = "dropped" if r.detail.get("dropped") else _spread(list(r.turns.values()))
            table.add_row(rid, t.status, "-", "not judged", "-", fill)
            continue
        if "allocator" not in r.detail:
            table.add_row(rid, t.status, "-", "[red]not scored: a reward raised[/]", "-", "-")
            continue
        na = r.detail.get("not_applicable", {})
        roles = [f"{role} {_num(v)}" for role, v in sorted(r.roles.items())] + [f"{role} n/a" for role in na.get("roles", [])]
        turn_values = _turn_level(r.detail)
        turn = [_spread(turn_values)] if turn_values else []
        turn += [f"{len(na['turns'])} n/a"] if na.get("turns") else []
        traj = "n/a" if na.get("trajectory") else _num(r.trajectory)
        table.add_row(rid, t.status, traj, ", ".join(roles) or "-", ", ".join(turn) or "-", _spread(list(r.turns.values())))
    if len(trajs) > max_rows:
        table.add_row(f"… {len(trajs) - max_rows} more", "", "", "", "", "")
    scored = [t.rewards.trajectory for t in trajs if t.rewards.trajectory is not None]
    if len(trajs) > 1 and scored:
        table.add_section()
        table.add_row(f"mean of {len(scored)}", "", _num(statistics.fmean(scored)), "", "", "")
    return table
