"""Communication: the links a placement gives every pipeline boundary and every all-reduce, and the seconds the
sends, gradient all-reduces and tied-embedding all-reduce of a plan take.

Megatron-LM orders ranks tensor-fastest, then data, then pipeline: rank r = t + tp*d + tp*dp*s, and torchrun
gives node n the ranks n*M .. n*M+M-1 (M GPUs per node). So pipeline stage s owns the contiguous rank block
[s*R, (s+1)*R) with R = tp*dp, and a placement -- the node types in node-rank order -- decides which GPU
types host each stage and which links every pipeline boundary and every all-reduce crosses.
"""

from __future__ import annotations

import math
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
                    layer_params: np.ndarray, k: int,
                    experts: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fixed, per layer, embedding) of each placement `geos`, with its stages' parameters (G, pp), each repeated
    for k micro-batch sizes (row g k + j): (G k, pp) data-parallel all-reduce of each stage's gradients beyond its
    layers, (G k, pp) what each layer adds, and (G k,) the tied embedding's all-reduce between its stages. Of the
    parameters, `experts` (fixed, per layer; (G, pp)) are routed experts', reduced over the expert-data-parallel
    group instead."""
    grad_bytes = gradient_bytes(model)
    per_byte = np.array([geo.dp_allreduce_s_per_byte for geo in geos])
    latency = np.array([geo.dp_allreduce_latency_s for geo in geos])
    ar_fixed = per_byte * grad_bytes * fixed_params + latency
    ar_layer = per_byte * grad_bytes * layer_params
    if experts is not None and model.is_moe and (config.ep, config.expert_tp) != (1, config.tp):
        expert_per_byte = np.array([geo.expert_allreduce_s_per_byte for geo in geos])
        for ar, params in ((ar_fixed, experts[0]), (ar_layer, experts[1])):
            ar += (expert_per_byte - per_byte) * grad_bytes * params
        ar_fixed += np.array([geo.expert_allreduce_latency_s for geo in geos])
    embedding = np.array([geo.embedding_allreduce_s_per_byte for geo in geos]) * grad_bytes \
        * model.padded_vocab(config.tp) * model.hidden_size / config.tp \
        + np.array([geo.embedding_allreduce_latency_s for geo in geos])
    return np.repeat(ar_fixed, k, axis=0), np.repeat(ar_layer, k, axis=0), np.repeat(embedding, k)


def layer_exchange_s(model: Model, geos: list[Geometry], config: Config, segment: np.ndarray, mbs: np.ndarray,
                     core_forward_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward): (G K, pp) seconds one layer of each stage adds per micro-batch, for placements `geos`
    and sizes `mbs` (row g K + k), with its attention core's forward seconds `core_forward_s` (G K, pp):

    - expert parallelism, in the segment's share of MoE layers: Megatron-core's alltoall dispatcher sends each
      rank's T k routed tokens (T = b s / (tp cp)) to their experts and back, two all-to-alls forward (dispatch,
      combine) and two backward, not overlapped (round 3 reference, part A section 6), the busiest rank
      receiving moe_load_imbalance times the mean;
    - context parallelism: the ring of cp - 1 steps forward, each sending the rank's K and V to the next rank while
      attention computes on the pair it holds, and backward K, V and their gradients (twice the bytes) against
      twice the compute (Transformer Engine's AttnFuncWithCPAndKVP2P): what a step's transfer takes beyond its
      share of the attention core is exposed."""
    rows = len(geos) * len(mbs)
    forward, backward = np.zeros((rows, config.pp)), np.zeros((rows, config.pp))

    def per_row(name: str) -> np.ndarray:
        """(G K, pp) a Geometry field of each placement, for each micro-batch size."""
        return np.repeat(np.array([getattr(geo, name) for geo in geos]), len(mbs), axis=0)

    p, h = model.precision_bytes, model.hidden_size
    seq = np.array([model.layer_seq_length(kind) for kind in model.layer_kinds])[segment]  # (G, pp)
    samples = np.tile(mbs, len(geos))[:, None]
    seq_rows = np.repeat(seq, len(mbs), axis=0)
    if config.ep > 1:
        share = np.repeat(np.array([model.moe_share(kind) for kind in model.layer_kinds])[segment], len(mbs), axis=0)
        per_byte, latency = per_row("alltoall_s_per_byte"), per_row("alltoall_latency_s")
        payload = p * samples * seq_rows / (config.tp * config.cp) * model.moe_router_topk * h * model.moe_load_imbalance
        alltoalls = 2 * share * (payload * per_byte + latency)
        forward += alltoalls
        backward += alltoalls
    if config.cp > 1:
        per_byte, latency = per_row("ring_s_per_byte"), per_row("ring_latency_s")
        send = kv_chunk_bytes(model, config.tp, config.cp) * samples * seq_rows * per_byte + latency
        step = core_forward_s / config.cp
        forward += (config.cp - 1) * np.maximum(send - step, 0.0)
        backward += (config.cp - 1) * 2 * np.maximum(send - step, 0.0)
    return forward, backward


