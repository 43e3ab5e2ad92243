"""Data-parallel plans: every GPU of the cluster trains the whole model on its own share of the global batch.

Four kinds (docs/cost-model.md section 9): `ddp` (PyTorch DistributedDataParallel: every GPU holds all model
state) and ZeRO stages 1, 2 and 3 (optimizer state, then gradients, then parameters sharded over all GPUs;
`zero3` is what FSDP's full sharding does). The global batch may be split unevenly: each node type gets its own
samples per GPU, micro-batch size and gradient-accumulation count, chosen so that the slowest GPU finishes
first (fasop.search.batchsplit, an exact integer optimisation), or evenly (every GPU the same samples) for comparison.
Each GPU holds the whole model: its memory and compute are the cost model's one pipeline stage at tp = 1, without
recomputation or with every layer checkpointed (FSDP's and DeepSpeed's activation checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from fasop.cost.compute import recompute_times, stage_compute
from fasop.cost.config import Config, segments, with_recompute
from fasop.cost.memory import GIB, optimizer_state_bytes, optimizer_traffic_bytes, stage_memory_gib, usable_gib
from fasop.cost.price import cost_per_step_usd
from fasop.errors import ArgumentError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile, profile_sources
from fasop.plans import Plan
from fasop.search.batchsplit import SplitStepLimit, best_split, step_times
from fasop.search.placement import type_order

KINDS = ("ddp", "zero1", "zero2", "zero3")
# Recomputation of data-parallel plans: none, or "full", every layer checkpointed (PyTorch's checkpoint_wrapper,
# DeepSpeed's activation checkpointing): the layer keeps its input alone and reruns its forward before its backward
RECOMPUTE = ("none", "full")
# What each kind shards over the data-parallel group: optimizer state, gradients, parameters.
SHARDED = {"ddp": (False, False, False), "zero1": (True, False, False), "zero2": (True, True, False),
           "zero3": (True, True, True)}
# PyTorch DistributedDataParallel's default gradient bucket (bucket_cap_mb = 25): the reduction starts bucket by
# bucket during the backward pass
BUCKET_BYTES = 25 * 2**20


class NoPlan(Exception):
    """Why a kind has no plan on a cluster (out of memory, batch too small or not divisible, no profile)."""


def state_bytes(model: Model, kind: str, world: int) -> float:
    """Model state per GPU: parameters and gradients in the model's precision (2 + 2 bytes under mixed
    precision) and the optimizer state, each divided by the data-parallel degree where `kind` shards it."""
    params = model.total_params()
    p = model.precision_bytes
    shard_optimizer, shard_grads, shard_params = SHARDED[kind]
    per_param = (p / (world if shard_params else 1) + p / (world if shard_grads else 1)
                 + optimizer_state_bytes(model) / (world if shard_optimizer else 1))
    return params * per_param


def gather_buffer_bytes(model: Model, kind: str) -> float:
    """zero3 gathers each unit's full parameters before using it: the largest unit held whole at one time."""
    if kind != "zero3":
        return 0.0
    units = [model.embedding_params(1), model.head_params(1, shares_stage_with_embedding=True)]
    units += [model.layer_params(k) for k in model.layer_kinds]
    if model.is_encoder_decoder:
        units.append(model.decoder_embedding_params(1))
    return max(units) * model.precision_bytes


def whole_model(recompute: str) -> Config:
    """The cost model's plan of one GPU holding the whole model (tp = pp = 1) under `recompute`: only its
    activations and compute are read here, the model state being data parallelism's own (state_bytes)."""
    return with_recompute(Config(tp=1, dp=1, pp=1, mbs=1, gbs=1, encoder_stages=0, distributed_optimizer=False),
                          recompute)


def activation_bytes_per_sample(model: Model, recompute: str = "none") -> float:
    """Activations of one sample on a GPU holding the whole model (section 8), those of a micro-batch of b
    samples being b times as many: the one stage's of fasop.cost.memory.stage_memory_gib, without parameters.
    Under full recomputation each layer keeps its input alone, and the layer rebuilt in the backward all of its
    own."""
    config = whole_model(recompute)
    no_params = (np.zeros(1), np.zeros(1))
    memory = stage_memory_gib(model, config, segments(model, config)[0], no_params, np.ones(1), np.ones(1))
    return float(memory.fixed_gib[0, 0]) * GIB  # one stage holding the model: everything is fixed


