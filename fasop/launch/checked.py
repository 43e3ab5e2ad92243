"""The plan to launch, checked against its model, cluster and site options before any script is rendered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fasop.cost.config import recompute_error, virtual_stages_error
from fasop.errors import InputError
from fasop.launch.options import LaunchOptions
from fasop.plans import Plan, PlanShape


@dataclass(frozen=True)
class LaunchPlan(PlanShape):
    rank: int | None
    encoder_stages: int
    gpus_per_node: int
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    virtual_stages: int = 1
    layers_per_virtual_stage: tuple[int, ...] = ()  # chunk-major, when virtual_stages > 1


def check_plan(plan: Plan, model: Any, cluster: Any, opts: LaunchOptions, where: str) -> LaunchPlan:
    """The plan (its fields already checked by the plan schema) against its model, cluster and options."""
    tp, dp, pp, mbs, gbs = plan.tp, plan.dp, plan.pp, plan.mbs, plan.gbs
    placement, layers = plan.placement, plan.layers_per_stage
    if len(layers) != pp:
        raise InputError(f"{where}: layers_per_stage",
                         f"expected {pp} layer counts >= 0 (one per stage), got {layers!r}")
    total = model.encoder_num_layers + model.decoder_num_layers
    if sum(layers) != total:
        raise InputError(f"{where}: layers_per_stage",
                         f"holds {sum(layers)} layers, model {model.name} has {total}")
    if gbs % (mbs * dp):
        raise InputError(f"{where}: gbs", f"{gbs} is not a multiple of mbs x dp = {mbs * dp}")
    gpn = _gpus_per_node(placement, cluster, opts, where)
    world = tp * dp * pp
    if world != gpn * len(placement):
        raise InputError(f"{where}: placement",
                         f"tp x dp x pp = {world} GPUs, but the placement lists {len(placement)} nodes of {gpn} GPUs")
    encoder_stages = plan.encoder_stages
    if model.architecture == "encoder-decoder" and pp > 1:
        if not 1 <= encoder_stages < pp:
            raise InputError(f"{where}: encoder_stages",
                             f"expected 1 to {pp - 1} for an encoder-decoder plan with pp={pp}, got {encoder_stages}")
        if sum(layers[:encoder_stages]) != model.encoder_num_layers:
            raise InputError(f"{where}: layers_per_stage",
                             f"the first {encoder_stages} stages hold {sum(layers[:encoder_stages])} layers, "
                             f"the encoder has {model.encoder_num_layers}")
    recompute = plan.recompute or "none"
    problem = recompute_error(recompute, plan.recompute_method, plan.recompute_num_layers)
    if problem:
        raise InputError(f"{where}: recompute", problem)
    if plan.recompute_method == "block" and min(layers) < (plan.recompute_num_layers or 0):
        raise InputError(f"{where}: recompute_num_layers", f"{plan.recompute_num_layers} layers recomputed per stage, "
                                                            f"but a stage holds {min(layers)} (fasop needs at least as many)")
    sequence_parallel = tp > 1 if plan.sequence_parallel is None else plan.sequence_parallel
    if sequence_parallel and tp == 1:
        raise InputError(f"{where}: sequence_parallel", "needs tensor parallelism (tp > 1), as Megatron-LM does")
    v, chunks = _virtual_layout(plan, model, where)
    return LaunchPlan(tp=tp, dp=dp, pp=pp, mbs=mbs, gbs=gbs, placement=tuple(placement),
                      layers_per_stage=tuple(layers), distributed_optimizer=bool(plan.distributed_optimizer),
                      rank=plan.rank, encoder_stages=encoder_stages, gpus_per_node=gpn,
                      # a plan that does not say: fasop's default, overlapped; Megatron-LM gathers parameters during
                      # the forward only with the distributed optimizer and with the gradient reduction overlapped
                      overlap_grad_reduce=plan.overlap_grad_reduce is not False,
                      overlap_param_gather=(plan.overlap_param_gather is not False and bool(plan.distributed_optimizer)
                                            and plan.overlap_grad_reduce is not False),
                      virtual_stages=v, layers_per_virtual_stage=tuple(chunks), recompute=recompute,
                      recompute_method=plan.recompute_method, recompute_num_layers=plan.recompute_num_layers,
                      sequence_parallel=sequence_parallel)


def _gpus_per_node(placement: list[str], cluster: Any, opts: LaunchOptions, where: str) -> int:
    """The placement checked against the cluster's node types and counts; the options' GPUs per node, else the
    one size of every node type the placement uses."""
    unknown = sorted(set(placement) - set(cluster.node_types))
    if unknown:
        known = ", ".join(cluster.node_types)
        raise InputError(f"{where}: placement", f"node type {unknown[0]} is not in cluster {cluster.name} (it has {known})")
    for name in sorted(set(placement)):
        used, have = placement.count(name), cluster.node_types[name].count
        if used > have:
            raise InputError(f"{where}: placement",
                             f"uses {used} nodes of type {name}, cluster {cluster.name} has {have}")
    if opts.gpus_per_node is not None:
        return opts.gpus_per_node
    sizes = {cluster.node_types[name].gpus_per_node for name in placement}
    if len(sizes) > 1:
        raise InputError(f"{where}: placement", f"node types with different GPUs per node {sorted(sizes)}")
    gpn = sizes.pop()
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:  # written into the scripts as it is
        raise InputError(f"cluster {cluster.name}: gpus_per_node", f"expected an integer >= 1, got {gpn!r}")
    return gpn


def _virtual_layout(plan: Plan, model: Any, where: str) -> tuple[int, list[int]]:
    """(virtual stages, layers per virtual stage): the plan's, checked to be what Megatron-LM runs and what fasop
    estimates (each stage's layers split evenly over its chunks)."""
    from fasop.search.record import virtual_layout

    v = plan.virtual_stages or 1
    if plan.layers_per_virtual_stage is not None and v == 1:
        raise InputError(f"{where}: layers_per_virtual_stage", "given, but virtual_stages is 1 or missing")
    if v == 1:
        return 1, []
    refusal = virtual_stages_error(model, plan.pp, v, plan.gbs // (plan.dp * plan.mbs))
    if refusal is not None:
        raise InputError(f"{where}: virtual_stages", f"{v}: {refusal}")
    even = virtual_layout(np.array(plan.layers_per_stage), v)
    if plan.layers_per_virtual_stage is not None and list(plan.layers_per_virtual_stage) != even:
        raise InputError(f"{where}: layers_per_virtual_stage",
                         f"expected {even}: each stage's layers split evenly over its {v} chunks, the first chunks "
                         f"taking one more, in virtual-stage order; got {list(plan.layers_per_virtual_stage)}")
    return v, even
