"""The files of `fasop emit`, rendered and written.

* `sbatch.sh`: one Slurm job for the whole plan (fasop.launch.slurm);
* `run_inter.sh`: the per-node launcher (fasop.launch.torchrun);
* `plan.json`: the plan and its estimate, to compare the run with the prediction. `fasop emit` first estimates
  the plan afresh (fasop.launch.restate) and refuses a plan file whose figures disagree.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fasop.errors import ArgumentError
from fasop.launch.options import LaunchOptions, check_options
from fasop.launch.slurm import sbatch_script
from fasop.launch.torchrun import run_inter_script
from fasop.plans import Plan
from fasop.search.spec import spec_of

OUTPUT_FILES = ("sbatch.sh", "run_inter.sh", "plan.json")


def check_out_dir(out_dir: Path, force: bool, argument: str = "out_dir") -> None:
    """Refuse an output path that is a file, or a directory holding files unless `force`; errors name `argument`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ArgumentError(argument, "exists and is not a directory", out_dir)
    if out_dir.is_dir() and not force and any(out_dir.iterdir()):
        raise ArgumentError(argument, "the directory holds files already; force replaces them", out_dir,
                            remedy="force")


def render_plan(plan: Plan, model: Any, cluster: Any, options: LaunchOptions | None = None,
                where: str | None = None) -> dict[str, str]:
    """The emitted files, name -> text, without writing anything."""
    opts = options or LaunchOptions()
    check_options(opts, "--")
    where = where or f"plan {plan.rank or '?'}"
    p = spec_of(plan, model, cluster, where, opts.gpus_per_node)
    return {
        "sbatch.sh": sbatch_script(plan, model, cluster, p.gpus_per_node, opts),
        "run_inter.sh": run_inter_script(plan, model, cluster, p, opts, where),
        "plan.json": json.dumps(plan.record(), indent=2, sort_keys=True) + "\n",
    }


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_files(out_dir: Path, files: Mapping[str, str], force: bool = False, argument: str = "out_dir") -> list[Path]:
    """Write `files` into `out_dir` through a temporary sibling, so a failure leaves no half-written output;
    errors name `argument`."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, force, argument)
    parent = out_dir.absolute().parent
    mask = _umask()
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=parent))
    except OSError as err:
        raise ArgumentError(argument, f"cannot create a directory beside it ({err.strerror})", out_dir) from None
    try:
        for name, text in files.items():
            path = tmp / name
            path.write_text(text, encoding="utf-8")
            os.chmod(path, (0o777 if name.endswith(".sh") else 0o666) & ~mask)
        if out_dir.is_dir():
            for name in files:
                os.replace(tmp / name, out_dir / name)
            tmp.rmdir()
        else:
            os.chmod(tmp, 0o777 & ~mask)
            os.rename(tmp, out_dir)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ArgumentError(argument, f"cannot write ({err.strerror or err})", out_dir) from None
    return [out_dir / name for name in files]


def emit_plan(plan: Plan, model: Any, cluster: Any, out_dir: Path, options: LaunchOptions | None = None,
              force: bool = False, where: str | None = None) -> list[Path]:
    """Write sbatch.sh, run_inter.sh and plan.json for `plan` into `out_dir`; returns the written paths."""
    check_out_dir(Path(out_dir), force)
    files = render_plan(plan, model, cluster, options, where)
    return write_files(Path(out_dir), files, force)
