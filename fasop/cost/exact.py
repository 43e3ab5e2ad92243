"""The step time a plan's layer counts give: the exact pipeline schedule (fasop.cost.schedule), then what each
stage does once its last backward has ended: its data-parallel gradient reduction, its optimizer step and its
parameter all-gather, overlapped with compute where Megatron-LM overlaps them (docs/cost-model.md sections 4.1,
5 and 7).

The partitioner (fasop.search.partition) optimises a closed form; the search ranks plans by `step_terms`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from fasop.cost.config import Config, chunk_layers, per_stage, recomputed_layers
from fasop.cost.fp8 import weight_cast_bytes
from fasop.cost.memory import all_layer_params, optimizer_traffic_bytes
from fasop.cost.schedule import stage_times
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model

# Megatron-core's default gradient bucket (DistributedDataParallelConfig.bucket_size): max(40M, 1M x dp) parameters
BUCKET_MIN_PARAMS = 40_000_000
BUCKET_PARAMS_PER_DP_RANK = 1_000_000


def bucket_params(dp: int) -> int:
    """Parameters per gradient bucket under Megatron-core's default."""
    return max(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_DP_RANK * dp)


def per_chunk(fixed_s: np.ndarray, layer_s: np.ndarray, n: np.ndarray, v: int) -> np.ndarray:
    """(..., P) seconds beyond the partitioned layers and per layer, for layer counts n -> (..., P, v) seconds of
    each model chunk: its layers' time, the first stage's fixed time on its first chunk and the last stage's on
    its last (the embedding and the head)."""
    layers = chunk_layers(n, v)
    fixed = np.zeros(layers.shape)
    fixed[..., 0, 0] = fixed_s[..., 0]
    fixed[..., -1, -1] += fixed_s[..., -1]
    return fixed + layer_s[..., None] * layers


