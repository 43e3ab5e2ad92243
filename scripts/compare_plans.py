"""Plans of FASOP's six experiments from this tree against those of an earlier commit, byte for byte.

    python scripts/compare_plans.py [--base REV]

Runs `fasop search --output plans.json` for each experiment with the code and bundled data of REV (exported
with `git archive` into a temporary folder) and with this tree, and reports any plan file that differs. Exit
code 1 if one does. REV defaults to the commit before the package was split into subpackages.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench_search import EXPERIMENTS  # FASOP's six experiments, from the script beside this one

ROOT = Path(__file__).resolve().parents[1]
BASE = "7ab2ffb"  # the last commit of main before the package was split into subpackages


def write_plans(source: Path, out: Path) -> dict[str, bytes]:
    """plans.json of every experiment, searched with the fasop package under `source`, by experiment name."""
    plans = {}
    for model, cluster in EXPERIMENTS:
        path = out / f"{model}-{cluster}.json"
        subprocess.run([sys.executable, "-m", "fasop", "search", "--model", model, "--cluster", cluster, "--top", "1",
                        "--output", str(path)], cwd=out, env={"PYTHONPATH": str(source), "PATH": ""},
                       capture_output=True, check=True)
        plans[path.name] = path.read_bytes()
    return plans


def export(rev: str, into: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BASE, help=f"the commit to compare with (default {BASE})")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_src, old_out, new_out = (Path(tmp) / name for name in ("src", "old", "new"))
        for folder in (old_src, old_out, new_out):
            folder.mkdir()
        export(args.base, old_src)
        old, new = write_plans(old_src, old_out), write_plans(ROOT, new_out)
    differ = [name for name in old if old[name] != new[name]]
    for name in old:
        print(f"{name:36} {len(new[name]):>9} bytes  {'DIFFERS' if name in differ else 'same'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
