"""The search engine: every plan of the space (fasop.search.space) with its optimal layer partition, ranked;
sound lower bounds prune what cannot reach the best plans, and large clusters are searched in processes."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from fasop.cost.communication import Geometry
from fasop.cost.config import RECOMPUTE_MODES, Config
from fasop.cost.exact import ScheduleBatch
from fasop.cost.memory import usable_gib
from fasop.cost.price import add_training_run, price_per_hour_usd
from fasop.cost.problem import PartitionBatch
from fasop.cost.step import StageCosts, recompute_variants
from fasop.errors import InputError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile
from fasop.plans import Plan
from fasop.search.partition import admits, lower_bounds, optimal_partitions
from fasop.search.record import plan_rows
from fasop.search.space import PLACEMENT_LIMIT, Group, Inputs, combinations, groups, max_stages, prepare, tensor_degrees

VIRTUAL_STAGES = (1, 2)  # model chunks per pipeline rank the search tries (interleaved 1F1B beyond 1)
# deepest pipeline the search interleaves: the schedule of deeper ones costs more to build than it is likely to gain
INTERLEAVE_MAX_STAGES = 16
PARALLEL_NODES = 32  # clusters this large are searched with one process per core
PRUNE_CHUNK = 256  # partition problems solved between two updates of the pruning threshold
PRUNE_SLACK = 1e-9  # relative: pruning never skips a plan within rounding of the threshold


@contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """A search allocates millions of small objects that hold no cycles (plan records and their stage rows);
    Python's cyclic collector would scan the growing heap again and again (four times the time it takes to
    build the plans of a 1,024-GPU search). Reference counting frees them all the same."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def virtual_stage_options(model: Model, pp: int) -> tuple[int, ...]:
    """Virtual sizes to try: interleaving needs two stages or more, and fasop splits only decoder and encoder
    stacks into chunks (an encoder-decoder pipeline's layout has no encoder layers in Megatron-LM)."""
    return (1,) if not 2 <= pp <= INTERLEAVE_MAX_STAGES or model.is_encoder_decoder else VIRTUAL_STAGES


def memory_overshoot(costs: StageCosts, row: int, cluster: Cluster) -> float:
    """Smallest factor by which the GPUs' memory would have to grow for some partition of row `row` to fit."""
    one = costs.problem.take(np.array([row]))
    mem_fixed, mem_layer = costs.mem_fixed_gib[row], costs.mem_layer_gib[row]

    def fits(ratio: float) -> bool:
        room = usable_gib(cluster, ratio * costs.capacity_gib[row]) - mem_fixed
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


SORT_KEYS = {"time": "step_time_s", "cost": "cost_per_step_usd"}


@dataclass
class SearchResult:
    """The ranked plans (best first) and what the search saw on the way."""

    rows: list[dict]  # the plans as records while evaluating; search_plans ranks them into `plans`
    plans_evaluated: int  # (tp, dp, pp, mbs, placement) combinations, each with its best split and partition
    partitions_solved: int  # layer-partition problems solved (one per encoder/decoder split)
    out_of_memory: int  # plans for which no partition fits memory
    pruned: int = 0  # partition problems skipped because their lower bound cannot reach the kept plans
    dominated: int = 0  # partition problems skipped because a lighter recompute mode of the plan is never worse,
    # or their lower bound exceeds what another recompute mode, virtual size or split of the plan reached
    closest_memory_factor: float | None = None  # when nothing fits: how much more memory the closest plan needs
    closest_plan: Config | None = None
    plans: list[Plan] = field(default_factory=list)

    def merge(self, other: SearchResult) -> None:
        self.rows += other.rows
        self.plans_evaluated += other.plans_evaluated
        self.partitions_solved += other.partitions_solved
        self.out_of_memory += other.out_of_memory
        self.pruned += other.pruned
        self.dominated += other.dominated
        if other.closest_memory_factor is not None and (self.closest_memory_factor is None
                                                        or other.closest_memory_factor < self.closest_memory_factor):
            self.closest_memory_factor, self.closest_plan = other.closest_memory_factor, other.closest_plan


