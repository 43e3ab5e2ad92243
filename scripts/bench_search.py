"""Wall time of `fasop search` on FASOP's six experiments, start-up included, as a user runs it.

    python scripts/bench_search.py [--repeat 3]

Prints, per experiment, the best wall time over the repeats and the number of plans the search evaluated.
FASOP's reference code needs 5.8 to 115 s for the same six runs on a 2-core machine (reference section 6,
item 13) while searching a smaller space.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

EXPERIMENTS = [
    ("gpt2-xl", "fasop-8xA10"),
    ("gpt2-xl", "fasop-1xA100-7xA10"),
    ("bert", "fasop-4xA10"),
    ("bert", "fasop-1xA100-3xA10"),
    ("t5", "fasop-8xA10"),
    ("t5", "fasop-1xA100-7xA10"),
]


# Python's default: compiled modules are cached (a PYTHONDONTWRITEBYTECODE set for the shell would time compiling them)
ENVIRONMENT = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


def run(model: str, cluster: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fasop", "search", "--model", model, "--cluster", cluster, "--top", "1"],
                          capture_output=True, text=True, check=True, env=ENVIRONMENT)
    return time.perf_counter() - started, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per experiment; the best is reported")
    args = parser.parse_args()
    print(f"{'model':8} {'cluster':20} {'wall s':>7} {'plans':>6} {'partitions':>10}  best plan")
    for model, cluster in EXPERIMENTS:
        times, out = [], ""
        for _ in range(args.repeat):
            elapsed, out = run(model, cluster)
            times.append(elapsed)
        plans, partitions = re.search(r"(\d+) plans evaluated.*?\((\d+) layer partitions", out).groups()
        lines = out.splitlines()
        header = next(line.split() for line in lines if line.split()[:1] == ["rank"])
        best = dict(zip(header, next(line.split() for line in lines if line.split()[:1] == ["1"])))  # the first row
        print(f"{model:8} {cluster:20} {min(times):7.2f} {plans:>6} {partitions:>10}  "
              f"mbs={best['mbs']} tp={best['tp']} dp={best['dp']} pp={best['pp']} vp={best['vp']} "
              f"recompute={best['recompute']} sp={best['sp']} {best['placement']} layers {best['layers/stage']} "
              f"step {best['step']} s")


if __name__ == "__main__":
    main()
