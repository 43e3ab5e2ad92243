"""Node placements: the orders of the cluster's nodes that can change a plan (every one, or a documented subset
when there are too many). fasop.cost.communication turns one into the links each stage's traffic crosses."""

from __future__ import annotations

import itertools

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
    stack: list[tuple[tuple[int, ...], int]] = [((), size)]
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
