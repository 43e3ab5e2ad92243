"""A plan's per-stage costs as affine functions of the layer counts: the problem the layer partition solves.

Every layer of a segment (the decoder-only stack, or the encoder and the decoder of an encoder-decoder model)
costs the same on a given stage, so every per-stage quantity is affine in the stage's layer count n_i, and
the step time of docs/cost-model.md is F(n) (see `PartitionBatch.objective`); fasop.search.partition finds
its minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

# the fields a batch holds per problem, in constructor order after the segments
_PER_PROBLEM = ("lo", "hi", "layer_s", "period_fixed_s", "ar_fixed_s", "ar_layer_s", "num_microbatches", "base_s")


@dataclass(frozen=True)
class PartitionBatch:
    """B partition problems with the same stages and segments; per-stage arrays are (B, P)."""

    segment_of_stage: np.ndarray  # which segment each stage holds; a segment's stages are contiguous
    segment_layers: np.ndarray  # (S,) layers to place in each segment
    lo: np.ndarray  # fewest layers a stage may hold
    hi: np.ndarray  # most layers that fit the stage's memory (below lo: nothing fits)
    layer_s: np.ndarray  # compute of one layer for one micro-batch, forward + backward
    period_fixed_s: np.ndarray  # steady-state period of the stage without its layers
    ar_fixed_s: np.ndarray  # data-parallel all-reduce without the layers' gradients
    ar_layer_s: np.ndarray  # all-reduce time each layer adds
    num_microbatches: np.ndarray  # (B,)
    base_s: np.ndarray  # (B,) everything that does not depend on the partition

    def __len__(self) -> int:
        return len(self.base_s)

    @staticmethod
    def stack(problems: list[PartitionBatch]) -> PartitionBatch:
        """One batch of all the problems (same number of stages and segment sizes)."""
        seg = np.concatenate([np.broadcast_to(p.segment_of_stage, p.lo.shape) for p in problems])
        return PartitionBatch(seg, problems[0].segment_layers,
                              *(np.concatenate([getattr(p, f) for p in problems]) for f in _PER_PROBLEM))

    def take(self, rows: np.ndarray) -> PartitionBatch:
        """The problems `rows` of this batch."""
        seg = self.segment_of_stage if self.segment_of_stage.ndim == 1 else self.segment_of_stage[rows]
        return PartitionBatch(seg, self.segment_layers, *(getattr(self, f)[rows] for f in _PER_PROBLEM))

    def objective(self, counts: np.ndarray) -> np.ndarray:
        """F(n) for counts (B, P) -> (B,)."""
        n = np.asarray(counts, dtype=float)
        period = (self.period_fixed_s + self.layer_s * n).max(axis=-1)
        allreduce = (self.ar_fixed_s + self.ar_layer_s * n).max(axis=-1)
        return self.base_s + (self.layer_s * n).sum(axis=-1) + (self.num_microbatches - 1) * period + allreduce

    @cached_property
    def most_layers(self) -> np.ndarray:
        """(B, P) most layers each stage can hold whatever the memory: its segment's layers less the fewest the
        segment's other stages hold."""
        seg = np.broadcast_to(self.segment_of_stage, self.lo.shape)
        lo_sum = np.take_along_axis(segment_sums(self.lo, seg, len(self.segment_layers)), seg, axis=-1)
        return self.segment_layers[seg] - (lo_sum - self.lo)

    def memory_binds(self) -> np.ndarray:
        """(B,) whether some stage's memory cap `hi` is below what the stage could otherwise hold."""
        return np.asarray((self.hi < self.most_layers).any(-1))

    def dominates(self, other: PartitionBatch) -> np.ndarray:
        """(B,) whether no partition of `other` beats this batch's optimum, row by row (same stages, segments and
        micro-batches): every partition `other` admits is admitted here and costs no more here, every term of F
        being no larger. A lighter recompute mode dominates a heavier one when its memory does not bind harder."""
        admitted = (self.lo <= other.lo) & (self.hi >= np.minimum(other.hi, other.most_layers))
        cheaper = [(getattr(self, f) <= getattr(other, f)) for f in ("layer_s", "period_fixed_s", "ar_fixed_s",
                                                                      "ar_layer_s")]
        same_m = self.num_microbatches == other.num_microbatches
        return np.logical_and.reduce(cheaper + [admitted]).all(-1) & same_m & (self.base_s <= other.base_s)

    def feasible(self, counts: np.ndarray) -> np.ndarray:
        n = np.asarray(counts)
        sums = segment_sums(n, self.segment_of_stage, len(self.segment_layers))
        return (n >= self.lo).all(-1) & (n <= self.hi).all(-1) & (sums == self.segment_layers).all(-1)


def segment_sums(values: np.ndarray, segment: np.ndarray, segments: int) -> np.ndarray:
    """(B, P) -> (B, S): sum of each segment's stages."""
    return np.stack([np.where(segment == s, values, 0).sum(axis=-1) for s in range(segments)], axis=-1)
