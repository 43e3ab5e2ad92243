"""The search: every tensor, data and pipeline degree, micro-batch size, placement and (for encoder-decoder
models) encoder/decoder stage split, each with its optimal layer partition, ranked by step time."""

from __future__ import annotations

import math
import os
from functools import lru_cache
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from fasop.inputs.cluster import Cluster
from fasop.errors import InputError
from fasop.cost.step import GIB, Config, StageCosts, breakdown, embedding_stages, stage_costs
from fasop.inputs.model import Model
from fasop.search.partition import PartitionBatch, admits, lower_bounds, optimal_partitions
from fasop.search.placement import Geometry, geometry, placements, with_embedding_group
from fasop.inputs.profiles import GpuProfile, load_profiles

PLACEMENT_LIMIT = 100  # more distinct placements per (tp, dp, pp) than this: the type-block subset
PARALLEL_NODES = 32  # clusters this large are searched with one process per core
PRUNE_CHUNK = 256  # partition problems solved between two updates of the pruning threshold
PRUNE_SLACK = 1e-9  # relative: pruning never skips a plan within rounding of the threshold


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
        raise InputError("--gbs", f"expected a global batch size from 1 to {MAX_GLOBAL_BATCH:,} samples (2^53: "
                                  f"sample and token counts stay exact in double precision), got {gbs}")
    return gbs


@dataclass(frozen=True)
class Inputs:
    model: Model
    cluster: Cluster
    profiles: dict[str, GpuProfile]
    gbs: int
    distributed_optimizer: bool = True


def prepare(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None,
            distributed_optimizer: bool = True, profiles: dict[str, GpuProfile] | None = None) -> Inputs:
    """Checked inputs of one search; `profiles` (already loaded, e.g. for many compositions) skips the files."""
    gbs = check_global_batch(model.global_batch_size if gbs is None else gbs)
    gpus = sorted({t.gpu for t in cluster.node_types.values()})
    if profiles is None:
        profiles = load_profiles(model, gpus, profiles_dir)
    return Inputs(model, cluster, {g: profiles[g] for g in gpus}, gbs, distributed_optimizer)


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
    return (geo.stage_node_types, tuple(np.round(geo.boundary_s_per_byte, 18)),
            tuple(np.round(geo.dp_allreduce_s_per_byte, 18)), round(geo.embedding_allreduce_s_per_byte, 18))


