"""Time and peak memory of `fasop search` on inputs whose numbers are huge but whose answers are small.

    python scripts/measure_limits.py [CASE ...]

Each case runs in a fresh process (`python -m fasop search ...`, one worker) on a cluster file written to a
temporary folder; the script prints the exit code, wall time, peak resident memory (the child's ru_maxrss)
and the first line the command printed. Cases: gbs (a global batch of 10^10 samples), huge-gbs (above the
accepted limit), nodes (10,000 nodes of one type), types3 (three types of 3,334 nodes), types12 (twelve types
of 1,000 nodes). Plan records list every node of every stage, so memory grows with plans times nodes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NODE = """[[node_type]]
name = "{name}"
gpu = "A10"
gpus_per_node = 4
gpu_memory_gib = 22.2
intra_node_bandwidth = "128 Gbit/s"
inter_node_bandwidth = "{inter} Gbit/s"
price_per_hour_usd = {price}
count = {count}
"""


def cluster_file(folder: Path, name: str, counts: list[int]) -> str:
    text = f'[cluster]\nname = "{name}"\nmemory_margin = 1.1\n\n'
    text += "\n".join(NODE.format(name=f"T{i}", inter=40 + i, price=8 + i, count=n) for i, n in enumerate(counts))
    path = folder / f"{name}.toml"
    path.write_text(text)
    return str(path)


def cases(folder: Path) -> dict[str, list[str]]:
    return {
        "gbs": ["--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10", "--gbs", str(10**10)],
        "huge-gbs": ["--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10", "--gbs", str(10**20)],
        "nodes": ["--model", "bert", "--cluster", cluster_file(folder, "nodes", [10_000]), "--gbs", "40000"],
        "types3": ["--model", "bert", "--cluster", cluster_file(folder, "types3", [3334] * 3), "--gbs", "40008"],
        "types12": ["--model", "bert", "--cluster", cluster_file(folder, "types12", [1000] * 12), "--gbs", "48000"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", metavar="CASE", help="the cases to run (default: every case)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = cases(Path(tmp))
        unknown = sorted(set(args.cases) - set(table))
        if unknown:
            parser.error(f"unknown case {unknown[0]} (cases: {', '.join(table)})")
        for name in args.cases or list(table):
            command = [sys.executable, "-m", "fasop", "search", *table[name], "--workers", "1", "--top", "1"]
            started = time.perf_counter()
            child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            output = child.stdout.read()
            _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not the largest so far
            elapsed = time.perf_counter() - started
            lines = output.strip().splitlines() or [""]
            print(f"{name}: exit {os.waitstatus_to_exitcode(status)}, {elapsed:.1f} s, "
                  f"peak {usage.ru_maxrss / 1024:.0f} MiB | {lines[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
