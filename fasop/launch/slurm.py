"""`sbatch.sh`: one Slurm job for the whole plan.

Nodes are requested per node type with their GRES type; when the placement mixes node types, every run of
consecutive nodes of one type becomes one component of a heterogeneous job (`#SBATCH hetjob`), in placement
order. Slurm numbers the tasks of `srun --het-group=0-K` component by component, so the global task id
(`SLURM_PROCID`) of the one task per node is the node's position in the plan's placement, and it becomes the
torchrun node rank. The first node of component 0 is the rendezvous. The job of a full run stops before its
time limit and requeues itself until the last iteration (fasop.launch.resume says how).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fasop.errors import InputError
from fasop.files import comment_line
from fasop.launch.options import SLURM_LIST, SLURM_NAME, LaunchOptions
from fasop.launch.resume import EXIT_DURATION_VARIABLE, LATEST
from fasop.launch.shell import quote
from fasop.plans import Plan, placement_runs


def _first(*values: str | None) -> str | None:
    return next((v for v in values if v is not None), None)


def _gres_type(node_type: Any, opts: LaunchOptions) -> str:
    """The node type's GRES type; "" asks for untyped GPUs (--gres=gpu:N)."""
    gres = _first(opts.gres_types.get(node_type.name), opts.gres_types.get(node_type.gpu),
                  getattr(node_type, "gres_type", None), opts.gres_type,
                  re.sub(r"[^a-z0-9_.+-]", "_", node_type.gpu.lower()))
    if gres and not SLURM_NAME.fullmatch(gres):
        raise InputError(f"node_type.{node_type.name}: gres_type", f"expected a Slurm name, got {gres!r}")
    return gres or ""


def _partition(node_type: Any, opts: LaunchOptions) -> str | None:
    part = _first(opts.partitions.get(node_type.name), opts.partitions.get(node_type.gpu),
                  getattr(node_type, "slurm_partition", None), opts.partition)
    if part is not None and not SLURM_LIST.fullmatch(part):
        raise InputError(f"node_type.{node_type.name}: slurm_partition", f"expected a Slurm name, got {part!r}")
    return part


def describe_plan(plan: Plan, model: Any, cluster: Any) -> str:
    return comment_line(f"fasop plan {plan.rank or 1}: {model.name} on {cluster.name}, tp={plan.tp} dp={plan.dp} "
                        f"pp={plan.pp} mbs={plan.mbs} gbs={plan.gbs}, layers per stage "
                        f"{'-'.join(str(n) for n in plan.layers_per_stage)}.")


def sbatch_script(plan: Plan, model: Any, cluster: Any, gpus_per_node: int, opts: LaunchOptions,
                  notes: Sequence[str] = (), resume: ResumeSettings | None = None) -> str:
    """One Slurm job for the plan: a heterogeneous one when its nodes are of several types; with `resume`, one
    that stops before its time limit and requeues itself until the training is done (fasop.launch.resume)."""
    runs = placement_runs(plan.placement)
    het = len(runs) > 1
    lines = [
        "#!/usr/bin/env bash",
        describe_plan(plan, model, cluster),
        comment_line(f"Node ranks 0-{len(plan.placement) - 1} in placement order: {' '.join(plan.placement)}."),
        *(comment_line(note[0].upper() + note[1:] + ".") for note in notes),
    ]
    if het:
        lines.append("# One heterogeneous-job component per run of nodes of one type, in that order.")
    lines.append("# Submit from this directory: sbatch sbatch.sh (or: sbatch --chdir=DIR DIR/sbatch.sh).")
    cpus = [opts.cpus_per_task or cluster.node_types[name].cpus_per_node for name, _ in runs]
    # job-wide, so in the first component (the batch shell, which gets the signal, runs there)
    requeue = [] if resume is None else ["#SBATCH --requeue", "#SBATCH --open-mode=append",
                                         f"#SBATCH --signal=B:USR1@{max(1, opts.stop_margin_s // 2)}"]
    lines += _directives(runs, model, cluster, gpus_per_node, opts, cpus, requeue)
    return "\n".join(lines + _job_lines(len(runs), opts, cpus[0] if len(set(cpus)) == 1 else None, resume))


def _directives(runs: list[tuple[str, int]], model: Any, cluster: Any, gpus_per_node: int | Mapping[str, int],
                opts: LaunchOptions, cpus: list[int | None], job_wide: list[str]) -> list[str]:
    """The #SBATCH lines of each component: one per run of nodes of one type; `gpus_per_node` per node type
    where they differ (stage-group plans)."""
    job_name = opts.job_name or re.sub(r"[^A-Za-z0-9_.+-]", "_", f"fasop-{model.name}")
    lines = []
    for index, (name, count) in enumerate(runs):
        node_type = cluster.node_types[name]
        if index > 0:
            lines.append("#SBATCH hetjob")
        else:
            lines += [f"#SBATCH --job-name={job_name}", "#SBATCH --output=fasop-%j.out", "#SBATCH --error=fasop-%j.err",
                      *job_wide]
        lines.append(f"#SBATCH --time={opts.time_limit}")
        if opts.account:
            lines.append(f"#SBATCH --account={opts.account}")
        partition, gres = _partition(node_type, opts), _gres_type(node_type, opts)
        if partition:
            lines.append(f"#SBATCH --partition={partition}")
        gpus = gpus_per_node if isinstance(gpus_per_node, int) else gpus_per_node[name]
        lines += [f"#SBATCH --nodes={count}", "#SBATCH --ntasks-per-node=1",
                  f"#SBATCH --gres=gpu:{gres + ':' if gres else ''}{gpus}"]
        if cpus[index]:
            lines.append(f"#SBATCH --cpus-per-task={cpus[index]}")
        if opts.exclusive:
            lines.append("#SBATCH --exclusive")
    return lines