@dataclass(frozen=True)
class Group:
    """Plans sharing (tp, dp, pp, encoder split): one geometry per distinct placement, every micro-batch size."""

    config: Config  # its mbs is a placeholder
    geos: list[Geometry]
    mbs_values: list[int]
    exhaustive: bool
    oversized: int = 0  # micro-batch sizes left out: their output layer alone overflows every GPU


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
    model, cluster = inputs.model, inputs.cluster
    usable_gib = max(t.gpu_memory_gib for t in cluster.node_types.values()) / cluster.memory_margin
    head_gib = model.head_activation_bytes(1, tp) / GIB
    sizes = divisors(inputs.gbs // dp)
    kept = [b for b in sizes if b == 1 or b * head_gib <= usable_gib * (1 + 1e-9)]
    return kept, len(sizes) - len(kept)


def groups(inputs: Inputs, combos: list[tuple[int, int]], placement_limit: int = PLACEMENT_LIMIT) -> list[Group]:
    model, cluster = inputs.model, inputs.cluster
    result = []
    for tp, dp in combos:
        pp = cluster.num_gpus // (tp * dp)
        mbs_values, oversized = micro_batch_sizes(inputs, tp, dp)
        nodes, exhaustive = placements(cluster, tp * dp, placement_limit)
        geos = [geometry(cluster, placement, tp, dp, pp) for placement in nodes]
        for split in encoder_splits(model, pp):
            config = Config(tp, dp, pp, 1, inputs.gbs, split, inputs.distributed_optimizer)
            emb = embedding_stages(model, config)
            unique: dict[tuple, Geometry] = {}
            for geo in geos:
                geo = with_embedding_group(cluster, geo, emb)
                unique.setdefault(_signature(geo), geo)
            result.append(Group(config, list(unique.values()), mbs_values, exhaustive, oversized))
    return result


def plan_rows(inputs: Inputs, config: Config, geo: Geometry, costs: StageCosts, counts: np.ndarray,
              keep: np.ndarray, exhaustive: bool) -> list[dict]:
    """One row per kept micro-batch size of `costs`, with the layer counts `counts` (K, pp)."""
    model, cluster = inputs.model, inputs.cluster
    terms = breakdown(costs, counts)
    layers = (counts + costs.fixed_layers).astype(int)
    price = sum(cluster.node_types[n].price_per_hour_usd for n in geo.placement)
    load = terms["stage_memory_gib"] / terms["stage_capacity_gib"]
    rows = []
    for k in np.flatnonzero(keep):
        worst = int(np.argmax(load[k]))
        step = float(terms["step_time_s"][k])
        mbs = int(costs.mbs[k])
        columns = zip(range(config.pp), costs.gpu, geo.stage_nodes, layers[k].tolist(), terms["stage_compute_s"][k].tolist(),
                      terms["stage_p2p_s"][k].tolist(), terms["stage_allreduce_s"][k].tolist(),
                      terms["stage_memory_gib"][k].tolist(), terms["stage_capacity_gib"][k].tolist())
        stages = [
            {"stage": s, "gpu": gpu, "nodes": list(nodes), "layers": n, "compute_s": compute, "p2p_s": p2p,
             "dp_allreduce_s": allreduce, "memory_gib": memory, "memory_capacity_gib": capacity}
            for s, gpu, nodes, n, compute, p2p, allreduce, memory, capacity in columns
        ]
        rows.append({
            "model": model.name, "model_file": model.file, "cluster": cluster.name, "cluster_file": cluster.file,
            "gbs": config.gbs, "mbs": mbs, "tp": config.tp, "dp": config.dp, "pp": config.pp,
            "num_microbatches": config.gbs // (config.dp * mbs),
            "placement": list(geo.placement), "layers_per_stage": layers[k].tolist(),
            "encoder_stages": config.encoder_stages, "distributed_optimizer": config.distributed_optimizer,
            "step_time_s": step,
            "throughput_samples_per_s": config.gbs / step,
            "tokens_per_s": config.gbs * model.seq_length / step,
            "pipeline_time_s": float(terms["pipeline_time_s"][k]), "bubble_s": float(terms["bubble_s"][k]),
            "p2p_s": float(terms["p2p_s"][k]), "dp_allreduce_s": float(terms["dp_allreduce_s"][k]),
            "embedding_allreduce_s": float(terms["embedding_allreduce_s"][k]),
            "peak_memory_gib": float(terms["stage_memory_gib"][k, worst]),
            "memory_capacity_gib": float(terms["stage_capacity_gib"][k, worst]),
            "cost_per_hour_usd": price, "cost_per_step_usd": price * step / 3600.0,
            "placement_search": "exhaustive" if exhaustive else "type-blocks",
            "stages": stages,
        })
    return rows


def memory_overshoot(costs: StageCosts, row: int, margin: float) -> float:
    """Smallest factor by which the GPUs' memory would have to grow for some partition of row `row` to fit."""
    one = costs.problem.take(np.array([row]))
    usable = costs.capacity_gib / margin
    mem_fixed, mem_layer = costs.mem_fixed_gib[row], costs.mem_layer_gib[row]

    def fits(ratio: float) -> bool:
        room = ratio * usable - mem_fixed
        if (room < -1e-12).any():
            return False
        with np.errstate(divide="ignore"):
            hi = np.floor(room / np.where(mem_layer > 0, mem_layer, np.inf) + 1e-12)
        return bool(admits(one, np.minimum(hi, 1e9)[None, :])[0])

    low, high = 0.0, 1.0
    while not fits(high):
        high *= 2
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def add_training_run(row: dict, model: Model, train_steps: int | None, train_tokens: float | None) -> None:
    """Steps, hours and dollars of the whole run, from a step count or a token count."""
    if train_steps is None and train_tokens is None:
        return
    steps = train_steps if train_steps is not None else math.ceil(train_tokens / (row["gbs"] * model.seq_length))
    row["train_steps"] = int(steps)
    row["train_hours"] = row["step_time_s"] * steps / 3600.0
    row["train_cost_usd"] = row["cost_per_step_usd"] * steps


SORT_KEYS = {"time": "step_time_s", "cost": "cost_per_step_usd"}


@dataclass
class SearchResult:
    """The ranked plans (best first) and what the search saw on the way."""

    plans: list[dict]
    plans_evaluated: int  # (tp, dp, pp, mbs, placement) combinations, each with its best split and partition
    partitions_solved: int  # layer-partition problems solved (one per encoder/decoder split)
    out_of_memory: int  # plans for which no partition fits memory
    pruned: int = 0  # partition problems skipped because their lower bound cannot reach the kept plans
    closest_memory_factor: float | None = None  # when nothing fits: how much more memory the closest plan needs
    closest_plan: Config | None = None

    def merge(self, other: "SearchResult") -> None:
        self.plans += other.plans
        self.plans_evaluated += other.plans_evaluated
        self.partitions_solved += other.partitions_solved
        self.out_of_memory += other.out_of_memory
        self.pruned += other.pruned
        if other.closest_plan is not None and (self.closest_plan is None
                                               or other.closest_memory_factor < self.closest_memory_factor):
            self.closest_memory_factor, self.closest_plan = other.closest_memory_factor, other.closest_plan


def _solve(batch: PartitionBatch, bound: np.ndarray, keep: int | None, keys: list[tuple], weight: np.ndarray,
           found: dict[tuple, float]):
    """(counts, step times, solved mask) of a batch, most promising problems first.

    With `keep`, a problem is skipped when its lower bound, times its ranking weight (1 to rank by time, the
    price per second to rank by cost), exceeds the keep-th best ranking value among the plans in `found`
    (plan key -> its best value so far; several problems, the encoder splits of one encoder-decoder plan, can
    share a key and count once). The threshold tightens chunk by chunk as problems are solved."""
    counts = np.zeros(batch.lo.shape, dtype=int)
    value = np.full(len(batch), np.inf)
    solved = np.zeros(len(batch), dtype=bool)
    ranking_bound = bound * weight
    order = np.argsort(ranking_bound, kind="stable")
    step = PRUNE_CHUNK if keep else len(order)
    for start in range(0, len(order), step):
        best = sorted(found.values())
        # the slack keeps plans whose bound ties the threshold up to rounding (bound, step time and the
        # ranking figures are computed along different paths)
        threshold = best[keep - 1] * (1 + PRUNE_SLACK) if keep and len(best) >= keep else np.inf
        chunk = order[start:start + step]
        chunk = chunk[ranking_bound[chunk] <= threshold]
        if len(chunk):
            counts[chunk], value[chunk], _ = optimal_partitions(batch.take(chunk))
            solved[chunk] = True
            for i in chunk[np.isfinite(value[chunk])]:
                found[keys[i]] = min(found.get(keys[i], np.inf), float(value[i] * weight[i]))
    return counts, value, solved


def _oversized_plans(todo: list[Group]) -> int:
    """Plans (tp, dp, pp, placement, micro-batch size) whose micro-batch size `groups` left out."""
    placements_of: dict[tuple, set] = {}
    oversized: dict[tuple, int] = {}
    for group in todo:
        combo = (group.config.tp, group.config.dp)
        placements_of.setdefault(combo, set()).update(geo.placement for geo in group.geos)
        oversized[combo] = group.oversized
    return sum(len(placements_of[combo]) * n for combo, n in oversized.items())


def evaluate(inputs: Inputs, combos: list[tuple[int, int]], placement_limit: int = PLACEMENT_LIMIT,
             keep: int | None = None, progress: Callable[[int, int], None] | None = None,
             sort: str = "time") -> SearchResult:
    """Plans of the given (tp, dp) combinations, unranked. With `keep`, partition problems whose lower bound
    cannot reach the keep-th best plan by `sort` found so far are skipped (they cannot be among the best)."""
    model, cluster = inputs.model, inputs.cluster
    todo = groups(inputs, combos, placement_limit)
    items = [(group, geo) for group in todo for geo in group.geos]
    buckets: dict[int, list] = {}
    for group, geo in items:  # plans with the same number of stages are partitioned in one batch
        costs = stage_costs(model, cluster, inputs.profiles, geo, group.config, group.mbs_values)
        buckets.setdefault(group.config.pp, []).append((group, geo, costs))
    problems = {pp: PartitionBatch.stack([c.problem for _, _, c in bucket]) for pp, bucket in buckets.items()}
    bounds = {pp: lower_bounds(batch) if keep else np.zeros(len(batch)) for pp, batch in problems.items()}
    # encoder-decoder plans differing only in their encoder/decoder split compete: the best split is the plan's
    best: dict[tuple, tuple] = {}
    found: dict[tuple, float] = {}  # best ranking value found so far of each plan (for the pruning threshold)
    solved = pruned = done = 0
    skipped: set[tuple] = set()  # plans with a split that was pruned rather than found not to fit
    for pp in sorted(buckets, key=lambda pp: bounds[pp].min()):  # most promising first
        bucket, batch = buckets[pp], problems[pp]
        keys, weight = [], []
        for group, geo, costs in bucket:
            price_per_s = sum(cluster.node_types[n].price_per_hour_usd for n in geo.placement) / 3600.0
            for mbs in costs.mbs:
                keys.append((group.config.tp, group.config.dp, group.config.pp, geo.placement, int(mbs)))
                weight.append(price_per_s if sort == "cost" else 1.0)
        counts, value, solved_here = _solve(batch, bounds[pp], keep, keys, np.array(weight), found)
        solved += int(solved_here.sum())
        pruned += len(batch) - int(solved_here.sum())
        at = 0
        for group, geo, costs in bucket:
            for row in range(len(costs.mbs)):
                key = keys[at + row]
                entry = (value[at + row], group.config.encoder_stages, group, geo, costs, row, counts[at + row])
                if not solved_here[at + row]:
                    skipped.add(key)
                if key not in best or entry[:2] < best[key][:2]:
                    best[key] = entry
            at += len(costs.mbs)
        done += len(bucket)
        if progress:
            progress(done, len(items))
    rows = []
    for value, _, group, geo, costs, row, counts in best.values():
        if np.isfinite(value):
            chosen = np.zeros(len(costs.mbs), dtype=bool)
            chosen[row] = True
            rows += plan_rows(inputs, group.config, geo, costs, np.broadcast_to(counts, costs.problem.lo.shape), chosen,
                              group.exhaustive)
    oom = sum(1 for key, entry in best.items() if np.isinf(entry[0]) and key not in skipped)
    oversized = _oversized_plans(todo)
    result = SearchResult(rows, len(best) + oversized, solved, oom + oversized, pruned)
    if not rows:
        for value, _, group, geo, costs, row, counts in best.values():
            factor = memory_overshoot(costs, row, cluster.memory_margin)
            if result.closest_plan is None or factor < result.closest_memory_factor:
                result.closest_memory_factor, result.closest_plan = factor, replace(group.config, mbs=int(costs.mbs[row]))
    return result


def search_plans(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None, *,
                 distributed_optimizer: bool = True, train_steps: int | None = None, train_tokens: float | None = None,
                 sort: str = "time", progress: Callable[[int, int], None] | None = None,
                 placement_limit: int = PLACEMENT_LIMIT, keep: int | None = None,
                 workers: int | None = None, profiles: dict[str, GpuProfile] | None = None) -> SearchResult:
    """Every plan that fits memory, best first, as plain records (see docs/formats.md for the keys).

    keep: evaluate only what can be among the best `keep` plans (sound lower bounds prune the rest).
    workers: processes to use; default: one per core for clusters of 32 nodes or more, else one (small
    searches finish before extra processes would have started).
    profiles: already loaded profiles (by GPU type) instead of reading profiles_dir.
    """
    inputs = prepare(model, cluster, gbs, profiles_dir, distributed_optimizer, profiles)
    if not tensor_degrees(inputs):
        profiled = {g: p.tensor_degrees for g, p in inputs.profiles.items()}
        raise InputError("profiles", f"no tensor degree dividing {cluster.gpus_per_node} GPUs per node, the attention "
                                     f"heads and the query groups is profiled for every GPU type {profiled}")
    combos = combinations(inputs)
    if not combos:
        raise InputError("--gbs", f"no plan can use a global batch size of {inputs.gbs} on {cluster.num_gpus} GPUs "
                                  f"(data-parallel degree must divide it and pipeline stages must not exceed {max_stages(model)})")
    if workers is None:
        workers = (os.cpu_count() or 1) if cluster.num_nodes >= PARALLEL_NODES else 1
    workers = max(1, min(workers, len(combos)))
    if workers == 1:
        result = evaluate(inputs, combos, placement_limit, keep, progress, sort)
    else:
        result = SearchResult([], 0, 0, 0)
        shares = [combos[i::workers] for i in range(workers)]  # interleaved, so each gets all pipeline depths
        with ProcessPoolExecutor(workers) as pool:
            futures = [pool.submit(evaluate, inputs, share, placement_limit, keep, None, sort) for share in shares]
            for done, future in enumerate(as_completed(futures), start=1):
                result.merge(future.result())
                if progress:
                    progress(done, len(futures))
    rows = result.plans
    if result.closest_plan is not None and rows:
        result.closest_memory_factor = result.closest_plan = None
    for row in rows:
        add_training_run(row, model, train_steps, train_tokens)
    rows.sort(key=lambda r: (r[SORT_KEYS[sort]], r["step_time_s"], r["tp"], r["dp"], r["pp"], r["mbs"],
                             r["encoder_stages"], r["placement"]))
    if keep:
        rows = rows[:keep]
    result.plans = [{"rank": rank, **row} for rank, row in enumerate(rows, start=1)]
    return result


def search(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None, **options):
    """Every plan that fits memory as a pandas DataFrame, best first, one row per plan with every cost term.

    Options are those of `search_plans`; `frame.attrs` holds plans_evaluated, partitions_solved,
    out_of_memory, pruned and, when nothing fits, closest_memory_factor and closest_plan.
    """
    import pandas as pd  # only the Python API needs pandas; the command line starts faster without it

    result = search_plans(model, cluster, gbs, profiles_dir, **options)
    frame = pd.DataFrame(result.plans)
    frame.attrs.update(plans_evaluated=result.plans_evaluated, partitions_solved=result.partitions_solved,
                       out_of_memory=result.out_of_memory, pruned=result.pruned)
    if result.closest_plan is not None:
        frame.attrs.update(closest_memory_factor=result.closest_memory_factor, closest_plan=result.closest_plan)
    return frame


def estimate(model: Model, cluster: Cluster, *, tp: int, dp: int, pp: int, mbs: int, placement: list[str],
             layers: list[int], gbs: int | None = None, profiles_dir: str | None = None,
             distributed_optimizer: bool = True, profiles: dict[str, GpuProfile] | None = None) -> dict:
    """The full breakdown of one explicit plan; `layers` lists transformer layers per stage; `profiles`: already
    loaded profiles (by GPU type) instead of reading profiles_dir."""
    used = {name: placement.count(name) for name in placement}
    for name, count in used.items():
        if name not in cluster.node_types:
            raise InputError("--placement", f"unknown node type {name!r} (cluster has {', '.join(cluster.node_types)})")
        if count > cluster.node_types[name].count:
            raise InputError("--placement", f"{count} nodes of type {name} but the cluster has {cluster.node_types[name].count}")
    sub = cluster.with_counts(used)
    inputs = prepare(model, sub, gbs, profiles_dir, distributed_optimizer, profiles)
    gpn = cluster.gpus_per_node
    if gpn % tp or tp not in tensor_degrees(inputs):
        raise InputError("--tp", f"expected a divisor of {gpn} GPUs per node that divides the attention heads and "
                                 f"query groups and that every GPU type's profile has, got {tp}")
    if tp * dp * pp != len(placement) * gpn:
        raise InputError("--placement", f"tp*dp*pp = {tp * dp * pp} GPUs but the placement's {len(placement)} nodes hold {len(placement) * gpn}")
    if inputs.gbs % (dp * mbs):
        raise InputError("--mbs", f"dp * mbs = {dp * mbs} must divide the global batch size {inputs.gbs}")
    if len(layers) != pp or sum(layers) != model.num_layers:
        raise InputError("--layers", f"expected {pp} stage counts summing to {model.num_layers} layers, got {','.join(map(str, layers))}")
    split = 0
    if model.is_encoder_decoder and pp > 1:
        prefix = np.cumsum(layers)
        if model.encoder_num_layers not in prefix[:-1]:
            raise InputError("--layers", f"no stage boundary falls after the {model.encoder_num_layers} encoder layers")
        split = int(np.searchsorted(prefix, model.encoder_num_layers)) + 1
    config = Config(tp, dp, pp, mbs, inputs.gbs, split, distributed_optimizer)
    geo = with_embedding_group(sub, geometry(sub, tuple(placement), tp, dp, pp), embedding_stages(model, config))
    costs = stage_costs(model, sub, inputs.profiles, geo, config, [mbs])
    counts = np.array(layers) - costs.fixed_layers
    if (counts < costs.problem.lo[0]).any():
        raise InputError("--layers", "every stage needs at least one layer (the first may hold only the embedding, the last only the head)")
    row = plan_rows(inputs, config, geo, costs, counts[None, :], np.array([True]), True)[0]
    usable = np.array([s["memory_capacity_gib"] for s in row["stages"]]) / cluster.memory_margin
    row["fits_memory"] = bool(all(s["memory_gib"] <= u for s, u in zip(row["stages"], usable)))
    return row
