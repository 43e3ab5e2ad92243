"""The search engine: every plan of the space (fasop.search.space) with its optimal layer partition, ranked;
sound lower bounds prune what cannot reach the best plans, and large clusters are searched in processes."""

from __future__ import annotations

import gc
import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from fasop.cost.config import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODES, Config
from fasop.cost.price import add_training_run
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile
from fasop.plans import PRINTED_DECIMALS, Plan
from fasop.search.evaluation import (
    Candidate,
    Cut,
    DepthBatch,
    best_of_plans,
    closest_fit,
    depth_batches,
    depth_bounds,
    partition_modes,
    plan_keys,
    plans_of,
    records,
)
from fasop.search.space import (
    PLACEMENT_LIMIT,
    Degrees,
    Group,
    Inputs,
    combinations,
    degrees_of,
    groups,
    key_degrees,
    max_stages,
    plan_key,
    prepare,
    tensor_degrees,
)

PARALLEL_NODES = 32  # clusters this large are searched with one process per core


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
    # the best step time and price per step of the plans leaving each set of node types idle (() for none)
    idle_bests: dict[tuple[str, ...], tuple[float, float]] = field(default_factory=dict)
    # (node types searched, tp, dp) of every plan found out of memory: where a search with more memory can find more
    unfit_combos: set[tuple[tuple[str, ...], Degrees]] = field(default_factory=set)
    # the plans found, the counts and idle_bests are those of the search below the memory headroom alone: its plans
    # filled every place kept (fasop.search.headroom)
    headroom_only: bool = False

    @property
    def idle(self) -> list[IdleChoice]:
        """Plans leaving node types idle that beat every plan on all nodes."""
        return idle_choices(self.idle_bests)

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
        self.idle_bests = merge_idle_bests(self.idle_bests, other.idle_bests)
        self.unfit_combos |= other.unfit_combos


def _oversized_plans(todo: list[Group]) -> int:
    """Plans (plan_key) whose micro-batch size `groups` left out."""
    placements_of: dict[tuple, set] = {}
    oversized: dict[tuple, int] = {}
    for group in todo:
        combo = degrees_of(group.config)
        placements_of.setdefault(combo, set()).update(geo.placement for geo in group.geos)
        oversized[combo] = group.oversized
    return sum(len(placements_of[combo]) * n for combo, n in oversized.items())


def _without(todo: list[Group], exclude: frozenset[tuple]) -> list[Group]:
    """The groups of `todo` without the placements and micro-batch sizes whose every plan is in `exclude`; the
    plans of `exclude` the rest still holds are left out problem by problem (_evaluate_depth)."""
    kept = []
    for group in todo:
        config = group.config
        wanted = [(geo, [mbs for mbs in group.mbs_values if plan_key(config, geo.placement, int(mbs)) not in exclude])
                  for geo in group.geos]
        geos = [geo for geo, sizes in wanted if sizes]
        if geos:
            sizes = {mbs for _, some in wanted for mbs in some}
            kept.append(replace(group, geos=geos, mbs_values=[mbs for mbs in group.mbs_values if mbs in sizes]))
    return kept


def evaluate(inputs: Inputs, combos: list[Degrees], placement_limit: int = PLACEMENT_LIMIT,
             keep: Cut | None = None, progress: Callable[[int, int], None] | None = None,
             sort: str = "time", exclude: frozenset[tuple] = frozenset()) -> SearchResult:
    """Plans of the given combinations of degrees, unranked. With `keep`, partition problems whose lower bound
    cannot reach the plans it keeps by `sort` among those found so far are skipped (they cannot be among them).
    Plans whose key (plan_keys) is in `exclude` are neither solved nor counted, out of memory or otherwise."""
    with _without_cyclic_gc():
        return _evaluate(inputs, combos, placement_limit, keep, progress, sort, exclude)