def kv_chunk_bytes(model: Model, tp: int, cp: int) -> float:
    """Bytes of keys and values one rank holds per token of a sample's sequence and sends at each step of the
    context-parallel ring: its 1/cp of the tokens, over its heads (multi-latent attention's per-head K and V,
    which it up-projects before the core, not its latent)."""
    if model.multi_latent_attention:
        width = model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim)
    else:
        width = 2 * model.kv_width
    return model.precision_bytes * width / tp / cp


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
    # (pp,) context and expert parallelism: one step of the context-parallel ring (each rank sends one byte to the
    # next), an all-to-all over the expert-parallel group (each rank holds one byte for the group), an all-reduce
    # over the expert-data-parallel group; zeros without them
    ring_s_per_byte: np.ndarray | None = None
    ring_latency_s: np.ndarray | None = None
    alltoall_s_per_byte: np.ndarray | None = None
    alltoall_latency_s: np.ndarray | None = None
    expert_allreduce_s_per_byte: np.ndarray | None = None
    expert_allreduce_latency_s: np.ndarray | None = None
    stage_keys: tuple = ()  # (pp,) each stage's Links.stage_key


def geometry(cluster: Cluster, placement: tuple[str, ...], tp: int, dp: int, pp: int, cp: int = 1,
             experts: tuple[int, int] | None = None, links: Links | None = None, keyed: bool = False) -> Geometry:
    """Where the ranks of a plan land on `placement`. Megatron-LM orders them tp, cp, dp, pp (tensor fastest;
    for an MoE model's `experts` (ep, etp), the expert grid etp, ep, edp, pp over the same ranks), so each stage
    owns a contiguous block of tp cp dp ranks; the data-parallel group of a dense parameter is the dp x cp ranks
    of one tensor index. `links`: the placement's, where already built; `keyed`: with each stage's key for
    with_experts (the geometry of an MoE model's plans)."""
    gpn = cluster.node_types[placement[0]].gpus_per_node  # the placement's node types hold one count (its spec)
    links = Links(cluster, placement) if links is None else links
    per_stage = tp * cp * dp
    node = np.arange(per_stage * pp).reshape(pp, dp * cp, tp) // gpn  # [stage, data and context index, tensor index]
    # a stage owns a contiguous rank block, so it spans a contiguous run of nodes
    stage_nodes = tuple(tuple(range(s * per_stage // gpn, ((s + 1) * per_stage - 1) // gpn + 1)) for s in range(pp))
    stage_types = tuple(tuple(sorted(set(placement[nodes[0]:nodes[-1] + 1]))) for nodes in stage_nodes)
    flat = node.reshape(pp, -1)
    # a stage's ranks in blocks of gcd(per_stage, gpn) from its first share their node and their partner's in any
    # other stage: the exchanges between stages, each to the next and the last to the first (the wrap), take one
    # rank of each block, standing for the block
    block = math.gcd(per_stage, gpn)
    ends = flat[:, ::block]
    sends, sends_latency = links.exchange(ends, np.roll(ends, -1, axis=0), block)
    boundary, boundary_latency, wrap, wrap_latency = sends[:-1], sends_latency[:-1], sends[-1:], sends_latency[-1:]
    # one data-parallel group per tensor index
    dp_cost, dp_latency = links.allreduce(node.transpose(0, 2, 1)) if dp * cp > 1 else (np.zeros(pp), np.zeros(pp))
    geo = Geometry(placement, stage_types, stage_nodes, boundary, dp_cost, node, boundary_latency, dp_latency,
                   wrap_s_per_byte=float(wrap[0]), wrap_latency_s=float(wrap_latency[0]),
                   stage_keys=tuple(links.stage_key(nodes, s * per_stage % gpn) for s, nodes in enumerate(stage_nodes))
                   if experts is not None or keyed else ())
    if cp > 1:  # each rank sends to the next context rank of its (data, tensor) index
        ranks = flat.reshape(pp, dp, cp, tp)
        ring, ring_latency = links.exchange(ranks.reshape(pp, -1), np.roll(ranks, -1, axis=2).reshape(pp, -1))
        geo = replace(geo, ring_s_per_byte=ring, ring_latency_s=ring_latency)
    return geo if experts is None else with_experts(geo, links, tp, *experts)


def with_experts(geo: Geometry, links: Links, tp: int, ep: int, etp: int, known: dict | None = None) -> Geometry:
    """`geo` (of `links`, its placement's) with the groups of an MoE model's expert grid: the all-to-all over the
    ep ranks of each expert-tensor index, the all-reduce over the expert-data-parallel ranks (none where the
    expert grid is the dense one: ep 1, etp tp). A stage's figures depend only on the links of the nodes it
    spans (links.stage_key); `known` keeps them by that key for the other placements of a search."""
    if (ep, etp) == (1, tp):
        return geo
    pp = len(geo.node)
    flat = geo.node.reshape(pp, -1)
    edp = flat.shape[1] // (etp * ep)
    grid = flat.reshape(pp, edp, ep, etp)  # [stage, expert-data index, expert index, expert-tensor index]
    known = {} if known is None else known
    keys = [(stage, flat.shape[1], ep, etp) for stage in geo.stage_keys]
    todo = sorted({key: s for s, key in enumerate(keys) if key not in known}.values())
    if todo:
        zeros = np.zeros(len(todo))
        alltoall = alltoall_latency = expert = expert_latency = zeros
        if ep > 1:
            alltoall, alltoall_latency = links.alltoall(grid[todo].transpose(0, 1, 3, 2).reshape(len(todo), edp * etp, ep))
        if edp > 1:
            expert, expert_latency = links.allreduce(grid[todo].reshape(len(todo), edp, ep * etp).transpose(0, 2, 1))
        for i, s in enumerate(todo):
            known[keys[s]] = (alltoall[i], alltoall_latency[i], expert[i], expert_latency[i])
    figures = np.array([known[key] for key in keys]).T
    return replace(geo, alltoall_s_per_byte=figures[0], alltoall_latency_s=figures[1],
                   expert_allreduce_s_per_byte=figures[2], expert_allreduce_latency_s=figures[3])


def with_embedding_group(cluster: Cluster, geo: Geometry, stages: tuple[int, ...]) -> Geometry:
    """`geo` with the cost of all-reducing the tied embedding between `stages` (one group per (d, t))."""
    return with_embedding_groups(cluster, geo, [stages])[0]


def with_embedding_groups(cluster: Cluster, geo: Geometry, stage_sets: list[tuple[int, ...]],
                          links: Links | None = None) -> list[Geometry]:
    """with_embedding_group for each of `stage_sets` (the encoder splits of one placement): sets of as many stages
    are costed in one call (`links`: the placement's, where already built)."""
    result: list[Geometry] = [replace(geo, embedding_allreduce_s_per_byte=0.0, embedding_allreduce_latency_s=0.0)
                              for _ in stage_sets]
    by_size: dict[int, list[int]] = {}
    for i, stages in enumerate(stage_sets):
        if len(stages) >= 2:
            by_size.setdefault(len(stages), []).append(i)
    links = Links(cluster, geo.placement) if links is None and by_size else links
    for size, sets in by_size.items():
        assert links is not None
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
        node_types = list(cluster.node_types.values())
        index = {node.name: i for i, node in enumerate(node_types)}
        kind = np.fromiter((index[n] for n in placement), dtype=np.int64, count=len(placement))  # each node's type
        self.types = placement
        self.intra, self.inter, self.intra_latency, self.inter_latency = (
            np.array([getattr(node, field) for node in node_types])[kind]
            for field in ("intra_node_bytes_per_s", "inter_node_bytes_per_s", "intra_node_latency_s", "inter_node_latency_s"))
        self.derating = cluster.derating
        # each node's domain: (its type, its index among the type's nodes // nodes per domain), numbered in
        # placement order
        count = np.bincount(kind, minlength=len(node_types))
        among = np.empty_like(kind)
        among[np.argsort(kind, kind="stable")] = np.arange(len(kind)) - np.repeat(np.cumsum(count) - count, count)
        per_domain = np.array([node.nvlink_domain_nodes for node in node_types])[kind]
        keys, first, key_of = np.unique(kind * len(kind) + among // per_domain, return_index=True, return_inverse=True)
        number = np.empty(len(keys), dtype=np.int64)
        number[np.argsort(first)] = np.arange(len(keys))
        self.domain = number[key_of.ravel()]
        self.domain_inter = np.bincount(self.domain, weights=self.inter)  # every node's interface of the domain
        first = np.unique(self.domain, return_index=True)[1]  # a domain's nodes are of one type: its first's links
        self.domain_intra, self.domain_intra_latency, self.domain_inter_latency = (
            self.intra[first], self.intra_latency[first], self.inter_latency[first])

    def _per_domain(self, sets: np.ndarray, domains: np.ndarray, weight) -> np.ndarray:
        """(S, D): for each set s (`sets`, broadcast against `domains`), the sum of `weight` over its entries on
        each domain (a bincount: the same sums, in the same order, as np.add.at, many times faster)."""
        width = len(self.domain_inter)
        cells = (np.broadcast_to(sets, domains.shape) * width + domains).ravel()
        sums = np.bincount(cells, weights=np.broadcast_to(weight, domains.shape).ravel(), minlength=len(sets) * width)
        return sums.reshape(len(sets), width)

    def exchange(self, src: np.ndarray, dst: np.ndarray, ranks: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(J,) seconds per byte and (J,) latency: across each boundary j every rank of one stage sends the same
        bytes to its partner in the next stage (rows of src and dst, the nodes of each pair, each pair standing
        for `ranks` pairs of the same nodes), all at once.

        Pairs inside a node use the per-GPU intra-node link; pairs across nodes share the network interface
        of their sending and of their receiving node, so the busiest interface sets the time. Each pair pays
        its link's latency once; the slowest pair counts.
        """
        der = self.derating
        boundary = np.arange(len(src))[:, None]
        src_domain, dst_domain = self.domain[src], self.domain[dst]
        local = src_domain == dst_domain
        intra = np.where(local, der.p2p_intra_node / self.intra[src], 0.0).max(axis=1, initial=0.0)
        crossing = np.where(local, 0.0, float(ranks))
        sends = self._per_domain(boundary, src_domain, crossing)
        receives = self._per_domain(boundary, dst_domain, crossing)
        inter = (np.maximum(sends, receives) * der.p2p_inter_node / self.domain_inter).max(axis=1, initial=0.0)
        pair_latency = np.where(local, self.intra_latency[src],
                                np.maximum(self.inter_latency[src], self.inter_latency[dst]))
        return np.maximum(intra, inter), pair_latency.max(axis=1, initial=0.0)

    def stage_key(self, nodes: tuple[int, ...], offset: int) -> tuple:
        """What the collectives among the ranks of one stage depend on: the rank its first node starts it at
        (`offset`), and each of its `nodes`' type, domain relative to the first node's and that domain's network
        interfaces."""
        first = self.domain[nodes[0]]
        return offset, tuple((self.types[n], int(self.domain[n] - first), float(self.domain_inter[self.domain[n]]))
                             for n in nodes)

    def alltoall(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(S,) seconds per byte and (S,) latency: for each set s, all-to-alls run at once, one per row of groups[s]
        (the nodes of its n members), each member holding one byte split evenly among the members. A member with
        c members in its domain sends (c - 1) / n over its intra-node link and (n - c) / n through its domain's
        network interfaces, which carry every member's of the set at once; the busiest link sets the time. The
        slowest link's latency is paid once."""
        der = self.derating
        domains = self.domain[groups]  # (S, R, n)
        sets, rows, n = groups.shape
        # members of each one's group in its domain: the count of its (group, domain) pair, in work linear in the
        # members (a comparison of every pair would be quadratic in the group)
        keys = np.arange(sets * rows).reshape(sets, rows, 1) * len(self.domain_inter) + domains
        _, pair, counts = np.unique(keys, return_inverse=True, return_counts=True)
        local = counts[pair].reshape(domains.shape)
        intra = ((local - 1) / n * der.collective_intra_node / self.intra[groups]).reshape(sets, -1).max(axis=1)
        load = self._per_domain(np.arange(sets)[:, None, None], domains, (n - local) / n)
        inter = (load * der.collective_inter_node / self.domain_inter).max(axis=1)
        latency = np.where((local < n).reshape(sets, -1).any(axis=1), self.inter_latency[groups].reshape(sets, -1).max(axis=1),
                           self.intra_latency[groups].reshape(sets, -1).max(axis=1))
        return np.maximum(intra, inter), latency

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
        group, node = pairs // nodes, pairs % nodes  # sorted by group, and every group has a pair
        starts = np.flatnonzero(np.diff(group, prepend=-1))  # each group's first pair
        k = np.diff(starts, append=len(group))
        g = np.maximum.reduceat(members, starts)
        slowest_intra = np.minimum.reduceat(self.domain_intra[node], starts)
        intra_part = np.where(g > 1, 2 * (g - 1) / g * der.collective_intra_node / slowest_intra, 0.0)
        spanning = k > 1
        set_node = group // rows * nodes + node
        nic_load = np.bincount(set_node, weights=spanning[group], minlength=sets * nodes)
        busiest = np.maximum.reduceat(nic_load[set_node] / self.domain_inter[node], starts)
        inter_part = np.where(spanning, 2 * (k - 1) / k * der.collective_inter_node * busiest, 0.0)
        intra_latency = np.maximum.reduceat(self.domain_intra_latency[node], starts)
        inter_latency = np.maximum.reduceat(self.domain_inter_latency[node], starts)
        latency = 2 * np.maximum(g - 1, 0) * intra_latency + 2 * (k - 1) * inter_latency
        return ((intra_part + inter_part).reshape(sets, rows).max(axis=1),
                latency.reshape(sets, rows).max(axis=1))
