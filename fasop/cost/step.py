"""The step time, memory and price of one plan, assembled from its parts (docs/cost-model.md has every formula).

A plan fixes the tensor, data and pipeline degrees, the micro-batch size, the placement and, for
encoder-decoder models, how many stages hold the encoder. `stage_costs` turns it into per-stage
quantities that are affine in the number of layers each stage holds; fasop.search.partition then
picks the layer counts, and `breakdown` reports every term of the result.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from itertools import chain

import numpy as np

from fasop.cost.communication import Geometry, allreduce_times, layer_exchange_s, p2p_times
from fasop.cost.compute import recompute_times, stage_compute, with_layer_exchange
from fasop.cost.config import Config, fewest_layers, recomputed_affine, segments
from fasop.cost.exact import ScheduleBatch, bucket_params, optimizer_times
from fasop.cost.fp8 import gathered_param_bytes
from fasop.cost.memory import (
    StageMemory,
    gradient_bytes,
    layers_that_fit,
    stage_capacity_gib,
    stage_expert_params,
    stage_memory_gib,
    stage_params,
    usable_gib,
)
from fasop.cost.pipeline import pipeline_terms
from fasop.cost.problem import PartitionBatch
from fasop.cost.schedule import interleaving_error
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile


@dataclass(frozen=True)
class StageCosts:
    """Everything the partition and the breakdown need for one split of a (tp, dp, pp) plan on G placements, each
    for K micro-batch sizes at once: per-stage arrays are (G K, pp), row g K + k for placement g and size k."""

    mbs: np.ndarray  # (G K,)
    problem: PartitionBatch
    gpu: tuple[tuple[str, ...], ...]  # per row: GPU types hosting each stage, '+'-joined when a stage spans two types
    boundary_s: np.ndarray  # (G K, pp-1) send of one micro-batch's activation across each boundary
    exchange_s: np.ndarray  # sends and receives a stage waits for in each steady-state step
    memory: StageMemory  # each stage's memory, for any layer counts
    mem_fixed_gib: np.ndarray  # its affine form that the partition takes (StageMemory.affine)
    mem_layer_gib: np.ndarray
    capacity_gib: np.ndarray  # (G K, pp) memory of the smallest GPU on the stage
    embedding_allreduce_s: np.ndarray  # (G K,)
    fixed_layers: np.ndarray  # (pp,) layers that are not partitioned (one stage holds the whole model)
    schedule: ScheduleBatch  # what the exact step needs

    def take(self, rows: np.ndarray) -> StageCosts:
        """The rows `rows` of these costs."""
        def part(name: str):
            value = getattr(self, name)
            if name == "fixed_layers":  # per stage, the same for every row
                return value
            if name == "gpu":
                return tuple(value[row] for row in rows)
            return value.take(rows) if name in ("problem", "schedule", "memory") else value[rows]

        return StageCosts(*(part(f.name) for f in fields(StageCosts)))

    @staticmethod
    def stack(parts: list[StageCosts]) -> StageCosts:
        """The rows of every part, in order (parts with the same stages and segments)."""
        def whole(name: str):
            values = [getattr(part, name) for part in parts]
            if name == "problem":
                return PartitionBatch.stack(values)
            if name == "schedule":
                return ScheduleBatch.stack(values)
            if name == "memory":
                return StageMemory.stack(values)
            if name == "gpu":
                return tuple(chain.from_iterable(values))
            return values[0] if name == "fixed_layers" else np.concatenate(values)

        return StageCosts(*(whole(f.name) for f in fields(StageCosts)))


def stage_costs(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], geo: Geometry,
                config: Config, mbs_values: list[int]) -> StageCosts:
    """Per-stage costs of `config` (its mbs is ignored) on `geo`, for each micro-batch size in mbs_values."""
    return next(recompute_variants(model, cluster, profiles, [([geo], [config])], mbs_values))


def recompute_variants(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile],
                       splits: list[tuple[list[Geometry], list[Config]]], mbs_values: list[int]) -> Iterator[StageCosts]:
    """Per-stage costs of one (tp, dp, pp) plan under each of several recompute settings in turn (nothing else
    differs), for every encoder/decoder split at once: `splits` holds each split's placements and its config under
    each setting. Rows run over the splits' placements, split by split, and the micro-batch sizes: row g K + k for
    placement g and size k. What recomputation leaves alone is computed once, and settings not asked for are not
    built."""
    config = splits[0][1][0]
    pp, whole = config.pp, config.pp == 1
    mbs = np.array(mbs_values)
    k = len(mbs)
    m = config.gbs // (config.dp * mbs)
    geos = [geo for split_geos, _ in splits for geo in split_geos]
    split_of_geo = np.repeat(np.arange(len(splits)), [len(split_geos) for split_geos, _ in splits])
    rows = len(geos) * k
    num_microbatches = np.tile(m, len(geos))
    split_segments = [segments(model, configs[0])[0] for _, configs in splits]
    segment_layers = segments(model, config)[1]
    split_params = [stage_params(model, configs[0], segment) for (_, configs), segment in zip(splits, split_segments)]
    segment = np.array(split_segments)[split_of_geo]  # (G, pp)
    fixed_params, layer_params = (np.array([params[i] for params in split_params])[split_of_geo] for i in range(2))
    experts = stage_expert_params(model, config, segment[0])  # the same on every split: MoE models have one segment
    experts = (np.broadcast_to(experts[0], segment.shape), np.broadcast_to(experts[1], segment.shape))
    placements = [geo.stage_node_types for geo in geos]
    compute = stage_compute(model, cluster, profiles, placements, config, tuple(int(b) for b in mbs_values), segment,
                            np.array([configs[0].encoder_stages for _, configs in splits])[split_of_geo],
                            core=config.cp > 1,
                            rerun=config.recompute_modules if any(c.recompute == "selective" for _, configs in splits
                                                                  for c in configs) else ())
    segment_rows = np.repeat(segment, k, axis=0)
    if config.cp > 1 or config.ep > 1:  # the context ring and the expert all-to-alls, in each layer's passes
        core = np.choose(segment_rows, compute.kind_core_forward_s) if config.cp > 1 else np.zeros(segment_rows.shape)
        compute = with_layer_exchange(compute, *layer_exchange_s(model, geos, config, segment, mbs, core),
                                      model.num_layers if whole else 0)
    fixed_layers = np.zeros(pp, dtype=int)
    if whole:
        fixed_layers[0] = model.num_layers
    boundary, exchange, wrap = p2p_times(model, geos, config, segment, mbs)
    ar_fixed, ar_layer, emb_ar = allreduce_times(model, geos, config, fixed_params, layer_params, k, experts)
    opt_fixed, opt_layer = (np.repeat(t, k, axis=0) for t in
                            optimizer_times(model, cluster, placements, config, fixed_params, layer_params, experts))
    grad_share, gather_fixed, gather_layer = reduction_shares(model, config)
    buckets = np.full(rows, float(bucket_params(config.dense_dp)))
    capacity = np.repeat(stage_capacity_gib(cluster, placements), k, axis=0)
    usable = usable_gib(cluster, capacity)
    refused = None  # micro-batch counts Megatron cannot interleave: nothing fits
    if config.virtual_stages > 1:
        refused = np.tile([interleaving_error(pp, config.virtual_stages, int(count)) is not None for count in m],
                          len(geos))
    per_byte = np.repeat(np.array([geo.dp_allreduce_s_per_byte for geo in geos]), k, axis=0)
    post_fixed, post_layer = post_tail(model, config, ar_fixed, ar_layer, opt_fixed, opt_layer, per_byte,
                                       buckets[:, None])
    for setting in range(len(splits[0][1])):
        variant = splits[0][1][setting]
        # memory does not depend on the placement, only what fits does
        split_memory = [stage_memory_gib(model, configs[setting], split_segment, split_param, mbs, m)
                        for (_, configs), split_segment, split_param in zip(splits, split_segments, split_params)]
        memory = StageMemory.stack([split_memory[s] for s in split_of_geo])
        # the partition takes each stage's recomputed layers as affine in its layers, exact from recomputed[1]
        # layers on: no stage holds fewer
        recomputed = recomputed_affine(variant.recomputed_per_chunk, variant.virtual_stages)
        hi = layers_that_fit(memory, recomputed, usable, whole)
        if refused is not None:
            hi = np.where(refused[:, None], -1, hi)
        lo = np.maximum(fewest_layers(model, variant), 0 if whole else int(recomputed[1]))
        recompute_layer_s, recompute_fixed_s = recompute_times(model, variant, compute, segment_rows)
        # the partition's compute: recomputed forwards run right before each backward
        fixed_s = compute.fixed_s + recompute_fixed_s + recomputed[1] * recompute_layer_s
        layer_s = compute.layer_s + recomputed[0] * recompute_layer_s
        problem = PartitionBatch(
            segment_of_stage=segment_rows, segment_layers=segment_layers, lo=np.broadcast_to(lo, (rows, pp)),
            hi=hi, layer_s=layer_s, period_fixed_s=fixed_s + exchange, ar_fixed_s=post_fixed, ar_layer_s=post_layer,
            num_microbatches=num_microbatches, base_s=fixed_s.sum(-1) + 2 * boundary.sum(-1) + emb_ar,
        )
        schedule = ScheduleBatch(
            fixed_s=compute.fixed_s, layer_s=compute.layer_s, fixed_forward_s=compute.fixed_forward_s,
            layer_forward_s=compute.layer_forward_s, boundary_s=boundary, num_microbatches=num_microbatches,
            grad_fixed_s=grad_share * ar_fixed, grad_layer_s=grad_share * ar_layer,
            gather_fixed_s=gather_fixed * ar_fixed, gather_layer_s=gather_layer * ar_layer,
            optimizer_fixed_s=opt_fixed, optimizer_layer_s=opt_layer,
            params_fixed=np.repeat(fixed_params, k, axis=0), params_layer=np.repeat(layer_params, k, axis=0),
            bucket_params=buckets, embedding_allreduce_s=emb_ar,
            overlap_grad_reduce=np.full(rows, config.overlap_grad_reduce),
            overlap_param_gather=np.full(rows, config.overlap_param_gather),
            virtual_stages=np.full(rows, config.virtual_stages), wrap_s=wrap, recompute_fixed_s=recompute_fixed_s,
            recompute_layer_s=recompute_layer_s, recomputed_per_chunk=np.full(rows, variant.recomputed_per_chunk))
        yield StageCosts(np.tile(mbs, len(geos)), problem, compute.gpu, boundary, exchange, memory,
                         *memory.affine(*recomputed), capacity, emb_ar, fixed_layers, schedule)


def reduction_shares(model: Model, config: Config) -> tuple[float, float, float]:
    """(gradient, parameter gather beyond the layers, the layers' parameter gather): the shares of a gradient
    all-reduce's time that the gradient reduction and the parameter all-gather take. The distributed optimizer
    reduce-scatters the gradients (half the all-reduce's traffic) and all-gathers the parameters, in the
    training precision rather than the gradients' (an fp8 model's layers in FP8 with --fp8-param-gather)."""
    if config.distributed_optimizer:
        half = 0.5 / gradient_bytes(model)
        return 0.5, half * model.precision_bytes, half * gathered_param_bytes(model)
    return 1.0, 0.0, 0.0


def post_tail(model: Model, config: Config, ar_fixed: np.ndarray, ar_layer: np.ndarray, opt_fixed: np.ndarray,
              opt_layer: np.ndarray, per_byte: np.ndarray, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per layer) of what the closed form the partitioner optimises charges each stage after its last
    backward: its gradient reduction, its parameter gather and its optimizer step; with overlap, only one bucket
    of the reduction (`per_byte`: the all-reduce's seconds per gradient byte; `buckets`: parameters per bucket)
    and none of the gather."""
    grad_share, gather_fixed, gather_layer = reduction_shares(model, config)
    exposed = 0.0 if config.overlap_param_gather else 1.0
    post_fixed = exposed * gather_fixed * ar_fixed + opt_fixed
    post_layer = exposed * gather_layer * ar_layer + opt_layer
    if config.overlap_grad_reduce:
        return post_fixed + grad_share * per_byte * gradient_bytes(model) * buckets, post_layer
    return post_fixed + grad_share * ar_fixed, post_layer + grad_share * ar_layer


def breakdown(costs: StageCosts, counts: np.ndarray, exact: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every term of the step time and memory of each row for the layer counts `counts` (K, pp): the step is the
    exact schedule's (fasop.cost.exact; `exact`: its terms when already computed); `closed_form_step_s` is the
    closed form the partitioner optimises."""
    p, sched = costs.problem, costs.schedule
    n = np.asarray(counts, dtype=float)
    recomputed = sched.stage_recomputed_layers(n)
    recompute = sched.recompute_fixed_s + sched.recompute_layer_s * recomputed
    compute = sched.fixed_s + sched.layer_s * n + recompute
    allreduce = (sched.grad_fixed_s + sched.gather_fixed_s) + (sched.grad_layer_s + sched.gather_layer_s) * n
    closed = pipeline_terms(compute, costs.exchange_s, costs.boundary_s, p.num_microbatches)
    exact = sched.step_terms(n) if exact is None else exact
    bottleneck = compute.argmax(-1)[:, None]  # the stage whose compute sets the pipeline's pace
    return {
        **exact,
        "bubble_s": exact["pipeline_time_s"] - p.num_microbatches * compute.max(-1),
        "p2p_s": closed["p2p_s"],
        # the partition's objective, at these counts' own recomputation
        "closed_form_step_s": closed["pipeline_time_s"] + costs.embedding_allreduce_s
        + (p.ar_fixed_s + p.ar_layer_s * n).max(-1),
        "dp_allreduce_s": allreduce.max(-1),
        "embedding_allreduce_s": costs.embedding_allreduce_s,
        "stage_compute_s": compute,
        "stage_forward_s": sched.fixed_forward_s + sched.layer_forward_s * n,
        "stage_recompute_s": recompute,
        # forwards the bottleneck stage recomputes in one step
        "recompute_s": p.num_microbatches * np.take_along_axis(recompute, bottleneck, -1)[:, 0],
        "stage_p2p_s": costs.exchange_s,
        "stage_allreduce_s": allreduce,
        "stage_memory_gib": costs.memory.at(n, recomputed),
        "stage_capacity_gib": costs.capacity_gib,
    }