@dataclass
class _Tally:
    """What the search met, depth by depth."""

    best: dict[tuple, Candidate] = field(default_factory=dict)  # the best problem of each plan
    found: list[np.ndarray] = field(default_factory=list)  # by pipeline depth: each plan's best ranking value so far
    skipped: set[tuple] = field(default_factory=set)  # plans with a problem pruned rather than found not to fit
    unfit: list[tuple[DepthBatch, np.ndarray]] = field(default_factory=list)  # problems found not to fit, by depth
    solved: int = 0
    pruned: int = 0
    dominated: int = 0


def _evaluate_depth(tally: _Tally, inputs: Inputs, batch: DepthBatch, bound: np.ndarray, keep: Cut | None,
                    sort: str, exclude: frozenset[tuple]) -> None:
    """Partition, schedule and rank the problems of one pipeline depth, into `tally`."""
    keys, plan, weight = plan_keys(batch, inputs.cluster, sort)
    excluded = np.array([key in exclude for key in keys], dtype=bool) if exclude else np.zeros(len(keys), dtype=bool)
    tally.found.append(np.full(int(plan.max()) + 1, np.inf))
    counts, terms, solved, beaten = partition_modes(batch, bound, keep, plan, weight, tally.found, excluded)
    tally.solved += int(solved.sum())
    tally.pruned += len(plan) - int(solved.sum()) - int(beaten.sum())
    tally.dominated += int((beaten & ~excluded).sum())
    best = best_of_plans(batch, keys, plan, counts, terms)
    tally.best.update((key, candidate) for key, candidate in best.items() if key not in exclude)
    tally.skipped.update(keys[i] for i in np.flatnonzero(~solved & ~beaten).tolist())
    tally.unfit.append((batch, np.flatnonzero(np.isinf(terms["step_time_s"]) & (solved | beaten) & ~excluded)))


def _evaluate(inputs: Inputs, combos: list[Degrees], placement_limit: int, keep: Cut | None,
              progress: Callable[[int, int], None] | None, sort: str, exclude: frozenset[tuple]) -> SearchResult:
    """The steps of fasop.search.evaluation in turn, pipeline depths most promising first."""
    todo = groups(inputs, combos, placement_limit)
    oversized = _oversized_plans(todo)
    unfit_combos = {degrees_of(group.config) for group in todo if group.oversized}
    if exclude:
        todo = _without(todo, exclude)
    batches, unbuilt = depth_batches(inputs, plans_of(todo))
    # bounds prune what cannot reach the kept plans, and heavier recompute modes that cannot beat a lighter one
    bounded = bool(keep) or len(inputs.recompute) > 1
    bounds = {pp: depth_bounds(batch, bounded) for pp, batch in batches.items()}
    tally = _Tally(dominated=unbuilt)
    done, total = 0, sum(batch.placements for batch in batches.values())
    for pp in sorted(batches, key=lambda pp: bounds[pp].min()):
        _evaluate_depth(tally, inputs, batches[pp], bounds[pp], keep, sort, exclude)
        done += batches[pp].placements
        if progress:
            progress(done, total)
    rows = records(inputs, tally.best, batches)
    unfit = [key for key, candidate in tally.best.items() if np.isinf(candidate.step_time_s) and key not in tally.skipped]
    result = SearchResult(rows, len(tally.best) + oversized, tally.solved, len(unfit) + oversized, tally.pruned,
                          tally.dominated)
    names = tuple(inputs.cluster.node_types)
    result.unfit_combos = {(names, combo) for combo in unfit_combos | {key_degrees(key) for key in unfit}}
    closest = None if rows else closest_fit(tally.unfit, inputs.cluster)
    if closest is not None:
        result.closest_memory_factor, result.closest_plan = closest
    return result


