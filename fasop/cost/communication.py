"""Communication: the links a placement gives every pipeline boundary and every all-reduce, and the seconds the
sends, gradient all-reduces and tied-embedding all-reduce of a plan take.

Megatron-LM orders ranks tensor-fastest, then data, then pipeline: rank r = t + tp*d + tp*dp*s, and torchrun
gives node n the ranks n*M .. n*M+M-1 (M GPUs per node). So pipeline stage s owns the contiguous rank block
[s*R, (s+1)*R) with R = tp*dp, and a placement -- the node types in node-rank order -- decides which GPU
types host each stage and which links every pipeline boundary and every all-reduce crosses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from fasop.cost.config import Config
from fasop.cost.memory import gradient_bytes
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model


@cache
def boundary_bytes(model: Model, segment: int, mbs: int, tp: int) -> float:
    """Bytes one tensor-parallel rank sends across a pipeline boundary for one micro-batch.

    Megatron scatters the activation over the tensor-parallel group (sequence parallelism), so each
    rank sends 1/tp. Decoder stages of encoder-decoder models also pass the encoder output along.
    """
    tokens = model.input_seq_length if segment == 0 else model.decoder_seq_length + model.encoder_seq_length
    return model.precision_bytes * tokens * mbs * model.hidden_size / tp


def p2p_times(model: Model, geos: list[Geometry], config: Config, segment: np.ndarray,
              mbs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(boundary, exchange, wrap) of each placement `geos`, its stages' segments `segment` (G, pp), and each
    micro-batch size, row g K + k: (G K, pp-1) seconds to send one micro-batch's activation across each boundary,
    (G K, pp) the sends and receives each stage waits for in each steady-state step, and (G K,) the send from the
    last stage to the first of an interleaved pipeline."""
    # activation sizes grow linearly with the micro-batch: compute them once for one sample
    per_sample_bytes = np.array([boundary_bytes(model, s, 1, config.tp)
                                 for s in range(len(model.layer_kinds))])[segment[:, 1:]]
    per_byte = np.array([geo.boundary_s_per_byte for geo in geos])
    latency = np.array([geo.boundary_latency_s for geo in geos])[:, None, :]
    boundary = ((per_byte * per_sample_bytes)[:, None, :] * mbs[None, :, None]
                + latency).reshape(len(geos) * len(mbs), config.pp - 1)
    exchange = np.zeros((len(boundary), config.pp))
    exchange[:, 1:] += boundary
    exchange[:, :-1] += boundary
    wrap_per_byte = np.array([geo.wrap_s_per_byte for geo in geos])
    wrap_latency = np.array([geo.wrap_latency_s for geo in geos])[:, None]
    wrap = (wrap_per_byte * per_sample_bytes[:, :1].sum(-1))[:, None] * mbs + wrap_latency
    return boundary, exchange, wrap.ravel()


def allreduce_times(model: Model, geos: list[Geometry], config: Config, fixed_params: np.ndarray,
                    layer_params: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fixed, per layer, embedding) of each placement `geos`, with its stages' parameters (G, pp), each repeated
    for k micro-batch sizes (row g k + j): (G k, pp) data-parallel all-reduce of each stage's gradients beyond its
    layers, (G k, pp) what each layer adds, and (G k,) the tied embedding's all-reduce between its stages."""
    grad_bytes = gradient_bytes(model)
    per_byte = np.array([geo.dp_allreduce_s_per_byte for geo in geos])
    latency = np.array([geo.dp_allreduce_latency_s for geo in geos])
    ar_fixed = per_byte * grad_bytes * fixed_params + latency
    ar_layer = per_byte * grad_bytes * layer_params
    embedding = np.array([geo.embedding_allreduce_s_per_byte for geo in geos]) * grad_bytes \
        * model.padded_vocab(config.tp) * model.hidden_size / config.tp \
        + np.array([geo.embedding_allreduce_latency_s for geo in geos])
    return np.repeat(ar_fixed, k, axis=0), np.repeat(ar_layer, k, axis=0), np.repeat(embedding, k)


@dataclass(frozen=True)
class Geometry:
    """Where the ranks of a (tp, dp, pp) plan land for one placement: seconds per byte, and the latency each
    transfer or collective pays once."""

    placement: tuple[str, ...]
    stage_node_types: tuple[tuple[str, ...], ...]  # distinct node types hosting each stage
    stage_nodes: tuple[tuple[int, ...], ...]  # node ranks hosting each stage
    boundary_s_per_byte: np.ndarray  # (pp-1,): one micro-batch's send per rank across boundary j
    dp_allreduce_s_per_byte: np.ndarray  # (pp,): all-reduce of one byte of each rank's gradients
    node: np.ndarray  # (pp, dp, tp): node of every rank
    boundary_latency_s: np.ndarray  # (pp-1,)
    dp_allreduce_latency_s: np.ndarray  # (pp,)
    embedding_allreduce_s_per_byte: float = 0.0  # all-reduce of the tied embedding between its stages
    embedding_allreduce_latency_s: float = 0.0
    wrap_s_per_byte: float = 0.0  # last stage to the first: what interleaved pipelines send around
    wrap_latency_s: float = 0.0


