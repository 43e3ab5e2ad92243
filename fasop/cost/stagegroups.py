"""Stage-group plans: pipeline stages that each have their own GPU type, tensor- and data-parallel degree
(docs/cost-model.md section 11).

How the runtime runs them (FlagScale's heterogeneous mode): every stage processes the same global micro-batch
of B = dp_0 x mbs_0 samples, so a stage of data-parallel degree d gives each of its GPUs B / d samples, and
every stage runs the same number of micro-batches per step, G / B. Stage i owns the contiguous rank block that
follows stage i - 1's, tensor rank fastest, then data rank. Across a boundary whose sides differ in tp or dp,
the activation (sequence x batch x hidden) is cut into each side's slices (sequence over tp, batch over dp) and
every source rank sends each destination rank the block their slices share.

A stage's own costs (compute, memory, gradient bytes, optimizer step) are those of the same stage in a uniform
plan of its degrees on its GPU type: they are taken column by column from fasop.cost.step on such a plan, so a
stage-group plan whose stages all share one tp and dp costs exactly what the uniform plan of that shape costs.
What depends on the neighbours (the sends across boundaries, the gradient reduction over the stage's own ranks,
the tied embedding's all-reduce) is computed on the plan's own rank layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fasop.cost.communication import Geometry, Links, boundary_bytes, geometry, with_embedding_group
from fasop.cost.config import Config, embedding_stages
from fasop.cost.exact import ScheduleBatch, bucket_params
from fasop.cost.memory import StageMemory, gradient_bytes
from fasop.cost.problem import PartitionBatch
from fasop.cost.step import StageCosts, post_tail, reduction_shares, stage_costs
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile


@dataclass(frozen=True)
class GroupLayout:
    """Where the ranks of a stage-group plan land: the node of every rank of every stage, and the physical node
    of every node position (a node holding several GPU kinds takes a position for each kind a plan runs on it,
    Cluster.hosts)."""

    placement: tuple[str, ...]  # node types in node-rank order (blocks of one GPU kind of a node holding several)
    stage_nodes: tuple[tuple[int, ...], ...]  # node positions hosting each stage
    rank_node: tuple[np.ndarray, ...]  # per stage, (dp, tp): the node of each rank, tensor rank fastest
    node_host: tuple[int, ...] = ()  # the physical node of each node position, in host order


def node_hosts(cluster: Cluster, placement: Sequence[str]) -> list[int]:
    """The physical node of each position of `placement`. A block of a node holding several GPU kinds joins the
    node of the position before it when that is a block of the same node type earlier in its CUDA device order:
    a node's ranks are one run in FlagScale's host order, its kinds' blocks in device order; every other
    position is a node of its own."""
    hosts: list[int] = []
    for i, name in enumerate(placement):
        node = cluster.node_types[name]
        before = cluster.node_types[placement[i - 1]] if i else None
        joins = before is not None and node.host != "" and before.host == node.host \
            and before.host_first_gpu < node.host_first_gpu
        hosts.append(hosts[-1] if joins else (hosts[-1] + 1 if hosts else 0))
    return hosts


def host_types(cluster: Cluster, placement: Sequence[str]) -> list[str]:
    """The node type of each physical node of `placement` in host order: a node holding several GPU kinds is
    named as its [[node_type]] table is (Cluster.hosts), whichever of its kinds the plan runs."""
    hosts = node_hosts(cluster, placement)
    return [cluster.node_types[name].host or name for i, name in enumerate(placement) if i == 0 or hosts[i] != hosts[i - 1]]


def label_places(stage_keys: Sequence[tuple[str, int, int]]) -> list[int]:
    """Each stage's label, as FlagScale's heterogeneous mode lists them: stages of one (node type, tp, dp) in a
    row form a mesh, meshes of one node type in a row share a label (one of a node type that comes back gets a
    label of its own); a label is named by the place of its first mesh in hetero_device_types."""
    places: list[int] = []
    mesh = -1
    for s, key in enumerate(stage_keys):
        if s == 0 or key != stage_keys[s - 1]:
            mesh += 1
        starts = s == 0 or key[0] != stage_keys[s - 1][0]
        places.append(mesh if starts else places[-1])
    return places


def host_labels(cluster: Cluster, placement: Sequence[str], position_label: Sequence[int]) -> list[int] | None:
    """The label of each physical node: FlagScale gives a host one label, exports that label's environment
    (which GPUs it runs) on it, and orders ranks by the place of their host's label, then by host. So each host
    takes one of its positions' labels (`position_label`, label_places), never one placed before the previous
    host's, and shares it only with hosts that run the same GPUs; None when no choice fits."""
    hosts = node_hosts(cluster, placement)
    bound: dict[int, tuple[str, ...]] = {}
    chosen: list[int] = []
    start = 0
    for host in range(hosts[-1] + 1 if hosts else 0):
        end = start
        while end < len(hosts) and hosts[end] == host:
            end += 1
        runs = tuple(placement[start:end])  # its blocks: its GPUs and its network settings
        usable = [label for label in dict.fromkeys(position_label[start:end])
                  if label >= (chosen[-1] if chosen else 0) and bound.get(label, runs) == runs]
        if not usable:
            return None
        bound[usable[0]] = runs
        chosen.append(usable[0])
        start = end
    return chosen


