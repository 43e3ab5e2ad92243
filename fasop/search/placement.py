"""Node placements and the rank geometry they imply.

Megatron-LM orders ranks tensor-fastest, then data, then pipeline: rank r = t + tp*d + tp*dp*s, and torchrun
gives node n the ranks n*M .. n*M+M-1 (M GPUs per node). So pipeline stage s owns the contiguous rank block
[s*R, (s+1)*R) with R = tp*dp, and a placement -- the node types in node-rank order -- decides which GPU
types host each stage and which links every pipeline boundary and every all-reduce crosses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from fasop.inputs.cluster import Cluster

SUBSET_ALL_ORDERS = 4  # node types up to which the subset tries every order of the types
SUBSET_NODES = 131_072  # node entries (placements x nodes) the subset may hold: bounds memory for huge clusters


def placement_unit(gpus_per_node: int, ranks_per_stage: int) -> int:
    """Nodes that can be reordered as one block without changing the plan.

    When a stage fills whole nodes, only the multiset of node types inside each stage matters (the order
    inside it is canonicalised, see `placements`); otherwise every node is its own unit.
    """
    return ranks_per_stage // gpus_per_node if ranks_per_stage % gpus_per_node == 0 else 1


def _unit_choices(counts: tuple[int, ...], size: int):
    """Ways to take `size` nodes from `counts` (one count per node type), as per-type counts, lazily (there
    can be very many) and without recursion (there can be many node types)."""
    suffix = [0] * (len(counts) + 1)  # nodes available from type i on
    for i in range(len(counts) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + counts[i]
    if suffix[0] < size:
        return
    stack = [((), size)]
    while stack:
        prefix, left = stack.pop()
        i = len(prefix)
        if i == len(counts) - 1:
            yield prefix + (left,)
            continue
        low, high = max(0, left - suffix[i + 1]), min(counts[i], left)
        stack.extend((prefix + (first,), left - first) for first in range(high, low - 1, -1))


def more_sequences_than(counts: tuple[int, ...], size: int, limit: int) -> bool:
    """Whether more than `limit` distinct unit sequences use exactly `counts` nodes.

    Builds the sequences unit by unit, keeping only how many nodes of each type remain and in how many ways;
    every partial sequence completes to at least one whole one, so the count can stop as soon as it passes
    the limit (the work is bounded by the limit times the number of units)."""
    ways = {counts: 1}
    for _ in range(sum(counts) // size):
        step: dict[tuple[int, ...], int] = {}
        total = 0
        for left, n in ways.items():
            for pick in _unit_choices(left, size):
                rest = tuple(c - p for c, p in zip(left, pick))
                step[rest] = step.get(rest, 0) + n
                total += n
                if total > limit:
                    return True
        ways = step
    return False


def _sequences(counts: tuple[int, ...], size: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every unit sequence using exactly `counts` nodes, built unit by unit (a recursion would go one level
    per unit: too deep for thousands of nodes); callers make sure there are few."""
    partial: list[tuple[tuple, tuple[int, ...]]] = [((), counts)]
    for _ in range(sum(counts) // size):
        partial = [(seq + (pick,), tuple(c - p for c, p in zip(left, pick)))
                   for seq, left in partial for pick in _unit_choices(left, size)]
    return [seq for seq, _ in partial]


def type_order(cluster: Cluster) -> list[str]:
    """Node types ordered fastest network first; inside a unit, nodes follow this order so that pipeline
    boundaries pair fast interfaces with fast ones (sorted matching minimises the slowest pair)."""
    return sorted(cluster.node_types, key=lambda n: (-cluster.node_types[n].inter_node_bytes_per_s, n))


def placements(cluster: Cluster, ranks_per_stage: int, limit: int) -> tuple[list[tuple[str, ...]], bool]:
    """Every placement that can change the plan, or (when there are more than `limit`) a documented subset.

    Returns (placements, exhaustive). The subset keeps each node type in one contiguous block, in every order
    of the types (up to SUBSET_ALL_ORDERS types; beyond, the rotations of the fastest-first order and of its
    reverse), and every rotation of those node sequences (so one type can hold both the first and the last
    stage, or share a stage with the type before it), evenly spaced ones when there are too many to hold;
    tests measure how far it lands from exhaustive.
    """
    names = type_order(cluster)
    counts = tuple(cluster.node_types[n].count for n in names)
    size = placement_unit(cluster.gpus_per_node, ranks_per_stage)
    if not more_sequences_than(counts, size, limit):
        return [tuple(names[t] for pick in seq for t, c in enumerate(pick) for _ in range(c))
                for seq in _sequences(counts, size)], True
    rank = {name: i for i, name in enumerate(names)}
    # the type orders: all of them for a few types, else every rotation of the fastest-first order and of
    # its reverse (n! orders would not fit anywhere)
    if len(names) <= SUBSET_ALL_ORDERS:
        orders = list(itertools.permutations(names))
    else:
        orders = [tuple(o[i:] + o[:i]) for o in (names, names[::-1]) for i in range(len(names))]
    # rotations of each order: every one while the subset stays within SUBSET_NODES node entries, else
    # evenly spaced ones
    total = sum(counts)
    shifts = min(total, max(1, SUBSET_NODES // (total * len(orders))))
    subset = set()
    for perm in orders:
        blocks = [name for name in perm for _ in range(cluster.node_types[name].count)]
        for shift in sorted({j * total // shifts for j in range(shifts)}):
            nodes = blocks[shift:] + blocks[:shift]
            units = [sorted(nodes[u:u + size], key=rank.__getitem__) for u in range(0, len(nodes), size)]
            subset.add(tuple(name for unit in units for name in unit))
    return sorted(subset), False


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
    per_stage = tp * dp
    node = np.arange(per_stage * pp).reshape(pp, dp, tp) // gpn  # [stage, data index, tensor index]
    # a stage owns a contiguous rank block, so it spans a contiguous run of nodes
    stage_nodes = tuple(tuple(range(s * per_stage // gpn, ((s + 1) * per_stage - 1) // gpn + 1)) for s in range(pp))
    stage_types = tuple(tuple(sorted({placement[n] for n in nodes})) for nodes in stage_nodes)
    flat = node.reshape(pp, -1)
    boundary = links.exchange(flat[:-1], flat[1:])
    dp_cost = links.allreduce(node.transpose(0, 2, 1)) if dp > 1 else np.zeros(pp)  # one group per tensor index
    return Geometry(placement, stage_types, stage_nodes, boundary, dp_cost, node)


def with_embedding_group(cluster: Cluster, geo: Geometry, stages: tuple[int, ...]) -> Geometry:
    """`geo` with the cost of all-reducing the tied embedding between `stages` (one group per (d, t))."""
    if len(stages) < 2:
        return replace(geo, embedding_allreduce_s_per_byte=0.0)
    groups = geo.node[list(stages)].reshape(len(stages), -1).T
    cost = _Links(cluster, geo.placement).allreduce(groups[None])[0]
    return replace(geo, embedding_allreduce_s_per_byte=float(cost))


class _Links:
    """The links of one placement: per-GPU intra-node and per-node inter-node bandwidth, derated."""

    def __init__(self, cluster: Cluster, placement: tuple[str, ...]):
        types = [cluster.node_types[n] for n in placement]
        self.intra = np.array([t.intra_node_bytes_per_s for t in types])
        self.inter = np.array([t.inter_node_bytes_per_s for t in types])
        self.derating = cluster.derating

    def _per_node(self, sets: np.ndarray, nodes: np.ndarray, weight) -> np.ndarray:
        """(S, N): for each set s, the sum of `weight` over its entries on each node."""
        out = np.zeros((len(sets), len(self.inter)))
        np.add.at(out, (np.broadcast_to(sets, nodes.shape), nodes), weight)
        return out

    def exchange(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """(J,) seconds per byte: across each boundary j every rank of one stage sends the same bytes to its
        partner in the next stage (rows of src and dst), all at once.

        Pairs inside a node use the per-GPU intra-node link; pairs across nodes share the network interface
        of their sending and of their receiving node, so the busiest interface sets the time.
        """
        der = self.derating
        boundary = np.arange(len(src))[:, None]
        local = src == dst
        intra = np.where(local, der.p2p_intra_node / self.intra[src], 0.0).max(axis=1, initial=0.0)
        crossing = (~local).astype(float)
        sends = self._per_node(boundary, src, crossing)
        receives = self._per_node(boundary, dst, crossing)
        inter = (np.maximum(sends, receives) * der.p2p_inter_node / self.inter).max(axis=1, initial=0.0)
        return np.maximum(intra, inter)

    def allreduce(self, groups: np.ndarray) -> np.ndarray:
        """(S,) seconds per gradient byte: for each set s, all-reduces run at once, one per row of groups[s]
        (the nodes of its members); the slowest counts.

        A group inside one node runs a ring over the intra-node links: 2(n-1)/n bytes per byte. A group across
        k nodes runs hierarchically: reduce-scatter and all-gather inside each node over its g local members
        (2(g-1)/g), and an all-reduce between the k nodes (2(k-1)/k) whose traffic every group of the set with
        members on a node pushes through that node's one interface.
        """
        der = self.derating
        sets, rows, _ = groups.shape
        nodes = len(self.inter)
        # the distinct (group, node) pairs and how many members each holds: sparse, since a group spans few
        # of the nodes and there can be thousands of both
        pairs, members = np.unique((np.arange(sets * rows)[:, None] * nodes + groups.reshape(sets * rows, -1)).ravel(),
                                   return_counts=True)
        group, node = pairs // nodes, pairs % nodes
        k = np.bincount(group, minlength=sets * rows)
        g = np.zeros(sets * rows, dtype=members.dtype)
        np.maximum.at(g, group, members)
        slowest_intra = np.full(sets * rows, np.inf)
        np.minimum.at(slowest_intra, group, self.intra[node])
        intra_part = np.where(g > 1, 2 * (g - 1) / g * der.collective_intra_node / slowest_intra, 0.0)
        spanning = k > 1
        set_node = group // rows * nodes + node
        nic_load = np.bincount(set_node, weights=spanning[group], minlength=sets * nodes)
        busiest = np.zeros(sets * rows)
        np.maximum.at(busiest, group, nic_load[set_node] / self.inter[node])
        inter_part = np.where(spanning, 2 * (k - 1) / np.maximum(k, 1) * der.collective_inter_node * busiest, 0.0)
        return (intra_part + inter_part).reshape(sets, rows).max(axis=1)
