"""Wall time of `fasop search` saying that no plan fits, against the same search where plans fit.

    python scripts/bench_no_fit.py [--repeat 3]

The case of issue 23: llama2-70b on 1 H100 + 3 A10G nodes (no plan fits) and on 2 H100 + 3 A10G nodes (plans
fit), the node types of the bundled h100-a100-a10g cluster; start-up included, as a user runs it. Prints the best
wall time of each over the repeats, the ratio, and what each search said.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fasop.inputs import bundled

MODEL = "llama2-70b"
CASES = {"no plan fits": {"H100": 1, "A10G": 3}, "plans fit": {"H100": 2, "A10G": 3}}


def cluster_file(folder: Path, name: str, counts: dict[str, int]) -> Path:
    """The bundled h100-a100-a10g cluster file with only the node types of `counts`, at those counts."""
    head, *tables = bundled.resolve("clusters", "h100-a100-a10g", ".toml").read_text().split("[[node_type]]")
    text = re.sub(r'(?m)^name = ".*"$', f'name = "{name}"', head, count=1)
    for table in tables:
        node_type = re.search(r'(?m)^name = "(.*)"$', table).group(1)
        if node_type in counts:
            text += "[[node_type]]" + re.sub(r"(?m)^count = \d+", f"count = {counts[node_type]}", table)
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def run(cluster: Path) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fasop", "search", "--model", MODEL, "--cluster", str(cluster),
                           "--top", "3"], capture_output=True, text=True, cwd=cluster.parent)
    elapsed = time.perf_counter() - started
    said = done.stderr.strip().splitlines()[-1] if done.returncode else done.stdout.splitlines()[0]
    return elapsed, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported")
    args = parser.parse_args()
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        for case, counts in CASES.items():
            path = cluster_file(Path(folder), "-".join(f"{c}x{n}" for n, c in counts.items()), counts)
            times, said = [], ""
            for _ in range(args.repeat):
                elapsed, said = run(path)
                times.append(elapsed)
            best[case] = min(times)
            print(f"{case:13} {' + '.join(f'{c} {n}' for n, c in counts.items()):14} {best[case]:6.2f} s  {said}")
    print(f"no / yes: {best['no plan fits'] / best['plans fit']:.2f}")


if __name__ == "__main__":
    main()
