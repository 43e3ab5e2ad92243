"""Write docs/compare.md: `fasop compare` for gpt2-xl and bert on every bundled FASOP cluster and on the
three-type cluster (bert has no bundled H100/A10G profiles, so they are synthesised into a temporary folder
with `fasop profile synth`, as the tests do).

    python scripts/compare_examples.py    # rewrites docs/compare.md
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ["fasop-1xA100-3xA10", "fasop-1xA100-7xA10", "fasop-4xA10", "fasop-8xA10", "h100-a100-a10g"]
MODELS = ["gpt2-xl", "bert"]


def fasop(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "fasop", *args], capture_output=True, text=True, check=True)
    return done.stdout.rstrip()


def synthesised_bert_profiles(folder: Path) -> Path:
    """bert's measured A100 profile plus synthesised H100 and A10G ones, in one folder."""
    from fasop.inputs import bundled

    measured = bundled.data_dir("profiles") / "bert" / "A100.csv"
    shutil.copy(measured, folder / "A100.csv")
    for gpu in ("H100", "A10G"):
        fasop("profile", "synth", "--model", "bert", "--gpu", gpu, "--out", str(folder / f"{gpu}.csv"))
    return folder


def main() -> None:
    # no options: --help shows the above (running rewrites docs/compare.md)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sections = ["# `fasop compare` on the bundled clusters", "",
                "Produced by `python scripts/compare_examples.py`; every number is fasop's estimate, not a "
                "measurement. bert on h100-a100-a10g uses bert's measured A100 profile and synthesised H100 and "
                "A10G profiles (`fasop profile synth`).", ""]
    with tempfile.TemporaryDirectory() as temp:
        for cluster in CLUSTERS:
            for model in MODELS:
                args = ["compare", "--model", model, "--cluster", cluster]
                shown = " ".join(args)
                if model == "bert" and cluster == "h100-a100-a10g":
                    args += ["--profiles", str(synthesised_bert_profiles(Path(temp)))]
                    shown += " --profiles DIR"
                sections += [f"## {model} on {cluster}", "", "```", f"$ fasop {shown}", fasop(*args), "```", ""]
    (ROOT / "docs" / "compare.md").write_text("\n".join(sections))


if __name__ == "__main__":
    main()
