"""Stage-group plans (plan kind "stage-groups"): each pipeline stage on its own GPU type with its own tensor- and
data-parallel degree. Their specification, checked once against the model and cluster (from a plan file, the
Python API or the search), and the estimate of one, with the same record as every plan (docs/formats.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fasop.cost.config import (
    DEFAULT_RECOMPUTE_MODULES,
    Config,
    checked_recompute,
    fewest_layers,
    param_gather_overlaps,
    sequence_parallel_on,
)
from fasop.cost.memory import usable_gib
from fasop.cost.price import cost_per_step_usd
from fasop.cost.stagegroups import GroupLayout, group_layout, host_types, stage_group_costs
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile
from fasop.plans import Plan
from fasop.search.record import plan_rows
from fasop.search.space import check_global_batch, prepare
from fasop.search.spec import Refuse


@dataclass(frozen=True)
class StageGroup:
    """One stage: the node type its GPUs are on, its degrees and its layers."""

    node_type: str
    tp: int
    dp: int
    layers: int


@dataclass(frozen=True)
class StageGroupSpec:
    """A checked stage-group plan: stages in pipeline order, each on whole or shared nodes of one GPU type."""

    gbs: int
    microbatch_samples: int  # B: the samples of one micro-batch, over every stage's data-parallel ranks
    placement: tuple[str, ...]  # node types in node-rank order
    stages: tuple[StageGroup, ...]
    layout: GroupLayout
    distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    recompute: str
    recompute_method: str | None
    recompute_num_layers: int | None
    sequence_parallel: bool | None  # None: on wherever a stage has tp > 1
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES  # selective recomputation's, canonical order

    @property
    def num_microbatches(self) -> int:
        return self.gbs // self.microbatch_samples

    @property
    def configs(self) -> list[Config]:
        """Each stage's degrees and micro-batch as the cost model takes them."""
        return [Config(s.tp, s.dp, len(self.stages), self.microbatch_samples // s.dp, self.gbs, 0,
                       self.distributed_optimizer, overlap_grad_reduce=self.overlap_grad_reduce,
                       overlap_param_gather=self.overlap_param_gather, recompute=self.recompute,
                       recompute_method=self.recompute_method, recompute_num_layers=self.recompute_num_layers,
                       sequence_parallel=sequence_parallel_on(s.tp, self.sequence_parallel),
                       recompute_modules=self.recompute_modules) for s in self.stages]


def stage_group_spec(model: Model, cluster: Cluster, *, placement: Sequence[str], stages: Sequence[StageGroup],
                     mbs: int, gbs: int | None = None, distributed_optimizer: bool = True,
                     overlap_grad_reduce: bool = True, overlap_param_gather: bool | None = None,
                     recompute: str = "none", recompute_method: str | None = None,
                     recompute_num_layers: int | None = None, sequence_parallel: bool | None = None,
                     recompute_modules: Sequence[str] | None = None, where: str | None = None) -> StageGroupSpec:
    """The stage-group plan checked against `model` and `cluster`: `mbs` is the first stage's micro-batch per
    GPU (every stage takes mbs x dp_0 samples per micro-batch). Errors name the argument, or `where` and the
    field (a plan file's)."""
    def refuse(field: str, problem: str) -> InputError:
        return ArgumentError(field, problem) if where is None else InputError(f"{where}: {field}", problem)

    placement, stages = tuple(placement), tuple(stages)
    if model.is_encoder_decoder:
        raise refuse("kind", "stage-group plans are for decoder-only models (FlagScale's heterogeneous mode runs "
                             "GPT-style models)")
    if len(stages) < 2:
        raise refuse("stages", "a stage-group plan has two stages or more (one stage is a 3D plan)")
    _check_nodes(cluster, placement, refuse)
    gbs = check_global_batch(model.global_batch_size if gbs is None else gbs)
    batch = mbs * stages[0].dp
    for i, stage in enumerate(stages):
        _check_stage(model, cluster, i, stage, batch, refuse)
    if gbs % batch:
        raise refuse("mbs", f"the micro-batch of mbs x dp = {batch} samples must divide the global batch size {gbs}")
    gpus = sum(cluster.node_types[name].gpus_per_node for name in placement)
    ranks = sum(s.tp * s.dp for s in stages)
    if ranks != gpus:
        raise refuse("placement", f"the stages' tp x dp add up to {ranks} GPUs, the placement's nodes hold {gpus}")
    layers = [s.layers for s in stages]
    if sum(layers) != model.num_layers:
        raise refuse("stages", f"expected layers summing to {model.num_layers}, got {','.join(map(str, layers))}")
    recompute_method, recompute_num_layers, modules = checked_recompute(
        model, recompute, recompute_method, recompute_num_layers, recompute_modules, refuse)
    layout = group_layout(cluster, placement, [(s.tp, s.dp) for s in stages])
    _check_layout(cluster, layout, stages, refuse)
    if model.tie_embeddings and (stages[0].tp, stages[0].dp) != (stages[-1].tp, stages[-1].dp):
        raise refuse("stages", "with tied embeddings the first and last stages need the same tp and dp (they "
                               "all-reduce the embedding rank by rank)")
    spec = StageGroupSpec(gbs, batch, placement, stages, layout, distributed_optimizer, overlap_grad_reduce,
                          param_gather_overlaps(overlap_grad_reduce, distributed_optimizer, overlap_param_gather),
                          recompute, recompute_method, recompute_num_layers, sequence_parallel, modules)
    least = fewest_layers(model, spec.configs[0])
    if (np.array(layers) < least).any():
        raise refuse("stages", "every stage needs at least one layer (the first may hold only the embedding, the "
                               "last only the head)" if not spec.configs[0].blocked_layers else
                     f"every stage needs at least the {spec.configs[0].blocked_layers} layers block recomputation "
                     "reruns in it")
    return spec


