"""The plan space: global batch sizes, tensor, data and pipeline degrees, micro-batch sizes, encoder/decoder
stage splits, and the groups of plans that share all but their placement and micro-batch size."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from fasop.cost.communication import Geometry, Links, geometry, with_embedding_groups, with_experts
from fasop.cost.config import (
    DEFAULT_RECOMPUTE_MODULES,
    RECOMPUTE_MODES,
    Config,
    check_recompute_modules,
    embedding_stages,
    param_gather_overlaps,
    sequence_parallel_on,
    with_recompute,
)
from fasop.cost.fp8 import check_param_gather
from fasop.cost.memory import GIB, bytes_per_param, head_fits, usable_gib
from fasop.cost.tpoverlap import overlap_error, overlap_pays
from fasop.errors import ArgumentError, InputError
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile, load_profiles
from fasop.search.placement import placement_unit, placements

PLACEMENT_LIMIT = 100  # more distinct placements per (tp, dp, pp) than this: the type-block subset
MAX_GLOBAL_BATCH = 2**53  # samples and token counts stay exact in double precision up to here
_TRIAL_CHUNK = 1 << 20  # candidate factors tested at once


@lru_cache(maxsize=256)
def _prime_factors(n: int) -> tuple[int, ...]:
    """The prime factors of n (with repeats, ascending) by trial division, vectorised: O(sqrt n) work for
    the largest n fasop accepts (MAX_GLOBAL_BATCH), well under a second."""
    factors: list[int] = []
    candidate = 2
    while candidate * candidate <= n:
        stop = min(math.isqrt(n) + 1, candidate + _TRIAL_CHUNK)
        trial = np.arange(candidate, stop, dtype=np.int64)
        hits = trial[n % trial == 0]
        if not len(hits):
            candidate = stop
            continue
        prime = int(hits[0])  # the smallest divisor above the factors taken out is prime
        while n % prime == 0:
            factors.append(prime)
            n //= prime
        candidate = prime + 1
    return tuple(factors) + ((n,) if n > 1 else ())


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, from its prime factorisation."""
    result = [1]
    for prime in sorted(set(_prime_factors(n))):
        power = _prime_factors(n).count(prime)
        result = [d * prime**e for d in result for e in range(power + 1)]
    return sorted(result)


def check_global_batch(gbs: int) -> int:
    if not 1 <= gbs <= MAX_GLOBAL_BATCH:
        raise ArgumentError("gbs", f"expected a global batch size from 1 to {MAX_GLOBAL_BATCH:,} samples (2^53: "
                                   f"sample and token counts stay exact in double precision), got {gbs}")
    return gbs


@dataclass(frozen=True)
class Inputs:
    model: Model
    cluster: Cluster
    profiles: dict[str, GpuProfile]
    gbs: int
    distributed_optimizer: bool = True
    overlap: bool = True  # Megatron's --overlap-grad-reduce, and --overlap-param-gather with the distributed optimizer
    recompute: tuple[str, ...] = RECOMPUTE_MODES  # the recompute modes to consider, lightest first
    sequence_parallel: bool = True  # on whenever tp > 1
    tp_comm_overlap: bool = True  # --tp-comm-overlap wherever Megatron runs it and it hides time
    # The placements' links and geometries built so far, by the node types and counts they are on (groups): what
    # several searches of one question share, as the memory headroom's two do (geometry ignores memory). Those
    # searches' clusters differ only in memory and in the node types kept, which is all the key holds.
    geometries: dict = field(default_factory=dict, compare=False, repr=False)
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES  # what selective recomputation reruns


# The most GPUs one plan spans: every placement's rank geometry (fasop.cost.communication) holds a node per rank,
# which takes about 0.5 GB of memory at this size; above the largest training clusters of 2026 (about 200,000).
MAX_PLAN_GPUS = 2**18