def traffic_factor(model: Model, kind: str) -> float:
    """Bytes each GPU moves per parameter, in units of one all-reduce of one byte (2 (n-1)/n bytes per byte):
    ddp all-reduces the gradients; zero1/2 reduce-scatter the gradients and all-gather the updated parameters
    (half an all-reduce each); zero3 also all-gathers the parameters in the forward and again in the backward,
    instead of after the step: 1.5 times ddp when parameters and gradients have the same size."""
    p = model.precision_bytes
    if kind == "ddp":
        return p
    return (p + p) / 2 if kind in ("zero1", "zero2") else (p + 2 * p) / 2


def reduce_share(kind: str) -> float:
    """The share of `kind`'s traffic that reduces gradients (and so may overlap the backward pass): all of ddp's
    all-reduce, zero1/2's reduce-scatter (half), zero3's reduce-scatter (a third: its two parameter all-gathers
    are the rest). The parameter all-gathers are charged after the step (zero1/2) or outside the backward."""
    return {"ddp": 1.0, "zero1": 0.5, "zero2": 0.5, "zero3": 1.0 / 3.0}[kind]


def reduction_end_s(computed_s: np.ndarray, last_backward_s: np.ndarray, reduce_s: float, buckets: int) -> float:
    """When a gradient reduction over every GPU, in `buckets` equal buckets, ends: each GPU type's gradients
    become ready evenly over its last micro-batch's backward (ending at computed_s); bucket k is reduced once
    every type has it and bucket k - 1 is done. The chain's end is max over k of ready_k + (buckets - k + 1)
    reduce_s / buckets."""
    k = np.arange(1, buckets + 1)
    ready = (computed_s[:, None] - last_backward_s[:, None] * (1 - k / buckets)).max(0)
    return float((ready + (buckets - k + 1) * reduce_s / buckets).max())


@dataclass(frozen=True)
class Group:
    """The GPUs of one node type: how many, how fast at each micro-batch size, how much memory."""

    node_type: str
    gpu: str
    gpus: int
    capacity_gib: float
    unit_s: np.ndarray  # forward + backward of the whole model for b = 0 .. largest size that fits
    backward_s: np.ndarray  # the backward alone, for b = 0 .. largest size
    memory_fixed_bytes: float  # model state and gather buffer
    activation_bytes_per_sample: float


def whole_model_s(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], node_type: str,
                  sizes: tuple[int, ...], recompute: str = "none") -> tuple[np.ndarray, np.ndarray]:
    """(forward + backward, backward) seconds of one micro-batch of each size on a GPU of `node_type` holding the
    whole model: the one stage's of fasop.cost.compute, with the forwards recomputation reruns, which belong to
    the backward pass."""
    config = whole_model(recompute)
    segment = segments(model, config)[0][None]
    compute = stage_compute(model, cluster, profiles, [((node_type,),)], config, sizes, segment, np.zeros(1, int))
    rerun_s = recompute_times(model, config, compute, np.repeat(segment, len(sizes), axis=0))[1][:, 0]
    step_s = compute.fixed_s[:, 0] + rerun_s
    return step_s, step_s - compute.fixed_forward_s[:, 0]