def spec_of_stage_groups(plan: Plan, model: Model, cluster: Cluster, where: str | None = None) -> StageGroupSpec:
    """The specification of a stage-groups plan record; each stage's node type is that of its first node."""
    stages = plan.stages or []
    placement = tuple(plan.placement)
    refuse_where = where or "plan"
    groups = []
    for row in stages:
        if not row.nodes or max(row.nodes) >= len(placement):
            raise InputError(f"{refuse_where}: stages: {row.stage}: nodes", f"expected node positions in the "
                                                                           f"placement's {len(placement)} nodes")
        assert row.tp is not None and row.dp is not None  # the plan schema requires them
        groups.append(StageGroup(placement[row.nodes[0]], row.tp, row.dp, row.layers))
    options = {name: value for name in ("gbs", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                                        "recompute", "recompute_method", "recompute_num_layers", "recompute_modules",
                                        "sequence_parallel")
               if name in plan.model_fields_set and (value := getattr(plan, name)) is not None}
    spec = stage_group_spec(model, cluster, placement=placement, stages=groups, mbs=plan.mbs, where=where, **options)
    for row, nodes in zip(stages, spec.layout.stage_nodes):
        if list(row.nodes) != list(nodes):
            raise InputError(f"{refuse_where}: stages: {row.stage}: nodes",
                             f"expected {list(nodes)}, where its ranks follow the previous stage's")
    if (plan.tp, plan.dp, plan.pp) != (groups[0].tp, groups[0].dp, len(groups)):
        raise InputError(f"{refuse_where}: tp", "tp and dp are the first stage's, pp the number of stages")
    return spec


def estimate_stage_groups(model: Model, cluster: Cluster, spec: StageGroupSpec, *, profiles_dir: str | None = None,
                          profiles: dict[str, GpuProfile] | None = None) -> Plan:
    """The full breakdown of one stage-group plan, with the record every plan has and each stage's tp, dp and
    micro-batch."""
    sub = cluster.with_counts(Counter(spec.placement))
    inputs = prepare(model, sub, spec.gbs, profiles_dir, spec.distributed_optimizer, profiles)
    for stage in spec.stages:
        gpu = cluster.node_types[stage.node_type].gpu
        if stage.tp not in inputs.profiles[gpu].tensor_degrees:
            raise ArgumentError("stages", f"the profile of {gpu} has no rows for tensor-parallel degree {stage.tp}")
    return Plan.trusted(stage_group_record(inputs, spec))