def _job_lines(components: int, opts: LaunchOptions, cpus: int | None, resume: ResumeSettings | None) -> list[str]:
    """What the job runs: the rendezvous address, then run_inter.sh on every node through one srun."""
    het = components > 1
    nodelist = "SLURM_JOB_NODELIST_HET_GROUP_0" if het else "SLURM_JOB_NODELIST"
    srun_args = ["--kill-on-bad-exit=1"]
    if het:
        srun_args.insert(0, f"--het-group=0-{components - 1}")
    lines = [
        "",
        "set -euo pipefail",
        "",
        'RUN_DIR="$PWD"',
        'if [[ ! -f "$RUN_DIR/run_inter.sh" ]]; then',
        '    echo "sbatch.sh: no run_inter.sh in $RUN_DIR; submit from the directory fasop emit wrote" >&2',
        "    exit 1",
        "fi",
        "",
        "# Rendezvous: the first node of the first component, which gets node rank 0.",
        f'MASTER_NODE="$(scontrol show hostnames "${nodelist}" | sed -n 1p)"',
        'MASTER_ADDR="$(scontrol -o show node "$MASTER_NODE" 2>/dev/null | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' || true)"',
        'export MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"',
        f'export MASTER_PORT="${{MASTER_PORT:-{opts.master_port}}}"',
    ]
    if cpus:  # srun does not take --cpus-per-task from the job (Slurm 22.05 and later)
        lines.append(f"export SRUN_CPUS_PER_TASK={cpus}")
    lines += ["", "# One task per node; its global task id (SLURM_PROCID) is its node rank.",
              "SRUN_ARGS=(" + " ".join(quote(a) for a in srun_args) + ")"]
    if opts.container_image:
        mounts = '"$RUN_DIR:$RUN_DIR"' + (f",{quote(opts.container_mounts)}" if opts.container_mounts else "")
        lines += [
            f"CONTAINER_IMAGE={quote(opts.container_image)}",
            f"CONTAINER_MOUNTS={mounts}",
            'SRUN_ARGS+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS" '
            '--container-workdir="$RUN_DIR")',
        ]
    if resume is None:
        return lines + ['srun "${SRUN_ARGS[@]}" bash "$RUN_DIR/run_inter.sh"', ""]
    return lines + _resume_lines(resume)


@dataclass(frozen=True)
class ResumeSettings:
    """What sbatch.sh of a full run needs to resume it: where Megatron-LM saves, and the last iteration."""

    checkpoint_dir: str
    train_iters: int
    exit_duration_min: int


def _resume_lines(resume: ResumeSettings) -> list[str]:
    """srun in the background: on Slurm's USR1 before the time limit the trainers get SIGTERM, save and stop
    (Megatron-LM's --exit-signal-handler); then the job requeues itself while training is left and this job
    saved progress."""
    return [
        "",
        "# The whole training across jobs: each resumes from the latest checkpoint (Megatron-LM --load).",
        f"CHECKPOINT_DIR={quote(resume.checkpoint_dir)}",
        f"TRAIN_ITERS={resume.train_iters}",
        f"export {EXIT_DURATION_VARIABLE}={resume.exit_duration_min}  # Megatron-LM saves and exits by itself then",
        'saved_iteration() {  # the last iteration Megatron-LM saved, 0 before the first checkpoint',
        f'    local saved; saved="$(cat "$CHECKPOINT_DIR/{LATEST}" 2>/dev/null || true)"',
        '    if [[ "$saved" =~ ^[0-9]+$ ]]; then echo "$saved"; else echo 0; fi',
        "}",
        'START_ITERATION="$(saved_iteration)"',
        'echo "sbatch.sh: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) starts at iteration $START_ITERATION' +
        ' of $TRAIN_ITERS"',
        "# shellcheck disable=SC2317  # run by the trap below",
        'stop_before_time_limit() {',
        '    echo "sbatch.sh: time limit near: the trainers save a checkpoint and stop" >&2',
        '    scancel --signal=TERM "$SLURM_JOB_ID"  # the job steps only, not this shell: the trainers',
        "}",
        "trap stop_before_time_limit USR1",
        'srun "${SRUN_ARGS[@]}" bash "$RUN_DIR/run_inter.sh" &',
        "SRUN_PID=$!",
        "while :; do",
        "    STATUS=0",
        '    wait "$SRUN_PID" || STATUS=$?',
        '    kill -0 "$SRUN_PID" 2>/dev/null || break  # else the wait ended early, on the signal',
        "done",
        'SAVED="$(saved_iteration)"',
        "if (( SAVED >= TRAIN_ITERS )); then",
        '    echo "sbatch.sh: training complete at iteration $SAVED"',
        "    exit 0",
        "fi",
        "if (( SAVED > START_ITERATION )); then",
        '    echo "sbatch.sh: saved iteration $SAVED of $TRAIN_ITERS; requeueing the job to resume"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'echo "sbatch.sh: no checkpoint saved beyond iteration $START_ITERATION (trainers exited with $STATUS);' +
        ' not requeued" >&2',
        'exit "$(( STATUS == 0 ? 1 : STATUS ))"',
        "",
    ]
