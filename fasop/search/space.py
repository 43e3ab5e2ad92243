"""The plan space: global batch sizes, tensor, data and pipeline degrees, micro-batch sizes, encoder/decoder
stage splits, and the groups of plans that share all but their placement and micro-batch size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fasop.cost.communication import Geometry, geometry, with_embedding_groups
from fasop.cost.config import (
    RECOMPUTE_MODES,
    Config,
    embedding_stages,
    param_gather_overlaps,
    sequence_parallel_on,
    with_recompute,
)
from fasop.cost.fp8 import check_param_gather
from fasop.cost.memory import head_fits
from fasop.cost.tpoverlap import overlap_error, overlap_pays
from fasop.errors import ArgumentError, InputError
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile, load_profiles
from fasop.search.placement import placements

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


# The most GPUs one plan spans: every placement's rank geometry (fasop.cost.communication) holds a node per rank,
# which takes about 0.5 GB of memory at this size; above the largest training clusters of 2026 (about 200,000).
MAX_PLAN_GPUS = 2**18


def prepare(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None,
            distributed_optimizer: bool = True, profiles: dict[str, GpuProfile] | None = None,
            overlap: bool = True, recompute: tuple[str, ...] = RECOMPUTE_MODES, sequence_parallel: bool = True,
            tp_comm_overlap: bool = True) -> Inputs:
    """Checked inputs of one search; `profiles` (already loaded, e.g. for many compositions) skips the files."""
    gbs = check_global_batch(model.global_batch_size if gbs is None else gbs)
    if cluster.num_gpus > MAX_PLAN_GPUS:
        raise InputError("cluster", f"{cluster.num_gpus:,} GPUs: a plan spans at most {MAX_PLAN_GPUS:,} "
                                    "(fasop's limit; a placement's rank geometry takes memory in proportion)")
    check_param_gather(model, distributed_optimizer)
    unknown = [mode for mode in recompute if mode not in RECOMPUTE_MODES]
    if unknown or not recompute:
        raise ArgumentError("recompute", f"expected one or more of {', '.join(RECOMPUTE_MODES)}, "
                                         f"got {','.join(recompute)!r}")
    gpus = sorted({t.gpu for t in cluster.node_types.values()})
    if profiles is None:  # the cluster's own [[gpu]] tables over the catalogue, as the command line reads them
        profiles = load_profiles(model, gpus, profiles_dir, specs=merged_specs(own=cluster.gpus))
    modes = tuple(mode for mode in RECOMPUTE_MODES if mode in recompute)  # lightest first, once each
    return Inputs(model, cluster, {g: profiles[g] for g in gpus}, gbs, distributed_optimizer, overlap, modes,
                  sequence_parallel, tp_comm_overlap)


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


def _signature(geo: Geometry) -> tuple:
    """What the costs of a placement depend on, but its tied embedding's all-reduce."""
    return (geo.stage_node_types, tuple(np.round(geo.boundary_s_per_byte, 18)),
            tuple(np.round(geo.dp_allreduce_s_per_byte, 18)), tuple(np.round(geo.boundary_latency_s, 15)),
            tuple(np.round(geo.dp_allreduce_latency_s, 15)))


@dataclass(frozen=True)
class Group:
    """Plans sharing (tp, dp, pp, encoder split): one geometry per distinct placement, every micro-batch size."""

    config: Config  # its mbs is a placeholder; the lightest recompute mode
    geos: list[Geometry]
    mbs_values: list[int]
    exhaustive: bool
    oversized: int = 0  # micro-batch sizes left out: their output layer alone overflows every GPU
    variants: tuple[Config, ...] = ()  # config under each recompute mode to search, lightest first


