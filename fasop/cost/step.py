"""The cost model: step time, memory and price of one plan (docs/cost-model.md has every formula).

A plan fixes the tensor, data and pipeline degrees, the micro-batch size, the placement and, for
encoder-decoder models, how many stages hold the encoder. `stage_costs` turns it into per-stage
quantities that are affine in the number of layers each stage holds; `partition.optimal_partition` then
picks the layer counts, and `breakdown` reports every term of the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.search.partition import PartitionBatch
from fasop.search.placement import Geometry
from fasop.inputs.profiles import GpuProfile

GIB = 2.0**30
FP32_BYTES = 4
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


@dataclass(frozen=True)
class Config:
    tp: int
    dp: int
    pp: int
    mbs: int
    gbs: int
    encoder_stages: int  # encoder-decoder models: stages holding the encoder; else 0
    distributed_optimizer: bool


def bytes_per_param(model: Model, dp: int, distributed_optimizer: bool) -> float:
    """Weights, fp32 main gradients and Adam state (with an fp32 master copy under mixed precision).

    This is Megatron-LM's accounting: 18 bytes per parameter for fp16/bf16, or 6 + 12/dp when the
    distributed optimizer shards the master weights and moments over the data-parallel group.
    """
    sharded = ADAM_STATE_BYTES + (FP32_BYTES if model.precision != "fp32" else 0)
    return model.precision_bytes + FP32_BYTES + sharded / (dp if distributed_optimizer else 1)


def gradient_comm_bytes(model: Model) -> int:
    """Bytes per gradient element in the data-parallel reduction: Megatron-LM reduces bf16 training's
    gradients in fp32 (it turns on accumulate-allreduce-grads-in-fp32 for bf16) and fp16's in fp16."""
    return FP32_BYTES if model.precision in ("bf16", "fp32") else model.precision_bytes


def embedding_stages(model: Model, config: Config) -> tuple[int, ...]:
    """Stages holding a copy of the tied word embedding, which Megatron all-reduces after each step."""
    if not model.tie_embeddings or config.pp == 1:
        return ()
    stages = {0, config.pp - 1}
    if model.is_encoder_decoder:
        stages.add(config.encoder_stages)
    return tuple(sorted(stages))


@dataclass(frozen=True)
class StageCosts:
    """Everything the partition and the breakdown need for one placement and split of a (tp, dp, pp)
    plan, for several micro-batch sizes at once: per-stage arrays are (K, pp), one row per size."""

    mbs: np.ndarray  # (K,)
    problem: PartitionBatch
    gpu: tuple[str, ...]  # GPU types hosting each stage, '+'-joined when a stage spans two types
    fixed_s: np.ndarray  # compute of the embedding/head units on the stage, one micro-batch
    boundary_s: np.ndarray  # (K, pp-1) send of one micro-batch's activation across each boundary
    exchange_s: np.ndarray  # sends and receives a stage waits for in each steady-state step
    mem_fixed_gib: np.ndarray
    mem_layer_gib: np.ndarray
    capacity_gib: np.ndarray  # (pp,) memory of the smallest GPU on the stage
    embedding_allreduce_s: np.ndarray  # (K,)
    fixed_layers: np.ndarray  # (pp,) layers that are not partitioned (one stage holds the whole model)