def stage_group_record(inputs: Any, spec: StageGroupSpec, placement_search: str | None = None) -> dict:
    """The plan record of `spec` on `inputs` (fasop.search.space.Inputs)."""
    configs = spec.configs
    costs, geo = stage_group_costs(inputs.model, inputs.cluster, inputs.profiles, configs, spec.layout)
    counts = np.array([[s.layers for s in spec.stages]])
    row = plan_rows(inputs, [(configs[0], geo, True)], costs, counts)[0]
    for stage, config in zip(row["stages"], configs):
        stage.update(tp=config.tp, dp=config.dp, mbs=config.mbs)
    row.update(kind="stage-groups", virtual_stages=1, sequence_parallel=configs[0].sequence_parallel)
    if placement_search is None:
        row.pop("placement_search")
    else:
        row["placement_search"] = placement_search
    cluster = inputs.cluster
    if cluster.hosts:  # a node holding several GPU kinds is rented whole, whichever of its kinds the plan runs
        price = sum((cluster.hosts.get(name) or cluster.node_types[name]).price_per_hour_usd
                    for name in host_types(cluster, spec.placement))
        row.update(cost_per_hour_usd=price, cost_per_step_usd=cost_per_step_usd(price, row["step_time_s"]))
    row["fits_memory"] = all(s["memory_gib"] <= usable_gib(cluster, s["memory_capacity_gib"]) for s in row["stages"])
    return row


def _check_nodes(cluster: Cluster, placement: tuple[str, ...], refuse: Refuse) -> None:
    for name, used in Counter(placement).items():
        if name not in cluster.node_types:
            raise refuse("placement", f"node type {name} is not in cluster {cluster.name} (it has "
                                      f"{', '.join(cluster.node_types)})")
        if used > cluster.node_types[name].count:
            raise refuse("placement", f"uses {used} nodes of type {name}, cluster {cluster.name} has "
                                      f"{cluster.node_types[name].count}")


def _check_stage(model: Model, cluster: Cluster, i: int, stage: StageGroup, batch: int, refuse: Refuse) -> None:
    if stage.node_type not in cluster.node_types:
        raise refuse("stages", f"stage {i}: node type {stage.node_type} is not in cluster {cluster.name}")
    gpn = cluster.node_types[stage.node_type].gpus_per_node
    tp, dp = stage.tp, stage.dp
    if tp < 1 or dp < 1 or stage.layers < 0:
        raise refuse("stages", f"stage {i}: expected tp, dp >= 1 and layers >= 0")
    if gpn % tp or model.num_attention_heads % tp or model.num_query_groups % tp:
        raise refuse("stages", f"stage {i}: tp {tp} must divide the {gpn} GPUs per node of {stage.node_type}, the "
                               f"{model.num_attention_heads} attention heads and the {model.num_query_groups} "
                               "query groups")
    if batch % dp:
        raise refuse("stages", f"stage {i}: dp {dp} must divide the micro-batch's {batch} samples (mbs x the "
                               "first stage's dp)")


def _check_layout(cluster: Cluster, layout: GroupLayout, stages: tuple[StageGroup, ...], refuse: Refuse) -> None:
    """Every stage on nodes of its own type, every tensor-parallel group inside one node, no more nodes holding
    several GPU kinds than the cluster has (each runs one run of the pipeline's ranks, fasop.cost.stagegroups)."""
    for name, used in Counter(host_types(cluster, layout.placement)).items():
        if name in cluster.hosts and used > cluster.hosts[name].count:
            kinds = ", ".join(n for n, t in cluster.node_types.items() if t.host == name)
            raise refuse("placement", f"takes {used} nodes of type {name}, cluster {cluster.name} has "
                                      f"{cluster.hosts[name].count}: a node's GPU kinds ({kinds}) hold consecutive "
                                      "stages in that order")
    for i, (stage, nodes, ranks) in enumerate(zip(stages, layout.stage_nodes, layout.rank_node)):
        held = {layout.placement[n] for n in nodes}
        if held != {stage.node_type}:
            raise refuse("placement", f"stage {i} ({stage.node_type}) would sit on nodes of {', '.join(sorted(held))}: "
                                      "each stage's ranks follow the previous stage's, on nodes of its own type")
        if (ranks != ranks[:, :1]).any():
            raise refuse("placement", f"stage {i}: a tensor-parallel group of {stage.tp} would span two nodes")