def groups(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], kind: str, batch: int,
           recompute: str = "none") -> list[Group]:
    """One group per node type, fastest network first; raises NoPlan when a GPU type cannot train at all."""
    world = cluster.num_gpus
    fixed = state_bytes(model, kind, world) + gather_buffer_bytes(model, kind)
    per_sample = activation_bytes_per_sample(model, recompute)
    result = []
    for name in type_order(cluster):
        node = cluster.node_types[name]
        profile = profiles[node.gpu]
        if 1 not in profile.tensor_degrees:
            raise NoPlan(f"no tp=1 profile for {node.gpu}")
        usable = usable_gib(cluster, node.gpu_memory_gib) * GIB
        largest = int(min((usable - fixed) // per_sample, batch)) if usable >= fixed + per_sample else 0
        if largest < 1:
            need = (fixed + per_sample) * cluster.memory_margin / GIB + cluster.gpu_memory_overhead_gib
            raise NoPlan(f"out of memory on {node.gpu}: {need:.1f} of {node.gpu_memory_gib:.1f} GiB for one sample"
                         + (" with full recomputation" if recompute == "full" else ""))
        step_s, backward_s = (np.concatenate([[0.0], t])
                              for t in whole_model_s(model, cluster, profiles, name, tuple(range(1, largest + 1)),
                                                     recompute))
        result.append(Group(name, node.gpu, node.count * cluster.gpus_per_node, node.gpu_memory_gib, step_s,
                            backward_s, fixed, per_sample))
    return result


def allreduce_cost(cluster: Cluster) -> tuple[float, float]:
    """(seconds per byte, latency seconds) of one all-reduce over every GPU of the cluster, the cluster's own
    links: fasop.cost.communication's hierarchical all-reduce (section 5) of one group holding every GPU of
    every node, a ring of the node's GPUs over the slowest intra-node link and a ring of the nodes through the
    slowest network interface, each step paying the slowest latency. Taken per node type, not per node."""
    derating, gpus, nodes = cluster.derating, cluster.gpus_per_node, cluster.num_nodes
    types = cluster.node_types.values()
    if gpus * nodes == 1:
        return 0.0, 0.0
    slowest, busiest = min(t.intra_node_bytes_per_s for t in types), max(1.0 / t.inter_node_bytes_per_s for t in types)
    intra = 2 * (gpus - 1) / gpus * derating.collective_intra_node / slowest if gpus > 1 else 0.0
    inter = 2 * (nodes - 1) / nodes * derating.collective_inter_node * busiest if nodes > 1 else 0.0
    latency = (2 * (gpus - 1) * max(0.0, *(t.intra_node_latency_s for t in types))
               + 2 * (nodes - 1) * max(0.0, *(t.inter_node_latency_s for t in types)))
    return intra + inter, latency


def optimizer_s(model: Model, cluster: Cluster, kind: str, members: list[Group]) -> float:
    """The optimizer step of the slowest GPU: a memory-bound pass over its optimizer state (section 7's bytes
    per parameter), all of the model under ddp, a 1/N shard under ZeRO."""
    params = model.total_params() / (cluster.num_gpus if SHARDED[kind][0] else 1)
    bandwidth = min(cluster.node_types[g.node_type].gpu_memory_bytes_per_s for g in members)
    return params * optimizer_traffic_bytes(model) / bandwidth


def best_plan_row(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], kind: str, batch: int,
                  even: bool = False, overlap: bool = True) -> Plan:
    """The fastest of plan_row over RECOMPUTE (the first of equals); raises NoPlan with the reason of the last,
    full recomputation (the least memory), when none has a plan."""
    rows, reason = [], NoPlan()
    for mode in RECOMPUTE:
        try:
            rows.append(plan_row(model, cluster, profiles, kind, batch, even, overlap=overlap, recompute=mode))
        except NoPlan as why:
            reason = why
    if not rows:
        raise reason
    return min(rows, key=lambda row: cast(float, row.step_time_s))


def plan_row(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], kind: str, batch: int,
             even: bool = False, samples: dict[str, int] | None = None, overlap: bool = True,
             recompute: str = "none") -> Plan:
    """The best plan of `kind` under `recompute` (one of RECOMPUTE) (or with `even`, every GPU the same
    samples; or with `samples`, the given samples per GPU of each node type) as a plan row; raises NoPlan with
    the reason when there is none. With `overlap` the gradient reduction runs bucket by bucket during the last
    micro-batch's backward."""
    if recompute not in RECOMPUTE:
        raise ArgumentError("recompute", f"data-parallel plans take {' or '.join(RECOMPUTE)}", recompute)
    world = cluster.num_gpus
    if batch < world:
        raise NoPlan(f"global batch {batch} < {world} GPUs")
    if even and batch % world:
        raise NoPlan(f"global batch {batch} not divisible by {world} GPUs")
    members = groups(model, cluster, profiles, kind, batch, recompute)
    counts = [g.gpus for g in members]
    per_byte, latency = allreduce_cost(cluster)
    # traffic_factor bytes per parameter, in all-reduces of one byte: as many all-reduce latencies per p bytes
    comm = traffic_factor(model, kind) * (per_byte * model.total_params() + latency / model.precision_bytes)
    reduce = comm * reduce_share(kind)
    buckets = max(1, -(-int(model.total_params()) * model.precision_bytes // BUCKET_BYTES))

    def times(split: list[int]) -> tuple[np.ndarray, list[int]]:
        """Each group's compute time and micro-batch size at its samples per GPU."""
        pairs = [step_times(g.unit_s, np.array([s])) for g, s in zip(members, split)]
        return np.array([time_s[0] for time_s, _ in pairs]), [int(size[0]) for _, size in pairs]

    def after_compute(split: list[int]) -> float:
        """The step's end past the compute: the gradient reduction (overlapped or not), then the rest."""
        computed, sizes = times(split)
        if not overlap:
            return float(computed.max()) + comm
        last = np.array([g.backward_s[s - b * ((s - 1) // b)] for g, s, b in zip(members, split, sizes)])
        return reduction_end_s(computed, last, reduce, buckets) + comm - reduce

    if samples is not None or even:
        split = [samples[g.node_type] for g in members] if samples else [batch // world] * len(members)
    else:
        try:
            best = best_split([g.unit_s for g in members], counts, batch)
        except SplitStepLimit as limit:
            raise NoPlan(str(limit)) from limit
        if best is None:  # every s_t is possible (micro-batches down to 1 fit): only divisibility can fail
            raise NoPlan(f"global batch {batch} not a sum of per-type batches over {', '.join(map(str, counts))} GPUs")
        split = best[1]
        # the split is the exact optimum of the compute; with overlap the even split may still end earlier
        if overlap and batch % world == 0 and after_compute([batch // world] * len(members)) < after_compute(split):
            split = [batch // world] * len(members)
    computed, sizes = times(split)
    compute = computed.max()
    optimizer = optimizer_s(model, cluster, kind, members)
    reduced = after_compute(split)
    step = reduced + optimizer
    price = cluster.price_per_hour_usd
    per_type: list[dict[str, Any]] = []
    for g, time_s, mbs, s in zip(members, computed, sizes, split):
        memory = (g.memory_fixed_bytes + g.activation_bytes_per_sample * mbs) / GIB
        per_type.append({"node_type": g.node_type, "gpu": g.gpu, "gpus": g.gpus, "samples_per_gpu": int(s),
                         "micro_batch_size": mbs, "accumulation_steps": -(-int(s) // mbs),
                         "compute_s": float(time_s), "memory_gib": memory, "memory_capacity_gib": g.capacity_gib})
    worst = max(per_type, key=lambda t: t["memory_gib"] / t["memory_capacity_gib"])
    placement = [name for name in type_order(cluster) for _ in range(cluster.node_types[name].count)]
    used = {t.gpu: profiles[t.gpu] for t in cluster.node_types.values()}
    return Plan.trusted({
        "model": model.name, "model_file": model.file, "cluster": cluster.name, "cluster_file": cluster.file,
        **profile_sources(used), "kind": kind, "batch_split": "even" if even else "uneven",
        "gbs": batch, "mbs": min(t["micro_batch_size"] for t in per_type), "tp": 1, "dp": world, "pp": 1,
        "placement": placement, "gpus_per_node": cluster.gpus_per_node, "layers_per_stage": [model.num_layers],
        "recompute": recompute, "step_time_s": step, "throughput_samples_per_s": batch / step,
        "tokens_per_s": batch * model.seq_length / step,
        "overlap_grad_reduce": overlap, "compute_s": float(compute), "dp_allreduce_s": comm,
        "dp_exposed_s": reduced - float(compute), "optimizer_s": optimizer,
        "peak_memory_gib": worst["memory_gib"], "memory_capacity_gib": worst["memory_capacity_gib"],
        "cost_per_hour_usd": price, "cost_per_step_usd": cost_per_step_usd(price, step),
        "per_type": per_type,
    })