def prepare(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None,
            distributed_optimizer: bool = True, profiles: dict[str, GpuProfile] | None = None,
            overlap: bool = True, recompute: tuple[str, ...] = RECOMPUTE_MODES, sequence_parallel: bool = True,
            tp_comm_overlap: bool = True, geometries: dict | None = None,
            recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES) -> Inputs:
    """Checked inputs of one search; `profiles` (already loaded, e.g. for many compositions) skips the files;
    `geometries`, another search's of the same question (Inputs.geometries); `recompute_modules`, what its
    selective plans rerun."""
    gbs = check_global_batch(model.global_batch_size if gbs is None else gbs)
    if cluster.num_gpus > MAX_PLAN_GPUS:
        largest = max(cluster.node_types.values(), key=lambda t: t.count * t.gpus_per_node)
        raise InputError(f"{cluster.file or cluster.name}: node_type.{largest.host or largest.name}.count",
                         f"expected at most {MAX_PLAN_GPUS:,} GPUs in all, the most a plan spans (fasop's limit; a "
                         f"placement's rank geometry takes memory in proportion), got {cluster.num_gpus:,}")
    check_param_gather(model, distributed_optimizer)
    modules = check_recompute_modules(model, recompute_modules)
    unknown = [mode for mode in recompute if mode not in RECOMPUTE_MODES]
    if unknown or not recompute:
        raise ArgumentError("recompute", f"expected one or more of {', '.join(RECOMPUTE_MODES)}, "
                                         f"got {','.join(recompute)!r}")
    gpus = sorted({t.gpu for t in cluster.node_types.values()})
    if profiles is None:  # the cluster's own [[gpu]] tables over the catalogue, as the command line reads them
        profiles = load_profiles(model, gpus, profiles_dir, specs=merged_specs(own=cluster.gpus))
    modes = tuple(mode for mode in RECOMPUTE_MODES if mode in recompute)  # lightest first, once each
    return Inputs(model, cluster, {g: profiles[g] for g in gpus}, gbs, distributed_optimizer, overlap, modes,
                  sequence_parallel, tp_comm_overlap, {} if geometries is None else geometries, modules)


def tensor_degrees(inputs: Inputs) -> list[int]:
    """Divisors of the GPUs per node (tensor parallelism stays inside a node) that split the attention heads
    and query groups evenly, as Megatron-LM requires, and are profiled for every GPU type."""
    profiled = [set(p.tensor_degrees) for p in inputs.profiles.values()]
    model = inputs.model
    return [t for t in divisors(inputs.cluster.gpus_per_node)
            if all(t in s for s in profiled) and model.num_attention_heads % t == 0 and model.num_query_groups % t == 0]


def max_stages(model: Model) -> int:
    # a stage may hold only the embedding or only the head (decoder and encoder models)
    return model.num_layers if model.is_encoder_decoder else model.num_layers + 2


def encoder_splits(model: Model, pp: int) -> list[int]:
    if not model.is_encoder_decoder or pp == 1:
        return [0]
    return [e for e in range(1, pp) if e <= model.encoder_num_layers and pp - e <= model.decoder_num_layers]


def _signature(geo: Geometry, experts: bool = False) -> tuple:
    """What the costs of a placement depend on, but its tied embedding's all-reduce (`experts`: what its expert
    groups add)."""
    if experts:
        return tuple(() if part is None else tuple(np.round(part, 18)) for part in (
            geo.alltoall_s_per_byte, geo.alltoall_latency_s, geo.expert_allreduce_s_per_byte,
            geo.expert_allreduce_latency_s))
    return (geo.stage_node_types, tuple(np.round(geo.boundary_s_per_byte, 18)),
            tuple(np.round(geo.dp_allreduce_s_per_byte, 18)), tuple(np.round(geo.boundary_latency_s, 15)),
            tuple(np.round(geo.dp_allreduce_latency_s, 15)),
            *(() if part is None else tuple(np.round(part, 18)) for part in (geo.ring_s_per_byte, geo.ring_latency_s)))


@dataclass(frozen=True)
class Group:
    """Plans sharing (tp, dp, pp, encoder split): one geometry per distinct placement, every micro-batch size."""

    config: Config  # its mbs is a placeholder; the lightest recompute mode
    geos: list[Geometry]
    mbs_values: list[int]
    exhaustive: bool
    oversized: int = 0  # micro-batch sizes left out: their output layer alone overflows every GPU
    variants: tuple[Config, ...] = ()  # config under each recompute mode to search, lightest first