def group_layout(cluster: Cluster, placement: Sequence[str], degrees: Sequence[tuple[int, int]]) -> GroupLayout:
    """The layout of stages of (tp, dp) `degrees` on `placement`, each stage's ranks following the previous
    stage's (the caller has checked that they fill the placement's GPUs)."""
    gpus = np.array([cluster.node_types[name].gpus_per_node for name in placement])
    first_gpu = np.cumsum(gpus) - gpus
    rank_node, stage_nodes = [], []
    offset = 0
    for tp, dp in degrees:
        ranks = offset + np.arange(tp * dp)
        nodes = np.searchsorted(first_gpu, ranks, side="right") - 1
        rank_node.append(nodes.reshape(dp, tp))
        stage_nodes.append(tuple(range(int(nodes[0]), int(nodes[-1]) + 1)))
        offset += tp * dp
    return GroupLayout(tuple(placement), tuple(stage_nodes), tuple(rank_node), tuple(node_hosts(cluster, placement)))


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value to compare by
class Hosts:
    """The physical nodes of a layout's node positions and, inside a node holding several GPU kinds, the link
    between its kinds (its intra-node link: PCIe through the host, the network never)."""

    index: np.ndarray  # (positions,) the physical node of each position
    between_kinds_bytes_per_s: np.ndarray  # (positions,) per GPU, towards a GPU of another kind of its node
    between_kinds_latency_s: np.ndarray  # (positions,)


def layout_hosts(cluster: Cluster, layout: GroupLayout) -> Hosts:
    whole = [cluster.hosts.get(cluster.node_types[name].host, cluster.node_types[name]) for name in layout.placement]
    return Hosts(np.array(layout.node_host, dtype=int), np.array([t.intra_node_bytes_per_s for t in whole]),
                 np.array([t.intra_node_latency_s for t in whole]))