def combinations(inputs: Inputs) -> list[tuple[int, int]]:
    """Every (tp, dp) whose pipeline degree uses all GPUs and whose data-parallel degree divides the batch."""
    model, world, gbs = inputs.model, inputs.cluster.num_gpus, inputs.gbs
    return [(tp, dp) for tp in tensor_degrees(inputs) for dp in divisors(world // tp)
            if gbs % dp == 0 and world // (tp * dp) <= max_stages(model)]


def micro_batch_sizes(inputs: Inputs, tp: int, dp: int) -> tuple[list[int], int]:
    """(sizes worth partitioning, how many sizes were left out). Every size divides the batch of one
    data-parallel replica; a size whose output-layer activations alone exceed the largest GPU's usable memory
    fits no stage (the last stage holds them, and memory only grows with the size), so it is counted out of
    memory without being built: their number grows with the divisors of the batch, not with the answer."""
    sizes = divisors(inputs.gbs // dp)
    sequence_parallel = inputs.sequence_parallel and sequence_parallel_on(tp)
    kept = [b for b in sizes if b == 1 or head_fits(inputs.model, inputs.cluster, tp, b, sequence_parallel)]
    return kept, len(sizes) - len(kept)


def groups(inputs: Inputs, combos: list[tuple[int, int]], placement_limit: int = PLACEMENT_LIMIT) -> list[Group]:
    model, cluster = inputs.model, inputs.cluster
    result = []
    for tp, dp in combos:
        pp = cluster.num_gpus // (tp * dp)
        mbs_values, oversized = micro_batch_sizes(inputs, tp, dp)
        nodes, exhaustive = placements(cluster, tp * dp, placement_limit)
        geos = [geometry(cluster, placement, tp, dp, pp) for placement in nodes]
        signatures = [_signature(geo) for geo in geos]
        sequence_parallel = inputs.sequence_parallel and sequence_parallel_on(tp)
        configs = [Config(tp, dp, pp, 1, inputs.gbs, split, inputs.distributed_optimizer,
                          overlap_grad_reduce=inputs.overlap,
                          overlap_param_gather=param_gather_overlaps(inputs.overlap, inputs.distributed_optimizer),
                          sequence_parallel=sequence_parallel,
                          tp_comm_overlap=tp_comm_overlap_on(inputs, tp, sequence_parallel, mbs_values))
                   for split in encoder_splits(model, pp)]
        stage_sets = [embedding_stages(model, config) for config in configs]
        embedded = [with_embedding_groups(cluster, geo, stage_sets) for geo in geos]  # [placement][split]
        for j, config in enumerate(configs):
            unique: dict[tuple, Geometry] = {}
            for signature, per_split in zip(signatures, embedded):
                geo = per_split[j]
                unique.setdefault(signature + (round(geo.embedding_allreduce_s_per_byte, 18),
                                               round(geo.embedding_allreduce_latency_s, 15)), geo)
            variants = tuple(with_recompute(config, mode) for mode in recompute_modes(inputs))
            result.append(Group(variants[0], list(unique.values()), mbs_values, exhaustive, oversized, variants))
    return result


def tp_comm_overlap_on(inputs: Inputs, tp: int, sequence_parallel: bool, mbs_values: list[int]) -> bool:
    """Whether the search's plans at `tp` run --tp-comm-overlap: where asked, Megatron runs it on every GPU type of
    the cluster, and it hides time at every micro-batch size there (fasop.cost.tpoverlap.overlap_pays). Then it
    only shortens layers, so it is simply on rather than searched both ways."""
    model = inputs.model
    return (inputs.tp_comm_overlap and overlap_error(model, tp, sequence_parallel, tuple(inputs.profiles)) is None
            and overlap_pays(model, inputs.profiles, tp, tuple(mbs_values)))


def recompute_modes(inputs: Inputs) -> tuple[str, ...]:
    """The recompute modes worth searching, lightest first. With flash attention selective recomputation keeps
    the same activations as none (the fused kernel stores no attention scores) and only adds the rerun of the
    kernel's forward, so it never wins and is left out."""
    if inputs.model.flash_attention and "none" in inputs.recompute:
        return tuple(mode for mode in inputs.recompute if mode != "selective")
    return inputs.recompute
