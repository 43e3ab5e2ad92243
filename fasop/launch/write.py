"""The files of `fasop emit`, rendered and written.

* `sbatch.sh`: one Slurm job for the whole plan (fasop.launch.slurm);
* `run_inter.sh`: the per-node launcher (fasop.launch.torchrun);
* `plan.json`: the plan and its estimate, to compare the run with the prediction. `fasop emit` first estimates
  the plan afresh (fasop.launch.restate) and refuses a plan file whose figures disagree.

`emit` is what `fasop emit` does (and fasop.emit in Python): the plan restated, then its files for a launcher
(fasop.launch.launchers) written; `emit_plan` writes a plan's Slurm files as they stand.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from fasop.errors import ArgumentError, InputError
from fasop.files import check_outputs
from fasop.inputs import bundled
from fasop.inputs.cluster import Cluster
from fasop.inputs.errorband import band_of
from fasop.inputs.model import Model
from fasop.launch.dataparallel import render_dp_plan, restate_dp_plan
from fasop.launch.flagscale import TRAIN_NAME, flagscale_launcher_files, render_flagscale
from fasop.launch.flagscale_scripts import CONFIG_NAME
from fasop.launch.launchers import LAUNCHERS, RENDEZVOUS, launcher_files, launcher_inputs
from fasop.launch.options import LaunchOptions, check_options, launch_options, split_flags
from fasop.launch.restate import restate_plan
from fasop.launch.resume import exit_duration_min, run_notes, train_iters
from fasop.launch.slurm import ResumeSettings, sbatch_script
from fasop.launch.torchrun import run_inter_script
from fasop.plans import Plan
from fasop.search.precision import plan_model
from fasop.search.spec import spec_of

# Every file an emit may write, whatever its launcher and plan kind (fasop.launch.launchers, fasop.launch.flagscale):
# replacing an emit, force removes those of the earlier one that the new one does not write.
EMITTED_FILES = ("sbatch.sh", "run_inter.sh", "plan.json", "hosts", "launch.sh", "commands.txt", "hostfile",
                 f"{CONFIG_NAME}.yaml", f"train/{TRAIN_NAME}.yaml")


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
    check_options(opts)
    where = where or f"plan {plan.rank or '?'}"
    model = plan_model(model, plan)
    p = spec_of(plan, model, cluster, where, opts.gpus_per_node)
    run_inter = run_inter_script(plan, model, cluster, p, opts, where)  # first: it refuses a run it cannot make
    resume = None if opts.smoke_test else ResumeSettings(opts.checkpoint_dir, train_iters(plan, opts),
                                                         exit_duration_min(opts))
    return {
        "sbatch.sh": sbatch_script(plan, model, cluster, p.gpus_per_node, opts,
                                   run_notes(plan, opts, band_of(cluster.error_band)), resume),
        "run_inter.sh": run_inter,
        "plan.json": json.dumps(plan.record(), indent=2, sort_keys=True) + "\n",
    }


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _stale_files(out_dir: Path, names: Iterable[str], keep: Iterable[Path]) -> list[Path]:
    """The files of an earlier emit in `out_dir` that `names` do not replace, but for the files in `keep`."""
    kept = [Path(path) for path in keep if Path(path).is_file()]
    stale = [out_dir / name for name in EMITTED_FILES if name not in names and (out_dir / name).is_file()]
    return [path for path in stale if not any(path.samefile(other) for other in kept)]


def write_files(out_dir: Path, files: Mapping[str, str], force: bool = False, argument: str = "out_dir",
                keep: Iterable[Path] = ()) -> list[Path]:
    """Write `files` into `out_dir` through a temporary sibling, so a failure leaves no half-written output;
    errors name `argument`. Into a directory that holds files (`force`), an earlier emit's files that `files`
    do not replace are removed once `files` are in place, but for those in `keep` (the run's inputs)."""
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
            path.parent.mkdir(exist_ok=True)  # FlagScale's train/ config group
            path.write_text(text, encoding="utf-8")
            os.chmod(path, (0o777 if name.endswith(".sh") else 0o666) & ~mask)
        if out_dir.is_dir():
            stale = _stale_files(out_dir, files, keep)
            for name in files:
                (out_dir / name).parent.mkdir(exist_ok=True)
                os.replace(tmp / name, out_dir / name)
            shutil.rmtree(tmp)
            for path in stale:
                path.unlink()
                if path.parent != out_dir and not any(path.parent.iterdir()):
                    path.parent.rmdir()  # FlagScale's train/, left empty
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


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)  # at the line that called emit


