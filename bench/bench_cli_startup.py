"""How long `mas-trainer --help` takes, against a bare `python -c pass` measured in the same run.

Every CLI command pays this before it does anything (it imports `mas_trainer.cli` and the
config). Prints the median and spread over `--runs` runs of each, the ratio, and a JSON line.

    python bench/bench_cli_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time


def _times(cmd: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)
    base = _times([sys.executable, "-c", "pass"], args.runs)
    cli = _times([sys.executable, "-m", "mas_trainer.cli", "--help"], args.runs)
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {platform.python_version()}",
        "runs": args.runs, "python_s": statistics.median(base), "help_s": statistics.median(cli),
        "help_min_s": min(cli), "help_max_s": max(cli),
    }
    result["help_over_python"] = result["help_s"] / result["python_s"]
    print(f"python -c pass: {result['python_s']:.3f} s; mas-trainer --help: {result['help_s']:.3f} s "
          f"(min {result['help_min_s']:.3f}, max {result['help_max_s']:.3f}; {args.runs} runs), "
          f"{result['help_over_python']:.1f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