def slice_overlap(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, share): every slice i of `a` equal slices and slice j of `b` that have a part of the dimension in
    common, and that share of it; at most a + b - 1 pairs (slice i meets the slices of b from its start to its
    end), so that two stages of many ranks cost what their pairs do, not a times b."""
    i = np.arange(a)
    first, last = (i * b) // a, ((i + 1) * b - 1) // a  # in units of 1 / (a b), slice i spans [i b, (i + 1) b)
    counts = last - first + 1
    ia = np.repeat(i, counts)
    ib = np.repeat(first, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    share = (np.minimum((ia + 1) * b, (ib + 1) * a) - np.maximum(ia * b, ib * a)) / (a * b)
    kept = share > 0
    return ia[kept], ib[kept], share[kept]


def reshard_s(links: Links, cluster: Cluster, src: np.ndarray, dst: np.ndarray, activation_bytes: float,
              hosts: Hosts | None = None) -> float:
    """Seconds to send one global micro-batch's activation (`activation_bytes` in all) from the ranks `src`
    (dp_a, tp_a: their node positions) to the ranks `dst` (dp_b, tp_b), every pair exchanging the block its
    batch and sequence slices share, all at once. A GPU's sends and receives inside its node share its
    intra-node link (towards a GPU of another kind of its node, `hosts`' link between kinds), a node's sends and
    receives to other nodes its network interface; the busiest sets the time, and the slowest pair's latency is
    paid once. `hosts`: None when every position is a node of its own."""
    batch_a, batch_b, batch_share = slice_overlap(src.shape[0], dst.shape[0])
    seq_a, seq_b, seq_share = slice_overlap(src.shape[1], dst.shape[1])
    sender = (batch_a[:, None] * src.shape[1] + seq_a[None, :]).ravel()  # flat ranks of the pairs that exchange
    receiver = (batch_b[:, None] * dst.shape[1] + seq_b[None, :]).ravel()
    sent = activation_bytes * (batch_share[:, None] * seq_share[None, :]).ravel()
    src_rank_node, dst_rank_node = src.ravel(), dst.ravel()
    src_node, dst_node = src_rank_node[sender], dst_rank_node[receiver]
    if hosts is None:
        hosts = Hosts(np.arange(len(links.inter)), links.intra, links.intra_latency)
    src_host, dst_host = hosts.index[src_node], hosts.index[dst_node]
    same_block = src_node == dst_node
    local = src_host == dst_host
    between = local & ~same_block  # two GPU kinds of one node
    der = cluster.derating
    block_bytes, between_bytes = np.where(same_block, sent, 0.0), np.where(between, sent, 0.0)

    def per_rank(ranks: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Seconds each rank's sends (or receives) take on its node's links."""
        return (np.bincount(ranks, weights=block_bytes, minlength=len(nodes)) / links.intra[nodes]
                + np.bincount(ranks, weights=between_bytes, minlength=len(nodes)) / hosts.between_kinds_bytes_per_s[nodes])

    intra = max(per_rank(sender, src_rank_node).max(initial=0.0),
                per_rank(receiver, dst_rank_node).max(initial=0.0)) * der.p2p_intra_node
    crossing = np.where(local, 0.0, sent)
    nodes = int(hosts.index.max()) + 1
    out = np.bincount(src_host, weights=crossing, minlength=nodes)
    into = np.bincount(dst_host, weights=crossing, minlength=nodes)
    interface = np.zeros(nodes)
    interface[hosts.index] = links.inter  # the positions of one node share its network interface
    inter = float((np.maximum(out, into) * der.p2p_inter_node / interface).max(initial=0.0))
    latency = np.where(same_block, links.intra_latency[src_node],
                       np.where(between, hosts.between_kinds_latency_s[src_node],
                                np.maximum(links.inter_latency[src_node], links.inter_latency[dst_node])))
    return max(intra, inter) + float(latency[sent > 0].max(initial=0.0))


def uniform_costs(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], node_type: str, config: Config,
                  mbs_values: list[int]) -> StageCosts:
    """The stage costs of the uniform plan `config` with every stage on nodes of `node_type` (as many as it
    takes), for each micro-batch size: what each stage of a stage-group plan of these degrees costs on its own."""
    gpn = cluster.node_types[node_type].gpus_per_node
    nodes = -(-config.tp * config.dp * config.pp // gpn)
    sub = cluster.with_counts({node_type: nodes})
    geo = with_embedding_group(sub, geometry(sub, (node_type,) * nodes, config.tp, config.dp, config.pp),
                               embedding_stages(model, config))
    return stage_costs(model, sub, profiles, geo, config, mbs_values)


def stage_group_costs(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile], configs: Sequence[Config],
                      layout: GroupLayout) -> tuple[StageCosts, Geometry]:
    """The costs of one stage-group plan (one row): stage i as configs[i] (its tp, dp, mbs; every config has the
    plan's pp, global batch and options) on the nodes `layout` gives it. Also a Geometry that carries the
    plan's placement and stage nodes for the record."""
    pp = len(configs)
    columns: dict[tuple, StageCosts] = {}
    stage_cols = []
    for config, nodes in zip(configs, layout.stage_nodes):
        node_type = layout.placement[nodes[0]]
        key = (node_type, config.tp, config.dp, config.mbs)
        if key not in columns:
            columns[key] = uniform_costs(model, cluster, profiles, node_type, config, [config.mbs])
        stage_cols.append(columns[key])

    def column(get) -> np.ndarray:
        """(1, pp): stage i's value from its uniform plan's row."""
        return np.array([[np.asarray(get(costs))[0, i] for i, costs in enumerate(stage_cols)]])

    links = Links(cluster, layout.placement)
    grad_bytes = gradient_bytes(model)
    per_byte, latency = np.zeros((1, pp)), np.zeros((1, pp))
    for i, (config, ranks) in enumerate(zip(configs, layout.rank_node)):
        if config.dp > 1:  # one data-parallel group per tensor rank
            cost, lat = links.allreduce(ranks.T[None])
            per_byte[0, i], latency[0, i] = cost[0], lat[0]
    sched = [costs.schedule for costs in stage_cols]
    params_fixed = column(lambda c: c.schedule.params_fixed)
    params_layer = column(lambda c: c.schedule.params_layer)
    ar_fixed = per_byte * grad_bytes * params_fixed + latency
    ar_layer = per_byte * grad_bytes * params_layer
    first = configs[0]
    grad_share, gather_fixed, gather_layer = reduction_shares(model, first)
    buckets = np.array([[float(bucket_params(c.dp)) for c in configs]])
    opt_fixed = column(lambda c: c.schedule.optimizer_fixed_s)
    opt_layer = column(lambda c: c.schedule.optimizer_layer_s)
    post_fixed, post_layer = post_tail(model, first, ar_fixed, ar_layer, opt_fixed, opt_layer, per_byte, buckets)
    # one global micro-batch crosses each boundary
    batch = first.dp * first.mbs
    activation = boundary_bytes(model, 0, batch, 1)
    hosts = layout_hosts(cluster, layout)
    boundary = np.array([[reshard_s(links, cluster, layout.rank_node[i], layout.rank_node[i + 1], activation, hosts)
                          for i in range(pp - 1)]])
    exchange = np.zeros((1, pp))
    exchange[:, 1:] += boundary
    exchange[:, :-1] += boundary
    emb = np.zeros(1)
    tied = embedding_stages(model, first)
    if len(tied) == 2:  # the caller has checked that both ends share tp and dp
        groups = np.stack([layout.rank_node[s].ravel() for s in tied], axis=-1)
        cost, lat = links.allreduce(groups[None])
        emb[0] = cost[0] * grad_bytes * model.padded_vocab(first.tp) * model.hidden_size / first.tp + lat[0]
    m = np.array([first.gbs // batch])
    compute_fixed = column(lambda c: c.problem.period_fixed_s - c.exchange_s)  # with recomputed forwards
    problem = PartitionBatch(
        segment_of_stage=np.zeros(pp, dtype=int), segment_layers=np.array([model.num_layers]),
        lo=column(lambda c: np.broadcast_to(c.problem.lo, c.problem.hi.shape)), hi=column(lambda c: c.problem.hi),
        layer_s=column(lambda c: c.problem.layer_s), period_fixed_s=compute_fixed + exchange,
        ar_fixed_s=post_fixed, ar_layer_s=post_layer, num_microbatches=m,
        base_s=compute_fixed.sum(-1) + 2 * boundary.sum(-1) + emb)
    schedule = ScheduleBatch(
        fixed_s=column(lambda c: c.schedule.fixed_s), layer_s=column(lambda c: c.schedule.layer_s),
        fixed_forward_s=column(lambda c: c.schedule.fixed_forward_s),
        layer_forward_s=column(lambda c: c.schedule.layer_forward_s), boundary_s=boundary, num_microbatches=m,
        grad_fixed_s=grad_share * ar_fixed, grad_layer_s=grad_share * ar_layer,
        gather_fixed_s=gather_fixed * ar_fixed, gather_layer_s=gather_layer * ar_layer,
        optimizer_fixed_s=opt_fixed, optimizer_layer_s=opt_layer, params_fixed=params_fixed,
        params_layer=params_layer, bucket_params=buckets, embedding_allreduce_s=emb,
        overlap_grad_reduce=sched[0].overlap_grad_reduce, overlap_param_gather=sched[0].overlap_param_gather,
        virtual_stages=np.ones(1, dtype=int), wrap_s=np.zeros(1),
        recompute_fixed_s=column(lambda c: c.schedule.recompute_fixed_s),
        recompute_layer_s=column(lambda c: c.schedule.recompute_layer_s),
        recomputed_per_chunk=sched[0].recomputed_per_chunk)
    memory = StageMemory(*(column(lambda c, name=name: getattr(c.memory, name))
                           for name in StageMemory.__dataclass_fields__))
    costs = StageCosts(
        mbs=np.array([first.mbs]), problem=problem,
        gpu=(tuple(costs.gpu[0][i] for i, costs in enumerate(stage_cols)),), boundary_s=boundary,
        exchange_s=exchange, memory=memory, mem_fixed_gib=column(lambda c: c.mem_fixed_gib),
        mem_layer_gib=column(lambda c: c.mem_layer_gib), capacity_gib=column(lambda c: c.capacity_gib),
        embedding_allreduce_s=emb, fixed_layers=np.zeros(pp, dtype=int), schedule=schedule)
    geo = Geometry(layout.placement, tuple((layout.placement[n[0]],) for n in layout.stage_nodes), layout.stage_nodes,
                   np.zeros(pp - 1), per_byte[0], np.zeros((pp, 1, 1), dtype=int), np.zeros(pp - 1), latency[0])
    return costs, geo