def search_plans(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None, *,
                 distributed_optimizer: bool = True, train_steps: int | None = None, train_tokens: float | None = None,
                 sort: str = "time", progress: Callable[[int, int], None] | None = None,
                 placement_limit: int = PLACEMENT_LIMIT, keep: int | None = None, places: int | None = None,
                 workers: int | None = None, profiles: dict[str, GpuProfile] | None = None,
                 overlap: bool = True, recompute: tuple[str, ...] = RECOMPUTE_MODES,
                 sequence_parallel: bool = True, tp_comm_overlap: bool = True, use_all: bool = False,
                 stage_groups: bool = False, bound_placements: int = 0,
                 exclude: frozenset[tuple] = frozenset(), only_combos: frozenset[tuple] | None = None,
                 geometries: dict | None = None,
                 recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES) -> SearchResult:
    """Every plan that fits memory, best first, as Plan records (fasop.plans, docs/formats.md).

    keep: evaluate only what can be among the best `keep` plans (sound lower bounds prune the rest).
    places: instead of keep, every plan among the best `places` ranking values as the ranked table prints them
    (PRINTED_DECIMALS): the table of the first `places` distinct rows is that of the full search (cut_of).
    workers: processes to use, at most one per core; default: one per core for clusters of 32 nodes or more,
    else one (small searches finish before extra processes would have started).
    profiles: already loaded profiles (by GPU type) instead of reading profiles_dir.
    overlap: Megatron's --overlap-grad-reduce, and --overlap-param-gather with the distributed optimizer.
    recompute: the recompute modes to consider (each plan takes its best); recompute_modules: what the selective
    mode reruns (Megatron's --recompute-modules); sequence_parallel: on when tp > 1.
    tp_comm_overlap: Megatron's --tp-comm-overlap wherever it runs and hides time (fasop.search.space).
    use_all: only plans on every node; by default plans that leave whole node types idle compete too
    (node_type_subsets), and `idle` says how the best of each subset compares.
    stage_groups: stage-group plans compete too (fasop.search.groupsearch; each stage its own node type, tp and
    dp, node counts upper bounds).
    bound_placements: of the first this many plans, those whose placement was searched as type blocks get the
    integer program's optimality_gap (fasop.search.placementbound).
    exclude: plans (tp, dp, pp, placement, micro-batch size) to leave out, as if not in the space.
    only_combos: search only these (node types, degrees) (SearchResult.unfit_combos), on every node-type set.
    geometries: the placements' geometries another search of the same question built (Inputs.geometries).
    """
    cut = cut_of(keep, places, sort)
    inputs = prepare(model, cluster, gbs, profiles_dir, distributed_optimizer, profiles, overlap, recompute,
                     sequence_parallel, tp_comm_overlap, geometries, recompute_modules)
    one_size = cluster.one_kind_per_node
    # plans of one tp and dp run on node types of one size and one GPU kind per node (Cluster.gpus_per_node)
    subsets = ([cluster] if one_size else []) if use_all else node_type_subsets(cluster)
    if not stage_groups and use_all and not one_size:
        raise ArgumentError("use_all", f"the nodes of {cluster.name} differ in GPU count or hold several GPU kinds: "
                                       "only stage-group plans can use every node", remedy="stage_groups")
    if not stage_groups and not subsets:
        raise InputError(f"{cluster.file or cluster.name}: node_type.gpus", "every node holds several GPU kinds: only "
                                                                            "stage-group plans use them",
                         remedy="stage_groups")
    spaces = [(sub, combinations(sub)) for sub in _subset_inputs(inputs, subsets)]
    if spaces and not any(tensor_degrees(sub) for sub, _ in (spaces[:1] if one_size else spaces)):
        profiled = {g: p.tensor_degrees for g, p in inputs.profiles.items()}
        raise InputError("profiles", f"no tensor degree dividing the {', '.join(map(str, cluster.node_sizes))} GPUs "
                                     f"per node, the attention heads and the query groups is profiled for every GPU "
                                     f"type {profiled}")
    if not any(combos for _, combos in spaces) and (one_size or not stage_groups):
        raise ArgumentError("gbs", f"no plan can use a global batch size of {inputs.gbs} on {cluster.num_gpus} GPUs "
                                   "(data-parallel degree must divide it and pipeline stages must not exceed "
                                   f"{max_stages(model)})")
    result = SearchResult([], 0, 0, 0)
    for i, (sub, combos) in enumerate(spaces):  # the bar follows the first, the largest search by far
        combos = _only(sub, combos, only_combos)
        if combos:
            result.merge(_search(sub, combos, placement_limit, cut, progress if i == 0 else None, sort, workers,
                                 exclude))
    rows = result.rows
    if stage_groups:  # the programs need only find what beats the best plan by time
        from fasop.search.groupsearch import search_stage_groups  # the solver's imports: only when asked

        rows += search_stage_groups(inputs, min((r["closed_form_step_s"] for r in rows), default=math.inf)
                                    if sort == "time" else math.inf)
    if result.closest_plan is not None and rows:
        result.closest_memory_factor = result.closest_plan = None
    for row in rows:
        add_training_run(row, model, train_steps, train_tokens)
    rows.sort(key=lambda r: (r[SORT_KEYS[sort]], r["step_time_s"], r["tp"], r["dp"], r["pp"], r["mbs"],
                             r["encoder_stages"], r["placement"]))
    result.idle_bests = idle_bests(rows, cluster) if not use_all else {}
    if cut:
        rows = cut.kept(rows, lambda row: (row[SORT_KEYS[sort]],))
    result.rows = []
    with _without_cyclic_gc():
        result.plans = [Plan.trusted({"rank": rank, **row}) for rank, row in enumerate(rows, start=1)]
    if any(plan.placement_search == "type-blocks" for plan in result.plans[:bound_placements]):
        from fasop.search.placementbound import placement_gaps  # the solver's imports: only when needed

        result.plans[:bound_placements] = placement_gaps(inputs, result.plans[:bound_placements])
    return result


