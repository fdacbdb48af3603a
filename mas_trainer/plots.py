"""PNG plots of a run's metrics (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_rewards"]


def plot_rewards(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Mean reward per role over training steps, plus the held-out mean reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    roles = sorted({k.split("/", 2)[2] for r in train for k in r if k.startswith("reward/role/")})
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps = [r["step"] for r in train]
    ax.plot(steps, [r.get("reward/mean") for r in train], color="black", lw=2, label="trajectory mean (train)")
    for role in roles:
        ax.plot(steps, [r.get(f"reward/role/{role}") for r in train], lw=1.2, label=f"role {role}")
    if val:
        ax.plot([r["step"] for r in val], [r.get("reward/mean") for r in val], "o--", color="tab:red", label="held-out mean")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("reward per role")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