def geometry(cluster: Cluster, placement: tuple[str, ...], tp: int, dp: int, pp: int) -> Geometry:
    gpn = cluster.node_types[placement[0]].gpus_per_node  # the placement's node types hold one count (its spec)
    links = Links(cluster, placement)
    per_stage = tp * dp
    node = np.arange(per_stage * pp).reshape(pp, dp, tp) // gpn  # [stage, data index, tensor index]
    # a stage owns a contiguous rank block, so it spans a contiguous run of nodes
    stage_nodes = tuple(tuple(range(s * per_stage // gpn, ((s + 1) * per_stage - 1) // gpn + 1)) for s in range(pp))
    stage_types = tuple(tuple(sorted({placement[n] for n in nodes})) for nodes in stage_nodes)
    flat = node.reshape(pp, -1)
    boundary, boundary_latency = links.exchange(flat[:-1], flat[1:])
    # one data-parallel group per tensor index
    dp_cost, dp_latency = links.allreduce(node.transpose(0, 2, 1)) if dp > 1 else (np.zeros(pp), np.zeros(pp))
    wrap, wrap_latency = links.exchange(flat[-1:], flat[:1])
    return Geometry(placement, stage_types, stage_nodes, boundary, dp_cost, node, boundary_latency, dp_latency,
                    wrap_s_per_byte=float(wrap[0]), wrap_latency_s=float(wrap_latency[0]))


def with_embedding_group(cluster: Cluster, geo: Geometry, stages: tuple[int, ...]) -> Geometry:
    """`geo` with the cost of all-reducing the tied embedding between `stages` (one group per (d, t))."""
    return with_embedding_groups(cluster, geo, [stages])[0]


def with_embedding_groups(cluster: Cluster, geo: Geometry, stage_sets: list[tuple[int, ...]]) -> list[Geometry]:
    """with_embedding_group for each of `stage_sets` (the encoder splits of one placement): sets of as many stages
    are costed in one call."""
    result: list[Geometry] = [replace(geo, embedding_allreduce_s_per_byte=0.0, embedding_allreduce_latency_s=0.0)
                              for _ in stage_sets]
    by_size: dict[int, list[int]] = {}
    for i, stages in enumerate(stage_sets):
        if len(stages) >= 2:
            by_size.setdefault(len(stages), []).append(i)
    links = Links(cluster, geo.placement)
    for size, sets in by_size.items():
        groups = np.stack([geo.node[list(stage_sets[i])].reshape(size, -1).T for i in sets])
        cost, latency = links.allreduce(groups)
        for i, set_cost, set_latency in zip(sets, cost, latency):
            result[i] = replace(geo, embedding_allreduce_s_per_byte=float(set_cost),
                                embedding_allreduce_latency_s=float(set_latency))
    return result


class Links:
    """The links of one placement: per-GPU intra-node and per-node inter-node bandwidth, derated, and latency.

    GPUs of one NVLink domain talk over their NVLink whether or not they share a node: nodes of a type whose
    domain spans several (a GB200 NVL72 rack's 18 trays) are taken in placement order, that many to a domain,
    and a domain sends to other domains through all its nodes' network interfaces (NCCL's PXN moves a GPU's
    traffic to the NIC of another GPU of its NVLink domain). A node without such a domain is its own (the arrays
    per domain are then those per node)."""

    def __init__(self, cluster: Cluster, placement: tuple[str, ...]):
        types = [cluster.node_types[n] for n in placement]
        self.intra = np.array([t.intra_node_bytes_per_s for t in types])
        self.inter = np.array([t.inter_node_bytes_per_s for t in types])
        self.intra_latency = np.array([t.intra_node_latency_s for t in types])
        self.inter_latency = np.array([t.inter_node_latency_s for t in types])
        self.derating = cluster.derating
        seen: dict[str, int] = {}
        keys = []  # each node's domain: (node type, its index among the type's nodes / nodes per domain)
        for node in types:
            k = seen[node.name] = seen.get(node.name, -1) + 1
            keys.append((node.name, k // node.nvlink_domain_nodes))
        ids: dict[tuple[str, int], int] = {}
        self.domain = np.array([ids.setdefault(key, len(ids)) for key in keys])  # numbered in placement order
        self.domain_inter = np.bincount(self.domain, weights=self.inter)  # every node's interface of the domain
        first = np.unique(self.domain, return_index=True)[1]  # a domain's nodes are of one type: its first's links
        self.domain_intra, self.domain_intra_latency, self.domain_inter_latency = (
            self.intra[first], self.intra_latency[first], self.inter_latency[first])

    def _per_domain(self, sets: np.ndarray, domains: np.ndarray, weight) -> np.ndarray:
        """(S, D): for each set s, the sum of `weight` over its entries on each domain."""
        out = np.zeros((len(sets), len(self.domain_inter)))
        np.add.at(out, (np.broadcast_to(sets, domains.shape), domains), weight)
        return out

    def exchange(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(J,) seconds per byte and (J,) latency: across each boundary j every rank of one stage sends the same
        bytes to its partner in the next stage (rows of src and dst), all at once.

        Pairs inside a node use the per-GPU intra-node link; pairs across nodes share the network interface
        of their sending and of their receiving node, so the busiest interface sets the time. Each pair pays
        its link's latency once; the slowest pair counts.
        """
        der = self.derating
        boundary = np.arange(len(src))[:, None]
        src_domain, dst_domain = self.domain[src], self.domain[dst]
        local = src_domain == dst_domain
        intra = np.where(local, der.p2p_intra_node / self.intra[src], 0.0).max(axis=1, initial=0.0)
        crossing = (~local).astype(float)
        sends = self._per_domain(boundary, src_domain, crossing)
        receives = self._per_domain(boundary, dst_domain, crossing)
        inter = (np.maximum(sends, receives) * der.p2p_inter_node / self.domain_inter).max(axis=1, initial=0.0)
        pair_latency = np.where(local, self.intra_latency[src],
                                np.maximum(self.inter_latency[src], self.inter_latency[dst]))
        return np.maximum(intra, inter), pair_latency.max(axis=1, initial=0.0)

    def allreduce(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(S,) seconds per gradient byte and (S,) latency: for each set s, all-reduces run at once, one per row
        of groups[s] (the nodes of its members); the slowest counts.

        A group inside one node runs a ring over the intra-node links: 2(n-1)/n bytes per byte. A group across
        k nodes runs hierarchically: reduce-scatter and all-gather inside each node over its g local members
        (2(g-1)/g), and an all-reduce between the k nodes (2(k-1)/k) whose traffic every group of the set with
        members on a node pushes through that node's one interface.

        A ring of n steps' worth pays 2 (n - 1) latencies: 2 (g - 1) of the slowest intra-node link of the
        group, 2 (k - 1) of the slowest network interface.
        """
        der = self.derating
        groups = self.domain[groups]  # a domain's members ring over its NVLink, as a node's do
        sets, rows, _ = groups.shape
        nodes = len(self.domain_inter)
        # the distinct (group, node) pairs and how many members each holds: sparse, since a group spans few
        # of the nodes and there can be thousands of both
        pairs, members = np.unique((np.arange(sets * rows)[:, None] * nodes + groups.reshape(sets * rows, -1)).ravel(),
                                   return_counts=True)
        group, node = pairs // nodes, pairs % nodes
        k = np.bincount(group, minlength=sets * rows)
        g = np.zeros(sets * rows, dtype=members.dtype)
        np.maximum.at(g, group, members)
        slowest_intra = np.full(sets * rows, np.inf)
        np.minimum.at(slowest_intra, group, self.domain_intra[node])
        intra_part = np.where(g > 1, 2 * (g - 1) / g * der.collective_intra_node / slowest_intra, 0.0)
        spanning = k > 1
        set_node = group // rows * nodes + node
        nic_load = np.bincount(set_node, weights=spanning[group], minlength=sets * nodes)
        busiest = np.zeros(sets * rows)
        np.maximum.at(busiest, group, nic_load[set_node] / self.domain_inter[node])
        inter_part = np.where(spanning, 2 * (k - 1) / np.maximum(k, 1) * der.collective_inter_node * busiest, 0.0)
        intra_latency, inter_latency = np.zeros(sets * rows), np.zeros(sets * rows)
        np.maximum.at(intra_latency, group, self.domain_intra_latency[node])
        np.maximum.at(inter_latency, group, self.domain_inter_latency[node])
        latency = 2 * np.maximum(g - 1, 0) * intra_latency + 2 * (k - 1) * inter_latency
        return ((intra_part + inter_part).reshape(sets, rows).max(axis=1),
                latency.reshape(sets, rows).max(axis=1))
