"""The estimate of one explicit plan: the same cost model and record as the search, for a plan given by hand."""

from __future__ import annotations

import numpy as np

from fasop.cost.communication import geometry, with_embedding_group
from fasop.cost.config import Config, embedding_stages, fewest_layers, recompute_error, virtual_stages_error
from fasop.cost.memory import usable_gib
from fasop.cost.step import StageCosts, stage_costs
from fasop.errors import InputError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile
from fasop.plans import Plan
from fasop.search.record import plan_rows
from fasop.search.space import prepare, tensor_degrees


def _used_nodes(cluster: Cluster, placement: list[str]) -> dict[str, int]:
    """The nodes of each type the placement uses, checked against the cluster's."""
    used = {name: placement.count(name) for name in placement}
    for name, count in used.items():
        if name not in cluster.node_types:
            raise InputError("--placement", f"unknown node type {name!r} (cluster has {', '.join(cluster.node_types)})")
        if count > cluster.node_types[name].count:
            raise InputError("--placement", f"{count} nodes of type {name} but the cluster has {cluster.node_types[name].count}")
    return used


def _encoder_stages(model: Model, layers: list[int]) -> int:
    """The stages holding an encoder-decoder model's encoder layers (0: no encoder split)."""
    if not model.is_encoder_decoder or len(layers) == 1:
        return 0
    prefix = np.cumsum(layers)
    if model.encoder_num_layers not in prefix[:-1]:
        raise InputError("--layers", f"no stage boundary falls after the {model.encoder_num_layers} encoder layers")
    return int(np.searchsorted(prefix, model.encoder_num_layers)) + 1


def estimate(model: Model, cluster: Cluster, *, tp: int, dp: int, pp: int, mbs: int, placement: list[str],
             layers: list[int], gbs: int | None = None, profiles_dir: str | None = None,
             distributed_optimizer: bool = True, profiles: dict[str, GpuProfile] | None = None,
             overlap: bool = True, virtual_stages: int = 1, recompute: str = "none", recompute_method: str | None = None,
             recompute_num_layers: int | None = None, sequence_parallel: bool | None = None) -> Plan:
    """The full breakdown of one explicit plan; `layers` lists transformer layers per stage; `profiles`: already
    loaded profiles (by GPU type) instead of reading profiles_dir; `overlap`: Megatron's --overlap-grad-reduce,
    and --overlap-param-gather with the distributed optimizer; `virtual_stages`: model chunks per pipeline rank,
    each stage's layers split evenly over them; full recomputation without a method is uniform over every layer;
    sequence_parallel: default on when tp > 1."""
    sub = cluster.with_counts(_used_nodes(cluster, placement))
    inputs = prepare(model, sub, gbs, profiles_dir, distributed_optimizer, profiles)
    gpn = cluster.gpus_per_node
    if gpn % tp or tp not in tensor_degrees(inputs):
        raise InputError("--tp", f"expected a divisor of {gpn} GPUs per node that divides the attention heads and "
                                 f"query groups and that every GPU type's profile has, got {tp}")
    if tp * dp * pp != len(placement) * gpn:
        raise InputError("--placement", f"tp*dp*pp = {tp * dp * pp} GPUs but the placement's {len(placement)} nodes "
                                        f"hold {len(placement) * gpn}")
    if inputs.gbs % (dp * mbs):
        raise InputError("--mbs", f"dp * mbs = {dp * mbs} must divide the global batch size {inputs.gbs}")
    if len(layers) != pp or sum(layers) != model.num_layers:
        raise InputError("--layers", f"expected {pp} stage counts summing to {model.num_layers} layers, "
                                     f"got {','.join(map(str, layers))}")
    split = _encoder_stages(model, layers)
    refusal = virtual_stages_error(model, pp, virtual_stages, inputs.gbs // (dp * mbs))
    if refusal is not None:
        raise InputError("--virtual-stages", f"{virtual_stages}: {refusal}")
    if recompute == "full" and recompute_method is None and recompute_num_layers is None:
        recompute_method, recompute_num_layers = "uniform", 1  # every layer, as the search takes full recomputation
    problem = recompute_error(recompute, recompute_method, recompute_num_layers)
    if problem:
        raise InputError("--recompute", problem)
    if sequence_parallel and tp == 1:
        raise InputError("--sequence-parallel", "needs tensor parallelism (tp > 1), as Megatron-LM does")
    sequence_parallel = tp > 1 if sequence_parallel is None else sequence_parallel
    config = Config(tp, dp, pp, mbs, inputs.gbs, split, distributed_optimizer,
                    overlap_grad_reduce=overlap, overlap_param_gather=overlap and distributed_optimizer,
                    virtual_stages=virtual_stages,
                    recompute=recompute, recompute_method=recompute_method, recompute_num_layers=recompute_num_layers,
                    sequence_parallel=sequence_parallel)
    geo = with_embedding_group(sub, geometry(sub, tuple(placement), tp, dp, pp), embedding_stages(model, config))
    costs = stage_costs(model, sub, inputs.profiles, geo, config, [mbs])
    counts = np.array(layers) - costs.fixed_layers
    if (counts < fewest_layers(model, config)).any():
        if config.blocked_layers:
            raise InputError("--layers", f"every stage needs at least the {config.blocked_layers} layers of "
                                         "--recompute-num-layers with block recomputation")
        raise InputError("--layers", "every stage needs at least one layer (the first may hold only the embedding, "
                                     "the last only the head)")
    row = plan_rows(inputs, [(config, geo, True)], costs, counts[None, :])[0]
    row["fits_memory"] = all(s["memory_gib"] <= usable_gib(cluster, s["memory_capacity_gib"]) for s in row["stages"])
    return Plan.trusted(row)


def plan_costs(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], plan: Plan) -> tuple[StageCosts, np.ndarray]:
    """The stage costs of a plan the search returned, on `cluster` and `profiles` (perturbed ones, say), and its
    partition as the layer counts those costs take (K = 1 row)."""
    config = Config(plan.tp, plan.dp, plan.pp, plan.mbs, plan.gbs, plan.encoder_stages, bool(plan.distributed_optimizer),
                    overlap_grad_reduce=bool(plan.overlap_grad_reduce), overlap_param_gather=bool(plan.overlap_param_gather),
                    virtual_stages=plan.virtual_stages or 1, recompute=plan.recompute or "none",
                    recompute_method=plan.recompute_method, recompute_num_layers=plan.recompute_num_layers,
                    sequence_parallel=plan.tp > 1 if plan.sequence_parallel is None else plan.sequence_parallel)
    geo = with_embedding_group(cluster, geometry(cluster, tuple(plan.placement), config.tp, config.dp, config.pp),
                               embedding_stages(model, config))
    costs = stage_costs(model, cluster, profiles, geo, config, [config.mbs])
    return costs, (np.array(plan.layers_per_stage) - costs.fixed_layers)[None, :]
