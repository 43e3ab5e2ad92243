"""Node placements and the rank geometry they imply.

Megatron-LM orders ranks tensor-fastest, then data, then pipeline: rank r = t + tp*d + tp*dp*s, and torchrun
gives node n the ranks n*M .. n*M+M-1 (M GPUs per node). So pipeline stage s owns the contiguous rank block
[s*R, (s+1)*R) with R = tp*dp, and a placement -- the node types in node-rank order -- decides which GPU
types host each stage and which links every pipeline boundary and every all-reduce crosses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from fasop.cluster import Cluster


def placement_unit(gpus_per_node: int, ranks_per_stage: int) -> int:
    """Nodes that can be reordered as one block without changing the plan.

    When a stage fills whole nodes, only the multiset of node types inside each stage matters (the order
    inside it is canonicalised, see `placements`); otherwise every node is its own unit.
    """
    return ranks_per_stage // gpus_per_node if ranks_per_stage % gpus_per_node == 0 else 1


def _unit_choices(counts: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    """Ways to take `size` nodes from `counts` (one count per node type), as per-type counts."""
    ranges = [range(min(c, size) + 1) for c in counts]
    return [pick for pick in itertools.product(*ranges) if sum(pick) == size]


@lru_cache(maxsize=None)
def count_sequences(counts: tuple[int, ...], size: int) -> int:
    """How many distinct unit sequences use exactly `counts` nodes."""
    if sum(counts) == 0:
        return 1
    return sum(count_sequences(tuple(c - p for c, p in zip(counts, pick)), size)
               for pick in _unit_choices(counts, size))


def _sequences(counts: tuple[int, ...], size: int):
    if sum(counts) == 0:
        yield ()
        return
    for pick in _unit_choices(counts, size):
        rest = tuple(c - p for c, p in zip(counts, pick))
        for tail in _sequences(rest, size):
            yield (pick,) + tail


def type_order(cluster: Cluster) -> list[str]:
    """Node types ordered fastest network first; inside a unit, nodes follow this order so that pipeline
    boundaries pair fast interfaces with fast ones (sorted matching minimises the slowest pair)."""
    return sorted(cluster.node_types, key=lambda n: (-cluster.node_types[n].inter_node_bytes_per_s, n))


def placements(cluster: Cluster, ranks_per_stage: int, limit: int) -> tuple[list[tuple[str, ...]], bool]:
    """Every placement that can change the plan, or (when there are more than `limit`) a documented subset.

    Returns (placements, exhaustive). The subset keeps each node type in one contiguous block, in every order
    of the types, which is where the search's heuristic mode starts (see docs/cost-model.md).
    """
    names = type_order(cluster)
    counts = tuple(cluster.node_types[n].count for n in names)
    size = placement_unit(cluster.gpus_per_node, ranks_per_stage)
    if count_sequences(counts, size) <= limit:
        result = []
        for seq in _sequences(counts, size):
            result.append(tuple(names[t] for pick in seq for t, c in enumerate(pick) for _ in range(c)))
        return result, True
    blocks = {tuple(n for t in perm for n in [names[t]] * counts[t]) for perm in itertools.permutations(range(len(names)))}
    return sorted(blocks), False


@dataclass(frozen=True)
class Geometry:
    """Where the ranks of a (tp, dp, pp) plan land for one placement; all times are seconds per byte."""

    placement: tuple[str, ...]
    stage_node_types: tuple[tuple[str, ...], ...]  # distinct node types hosting each stage
    stage_nodes: tuple[tuple[int, ...], ...]  # node ranks hosting each stage
    boundary_s_per_byte: np.ndarray  # (pp-1,): one micro-batch's send per rank across boundary j
    dp_allreduce_s_per_byte: np.ndarray  # (pp,): all-reduce of one byte of each rank's gradients
    node: np.ndarray  # (pp, dp, tp): node of every rank
    embedding_allreduce_s_per_byte: float = 0.0  # all-reduce of the tied embedding between its stages


def geometry(cluster: Cluster, placement: tuple[str, ...], tp: int, dp: int, pp: int) -> Geometry:
    gpn = cluster.gpus_per_node
    links = _Links(cluster, placement)
    node = np.arange(tp * dp * pp).reshape(pp, dp, tp) // gpn  # [stage, data index, tensor index]
    stage_nodes = tuple(tuple(int(n) for n in np.unique(node[s])) for s in range(pp))
    stage_types = tuple(tuple(sorted({placement[n] for n in nodes})) for nodes in stage_nodes)
    flat = node.reshape(pp, -1)
    boundary = np.array([links.exchange(flat[j], flat[j + 1]) for j in range(pp - 1)])
    dp_cost = np.zeros(pp)
    if dp > 1:
        dp_cost = np.array([links.allreduce(node[s].T) for s in range(pp)])  # one group per tensor index
    return Geometry(placement, stage_types, stage_nodes, boundary, dp_cost, node)


def with_embedding_group(cluster: Cluster, geo: Geometry, stages: tuple[int, ...]) -> Geometry:
    """`geo` with the cost of all-reducing the tied embedding between `stages` (one group per (d, t))."""
    if len(stages) < 2:
        return replace(geo, embedding_allreduce_s_per_byte=0.0)
    groups = geo.node[list(stages)].reshape(len(stages), -1).T
    return replace(geo, embedding_allreduce_s_per_byte=_Links(cluster, geo.placement).allreduce(groups))


class _Links:
    """The links of one placement: per-GPU intra-node and per-node inter-node bandwidth, derated."""

    def __init__(self, cluster: Cluster, placement: tuple[str, ...]):
        types = [cluster.node_types[n] for n in placement]
        self.intra = np.array([t.intra_node_bytes_per_s for t in types])
        self.inter = np.array([t.inter_node_bytes_per_s for t in types])
        self.derating = cluster.derating

    def exchange(self, src: np.ndarray, dst: np.ndarray) -> float:
        """Every rank of one stage sends the same bytes to its partner in the next stage, all at once.

        Pairs inside a node use the per-GPU intra-node link; pairs across nodes share the network interface
        of their sending and of their receiving node, so the busiest interface sets the time.
        """
        der = self.derating
        local = src == dst
        worst = float(np.max(der.p2p_intra_node / self.intra[src[local]])) if local.any() else 0.0
        if not local.all():
            for side in (src[~local], dst[~local]):
                flows = np.bincount(side, minlength=len(self.inter))
                worst = max(worst, float(np.max(flows * der.p2p_inter_node / self.inter)))
        return worst

    def allreduce(self, groups: np.ndarray) -> float:
        """Seconds per gradient byte for all-reduces running at once, one per row of `groups` (member nodes).

        A group inside one node runs a ring over the intra-node links: 2(n-1)/n bytes per byte. A group across
        k nodes runs hierarchically: reduce-scatter and all-gather inside each node over its g local members
        (2(g-1)/g), and an all-reduce between the k nodes (2(k-1)/k) whose traffic every group with members
        on a node pushes through that node's one interface.
        """
        der = self.derating
        rows = np.repeat(np.arange(len(groups)), groups.shape[1])
        members = np.zeros((len(groups), len(self.inter)))
        np.add.at(members, (rows, groups.ravel()), 1)
        present = members > 0
        k = present.sum(axis=1)
        g = members.max(axis=1)
        slowest_intra = np.where(present, self.intra, np.inf).min(axis=1)
        intra_part = np.where(g > 1, 2 * (g - 1) / g * der.collective_intra_node / slowest_intra, 0.0)
        spanning = k > 1
        nic_load = (present & spanning[:, None]).sum(axis=0)
        busiest = np.where(present, nic_load / self.inter, 0.0).max(axis=1)
        inter_part = np.where(spanning, 2 * (k - 1) / np.maximum(k, 1) * der.collective_inter_node * busiest, 0.0)
        return float((intra_part + inter_part).max())
