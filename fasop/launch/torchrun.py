"""`run_inter.sh`: the per-node launcher, `torchrun ... <entry script> <Megatron-LM flags>`."""

from __future__ import annotations

import os
from typing import Any

from fasop.launch.megatron import (
    ENTRY_SCRIPTS,
    context_expert_flags,
    data_flags,
    model_flags,
    recompute_flags,
    split_layer_flags,
    tensor_parallel_flags,
    training_flags,
)
from fasop.launch.network import network_lines
from fasop.launch.options import LaunchOptions
from fasop.launch.resume import EXIT_DURATION_VARIABLE
from fasop.launch.shell import group_flags, quote
from fasop.launch.slurm import describe_plan
from fasop.launch.startup import startup_lines, torchrun_lines
from fasop.plans import Plan
from fasop.search.spec import PlanSpec


def run_inter_script(plan: Plan, model: Any, cluster: Any, p: PlanSpec, opts: LaunchOptions, where: str) -> str:
    entry = opts.entry_script or ENTRY_SCRIPTS[model.architecture]
    entry_value = quote(entry) if os.path.isabs(entry) else f'"$MEGATRON_PATH"/{quote(entry)}'
    parallel: list[tuple[str, ...]] = [("--tensor-model-parallel-size", str(p.tp)), ("--pipeline-model-parallel-size", str(p.pp))]
    parallel += context_expert_flags(p, model)
    parallel += split_layer_flags(p, model, opts, where)
    parallel += tensor_parallel_flags(p)
    parallel += recompute_flags(p)
    if p.distributed_optimizer:
        parallel.append(("--use-distributed-optimizer",))
    if p.overlap_grad_reduce:
        parallel.append(("--overlap-grad-reduce",))
    if p.overlap_param_gather:
        parallel.append(("--overlap-param-gather",))
    parallel += [("--micro-batch-size", str(p.mbs)), ("--global-batch-size", str(p.gbs))]
    lines = [
        "#!/usr/bin/env bash",
        describe_plan(plan, model, cluster),
        "# Per-node launcher, started once per node by sbatch.sh, launch.sh or the lines of commands.txt; by hand: "
        "NODE_RANK=r MASTER_ADDR=host bash run_inter.sh",
        "set -euo pipefail",
        "",
        *startup_lines(p.placement, [cluster.node_types[name].gpu for name in p.placement], p.gpus_per_node,
                       opts.master_port),
        f"DEFAULT_MEGATRON_PATH={quote(opts.megatron_path)}",
        'MEGATRON_PATH="${MEGATRON_PATH:-$DEFAULT_MEGATRON_PATH}"',
        f"ENTRY_SCRIPT={entry_value}",
        'echo "run_inter.sh: node rank $NODE_RANK of $NNODES (plan: ${NODE_TYPES[$NODE_RANK]}) on $(hostname), '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "",
        *network_lines([cluster.node_types[name] for name in dict.fromkeys(p.placement)]),
        *torchrun_lines([("PARALLEL_ARGS", parallel), ("MODEL_ARGS", model_flags(model, opts)),
                         ("TRAINING_ARGS", training_flags(plan, model, opts)), ("DATA_ARGS", data_flags(model, opts)),
                         ("EXTRA_ARGS", group_flags(opts.extra_flags))],
                       before_run=[f'if [[ -n "${{{EXIT_DURATION_VARIABLE}:-}}" ]]; then  # set by sbatch.sh: its time limit',
                                   f'    TRAINING_ARGS+=(--exit-duration-in-mins "${EXIT_DURATION_VARIABLE}")',
                                   "fi"]),
    ]
    return "\n".join(lines)
