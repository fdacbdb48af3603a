"""rewards.png (`mas_trainer.plots.plot_rewards`): every curve in its own colour."""

from __future__ import annotations

import itertools
import math

import pytest
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure

from mas_trainer.plots import plot_rewards


def _rows(roles: int, *, val: bool = True) -> list[dict]:
    rows: list[dict] = [{"kind": "val", "step": 0, "reward/mean": 0.1}] if val else []
    for step in (1, 2, 3):
        rows.append({"kind": "train", "step": step, "reward/mean": 0.1 * step,
                     **{f"reward/role/r{i:02d}": 0.01 * i + 0.1 * step for i in range(roles)}})
        if val:
            rows.append({"kind": "val", "step": step, "reward/mean": 0.1 * step + 0.05})
    return rows


@pytest.fixture
def saved_figures(monkeypatch) -> list[Figure]:
    """The figures `plot_rewards` saves, as they were when saved."""
    seen: list[Figure] = []
    save = Figure.savefig

    def savefig(self, *args, **kwargs):
        seen.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


@pytest.mark.parametrize("roles", [1, 4, 8, 9, 12, 20])
def test_every_curve_has_its_own_colour(roles, saved_figures, tmp_path):
    path = plot_rewards(_rows(roles), tmp_path / "rewards.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved_figures
    lines = [ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")]
    labels = [ln.get_label() for ln in lines]
    assert labels == ["trajectory mean (train)", *(f"role r{i:02d}" for i in range(roles)), "held-out mean"]
    colours = {ln.get_label(): to_rgb(ln.get_color()) for ln in lines}
    # pairwise distinct, and not merely by a rounding error: at least 0.15 apart in RGB
    close = [(a, b, round(math.dist(colours[a], colours[b]), 3)) for a, b in itertools.combinations(labels, 2)
             if math.dist(colours[a], colours[b]) < 0.15]
    assert not close, close
    # the legend shows every curve
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == labels


def test_the_figure_can_be_inspected_before_saving(tmp_path):
    from mas_trainer.plots import reward_figure

    fig = reward_figure(_rows(12, val=False))
    lines = fig.axes[0].get_lines()
    assert len(lines) == 13 and len({to_rgb(ln.get_color()) for ln in lines}) == 13
    assert not list(tmp_path.iterdir())  # nothing written
