"""The search engine: every plan of the space (fasop.search.space) with its optimal layer partition, ranked;
sound lower bounds prune what cannot reach the best plans, and large clusters are searched in processes."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

import numpy as np

from fasop.cost.config import Config
from fasop.cost.exact import ScheduleBatch
from fasop.cost.price import add_training_run, price_per_hour_usd
from fasop.cost.problem import PartitionBatch
from fasop.cost.step import StageCosts, stage_costs
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


def virtual_stage_options(model: Model, pp: int) -> tuple[int, ...]:
    """Virtual sizes to try: interleaving needs two stages or more, and fasop splits only decoder and encoder
    stacks into chunks (an encoder-decoder pipeline's layout has no encoder layers in Megatron-LM)."""
    return (1,) if not 2 <= pp <= INTERLEAVE_MAX_STAGES or model.is_encoder_decoder else VIRTUAL_STAGES


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


SORT_KEYS = {"time": "step_time_s", "cost": "cost_per_step_usd"}


@dataclass
class SearchResult:
    """The ranked plans (best first) and what the search saw on the way."""

    rows: list[dict]  # the plans as records while evaluating; search_plans ranks them into `plans`
    plans_evaluated: int  # (tp, dp, pp, mbs, placement) combinations, each with its best split and partition
    partitions_solved: int  # layer-partition problems solved (one per encoder/decoder split)
    out_of_memory: int  # plans for which no partition fits memory
    pruned: int = 0  # partition problems skipped because their lower bound cannot reach the kept plans
    closest_memory_factor: float | None = None  # when nothing fits: how much more memory the closest plan needs
    closest_plan: Config | None = None
    plans: list[Plan] = field(default_factory=list)

    def merge(self, other: SearchResult) -> None:
        self.rows += other.rows
        self.plans_evaluated += other.plans_evaluated
        self.partitions_solved += other.partitions_solved
        self.out_of_memory += other.out_of_memory
        self.pruned += other.pruned
        if other.closest_memory_factor is not None and (self.closest_memory_factor is None
                                                        or other.closest_memory_factor < self.closest_memory_factor):
            self.closest_memory_factor, self.closest_plan = other.closest_memory_factor, other.closest_plan


def _solve(batch: PartitionBatch, schedule: ScheduleBatch, bound: np.ndarray, keep: int | None, keys: list[tuple],
           weight: np.ndarray, found: dict[tuple, float]):
    """(counts, exact step terms, solved mask) of a batch, most promising problems first: each problem's layers
    are partitioned for the closed form, and the partition is timed with the exact schedule.

    With `keep`, a problem is skipped when its lower bound on the exact step time, times its ranking weight (1 to
    rank by time, the price per second to rank by cost), exceeds the keep-th best ranking value among the plans in
    `found` (plan key -> its best value so far; several problems, the encoder splits of one encoder-decoder plan,
    can share a key and count once). The threshold tightens chunk by chunk as problems are solved."""
    counts = np.zeros(batch.lo.shape, dtype=int)
    terms: dict[str, np.ndarray] = {"step_time_s": np.full(len(batch), np.inf)}
    solved = np.zeros(len(batch), dtype=bool)
    ranking_bound = np.full(len(bound), np.inf)  # inf: no partition fits, also for a plan that costs nothing
    fits = np.isfinite(bound)
    ranking_bound[fits] = bound[fits] * weight[fits]
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
            counts[chunk], value, _ = optimal_partitions(batch.take(chunk))
            solved[chunk] = True
            timed = chunk[np.isfinite(value)]
            for name, column in schedule.take(timed).step_terms(counts[timed]).items():
                if name not in terms:
                    terms[name] = np.full((len(batch),) + column.shape[1:], np.nan)
                terms[name][timed] = column
            for i in timed:
                found[keys[i]] = min(found.get(keys[i], np.inf), float(terms["step_time_s"][i] * weight[i]))
    return counts, terms, solved


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
        for v in virtual_stage_options(model, group.config.pp):  # the best virtual size is the plan's
            chunked = replace(group, config=replace(group.config, virtual_stages=v))
            costs = stage_costs(model, cluster, inputs.profiles, geo, chunked.config, group.mbs_values)
            buckets.setdefault(group.config.pp, []).append((chunked, geo, costs))
    total = sum(len(bucket) for bucket in buckets.values())
    problems = {pp: PartitionBatch.stack([c.problem for _, _, c in bucket]) for pp, bucket in buckets.items()}
    schedules = {pp: ScheduleBatch.stack([c.schedule for _, _, c in bucket]) for pp, bucket in buckets.items()}
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
            price_per_s = price_per_hour_usd(cluster, geo.placement) / 3600.0
            for mbs in costs.mbs:
                keys.append((group.config.tp, group.config.dp, group.config.pp, geo.placement, int(mbs)))
                weight.append(price_per_s if sort == "cost" else 1.0)
        counts, terms, solved_here = _solve(batch, schedules[pp], bounds[pp], keep, keys, np.array(weight), found)
        value = terms["step_time_s"]
        solved += int(solved_here.sum())
        pruned += len(batch) - int(solved_here.sum())
        at = 0
        for group, geo, costs in bucket:
            for row in range(len(costs.mbs)):
                key = keys[at + row]
                entry = (value[at + row], group.config.encoder_stages, group, geo, costs, row, counts[at + row],
                         {name: column[at + row] for name, column in terms.items()})
                if not solved_here[at + row]:
                    skipped.add(key)
                if key not in best or entry[:2] < best[key][:2]:  # ties: fewer encoder stages, then fewer chunks (tried first)
                    best[key] = entry
            at += len(costs.mbs)
        done += len(bucket)
        if progress:
            progress(done, total)
    rows = []
    for value, _, group, geo, costs, row, counts, exact in best.values():
        if np.isfinite(value):
            chosen = np.zeros(len(costs.mbs), dtype=bool)
            chosen[row] = True
            shape = costs.problem.lo.shape
            exact = {name: np.broadcast_to(column, shape[:1] + np.shape(column)) for name, column in exact.items()}
            rows += plan_rows(inputs, group.config, geo, costs, np.broadcast_to(counts, shape), chosen,
                              group.exhaustive, exact)
    oom = sum(1 for key, entry in best.items() if np.isinf(entry[0]) and key not in skipped)
    oversized = _oversized_plans(todo)
    result = SearchResult(rows, len(best) + oversized, solved, oom + oversized, pruned)
    if not rows:
        for _, _, group, _, costs, row, _, _ in best.values():
            factor = memory_overshoot(costs, row, cluster.memory_margin)
            if result.closest_memory_factor is None or factor < result.closest_memory_factor:
                result.closest_memory_factor, result.closest_plan = factor, replace(group.config, mbs=int(costs.mbs[row]))
    return result


def search_plans(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None, *,
                 distributed_optimizer: bool = True, train_steps: int | None = None, train_tokens: float | None = None,
                 sort: str = "time", progress: Callable[[int, int], None] | None = None,
                 placement_limit: int = PLACEMENT_LIMIT, keep: int | None = None,
                 workers: int | None = None, profiles: dict[str, GpuProfile] | None = None,
                 overlap: bool = True) -> SearchResult:
    """Every plan that fits memory, best first, as Plan records (fasop.plans, docs/formats.md).

    keep: evaluate only what can be among the best `keep` plans (sound lower bounds prune the rest).
    workers: processes to use; default: one per core for clusters of 32 nodes or more, else one (small
    searches finish before extra processes would have started).
    profiles: already loaded profiles (by GPU type) instead of reading profiles_dir.
    overlap: Megatron's --overlap-grad-reduce, and --overlap-param-gather with the distributed optimizer.
    """
    inputs = prepare(model, cluster, gbs, profiles_dir, distributed_optimizer, profiles, overlap)
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
    result.plans = [Plan.trusted({"rank": rank, **row}) for rank, row in enumerate(rows, start=1)]
    return result