def cut_of(keep: int | None, places: int | None, sort: str) -> Cut | None:
    """The Cut of search_plans' `keep` or `places` (at most one of them), ranked by `sort`: each checked."""
    if sort not in SORT_KEYS:
        raise ArgumentError("sort", f"expected one of {', '.join(SORT_KEYS)}", sort)
    for name, count in (("keep", keep), ("places", places)):
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ArgumentError(name, "expected a whole number of at least 1, or None for every plan", count)
    if keep is not None and places is not None:
        raise ArgumentError("places", "keeps plans instead of keep: give one of them")
    return Cut(keep) if keep else Cut(places, PRINTED_DECIMALS[SORT_KEYS[sort]]) if places else None


def _only(inputs: Inputs, combos: list[Degrees], only_combos: frozenset[tuple] | None) -> list[Degrees]:
    """The degrees of `combos` that `only_combos` names for the node types of inputs.cluster (all without it)."""
    names = tuple(inputs.cluster.node_types)
    return combos if only_combos is None else [combo for combo in combos if (names, combo) in only_combos]


def node_type_subsets(cluster: Cluster) -> list[Cluster]:
    """The cluster, then every cluster of some of its node types (each at its full count), most nodes first:
    a plan that leaves a slow or costly node type idle can be faster or cheaper per sample than any plan on
    every node. Counts below the full ones are the market's sweep (fasop.market.pareto). Only sets whose node
    types hold one GPU count per node are kept, the cluster itself included, and no node holding several GPU
    kinds: a plan of one tensor and data degree gives every node as many ranks of one kind (stage-group plans
    use such nodes)."""
    names = [name for name, node in cluster.node_types.items() if not node.host]
    subsets = [kept for size in range(len(names), 0, -1) for kept in itertools.combinations(names, size)
               if len({cluster.node_types[name].gpus_per_node for name in kept}) == 1]
    subsets.sort(key=lambda kept: -sum(cluster.node_types[name].count for name in kept))
    return [cluster if len(kept) == len(cluster.node_types) else
            cluster.with_counts({name: cluster.node_types[name].count for name in kept}) for kept in subsets]