def stage_costs(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], geo: Geometry,
                config: Config, mbs_values: list[int]) -> StageCosts:
    """Per-stage costs of `config` (its mbs is ignored) on `geo`, for each micro-batch size in mbs_values."""
    tp, dp, pp = config.tp, config.dp, config.pp
    mbs = np.array(mbs_values)
    sizes = tuple(int(b) for b in mbs_values)
    k = len(mbs)
    m = config.gbs // (dp * mbs)
    whole = pp == 1
    stages = np.arange(pp)

    # GPU types of each stage; the slowest GPU on a stage sets its pace, the smallest its memory
    stage_gpus = [tuple(sorted({cluster.node_types[n].gpu for n in names})) for names in geo.stage_node_types]
    gpu_sets = sorted(set(stage_gpus))
    stage_set = np.array([gpu_sets.index(g) for g in stage_gpus])
    capacity = np.array([min(cluster.node_types[n].gpu_memory_gib for n in names) for names in geo.stage_node_types])

    def unit_s(kind: str) -> np.ndarray:
        """(K, pp): forward + backward of one unit of `kind` for one micro-batch on each stage."""
        per_set = np.array([np.max([profiles[g].step_s(tp, kind, sizes) for g in gpus], axis=0) for gpus in gpu_sets])
        return per_set[stage_set].T

    kinds = model.layer_kinds
    if model.is_encoder_decoder and not whole:
        segment = (stages >= config.encoder_stages).astype(int)
        segment_layers = np.array(model.segment_layers)
    else:
        segment = np.zeros(pp, dtype=int)
        segment_layers = np.array([0 if whole else model.num_layers])
    layer_by_kind = [unit_s(kind) for kind in kinds]
    layer_s = np.choose(segment, layer_by_kind) if len(kinds) > 1 else layer_by_kind[0]
    fixed_layers = np.zeros(pp, dtype=int)

    first_decoder = min(config.encoder_stages, pp - 1)
    fixed_s = np.zeros((k, pp))
    fixed_s[:, 0] += unit_s("embedding")[:, 0]
    fixed_s[:, -1] += unit_s("head")[:, -1]
    if model.is_encoder_decoder:
        fixed_s[:, first_decoder] += unit_s("decoder_embedding")[:, first_decoder]
    if whole:
        fixed_layers[0] = model.num_layers
        fixed_s[:, 0] += sum(n * t[:, 0] for n, t in zip(model.segment_layers, layer_by_kind))

    # activation sizes grow linearly with the micro-batch: compute them once for one sample
    per_sample_bytes = np.array([model.boundary_bytes(s, 1, tp) for s in range(len(kinds))])[segment[1:]]
    boundary = geo.boundary_s_per_byte[None, :] * per_sample_bytes[None, :] * mbs[:, None]
    exchange = np.zeros((k, pp))
    exchange[:, 1:] += boundary
    exchange[:, :-1] += boundary

    # parameters per rank on each stage, beyond the partitioned layers
    kind_params = np.array([model.layer_params(kind) / tp for kind in kinds])
    fixed_params = np.zeros(pp)
    fixed_params[0] += model.embedding_params(tp)
    fixed_params[-1] += model.head_params(tp, shares_stage_with_embedding=whole)
    if model.is_encoder_decoder and not whole:
        fixed_params[first_decoder] += model.decoder_embedding_params(tp)
    layer_params = kind_params[segment]
    if whole:
        fixed_params[0] += float(np.dot(model.segment_layers, kind_params))

    grad_bytes = gradient_comm_bytes(model)
    ar_fixed = np.broadcast_to(geo.dp_allreduce_s_per_byte * grad_bytes * fixed_params, (k, pp))
    ar_layer = np.broadcast_to(geo.dp_allreduce_s_per_byte * grad_bytes * layer_params, (k, pp))
    emb_ar = np.full(k, geo.embedding_allreduce_s_per_byte * grad_bytes * model.padded_vocab(tp) * model.hidden_size / tp)

    # memory: model state, and activations of the micro-batches in flight (1F1B keeps min(pp - s, m) on stage s)
    in_flight = np.minimum(pp - stages[None, :], m[:, None])
    per_param = bytes_per_param(model, dp, config.distributed_optimizer)
    kind_act = np.array([model.layer_activation_bytes(kind, 1, tp) for kind in kinds])
    fixed_act = np.zeros(pp)
    fixed_act[0] += model.embedding_activation_bytes(1, tp)
    fixed_act[-1] += model.head_activation_bytes(1, tp)
    if whole:
        fixed_act[0] += float(np.dot(model.segment_layers, kind_act))
    held = in_flight * mbs[:, None]  # samples whose activations a stage holds
    mem_fixed = (fixed_params * per_param + fixed_act * held) / GIB
    mem_layer = (layer_params * per_param + kind_act[segment] * held) / GIB
    usable = capacity / cluster.memory_margin
    with np.errstate(divide="ignore", invalid="ignore"):
        hi = np.floor((usable - mem_fixed) / mem_layer + 1e-12)
    hi = np.where(mem_fixed <= usable, 0 if whole else hi, -1).astype(int)

    lo = np.ones(pp, dtype=int)
    if whole:
        lo[:] = 0
    elif not model.is_encoder_decoder:
        lo[0] = lo[-1] = 0  # a first stage may hold only the embedding, a last one only the head
    problem = PartitionBatch(
        segment_of_stage=segment, segment_layers=segment_layers, lo=np.broadcast_to(lo, (k, pp)), hi=hi,
        layer_s=layer_s, period_fixed_s=fixed_s + exchange, ar_fixed_s=ar_fixed, ar_layer_s=ar_layer,
        num_microbatches=m, base_s=fixed_s.sum(-1) + 2 * boundary.sum(-1) + emb_ar,
    )
    return StageCosts(mbs, problem, tuple("+".join(g) for g in stage_gpus), fixed_s, boundary, exchange,
                      mem_fixed, mem_layer, capacity, emb_ar, fixed_layers)


def breakdown(costs: StageCosts, counts: np.ndarray) -> dict[str, np.ndarray]:
    """Every term of the step time and memory of each row for the layer counts `counts` (K, pp)."""
    p = costs.problem
    n = np.asarray(counts, dtype=float)
    compute = costs.fixed_s + p.layer_s * n
    period = compute + costs.exchange_s
    allreduce = p.ar_fixed_s + p.ar_layer_s * n
    m = p.num_microbatches
    boundary = 2 * costs.boundary_s.sum(-1)
    bottleneck = period.argmax(-1)
    pipeline = compute.sum(-1) + boundary + (m - 1) * period.max(-1)
    memory = costs.mem_fixed_gib + costs.mem_layer_gib * n
    return {
        "step_time_s": pipeline + allreduce.max(-1) + costs.embedding_allreduce_s,
        "pipeline_time_s": pipeline,
        "bubble_s": pipeline - m * compute.max(-1),
        "p2p_s": boundary + (m - 1) * np.take_along_axis(costs.exchange_s, bottleneck[:, None], -1)[:, 0],
        "dp_allreduce_s": allreduce.max(-1),
        "embedding_allreduce_s": costs.embedding_allreduce_s,
        "stage_compute_s": compute,
        "stage_p2p_s": costs.exchange_s,
        "stage_allreduce_s": allreduce,
        "stage_memory_gib": memory,
        "stage_capacity_gib": np.broadcast_to(costs.capacity_gib, memory.shape),
    }