class Degrees(NamedTuple):
    """A plan's parallel degrees but its pipeline's (world / (tp cp dp)): tensor, data, context, and for an MoE
    model's experts, expert and expert-tensor (ep 1, etp tp for a dense model: its expert grid is the dense one)."""

    tp: int
    dp: int
    cp: int = 1
    ep: int = 1
    etp: int = 0  # 0: tp


def degrees_of(config: Config) -> Degrees:
    return Degrees(config.tp, config.dp, config.cp, config.ep, config.expert_tp)


def plan_key(config: Config, placement: tuple[str, ...], mbs: int) -> tuple:
    """What tells one plan of a search from the others but its layers' partition and recomputation."""
    return (config.tp, config.dp, config.pp, placement, mbs, config.cp, config.ep, config.expert_tp)


def key_degrees(key: tuple) -> Degrees:
    """The degrees of a plan_key."""
    return Degrees(key[0], key[1], *key[5:])


# Context parallelism is searched where each rank keeps at least this many tokens of a sequence, as NVIDIA's
# published Megatron recipes run it (NeMo and Megatron-Bridge performance tables, dgxc-benchmarking: CP from
# 8K-token sequences at 2 ranks up, 4K tokens per rank or more): a documented subset of the plan space
# (docs/cost-model.md section 13); a plan file or --cp may give any degree Megatron-LM runs.
MIN_CONTEXT_TOKENS = 4096