def _subset_inputs(inputs: Inputs, clusters: list[Cluster]) -> list[Inputs]:
    """`inputs` on each cluster of `clusters` (the first is inputs.cluster), with the profiles read once."""
    return [inputs if sub is inputs.cluster else
            prepare(inputs.model, sub, inputs.gbs, None, inputs.distributed_optimizer, inputs.profiles, inputs.overlap,
                    inputs.recompute, inputs.sequence_parallel, inputs.tp_comm_overlap, inputs.geometries,
                    inputs.recompute_modules)
            for sub in clusters]


@dataclass(frozen=True)
class IdleChoice:
    """The best plan that leaves whole node types idle, when it beats every plan on all nodes by `metric`."""

    idle: tuple[str, ...]  # the node types it leaves idle
    metric: str  # step_time_s or cost_per_step_usd
    value: float  # the metric of the best plan leaving them idle
    every_node: float | None  # the metric of the best plan on every node (None: none fits)


def idle_types(cluster: Cluster, used: Iterable[str]) -> tuple[str, ...]:
    """The node types of `cluster` that a plan on the node types `used` leaves idle (idle_bests' keys)."""
    used = set(used)
    return tuple(name for name in cluster.node_types if name not in used)


def idle_bests(rows: list[dict], cluster: Cluster) -> dict[tuple[str, ...], tuple[float, float]]:
    """The best step time and price per step of the rows leaving each set of node types idle."""
    best: dict[tuple[str, ...], tuple[float, float]] = {}
    for row in rows:
        idle = idle_types(cluster, row["placement"])
        time_s, cost = best.get(idle, (math.inf, math.inf))
        best[idle] = min(time_s, row["step_time_s"]), min(cost, row["cost_per_step_usd"])
    return best


def merge_idle_bests(one: dict[tuple[str, ...], tuple[float, float]],
                     other: dict[tuple[str, ...], tuple[float, float]]) -> dict[tuple[str, ...], tuple[float, float]]:
    """The better of both for each set of idle node types (idle_bests of two searches)."""
    merged = dict(one)
    for idle, (time_s, cost) in other.items():
        best_time_s, best_cost = merged.get(idle, (math.inf, math.inf))
        merged[idle] = min(best_time_s, time_s), min(best_cost, cost)
    return merged


def idle_choices(bests: dict[tuple[str, ...], tuple[float, float]]) -> list[IdleChoice]:
    """For step time and for price per step: the set of idle node types whose best plan beats the best plan on
    every node (idle_bests), if any."""
    choices = []
    for column, metric in enumerate(SORT_KEYS.values()):
        best = {idle: values[column] for idle, values in bests.items()}
        every_node = best.pop((), None)
        if best:
            idle, value = min(best.items(), key=lambda item: (item[1], item[0]))
            if every_node is None or value < every_node:
                choices.append(IdleChoice(idle, metric, value, every_node))
    return choices


def _search(inputs: Inputs, combos: list[Degrees], placement_limit: int, keep: Cut | None,
            progress: Callable[[int, int], None] | None, sort: str, workers: int | None,
            exclude: frozenset[tuple]) -> SearchResult:
    """The plans of `combos` on inputs.cluster, unranked: in this process, or in one process per core for large
    clusters (each takes every few combinations, so that each gets all pipeline depths)."""
    cores = os.cpu_count() or 1
    if workers is None:
        workers = cores if inputs.cluster.num_nodes >= PARALLEL_NODES else 1
    workers = max(1, min(workers, len(combos), cores))  # more processes than cores only share them
    if workers == 1:
        return evaluate(inputs, combos, placement_limit, keep, progress, sort, exclude)
    result = SearchResult([], 0, 0, 0)
    from concurrent.futures import ProcessPoolExecutor, as_completed  # only here: its import costs a small search

    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(evaluate, inputs, combos[i::workers], placement_limit, keep, None, sort, exclude)
                   for i in range(workers)]
        for done, future in enumerate(as_completed(futures), start=1):
            result.merge(future.result())
            if progress:
                progress(done, len(futures))
    return result
