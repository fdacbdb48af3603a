"""PNG plots of a run's metrics (matplotlib, headless)."""

from __future__ import annotations

import colorsys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_rewards", "reward_figure", "role_styles"]

MEAN_COLOUR = "black"  # the trajectory mean (train), drawn thick
HELD_OUT_COLOUR = "tab:red"  # the held-out mean, dashed with markers
# tab10 without its red (the held-out mean's) and its grey (too close to the black mean)
_ROLE_PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
_LINE_STYLES = ["-", "--", "-.", ":"]


def role_styles(n: int) -> list[tuple[Any, str]]:
    """(colour, line style) for `n` role curves, every colour its own and none the black of the
    trajectory mean or the red of the held-out mean: the 8 colours of tab10 left when those are
    taken out for up to 8 roles; for more, `n` hues spread evenly between orange and magenta
    (red left out), alternately darker and lighter, with the line style cycling too, so that
    neighbouring hues also differ in their dashes."""
    if n <= len(_ROLE_PALETTE):
        return [(c, "-") for c in _ROLE_PALETTE[:n]]
    out: list[tuple[Any, str]] = []
    for i in range(n):
        hue = 0.07 + 0.83 * i / (n - 1)
        rgb = colorsys.hsv_to_rgb(hue, 0.85, 0.85 if i % 2 == 0 else 0.6)
        out.append((rgb, _LINE_STYLES[i % len(_LINE_STYLES)]))
    return out


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    """`key` of each row as a float; missing or not a number: NaN (a gap in the curve)."""
    return [float(v) if isinstance(v := r.get(key), (int, float)) and not isinstance(v, bool) else float("nan") for r in rows]


def reward_figure(rows: list[dict[str, Any]]) -> Figure:
    """The figure of :func:`plot_rewards`, not saved (the tests look at its lines' colours)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    roles = sorted({k.split("/", 2)[2] for r in train for k in r if k.startswith("reward/role/")})
    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.add_subplot()
    steps = [r["step"] for r in train]
    ax.plot(steps, _values(train, "reward/mean"), color=MEAN_COLOUR, lw=2, label="trajectory mean (train)")
    for role, (colour, style) in zip(roles, role_styles(len(roles)), strict=True):
        ax.plot(steps, _values(train, f"reward/role/{role}"), color=colour, ls=style, lw=1.2, label=f"role {role}")
    if val:
        ax.plot([r["step"] for r in val], _values(val, "reward/mean"), "o--", color=HELD_OUT_COLOUR, label="held-out mean")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward per role")
    ax.grid(alpha=0.3)
    curves = 1 + len(roles) + bool(val)
    if curves > 8:  # a long legend beside the axes, not over the curves
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 if curves <= 16 else 2, borderaxespad=0)
        fig.set_size_inches(9 if curves <= 16 else 11, 4)
    else:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def plot_rewards(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Mean reward per role over training steps, plus the held-out mean reward: each curve in its own colour."""
    path = Path(path)
    reward_figure(rows).savefig(path)
    return path