def context_degrees(model: Model, ranks: int) -> list[int]:
    """The context-parallel degrees searched with `ranks` GPUs left per pipeline stage and data replica: 1, and
    divisors c with the sequence divisible by 2 c (Megatron-LM's rule: each rank holds two of 2 c chunks) and
    at least MIN_CONTEXT_TOKENS per rank, for models Megatron-LM runs context parallelism on (flash attention,
    one sequence)."""
    if context_error(model, 2) is not None:
        return [1]
    s = model.seq_length
    return [c for c in divisors(ranks) if c == 1 or (s % (2 * c) == 0 and s // c >= MIN_CONTEXT_TOKENS)]


def context_error(model: Model, cp: int) -> str | None:
    """Why `model` cannot run `cp`-way context parallelism, or None."""
    if cp == 1:
        return None
    if model.is_encoder_decoder:
        return "context parallelism needs a one-sequence model (Megatron-LM has it for GPT-style models)"
    if not model.flash_attention:
        return "context parallelism runs in Transformer Engine's fused attention: the model needs flash_attention"
    if model.seq_length % (2 * cp):
        return f"the sequence length {model.seq_length} must be divisible by 2 cp = {2 * cp} (Megatron-LM's rule)"
    return None


def expert_degrees(model: Model, tp: int, ranks: int) -> list[tuple[int, int]]:
    """(ep, etp) searched for a stage of `ranks` = tp cp dp GPUs: for a dense model (1, tp); for an MoE model
    every ep dividing the experts with etp either 1 (each expert whole, advised for fine-grained experts) or tp
    (Megatron-LM's default; not for experts with linear biases), etp ep dividing tp cp dp (the expert grid folds
    out of the dense one)."""
    if not model.is_moe:
        return [(1, tp)]
    etps = [1] if model.linear_bias else sorted({1, tp})  # Megatron-core: biased experts only with etp 1
    return [(ep, etp) for ep in divisors(model.num_experts) for etp in etps if ranks % (ep * etp) == 0]


def combinations(inputs: Inputs) -> list[Degrees]:
    """Every set of degrees whose pipeline degree uses all GPUs and whose data-parallel degree divides the batch."""
    model, world, gbs = inputs.model, inputs.cluster.num_gpus, inputs.gbs
    # context and expert parallelism are priced on the roofline: only where every GPU type has one
    priced = all(profile.prices_layouts for profile in inputs.profiles.values())
    combos = []
    for tp in tensor_degrees(inputs):
        if model.is_moe and tp > 1 and not inputs.sequence_parallel:
            continue  # Megatron-LM's MoE layers need sequence parallelism with tp > 1
        for cp in context_degrees(model, world // tp) if priced else [1]:
            for dp in divisors(world // (tp * cp)):
                if gbs % dp or world // (tp * cp * dp) > max_stages(model):
                    continue
                combos += [Degrees(tp, dp, cp, ep, etp) for ep, etp in expert_degrees(model, tp, tp * cp * dp)
                           if priced or ep == 1]
    # an MoE model's expert degrees multiply the combinations: those whose state cannot fit are not built (all of
    # them where none can, so that the search still finds the plan closest to fitting)
    fitting = [combo for combo in combos if state_fits(inputs, combo)] if model.is_moe else combos
    return fitting or combos


def state_fits(inputs: Inputs, degrees: Degrees) -> bool:
    """Whether the model state of a plan of these degrees may fit: its mean rank's (every parameter's weights,
    gradients and optimizer state over the pipeline's stages, each stage on as many ranks) within the mean usable
    memory of the cluster's GPUs. Every rank's state fits its own GPU in a plan that fits, and the sums of both
    over the ranks are the means times the GPUs, so a plan failing this fits nowhere: its placements are not
    built."""
    model, cluster = inputs.model, inputs.cluster
    tp, dp, cp, ep, etp = degrees
    pp = cluster.num_gpus // (tp * cp * dp)
    experts = sum(n * model.layer_expert_params(kind) for n, kind in zip(model.segment_layers, model.layer_kinds))
    dense = model.total_params() - experts
    sharded = inputs.distributed_optimizer
    state = (dense / tp * bytes_per_param(model, dp * cp, sharded)
             + experts / (etp * ep) * bytes_per_param(model, tp * cp * dp // (etp * ep), sharded)) / pp
    types = cluster.node_types.values()
    usable = sum(t.count * t.gpus_per_node * usable_gib(cluster, t.gpu_memory_gib) for t in types) / cluster.num_gpus
    return bool(state / GIB <= usable * (1 + 1e-9))


def micro_batch_sizes(inputs: Inputs, tp: int, dp: int, cp: int = 1) -> tuple[list[int], int]:
    """(sizes worth partitioning, how many sizes were left out). Every size divides the batch of one
    data-parallel replica; a size whose output-layer activations alone exceed the largest GPU's usable memory
    fits no stage (the last stage holds them, and memory only grows with the size), so it is counted out of
    memory without being built: their number grows with the divisors of the batch, not with the answer."""
    sizes = divisors(inputs.gbs // dp)
    sequence_parallel = inputs.sequence_parallel and sequence_parallel_on(tp)
    kept = [b for b in sizes if b == 1 or head_fits(inputs.model, inputs.cluster, tp, b, sequence_parallel, cp)]
    return kept, len(sizes) - len(kept)


def groups(inputs: Inputs, combos: list[Degrees], placement_limit: int = PLACEMENT_LIMIT) -> list[Group]:
    model, cluster = inputs.model, inputs.cluster
    result = []
    built = inputs.geometries.setdefault(tuple((name, t.count) for name, t in cluster.node_types.items()), {})
    links_of: dict[tuple[str, ...], Links] = built.setdefault("links", {})  # each placement's, once for every plan
    dense_of: dict[tuple, tuple] = built.setdefault("dense", {})  # _dense_geometries of each dense grid
    placements_of: dict[tuple, tuple] = built.setdefault("placements", {})  # placements() of each unit and limit
    stage_experts: dict = built.setdefault("experts", {})  # the expert groups' figures of a stage (with_experts)
    for tp, dp, cp, ep, etp in (Degrees(*combo) for combo in combos):  # (tp, dp) alone: a dense plan's
        pp = cluster.num_gpus // (tp * cp * dp)
        mbs_values, oversized = micro_batch_sizes(inputs, tp, dp, cp)
        sequence_parallel = inputs.sequence_parallel and sequence_parallel_on(tp)
        configs = [Config(tp, dp, pp, 1, inputs.gbs, split, inputs.distributed_optimizer,
                          overlap_grad_reduce=inputs.overlap,
                          overlap_param_gather=param_gather_overlaps(inputs.overlap, inputs.distributed_optimizer),
                          sequence_parallel=sequence_parallel,
                          tp_comm_overlap=tp_comm_overlap_on(inputs, tp, sequence_parallel, mbs_values, cp),
                          cp=cp, ep=ep, etp=etp, recompute_modules=inputs.recompute_modules)
                   for split in encoder_splits(model, pp)]
        grid = (tp, dp, cp, placement_limit)  # pp follows, and with it the encoder splits of the configs
        if grid not in dense_of:
            dense_of[grid] = _dense_geometries(inputs, links_of, placements_of, tp, dp, cp, pp, configs, placement_limit)
        geos, signatures, embedded, exhaustive = dense_of[grid]
        if model.is_moe:
            embedded = [[with_experts(geo, links_of[geo.placement], tp, ep, etp, stage_experts) for geo in per_split]
                        for per_split in embedded]
        for j, config in enumerate(configs):
            unique: dict[tuple, Geometry] = {}
            for signature, per_split in zip(signatures, embedded):
                geo = per_split[j]
                unique.setdefault(signature + _signature(geo, experts=True) + (
                    round(geo.embedding_allreduce_s_per_byte, 18), round(geo.embedding_allreduce_latency_s, 15)), geo)
            variants = tuple(with_recompute(config, mode) for mode in recompute_modes(inputs))
            result.append(Group(variants[0], list(unique.values()), mbs_values, exhaustive, oversized, variants))
    return result


def _dense_geometries(inputs: Inputs, links_of: dict[tuple[str, ...], Links], placements_of: dict[tuple, tuple],
                      tp: int, dp: int, cp: int, pp: int, configs: list[Config],
                      placement_limit: int) -> tuple[list, list, list, bool]:
    """(geometries, their signatures, each with the embedding groups of each encoder split, whether every
    placement was searched) of the placements of a plan's dense grid; `placements_of` keeps the placements of
    each placement unit, which many grids share."""
    cluster = inputs.cluster
    unit = (placement_unit(cluster.gpus_per_node, tp * cp * dp), placement_limit)
    if unit not in placements_of:
        placements_of[unit] = placements(cluster, tp * cp * dp, placement_limit)
    nodes, exhaustive = placements_of[unit]
    for placement in nodes:
        if placement not in links_of:
            links_of[placement] = Links(cluster, placement)
    geos = [geometry(cluster, placement, tp, dp, pp, cp, links=links_of[placement], keyed=inputs.model.is_moe)
            for placement in nodes]
    stage_sets = [embedding_stages(inputs.model, config) for config in configs]
    embedded = [with_embedding_groups(cluster, geo, stage_sets, links_of[geo.placement])
                for geo in geos]  # [placement][split]
    return geos, [_signature(geo) for geo in geos], embedded, exhaustive


def tp_comm_overlap_on(inputs: Inputs, tp: int, sequence_parallel: bool, mbs_values: list[int], cp: int = 1) -> bool:
    """Whether the search's plans at `tp` run --tp-comm-overlap: where asked, Megatron runs it on every GPU type of
    the cluster, and it hides time at every micro-batch size there (fasop.cost.tpoverlap.overlap_pays). Then it
    only shortens layers, so it is simply on rather than searched both ways."""
    model = inputs.model
    return (inputs.tp_comm_overlap and overlap_error(model, tp, sequence_parallel, tuple(inputs.profiles), cp) is None
            and overlap_pays(model, inputs.profiles, tp, tuple(mbs_values)))


def recompute_modes(inputs: Inputs) -> tuple[str, ...]:
    """The recompute modes worth searching, lightest first. With flash attention selective recomputation of the
    attention core alone keeps the same activations as none (the fused kernel stores no attention scores) and
    only adds the rerun of the kernel's forward, so it never wins and is left out."""
    if inputs.model.flash_attention and "none" in inputs.recompute and inputs.recompute_modules == DEFAULT_RECOMPUTE_MODULES:
        return tuple(mode for mode in inputs.recompute if mode != "selective")
    return inputs.recompute
