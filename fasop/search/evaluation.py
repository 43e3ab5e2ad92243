"""The evaluation of plans in named steps; fasop.search.engine runs them in this order:

1. placements: the plans of the space, each with its encoder/decoder splits and their placements (`plans_of`);
2. stage costs: each plan's per-stage costs under each virtual size and recompute setting, gathered by pipeline
   depth, and the rows a lighter recompute mode dominates (`plan_entries`, `depth_batches`);
3. partition: each problem's exact layer partition, most promising first, skipping what lower bounds show cannot
   matter (`partition`, recompute mode by mode in `partition_modes`);
4. schedule: each partition timed with the exact schedule (`scheduled`), whose times tighten the pruning;
5. rank: the best split, recompute mode and virtual size of each plan (`best_of_plans`), and its record
   (`records`);
6. memory: when no plan fits, the one closest to fitting and how much more memory it needs (`closest_fit`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from fasop.cost.communication import Geometry
from fasop.cost.config import RECOMPUTE_MODES, Config
from fasop.cost.exact import ScheduleBatch
from fasop.cost.memory import growth_to_fit
from fasop.cost.price import cost_per_step_usd, price_per_hour_usd
from fasop.cost.problem import PartitionBatch
from fasop.cost.step import StageCosts, recompute_variants
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.search.partition import least_admitting, lower_bounds, optimal_partitions
from fasop.search.record import plan_rows
from fasop.search.space import Group, Inputs, degrees_of, plan_key

VIRTUAL_STAGES = (1, 2)  # model chunks per pipeline rank the search tries (interleaved 1F1B beyond 1)
# deepest pipeline the search interleaves: the schedule of deeper ones costs more to build than it is likely to gain
INTERLEAVE_MAX_STAGES = 16
PRUNE_CHUNK = 256  # partition problems solved between two updates of the pruning threshold
PRUNE_SLACK = 1e-9  # relative: pruning never skips a plan within rounding of the threshold
OVERSHOOT_CHUNK = 1024  # problems whose memory overshoot is found at once (arrays of problems x stages x layers)


def virtual_stage_options(model: Model, pp: int) -> tuple[int, ...]:
    """Virtual sizes to try: interleaving needs two stages or more, and fasop splits only decoder and encoder
    stacks into chunks (an encoder-decoder pipeline's layout has no encoder layers in Megatron-LM)."""
    return (1,) if not 2 <= pp <= INTERLEAVE_MAX_STAGES or model.is_encoder_decoder else VIRTUAL_STAGES


# -- 1. placements ----------------------------------------------------------------------------------------------

def plans_of(todo: list[Group]) -> list[list[Group]]:
    """The groups of `todo` plan by plan (tp, dp, pp): the encoder/decoder splits of a plan, which
    fasop.search.space.groups lists one after another."""
    plans: list[list[Group]] = []
    for group in todo:
        if plans and degrees_of(plans[-1][0].config) == degrees_of(group.config):
            plans[-1].append(group)
        else:
            plans.append([group])
    return plans


# -- 2. stage costs ---------------------------------------------------------------------------------------------

class Entry(NamedTuple):
    """One recompute setting and virtual size of a (tp, dp, pp) plan: its stage costs on every encoder/decoder split,
    placement and micro-batch size (fasop.cost.step.recompute_variants)."""

    splits: list[Group]
    configs: list[Config]  # each split's
    costs: StageCosts
    split: np.ndarray  # the split of each row of costs
    split_start: np.ndarray  # the first row of each split
    beaten: np.ndarray  # rows a lighter recompute mode of the plan dominates: they are not partitioned
    order: tuple[int, int, int]  # (plan, virtual size, setting): where the search meets it


def plan_entries(inputs: Inputs, index: int, splits: list[Group]) -> tuple[list[Entry], int]:
    """The entries of plan `index` (its encoder/decoder splits), each virtual size's recompute settings lightest
    first, and how many rows of heavier settings were not even built: where every lighter mode's memory stops
    binding for all micro-batch sizes, the lightest free of memory limits beats the heavier ones (as
    PartitionBatch.dominates finds), so they are not partitioned."""
    k = len(splits[0].mbs_values)
    geos = [geo for group in splits for geo in group.geos]
    split_rows = [len(group.geos) * k for group in splits]
    split, split_start = np.repeat(np.arange(len(splits)), split_rows), np.cumsum([0] + split_rows)[:-1]
    entries: list[Entry] = []
    unbuilt = 0
    for v in virtual_stage_options(inputs.model, splits[0].config.pp):  # the best virtual size is the plan's
        settings = [[replace(c, virtual_stages=v) for c in (group.variants or (group.config,))] for group in splits]
        lighter: list[StageCosts] = []
        binding = np.ones(len(geos), dtype=bool)  # placements where every lighter mode's memory binds
        variants = recompute_variants(inputs.model, inputs.cluster, inputs.profiles,
                                      [(group.geos, configs) for group, configs in zip(splits, settings)],
                                      splits[0].mbs_values)
        for setting, costs in enumerate(variants):
            beaten = ~np.repeat(binding, k)
            for light in lighter:
                beaten |= light.problem.dominates(costs.problem)
            entries.append(Entry(splits, [configs[setting] for configs in settings], costs, split, split_start, beaten,
                                 (index, v, setting)))
            lighter.append(costs)
            binding &= costs.problem.memory_binds().reshape(len(geos), -1).any(-1)
            if not binding.any():  # the heavier modes are not even built
                unbuilt += len(costs.mbs) * (len(settings[0]) - len(lighter))
                break
    return entries, unbuilt


@dataclass
class DepthBatch:
    """The entries of every plan with one pipeline depth, partitioned in one batch: their rows one entry after
    another."""

    entries: list[Entry] = field(default_factory=list)
    placements: int = 0  # of its plans, for progress

    @cached_property
    def costs(self) -> StageCosts:
        return StageCosts.stack([entry.costs for entry in self.entries])

    @cached_property
    def entry_of(self) -> np.ndarray:
        """The entry of each row."""
        return np.repeat(np.arange(len(self.entries)), [len(entry.costs.mbs) for entry in self.entries])

    @cached_property
    def start(self) -> np.ndarray:
        """The first row of each entry."""
        return np.cumsum([0] + [len(entry.costs.mbs) for entry in self.entries])[:-1]

    def per_row(self, value: Callable[[Entry], int]) -> np.ndarray:
        """value(entry) of each row's entry."""
        return np.array([value(entry) for entry in self.entries])[self.entry_of]

    @cached_property
    def mode(self) -> np.ndarray:
        """Each row's recompute mode, as its index in RECOMPUTE_MODES (lightest first)."""
        return self.per_row(lambda entry: RECOMPUTE_MODES.index(entry.configs[0].recompute))

    def at(self, row: int) -> tuple[Entry, int, int]:
        """The entry of batch row `row`, the row within it, and the row's encoder/decoder split."""
        entry = self.entries[self.entry_of[row]]
        within = row - self.start[self.entry_of[row]]
        return entry, within, entry.split[within]


def depth_batches(inputs: Inputs, plans: list[list[Group]]) -> tuple[dict[int, DepthBatch], int]:
    """The entries of every plan by pipeline depth (plans with the same number of stages are partitioned in one
    batch), and the rows left unbuilt (plan_entries)."""
    batches: dict[int, DepthBatch] = {}
    unbuilt = 0
    for index, splits in enumerate(plans):
        entries, left = plan_entries(inputs, index, splits)
        batch = batches.setdefault(splits[0].config.pp, DepthBatch())
        batch.entries += entries
        batch.placements += sum(len(group.geos) for group in splits)
        unbuilt += left
    return batches, unbuilt


def depth_bounds(batch: DepthBatch, bounded: bool) -> np.ndarray:
    """Lower bounds on the exact step time of the batch's problems (inf where no partition fits), computed only
    for those a lighter recompute mode does not dominate; zeros when not `bounded`."""
    problems = batch.costs.problem
    if not bounded:
        return np.zeros(len(problems))
    beaten = np.concatenate([entry.beaten for entry in batch.entries])
    bound = np.full(len(problems), np.inf)
    rows = np.flatnonzero(~beaten)
    bound[rows] = lower_bounds(problems.take(rows))
    return bound


# -- 3. and 4. partition and schedule ---------------------------------------------------------------------------

def plan_keys(batch: DepthBatch, cluster: Cluster, sort: str) -> tuple[list[tuple], np.ndarray, np.ndarray]:
    """Each row's plan (plan_key), the index of that plan among the batch's, and
    the row's ranking weight: 1 to rank by time, the price of a second to rank by cost."""
    keys: list[tuple] = []
    weight: list[float] = []
    prices: dict[tuple[str, ...], float] = {}  # per placement: placements recur in every plan of the batch
    for entry in batch.entries:
        config = entry.configs[0]
        for group in entry.splits:
            for geo in group.geos:
                if geo.placement not in prices:
                    prices[geo.placement] = cost_per_step_usd(price_per_hour_usd(cluster, geo.placement), 1.0)
                price_per_s = prices[geo.placement]
                for mbs in group.mbs_values:
                    keys.append(plan_key(config, geo.placement, int(mbs)))
                    weight.append(price_per_s if sort == "cost" else 1.0)
    ids: dict[tuple, int] = {}
    plan = np.array([ids.setdefault(key, len(ids)) for key in keys])
    return keys, plan, np.array(weight)


def ranking_bound(bound: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Lower bounds times ranking weights; inf where no partition fits, also for a plan that costs nothing."""
    ranked = np.full(len(bound), np.inf)
    fits = np.isfinite(bound)
    ranked[fits] = bound[fits] * weight[fits]
    return ranked


class Cut(NamedTuple):
    """What a pruned search keeps: the best `size` plans, or, with `decimals`, every plan among the best `size`
    distinct ranking values rounded to that many decimals, as the ranked table prints them
    (fasop.plans.PRINTED_DECIMALS): the table of such a search is the table of the full search, each row with all
    the plans it stands for."""

    size: int
    decimals: int | None = None

    def threshold(self, found: list[np.ndarray]) -> float:
        """The highest ranking value a plan may have to be kept, among the plans found so far (the best value so
        far of each plan, inf if none); inf before enough are found. The slack keeps plans whose bound ties it up
        to rounding (bound, step time and the ranking figures are computed along different paths)."""
        values = np.concatenate(found)
        values = values[np.isfinite(values)]
        if self.decimals is not None:  # the last value that prints as the size-th place
            values = np.unique(np.round(values, self.decimals)) + 0.5 * 10.0 ** -self.decimals
        if len(values) < self.size:
            return np.inf
        return np.partition(values, self.size - 1)[self.size - 1] * (1 + PRUNE_SLACK)

    def kept(self, ranked: list, value: Callable[[Any], tuple]) -> list:
        """The items of `ranked` (best first) this cut keeps; value(item) is a tuple whose last element is its
        ranking value, the elements before it ranking first (such as the flag of a plan above the memory
        headroom)."""
        if self.decimals is None:
            return ranked[:self.size]
        kept: list = []
        places: set = set()
        for item in ranked:
            place = self._place(value(item))
            if place not in places:
                if len(places) == self.size:
                    break
                places.add(place)
            kept.append(item)
        return kept

    def places(self, ranked: list, value: Callable[[Any], tuple]) -> int:
        """How many of this cut's places the items of `ranked` fill."""
        return len(ranked) if self.decimals is None else len({self._place(value(item)) for item in ranked})

    def arguments(self) -> dict[str, Any]:
        """The search_plans argument that makes this cut (keep or places)."""
        return {"keep" if self.decimals is None else "places": self.size}

    def _place(self, value: tuple) -> tuple:
        """The place of a ranking value: as printed."""
        *first, last = value
        return (*first, round(last, self.decimals))


def scheduled(schedule: ScheduleBatch, rows: np.ndarray, counts: np.ndarray, terms: dict[str, np.ndarray]) -> None:
    """The exact step terms of rows `rows` for their layer counts, written into `terms` (a column per term over
    every row of the batch, NaN where not timed)."""
    for name, column in schedule.take(rows).step_terms(counts[rows]).items():
        if name not in terms:
            terms[name] = np.full((len(schedule),) + column.shape[1:], np.nan)
        terms[name][rows] = column


def partition(batch: PartitionBatch, schedule: ScheduleBatch, bound: np.ndarray, keep: Cut | None, plan: np.ndarray,
              weight: np.ndarray, found: list[np.ndarray], dominated: np.ndarray):
    """(counts, exact step terms, solved mask, outdone mask) of a batch, most promising problems first: each
    problem's layers are partitioned for the closed form, and the partition is timed with the exact schedule.
    `dominated` problems are not solved.

    With `keep`, a problem is skipped when its lower bound on the exact step time, times its ranking weight (1 to
    rank by time, the price per second to rank by cost), exceeds the last ranking value `keep` keeps among the
    plans `found` (Cut.threshold; the best value so far of each plan, inf if none, one array per pipeline depth,
    this batch's last; several problems, the encoder splits of one encoder-decoder plan, share their `plan` and count once). The
    threshold tightens chunk by chunk as problems are solved. Whatever `keep`, a problem whose bound exceeds what
    another problem of its plan reached (a split, a recompute mode, a virtual size) is skipped: it cannot become
    the plan's (the outdone mask)."""
    counts = np.zeros(batch.lo.shape, dtype=int)
    terms: dict[str, np.ndarray] = {"step_time_s": np.full(len(batch), np.inf)}
    solved = np.zeros(len(batch), dtype=bool)
    outdone = np.zeros(len(batch), dtype=bool)
    ranked = ranking_bound(bound, weight)
    order = np.argsort(ranked, kind="stable")
    order = order[~dominated[order]]
    step = PRUNE_CHUNK if keep or bound.any() else max(1, len(order))
    reached = found[-1]
    for start in range(0, len(order), step):
        limit = keep.threshold(found) if keep else np.inf
        chunk = order[start:start + step]
        beaten = ranked[chunk] > reached[plan[chunk]] * (1 + PRUNE_SLACK)  # by another split or mode
        outdone[chunk[beaten]] = True
        chunk = chunk[(ranked[chunk] <= limit) & ~beaten]
        if len(chunk):
            counts[chunk], value, _ = optimal_partitions(batch.take(chunk))
            solved[chunk] = True
            timed = chunk[np.isfinite(value)]
            scheduled(schedule, timed, counts, terms)
            np.minimum.at(reached, plan[timed], terms["step_time_s"][timed] * weight[timed])
    return counts, terms, solved, outdone


def partition_modes(batch: DepthBatch, bound: np.ndarray, keep: Cut | None, plan: np.ndarray, weight: np.ndarray,
                    found: list[np.ndarray], excluded: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray],
                                                                          np.ndarray, np.ndarray]:
    """`partition` of a depth's batch, recompute mode by mode, lightest first: a heavier mode has to beat what the
    lighter ones reached; `excluded` problems are left alone. (counts, exact step terms, solved mask, mask of the
    problems dominated, outdone or excluded)."""
    problems, schedule = batch.costs.problem, batch.costs.schedule
    beaten = np.concatenate([entry.beaten for entry in batch.entries]) | excluded
    counts = np.zeros(problems.lo.shape, dtype=int)
    terms: dict[str, np.ndarray] = {}
    solved = np.zeros(len(problems), dtype=bool)
    for mode in np.unique(batch.mode):
        this = batch.mode == mode
        beaten |= this & (ranking_bound(bound, weight) > found[-1][plan] * (1 + PRUNE_SLACK))
        mode_counts, mode_terms, mode_solved, outdone = partition(problems, schedule, bound, keep, plan, weight, found,
                                                                  beaten | ~this)
        beaten |= outdone
        counts[mode_solved] = mode_counts[mode_solved]
        for name, column in mode_terms.items():
            merged = terms.setdefault(name, np.full(column.shape, np.inf if name == "step_time_s" else np.nan))
            merged[mode_solved] = column[mode_solved]
        solved |= mode_solved
    return counts, terms, solved, beaten


# -- 5. rank ----------------------------------------------------------------------------------------------------

class Candidate(NamedTuple):
    """The best partition problem of a plan, solved or not."""

    step_time_s: float  # inf when not solved or nothing fits
    config: Config
    geo: Geometry
    exhaustive: bool  # whether the plan's placements were all searched
    counts: np.ndarray  # layers per stage
    terms: dict[str, np.ndarray]  # the exact step terms of the problem's batch
    at: int  # the problem's row in its batch


def best_of_plans(batch: DepthBatch, keys: list[tuple], plan: np.ndarray, counts: np.ndarray,
                  terms: dict[str, np.ndarray]) -> dict[tuple, Candidate]:
    """The best problem of each plan of a depth's batch, by plan key: the best split, recompute mode and virtual
    size are the plan's; ties go to fewer encoder stages, then the lighter mode, then fewer chunks."""
    value = terms["step_time_s"]
    encoder = np.concatenate([np.array([c.encoder_stages for c in entry.configs])[entry.split] for entry in batch.entries])
    virtual = batch.per_row(lambda entry: entry.configs[0].virtual_stages)
    order = np.lexsort((np.arange(len(plan)), virtual, batch.mode, encoder, value, plan))
    best: dict[tuple, Candidate] = {}
    for i in order[np.r_[True, plan[order][1:] != plan[order][:-1]]].tolist():
        entry, row, split = batch.at(i)
        group = entry.splits[split]
        geo = group.geos[(row - entry.split_start[split]) // len(group.mbs_values)]
        best[keys[i]] = Candidate(value[i], entry.configs[split], geo, group.exhaustive, counts[i], terms, i)
    return best


def records(inputs: Inputs, best: dict[tuple, Candidate], batches: dict[int, DepthBatch]) -> list[dict]:
    """The records of the plans whose best problem fits, those of one pipeline depth made together."""
    fitting_of: dict[int, list[Candidate]] = {}
    for candidate in best.values():
        if np.isfinite(candidate.step_time_s):
            fitting_of.setdefault(candidate.config.pp, []).append(candidate)
    rows = []
    for pp, fitting in fitting_of.items():
        plans = [(c.config, c.geo, c.exhaustive) for c in fitting]
        at = np.array([c.at for c in fitting])
        exact = {name: column[at] for name, column in fitting[0].terms.items()}
        rows += plan_rows(inputs, plans, batches[pp].costs.take(at), np.array([c.counts for c in fitting]), exact)
    return rows


# -- 6. memory --------------------------------------------------------------------------------------------------

def memory_overshoots(costs: StageCosts, rows: np.ndarray, cluster: Cluster) -> np.ndarray:
    """(R,) smallest factor by which the GPUs' memory would have to grow for some partition of each row of `rows` to
    fit (inf where none can): the least factor at which each stage holds its layers, a bottleneck threshold like
    the partition's own (fasop.search.partition.least_admitting), for many rows at once."""
    fixed, per_layer = growth_to_fit(cluster, costs.capacity_gib[rows], costs.mem_fixed_gib[rows],
                                     costs.mem_layer_gib[rows])
    return least_admitting(fixed, per_layer, costs.problem.take(rows))


def closest_fit(unfit: list[tuple[DepthBatch, np.ndarray]], cluster: Cluster) -> tuple[float, Config] | None:
    """Of the problems found not to fit (each depth's batch and rows), the plan that needs the least more memory
    and that factor (memory_overshoots), None if no memory would fit any; the first in search order wins a tie."""
    closest: tuple[float, Config] | None = None
    for batch, rows in unfit:
        # plan by plan, each split's virtual sizes, recompute settings and rows in turn
        order = sorted(rows.tolist(), key=lambda i: _search_order(*batch.at(i)[:2]))
        for start in range(0, len(order), OVERSHOOT_CHUNK):
            chunk = np.array(order[start:start + OVERSHOOT_CHUNK])
            for i, factor in zip(chunk.tolist(), memory_overshoots(batch.costs, chunk, cluster).tolist()):
                if factor < (np.inf if closest is None else closest[0]):  # none: no memory would do
                    entry, row, split = batch.at(i)
                    closest = factor, replace(entry.configs[split], mbs=int(entry.costs.mbs[row]))
    return closest


def _search_order(entry: Entry, row: int) -> tuple[int, ...]:
    return entry.order[0], int(entry.split[row]), *entry.order[1:], row