def emit(plan: Plan, model: Model, cluster: Cluster, out_dir: str | os.PathLike, *, force: bool = False,
         profiles_dir: str | None = None, launcher: str = "slurm", hosts_file: str | None = None,
         rendezvous: str = "tcp", rendezvous_file: str | None = None, inputs: Iterable[str | os.PathLike] = (),
         where: str | None = None, warn: Callable[[str], None] = _warn, **site: Any) -> list[Path]:
    """What `fasop emit` does: `plan` (3D or data-parallel) estimated afresh from `model`, `cluster` and the
    profiles in `profiles_dir` (default: `plan.profiles`, the folder the plan was made with) and refused when a
    figure it states disagrees; with `force` it is emitted with the fresh figures and `warn` (default: a
    UserWarning) says so. Then its files for `launcher` are written into `out_dir`, which must hold no files
    unless `force`: sbatch.sh, run_inter.sh and plan.json for slurm; run_inter.sh, plan.json, hosts (from
    `hosts_file`) and launch.sh for ssh; run_inter.sh, plan.json and commands.txt for manual. With `force`, the
    files an earlier emit wrote there that this one does not (EMITTED_FILES) are removed, but for the inputs.
    Returns the paths written.

    `site`: launch options (fasop.launch.options.LaunchOptions: time_limit=..., partitions={"A100": "hgx"}, ...)
    over the cluster file's [launch] table; a `partition` or `gres_type` names every node type, over the table's
    per-type names. `extra_flags`: Megatron-LM arguments, or one string split as a shell would. `inputs`: files
    besides the model, cluster and hosts files that no output may replace (the plan list). A full run needs the
    plan's train_steps (or train_iters), data_path and a tokenizer, and the model's lr (or training={"lr": ...});
    smoke_test=True makes a short run instead. `warn` also gets what the user must know about the run: its
    length and, when it outlasts the time limit, the jobs it takes (fasop.launch.resume).
    """
    for value, argument, known in ((launcher, "launcher", LAUNCHERS), (rendezvous, "rendezvous", RENDEZVOUS)):
        if value not in known:
            raise ArgumentError(argument, f"expected one of {', '.join(known)}", value)
    out = Path(out_dir)
    check_out_dir(out, force)
    where = where or f"plan {plan.rank or '?'}"
    model = plan_model(model, plan)
    restate, render = (restate_dp_plan, render_dp_plan) if plan.is_data_parallel else (restate_plan, render_plan)
    if plan.is_stage_groups:  # FlagScale's heterogeneous mode (fasop.launch.flagscale)
        render = render_flagscale
    plan, warning = restate(plan, model, cluster, plan.profiles if profiles_dir is None else profiles_dir, force, where)
    options = launch_options(cluster.launch, f"{cluster.file or cluster.name}: launch", **_site_overrides(cluster, site))
    launch = {"launcher": launcher, "hosts_file": hosts_file, "rendezvous": rendezvous, "rendezvous_file": rendezvous_file}
    if plan.is_stage_groups:
        files = flagscale_launcher_files(render(plan, model, cluster, options, where), plan, cluster, out, options, launch)
    else:
        files = launcher_files(render(plan, model, cluster, options, where), plan, out, options.master_port, launch)
    model_files = [bundled.resolve(kind, given.file, ".toml") for kind, given in (("models", model), ("clusters", cluster))
                   if given.file]
    input_files = [*map(Path, inputs), *model_files, *launcher_inputs(launch)]
    _check_outputs(out, files, input_files)
    written = write_files(out, files, force, keep=input_files)
    if warning:
        warn(warning)
    if not plan.is_data_parallel:
        for note in run_notes(plan, options, band_of(cluster.error_band)):
            warn(note)
    return written


def _site_overrides(cluster: Cluster, site: dict[str, Any]) -> dict[str, Any]:
    """`site` as launch_options takes it: a `partition` or `gres_type` added to the per-type names (`partitions`,
    `gres_types`) for every node type they do not name, so that it wins over the cluster file's per-type names;
    `extra_flags` split. A per-type name must name a node type or GPU of the cluster: another would be ignored."""
    overrides = dict(site)
    types = [*cluster.node_types.values(), *cluster.hosts.values()]
    known = sorted({t.name for t in types} | {t.gpu for t in types})
    for key in ("partition", "gres_type"):
        default, per_type = overrides.get(key), dict(overrides.get(f"{key}s") or {})
        for name, value in per_type.items():
            if name not in known:
                raise ArgumentError(f"{key}s", f"{name} is no node type or GPU of cluster {cluster.name}; expected one "
                                               f"of {', '.join(known)}", f"{name}={value}")
        for node_type in cluster.node_types.values():
            if default is not None and node_type.name not in per_type and node_type.gpu not in per_type:
                per_type[node_type.name] = default
        overrides[f"{key}s"] = per_type
    if overrides.get("extra_flags") is not None:
        overrides["extra_flags"] = split_flags(overrides["extra_flags"], "extra_flags")
    return overrides


def _check_outputs(out_dir: Path, names: Iterable[str], inputs: list[Path]) -> None:
    """No file to be written into `out_dir` may replace an input (fasop.files.check_outputs); errors name out_dir
    and the file."""
    for name in names:
        try:
            check_outputs([(out_dir / name, "out_dir")], inputs)
        except InputError as err:
            raise ArgumentError("out_dir", err.problem, out_dir / name) from None
