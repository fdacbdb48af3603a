"""Tabulate `loop.py` runs: one row per seed (OUT/seed_S/result.json), the mean and range of the
served graph's held-out scores before and after, and a PNG of them.

    python examples/closed_loop/report.py runs/closed_loop [--png docs/results/closed_loop.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the --out folder of loop.py")
    ap.add_argument("--png", default=None, help="where to draw before/after per seed (default OUT/closed_loop.png)")
    args = ap.parse_args(argv)
    results = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob("seed_*/result.json"))]
    if not results:
        raise SystemExit(f"no seed_*/result.json under {args.out}: run examples/closed_loop/loop.py --out {args.out} first")
    print("| seed | users' F1 (base, served) | SFT lines | held-out EM before -> after | held-out F1 before -> after | wall time |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['seed']} | {r['users_f1']:.3f} | {r['data']['sft_lines']} | {r['heldout_em_before']:.3f} -> "
              f"{r['heldout_em_after']:.3f} | {r['heldout_f1_before']:.3f} -> {r['heldout_f1_after']:.3f} | "
              f"{r['wall_s'] / 60:.0f} min |")
    for key in ("heldout_em_before", "heldout_em_after", "heldout_f1_before", "heldout_f1_after"):
        values = [r[key] for r in results]
        print(f"{key}: mean {sum(values) / len(values):.3f}, range {min(values):.3f}-{max(values):.3f} ({len(values)} seeds)")

    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2))
    ax = fig.add_subplot()
    seeds = [str(r["seed"]) for r in results]
    xs = range(len(results))
    for offset, (key, label) in enumerate((("heldout_em_before", "EM before"), ("heldout_em_after", "EM after"),
                                           ("heldout_f1_before", "F1 before"), ("heldout_f1_after", "F1 after"))):
        ax.bar([x + (offset - 1.5) * 0.2 for x in xs], [r[key] for r in results], width=0.2, label=label)
    ax.set_xticks(list(xs), [f"seed {s}" for s in seeds])
    ax.set_ylim(0, 1)
    ax.set_ylabel("served graph, held-out")
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    png = Path(args.png or Path(args.out) / "closed_loop.png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
