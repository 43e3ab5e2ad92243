"""`fasop emit` for data-parallel plans (kinds ddp, zero1, zero2, zero3): the same Slurm job as for 3D plans
(fasop/emit.py's sbatch.sh: one heterogeneous-job component per run of node types, one task per node), whose
per-node run_inter.sh starts torchrun with the user's training script and `--plan plan.json`; the script reads
its batch split with fasop.runtime (docs/uneven-ddp.md)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from fasop.errors import ArgumentError, InputError
from fasop.files import comment_line
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.profiles import load_profiles
from fasop.launch.options import LaunchOptions, check_options
from fasop.launch.restate import disagreements
from fasop.launch.shell import group_flags, quote
from fasop.launch.slurm import sbatch_script
from fasop.launch.startup import startup_lines, torchrun_lines
from fasop.plans import Plan
from fasop.runtime import check_plan
from fasop.search.dataparallel import NoPlan, plan_row

DEFAULT_ENTRY_SCRIPT = "train.py"  # beside sbatch.sh unless --entry-script names another
_NOT_FIGURES = ("model", "model_file", "cluster", "cluster_file", "profiles", "synthesised_profiles")


def _checked(plan: Plan, cluster: Any, where: str) -> int:
    """The plan's GPUs per node, once the plan is found to use every node of `cluster`."""
    check_plan(plan, where)
    have = Counter({name: t.count for name, t in cluster.node_types.items()})
    if Counter(plan.placement) != have or plan.gpus_per_node != cluster.gpus_per_node:
        raise InputError(f"{where}: placement", f"a {plan.kind} plan uses every node of its cluster; cluster "
                                                f"{cluster.name} has {dict(have)} nodes of {cluster.gpus_per_node} GPUs")
    return cluster.gpus_per_node


def restate_dp_plan(plan: Plan, model: Any, cluster: Any, profiles_dir: str | None = None,
                    force: bool = False, where: str | None = None) -> tuple[Plan, str | None]:
    """As restate_plan for 3D plans: the plan's split estimated afresh; a plan whose figures disagree is
    refused, or with `force` returned with the fresh figures and a warning."""
    where = where or f"plan {plan.rank or '?'}"
    _checked(plan, cluster, where)
    samples = {item.node_type: item.samples_per_gpu for item in plan.per_type or []}
    try:
        profiles = load_profiles(model, [t.gpu for t in cluster.node_types.values()], profiles_dir,
                                 specs=merged_specs(own=cluster.gpus))
        fresh = plan_row(model, cluster, profiles, plan.kind, plan.gbs, plan.batch_split == "even", samples,
                         overlap=plan.overlap_grad_reduce is not False, recompute=plan.recompute or "none")
    except (InputError, NoPlan) as err:
        raise InputError(where, f"cannot be estimated afresh from model {model.name} and cluster {cluster.name} "
                                f"({err})") from None
    figures = {key: value for key, value in fresh.record().items() if key not in _NOT_FIGURES}
    given = plan.record()
    stale = disagreements(given, figures, "")
    if not stale:
        return Plan.trusted({**figures, **given}), None
    key, was, value = stale[0]
    message = f"stale plan: {key} is {was!r} in the plan file but {value!r} estimated afresh"
    if not force:
        raise InputError(where, f"{message}; compare again with the same profiles, or force it out with the fresh "
                                "with the fresh figures")
    return Plan.trusted({**given, **figures}), f"warning: {where}: {message}; emitted with the fresh figures (forced)"


def _run_inter(plan: Plan, model: Any, cluster: Any, gpus_per_node: int, opts: LaunchOptions) -> str:
    entry = f'"$RUN_DIR"/{quote(DEFAULT_ENTRY_SCRIPT)}' if opts.entry_script is None else quote(opts.entry_script)
    split = ", ".join(f"{t.node_type} {t.samples_per_gpu} samples per GPU" for t in plan.per_type or [])
    lines = [
        "#!/usr/bin/env bash",
        comment_line(f"fasop plan {plan.rank or 1}: {model.name} on {cluster.name}, {plan.kind} over {plan.dp} GPUs, "
                     f"global batch {plan.gbs}: {split}."),
        "# Per-node launcher, started once per node by sbatch.sh; by hand: NODE_RANK=r MASTER_ADDR=host bash run_inter.sh",
        "set -euo pipefail",
        "",
        'RUN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        *startup_lines(plan.placement, [cluster.node_types[name].gpu for name in plan.placement], gpus_per_node,
                       opts.master_port),
        f"ENTRY_SCRIPT={entry}",
        "",
        "# Every rank reads its samples per step, micro-batches and loss weight from the plan (fasop.runtime).",
        *torchrun_lines([("EXTRA_ARGS", group_flags(opts.extra_flags))], '--plan "$RUN_DIR/plan.json"'),
    ]
    return "\n".join(lines)


def render_dp_plan(plan: Plan, model: Any, cluster: Any, options: LaunchOptions | None = None,
                   where: str | None = None) -> dict[str, str]:
    """sbatch.sh, run_inter.sh and plan.json of a data-parallel plan, without writing anything."""
    opts = options or LaunchOptions()
    check_options(opts)
    where = where or f"plan {plan.rank or '?'}"
    gpus_per_node = _checked(plan, cluster, where)
    if opts.gpus_per_node not in (None, gpus_per_node):
        raise ArgumentError("gpus_per_node", f"the plan splits its batch over {gpus_per_node} GPUs per node",
                            opts.gpus_per_node)
    return {
        "sbatch.sh": sbatch_script(plan, model, cluster, gpus_per_node, opts),
        "run_inter.sh": _run_inter(plan, model, cluster, gpus_per_node, opts),
        "plan.json": json.dumps(plan.record(), indent=2, sort_keys=True) + "\n",
    }