def _bounds(batch: PartitionBatch, dominated: np.ndarray) -> np.ndarray:
    """lower_bounds of the problems a lighter recompute mode does not dominate (the others are never solved)."""
    bound = np.full(len(batch), np.inf)
    rows = np.flatnonzero(~dominated)
    bound[rows] = lower_bounds(batch.take(rows))
    return bound


def _ranking_bound(bound: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Lower bounds times ranking weights; inf where no partition fits, also for a plan that costs nothing."""
    ranking_bound = np.full(len(bound), np.inf)
    fits = np.isfinite(bound)
    ranking_bound[fits] = bound[fits] * weight[fits]
    return ranking_bound


def _solve(batch: PartitionBatch, schedule: ScheduleBatch, bound: np.ndarray, keep: int | None, plan: np.ndarray,
           weight: np.ndarray, found: list[np.ndarray], dominated: np.ndarray):
    """(counts, exact step terms, solved mask, outdone mask) of a batch, most promising problems first: each problem's layers
    are partitioned for the closed form, and the partition is timed with the exact schedule. `dominated`
    problems (a lighter recompute mode of the same plan is never worse, or another recompute mode is solved
    apart) are not solved.

    With `keep`, a problem is skipped when its lower bound on the exact step time, times its ranking weight (1 to
    rank by time, the price per second to rank by cost), exceeds the keep-th best ranking value among the plans
    `found` (the best value so far of each plan, inf if none, one array per pipeline depth, this batch's last;
    several problems, the encoder splits of one encoder-decoder plan, share their `plan` and count once). The
    threshold tightens chunk by chunk as problems are solved. Whatever `keep`, a problem whose bound exceeds what
    another problem of its plan reached (a split, a recompute mode, a virtual size) is skipped: it cannot become the
    plan's (the outdone mask)."""
    counts = np.zeros(batch.lo.shape, dtype=int)
    terms: dict[str, np.ndarray] = {"step_time_s": np.full(len(batch), np.inf)}
    solved = np.zeros(len(batch), dtype=bool)
    outdone = np.zeros(len(batch), dtype=bool)
    ranking_bound = _ranking_bound(bound, weight)
    order = np.argsort(ranking_bound, kind="stable")
    order = order[~dominated[order]]
    step = PRUNE_CHUNK if keep or bound.any() else max(1, len(order))
    reached = found[-1]
    for start in range(0, len(order), step):
        threshold = np.inf
        if keep:
            values = np.concatenate(found)
            if np.isfinite(values).sum() >= keep:
                # the slack keeps plans whose bound ties the threshold up to rounding (bound, step time and the
                # ranking figures are computed along different paths)
                threshold = np.partition(values, keep - 1)[keep - 1] * (1 + PRUNE_SLACK)
        chunk = order[start:start + step]
        beaten = ranking_bound[chunk] > reached[plan[chunk]] * (1 + PRUNE_SLACK)  # by another split or mode
        outdone[chunk[beaten]] = True
        chunk = chunk[(ranking_bound[chunk] <= threshold) & ~beaten]
        if len(chunk):
            counts[chunk], value, _ = optimal_partitions(batch.take(chunk))
            solved[chunk] = True
            timed = chunk[np.isfinite(value)]
            for name, column in schedule.take(timed).step_terms(counts[timed]).items():
                if name not in terms:
                    terms[name] = np.full((len(batch),) + column.shape[1:], np.nan)
                terms[name][timed] = column
            np.minimum.at(reached, plan[timed], terms["step_time_s"][timed] * weight[timed])
    return counts, terms, solved, outdone


class _Entry(NamedTuple):
    """One recompute setting and virtual size of a (tp, dp, pp) plan: its stage costs on every encoder/decoder split,
    placement and micro-batch size (fasop.cost.step.recompute_variants)."""

    splits: list[Group]
    configs: list[Config]  # each split's
    costs: StageCosts
    split: np.ndarray  # the split of each row of costs
    split_start: np.ndarray  # the first row of each split
    order: tuple[int, int, int]  # (plan, virtual size, setting): where the search meets it


class _Candidate(NamedTuple):
    """The best partition problem of a plan, solved or not."""

    step_time_s: float  # inf when not solved or nothing fits
    config: Config
    geo: Geometry
    exhaustive: bool  # whether the plan's placements were all searched
    counts: np.ndarray  # layers per stage
    terms: dict[str, np.ndarray]  # the exact step terms of the problem's batch
    at: int  # the problem's row in its batch


def _plans(todo: list[Group]) -> list[list[Group]]:
    """The groups of `todo` plan by plan (tp, dp, pp): the encoder/decoder splits of a plan, which `groups` lists
    one after another."""
    plans: list[list[Group]] = []
    for group in todo:
        if plans and plans[-1][0].config.pp == group.config.pp and plans[-1][0].config.tp == group.config.tp:
            plans[-1].append(group)
        else:
            plans.append([group])
    return plans


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
    with _without_cyclic_gc():
        return _evaluate(inputs, combos, placement_limit, keep, progress, sort)


def _evaluate(inputs: Inputs, combos: list[tuple[int, int]], placement_limit: int, keep: int | None,
              progress: Callable[[int, int], None] | None, sort: str) -> SearchResult:
    model, cluster = inputs.model, inputs.cluster
    todo = groups(inputs, combos, placement_limit)
    buckets: dict[int, list[_Entry]] = {}  # by pipeline depth
    beaten_of: dict[int, list[np.ndarray]] = {}  # by pipeline depth: rows a lighter mode dominates
    items_of: dict[int, int] = {}
    dominated = 0
    for index, splits in enumerate(_plans(todo)):  # plans with the same number of stages are partitioned in one batch
        pp, k = splits[0].config.pp, len(splits[0].mbs_values)
        geos = [geo for group in splits for geo in group.geos]
        split_rows = [len(group.geos) * k for group in splits]
        split, split_start = np.repeat(np.arange(len(splits)), split_rows), np.cumsum([0] + split_rows)[:-1]
        for v in virtual_stage_options(model, pp):  # the best virtual size is the plan's
            settings = [[replace(c, virtual_stages=v) for c in (group.variants or (group.config,))] for group in splits]
            lighter: list[StageCosts] = []
            # placements where every lighter mode's memory binds for some micro-batch size: elsewhere the lightest
            # free of memory limits beats the heavier modes (as `dominates` finds), which are not partitioned
            binding = np.ones(len(geos), dtype=bool)
            variants = recompute_variants(model, cluster, inputs.profiles,
                                          [(group.geos, configs) for group, configs in zip(splits, settings)],
                                          splits[0].mbs_values)
            for setting, costs in enumerate(variants):
                configs = [configs[setting] for configs in settings]
                buckets.setdefault(pp, []).append(_Entry(splits, configs, costs, split, split_start, (index, v, setting)))
                beaten = ~np.repeat(binding, k)
                for light in lighter:
                    beaten |= light.problem.dominates(costs.problem)
                beaten_of.setdefault(pp, []).append(beaten)
                lighter.append(costs)
                binding &= costs.problem.memory_binds().reshape(len(geos), -1).any(-1)
                if not binding.any():  # the heavier modes are not even built
                    dominated += len(costs.mbs) * (len(settings[0]) - len(lighter))
                    break
        items_of[pp] = items_of.get(pp, 0) + len(geos)
    stacked = {pp: StageCosts.stack([entry.costs for entry in bucket]) for pp, bucket in buckets.items()}
    problems = {pp: costs.problem for pp, costs in stacked.items()}
    # bounds prune what cannot reach the kept plans, and heavier recompute modes that cannot beat a lighter one
    bounded = keep or len(inputs.recompute) > 1
    bounds = {pp: _bounds(batch, np.concatenate(beaten_of[pp])) if bounded else np.zeros(len(batch))
              for pp, batch in problems.items()}
    # encoder-decoder plans differing only in their encoder/decoder split compete: the best split is the plan's
    best: dict[tuple, _Candidate] = {}
    found: list[np.ndarray] = []  # by pipeline depth: the best ranking value found so far of each plan
    solved = pruned = done = 0
    skipped: set[tuple] = set()  # plans with a split that was pruned rather than found not to fit
    # the problems found not to fit, each split and mode: by pipeline depth, (bucket, entry and first row, rows)
    unfit: list[tuple] = []
    for pp in sorted(buckets, key=lambda pp: bounds[pp].min()):  # most promising first
        bucket, batch = buckets[pp], problems[pp]
        keys, weight = [], []
        for entry in bucket:
            config = entry.configs[0]
            for group in entry.splits:
                for geo in group.geos:
                    price_per_s = price_per_hour_usd(cluster, geo.placement) / 3600.0
                    for mbs in group.mbs_values:
                        keys.append((config.tp, config.dp, config.pp, geo.placement, int(mbs)))
                        weight.append(price_per_s if sort == "cost" else 1.0)
        ids: dict[tuple, int] = {}
        plan = np.array([ids.setdefault(key, len(ids)) for key in keys])
        found.append(np.full(len(ids), np.inf))
        beaten = np.concatenate(beaten_of[pp])
        mode_of_row = np.concatenate([np.full(len(entry.costs.mbs), RECOMPUTE_MODES.index(entry.configs[0].recompute))
                                      for entry in bucket])
        weights = np.array(weight)
        counts = np.zeros(batch.lo.shape, dtype=int)
        terms: dict[str, np.ndarray] = {}
        solved_here = np.zeros(len(batch), dtype=bool)
        for mode in np.unique(mode_of_row):  # lightest first: a heavier mode has to beat what they reached
            this = mode_of_row == mode
            beaten |= this & (_ranking_bound(bounds[pp], weights) > found[-1][plan] * (1 + PRUNE_SLACK))
            mode_counts, mode_terms, mode_solved, outdone = _solve(batch, stacked[pp].schedule, bounds[pp], keep, plan,
                                                                   weights, found, beaten | ~this)
            beaten |= outdone
            counts[mode_solved] = mode_counts[mode_solved]
            for name, column in mode_terms.items():
                merged = terms.setdefault(name, np.full(column.shape, np.inf if name == "step_time_s" else np.nan))
                merged[mode_solved] = column[mode_solved]
            solved_here |= mode_solved
        value = terms["step_time_s"]
        solved += int(solved_here.sum())
        pruned += len(batch) - int(solved_here.sum()) - int(beaten.sum())
        dominated += int(beaten.sum())
        sizes = [len(entry.costs.mbs) for entry in bucket]
        entry_of = np.repeat(np.arange(len(bucket)), sizes)  # the bucket entry of each row
        start = np.cumsum([0] + sizes)[:-1]  # the first row of each entry
        split = np.concatenate([entry.split for entry in bucket])
        # the best split, recompute mode and virtual size are the plan's; ties go to fewer encoder stages, then the
        # lighter mode, then fewer chunks
        encoder = np.concatenate([np.array([c.encoder_stages for c in entry.configs])[entry.split] for entry in bucket])
        virtual = np.array([entry.configs[0].virtual_stages for entry in bucket])[entry_of]
        order = np.lexsort((np.arange(len(batch)), virtual, mode_of_row, encoder, value, plan))
        for i in order[np.r_[True, plan[order][1:] != plan[order][:-1]]].tolist():
            entry, row = bucket[entry_of[i]], i - start[entry_of[i]]
            group = entry.splits[split[i]]
            geo = group.geos[(row - entry.split_start[split[i]]) // len(group.mbs_values)]
            best[keys[i]] = _Candidate(value[i], entry.configs[split[i]], geo, group.exhaustive, counts[i], terms, i)
        skipped.update(keys[i] for i in np.flatnonzero(~solved_here & ~beaten).tolist())
        unfit.append((bucket, entry_of, start, np.flatnonzero(np.isinf(value) & (solved_here | beaten))))
        done += items_of[pp]
        if progress:
            progress(done, sum(items_of.values()))
    rows = []
    fitting_of: dict[int, list[_Candidate]] = {}  # the best of each plan that fits, by pipeline depth
    for candidate in best.values():
        if np.isfinite(candidate.step_time_s):
            fitting_of.setdefault(candidate.config.pp, []).append(candidate)
    for fitting in fitting_of.values():  # recorded together
        plans = [(c.config, c.geo, c.exhaustive) for c in fitting]
        at = np.array([c.at for c in fitting])
        exact = {name: column[at] for name, column in fitting[0].terms.items()}
        rows += plan_rows(inputs, plans, stacked[fitting[0].config.pp].take(at), np.array([c.counts for c in fitting]),
                          exact)
    oom = sum(1 for key, candidate in best.items() if np.isinf(candidate.step_time_s) and key not in skipped)
    oversized = _oversized_plans(todo)
    result = SearchResult(rows, len(best) + oversized, solved, oom + oversized, pruned, dominated)
    if not rows:
        for bucket, entry_of, start, rows_unfit in unfit:
            problems_unfit = [(bucket[entry_of[i]], i - start[entry_of[i]]) for i in rows_unfit]
            # plan by plan, each split's virtual sizes, recompute settings and rows in turn
            problems_unfit.sort(key=lambda p: (p[0].order[0], p[0].split[p[1]], *p[0].order[1:], p[1]))
            for entry, row in problems_unfit:
                factor = memory_overshoot(entry.costs, row, cluster)
                if result.closest_memory_factor is None or factor < result.closest_memory_factor:
                    config = entry.configs[entry.split[row]]
                    result.closest_memory_factor, result.closest_plan = factor, replace(config, mbs=int(entry.costs.mbs[row]))
    return result


def search_plans(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None, *,
                 distributed_optimizer: bool = True, train_steps: int | None = None, train_tokens: float | None = None,
                 sort: str = "time", progress: Callable[[int, int], None] | None = None,
                 placement_limit: int = PLACEMENT_LIMIT, keep: int | None = None,
                 workers: int | None = None, profiles: dict[str, GpuProfile] | None = None,
                 overlap: bool = True, recompute: tuple[str, ...] = RECOMPUTE_MODES,
                 sequence_parallel: bool = True) -> SearchResult:
    """Every plan that fits memory, best first, as Plan records (fasop.plans, docs/formats.md).

    keep: evaluate only what can be among the best `keep` plans (sound lower bounds prune the rest).
    workers: processes to use; default: one per core for clusters of 32 nodes or more, else one (small
    searches finish before extra processes would have started).
    profiles: already loaded profiles (by GPU type) instead of reading profiles_dir.
    overlap: Megatron's --overlap-grad-reduce, and --overlap-param-gather with the distributed optimizer.
    recompute: the recompute modes to consider (each plan takes its best); sequence_parallel: on when tp > 1.
    """
    inputs = prepare(model, cluster, gbs, profiles_dir, distributed_optimizer, profiles, overlap, recompute,
                     sequence_parallel)
    if not tensor_degrees(inputs):
        profiled = {g: p.tensor_degrees for g, p in inputs.profiles.items()}
        raise InputError("profiles", f"no tensor degree dividing {cluster.gpus_per_node} GPUs per node, the attention "
                                     f"heads and the query groups is profiled for every GPU type {profiled}")
    combos = combinations(inputs)
    if not combos:
        raise InputError("--gbs", f"no plan can use a global batch size of {inputs.gbs} on {cluster.num_gpus} GPUs "
                                  "(data-parallel degree must divide it and pipeline stages must not exceed "
                                  f"{max_stages(model)})")
    if workers is None:
        workers = (os.cpu_count() or 1) if cluster.num_nodes >= PARALLEL_NODES else 1
    workers = max(1, min(workers, len(combos)))
    if workers == 1:
        result = evaluate(inputs, combos, placement_limit, keep, progress, sort)
    else:
        result = SearchResult([], 0, 0, 0)
        from concurrent.futures import ProcessPoolExecutor, as_completed  # only here: its import costs a small search

        shares = [combos[i::workers] for i in range(workers)]  # interleaved, so each gets all pipeline depths
        with ProcessPoolExecutor(workers) as pool:
            futures = [pool.submit(evaluate, inputs, share, placement_limit, keep, None, sort) for share in shares]
            for done, future in enumerate(as_completed(futures), start=1):
                result.merge(future.result())
                if progress:
                    progress(done, len(futures))
    rows = result.rows
    if result.closest_plan is not None and rows:
        result.closest_memory_factor = result.closest_plan = None
    for row in rows:
        add_training_run(row, model, train_steps, train_tokens)
    rows.sort(key=lambda r: (r[SORT_KEYS[sort]], r["step_time_s"], r["tp"], r["dp"], r["pp"], r["mbs"],
                             r["encoder_stages"], r["placement"]))
    if keep:
        rows = rows[:keep]
    result.rows = []
    with _without_cyclic_gc():
        result.plans = [Plan.trusted({"rank": rank, **row}) for rank, row in enumerate(rows, start=1)]
    return result