@dataclass(frozen=True)
class ScheduleBatch:
    """What the exact step needs of B plans with the same number of stages; per-stage arrays are (B, P), each
    the value beyond the stage's partitioned layers (`*_fixed`) or what one of those layers adds (`*_layer`)."""

    fixed_s: np.ndarray  # forward + backward of one micro-batch, without recomputation
    layer_s: np.ndarray
    fixed_forward_s: np.ndarray  # its forward part
    layer_forward_s: np.ndarray
    boundary_s: np.ndarray  # (B, P - 1) one micro-batch's send across each boundary
    num_microbatches: np.ndarray  # (B,)
    grad_fixed_s: np.ndarray  # the gradient all-reduce (reduce-scatter with the distributed optimizer)
    grad_layer_s: np.ndarray
    gather_fixed_s: np.ndarray  # the parameter all-gather of the distributed optimizer (0 without it)
    gather_layer_s: np.ndarray
    optimizer_fixed_s: np.ndarray  # the optimizer step
    optimizer_layer_s: np.ndarray
    params_fixed: np.ndarray  # parameters per rank, for the bucket count
    params_layer: np.ndarray
    bucket_params: np.ndarray  # (B,), or (B, P) where stages differ in data-parallel degree
    embedding_allreduce_s: np.ndarray  # (B,)
    overlap_grad_reduce: np.ndarray  # (B,) bool
    overlap_param_gather: np.ndarray  # (B,) bool
    virtual_stages: np.ndarray  # (B,) model chunks per stage
    wrap_s: np.ndarray  # (B,) the last stage's send to the first, interleaved
    recompute_fixed_s: np.ndarray  # forwards recomputed beyond the partitioned layers (a stage holding the model)
    recompute_layer_s: np.ndarray  # forward each recomputed layer reruns, one micro-batch
    recomputed_per_chunk: np.ndarray  # (B,) most layers of a model chunk recomputed (Config.recomputed_per_chunk)

    def __len__(self) -> int:
        return len(self.num_microbatches)

    @staticmethod
    def stack(batches: list[ScheduleBatch]) -> ScheduleBatch:
        return ScheduleBatch(*(np.concatenate([getattr(b, f.name) for b in batches]) for f in fields(ScheduleBatch)))

    def take(self, rows: np.ndarray) -> ScheduleBatch:
        return ScheduleBatch(*(getattr(self, f.name)[rows] for f in fields(ScheduleBatch)))

    def chunks(self, rows: np.ndarray, v: int, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward without recomputation), each (rows, P, v), of every model chunk: a stage's layers
        split evenly over its chunks (`chunk_layers`); the first stage's fixed units (the embedding) on its first
        chunk, the last stage's (the head) on its last."""
        return per_chunk(self.fixed_forward_s[rows], self.layer_forward_s[rows], n, v), \
            per_chunk(self.fixed_s[rows] - self.fixed_forward_s[rows], self.layer_s[rows] - self.layer_forward_s[rows], n, v)

    def recompute_s(self, rows: np.ndarray, v: int, n: np.ndarray) -> np.ndarray:
        """(rows, P, v) forwards each model chunk recomputes per micro-batch: its recomputed layers'
        (`recomputed_layers`), and on a stage holding the whole model (one chunk) all of its own."""
        redo = recomputed_layers(n, v, self.recomputed_per_chunk[rows]) * self.recompute_layer_s[rows][..., None]
        redo[..., 0] += self.recompute_fixed_s[rows]
        return redo

    def stage_recomputed_layers(self, counts: np.ndarray) -> np.ndarray:
        """(B, P) layers each stage recomputes, over all its chunks, for layer counts (B, P)."""
        n = np.asarray(counts, dtype=float)
        total = np.empty_like(n)
        for v in np.unique(self.virtual_stages):
            rows = np.flatnonzero(self.virtual_stages == v)
            total[rows] = recomputed_layers(n[rows], int(v), self.recomputed_per_chunk[rows]).sum(-1)
        return total

    def step_terms(self, counts: np.ndarray) -> dict[str, np.ndarray]:
        """The step of each plan for layer counts (B, P): the schedule's makespan (`pipeline_time_s`), when each
        stage is done (`stage_done_s`), the optimizer step and the data-parallel time left exposed by the
        slowest stage (`optimizer_s`, `dp_exposed_s`), and `step_time_s`."""
        n = np.asarray(counts, dtype=float)
        forward = self.fixed_forward_s + self.layer_forward_s * n
        backward = self.fixed_s - self.fixed_forward_s + (self.layer_s - self.layer_forward_s) * n
        first, end, recompute = np.empty_like(n), np.empty_like(n), np.empty_like(n)
        for v in np.unique(self.virtual_stages):
            rows = np.flatnonzero(self.virtual_stages == v)
            f, b = (forward[rows], backward[rows]) if v == 1 else self.chunks(rows, int(v), n[rows])
            redo = self.recompute_s(rows, int(v), n[rows])
            first[rows], end[rows] = stage_times(f, b, self.boundary_s[rows], self.num_microbatches[rows],
                                                 virtual_stages=int(v), wrap_send_s=self.wrap_s[rows], recompute_s=redo)
            recompute[rows] = redo.sum(-1)
        backward = backward + recompute  # recomputed forwards open each backward
        grad = self.grad_fixed_s + self.grad_layer_s * n
        gather = self.gather_fixed_s + self.gather_layer_s * n
        optimizer = self.optimizer_fixed_s + self.optimizer_layer_s * n
        per_bucket = self.bucket_params if self.bucket_params.ndim == 2 else self.bucket_params[:, None]
        buckets = np.maximum(1.0, np.ceil((self.params_fixed + self.params_layer * n) / per_bucket))
        # the last backward of each stage: it ends computing before its gradient send upstream (none on stage 0)
        send = np.zeros_like(end)
        send[:, 1:] = self.boundary_s
        # gradients become ready evenly over the last backward; a bucket's reduction starts once it is full and
        # the previous bucket's has ended, so the first and the last bucket bound how long after the stage's end
        # the reduction ends (from these terms: a difference of two times near 1e14 s, the end of a step of 2^52
        # micro-batches, would keep only milliseconds)
        overlapped = np.maximum(grad - backward + backward / buckets, grad / buckets) - send
        reduce_after = np.where(self.overlap_grad_reduce[:, None], np.maximum(overlapped, 0.0), grad)
        # the next step's first forward needs its parameters bucket by bucket; before it the stage waits for its
        # input anyway: only what the first bucket, or the whole gather, cannot fit in that time is exposed
        hidden_gather = np.maximum.reduce([gather / buckets - first, gather - first - forward * (buckets - 1) / buckets,
                                           np.zeros_like(gather)])
        gathered = np.where(self.overlap_param_gather[:, None], hidden_gather, gather)
        exposed = reduce_after + gathered
        done = end + exposed + optimizer
        step = done.max(-1) + self.embedding_allreduce_s
        return {
            "step_time_s": step,
            "pipeline_time_s": end.max(-1),
            "stage_done_s": done,
            "optimizer_s": optimizer.max(-1),
            "dp_exposed_s": exposed.max(-1),
        }


def optimizer_times(model: Model, cluster: Cluster, placements: list[tuple[tuple[str, ...], ...]], config: Config,
                    fixed_params: np.ndarray, layer_params: np.ndarray,
                    experts: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per layer): (G, pp) seconds of each stage's optimizer step for G placements (the node types hosting
    each stage), a memory-bound pass over its ranks' optimizer state (sharded over the data-parallel group with the
    distributed optimizer; of the parameters, `experts` (fixed, per layer) over the expert-data-parallel group) at
    the memory bandwidth of the stage's slowest GPU; an fp8 model's layers add the once-a-step FP8 casts of their
    weights (fasop.cost.fp8)."""
    def slowest(names: tuple[str, ...]) -> float:
        return min(cluster.node_types[n].gpu_memory_bytes_per_s for n in names)

    bandwidth: np.ndarray = np.array(per_stage(placements, slowest))
    sharded = config.distributed_optimizer
    per_param = optimizer_traffic_bytes(model) / (config.dense_dp if sharded else 1) / bandwidth
    cast = weight_cast_bytes(model) / bandwidth
    whole = all_layer_params(model, config.tp, config.expert_split) if config.pp == 1 else 0.0
    fixed, layer = fixed_params * per_param + whole * cast, layer_params * (per_param + cast)
    if experts is not None and model.is_moe and sharded:  # expert state sharded over edp instead
        per_expert = optimizer_traffic_bytes(model) / config.expert_dp / bandwidth - per_param
        fixed, layer = fixed + experts[0] * per_expert, layer + experts[1] * per_expert
    return fixed, layer
