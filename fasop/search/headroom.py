"""Memory headroom: a plan whose peak memory on some GPU is above a fraction (the headroom, 0.90 by default on the
command line) of that GPU's usable memory is flagged and ranked after every plan below it. Estimates of memory
err too, and a plan at 98% of a GPU fails on the first allocator spike where one a little slower at 60% runs.

Each plan (tp, dp, pp, placement, micro-batch size) takes its fastest partition, recompute mode and virtual size
below the headroom when it has one: that is a search on the cluster whose usable memory is the headroom's share
(the memory margin divided by the headroom), exact and pruned as any search. Only the plans it finds no room for
are then searched on the whole memory, flagged: the plans below the headroom are left out of that search, so the
whole work is one search and the few plans that fit only above the headroom. With `keep`, a flagged plan never
sets the bound that prunes a plan below the headroom: the tight search prunes among plans below it alone, and when
it finds fewer than `keep` it pruned nothing (its threshold needs `keep` plans), so the second search fills the
places left with the best flagged plans. When the plans below the headroom fill every place, no flagged plan can
enter: the second search is left out, but for the node-type sets with no plan below the headroom (whose best plan
the notes on idle node types compare), and the counts are those below the headroom."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fasop.cost.memory import usable_gib
from fasop.errors import ArgumentError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.plans import Plan
from fasop.search.engine import SORT_KEYS, SearchResult, cut_of, idle_types, merge_idle_bests, search_plans
from fasop.search.evaluation import Cut

DEFAULT_MEMORY_HEADROOM = 0.90  # a policy, not a measured fact: the share of usable memory a plan may fill unflagged
HEADROOM_TOLERANCE = 1e-9  # memory at the headroom up to rounding counts as below it
# The least headroom: a plan under 1% of usable memory is no plan (its model state alone fills more), and a
# smaller fraction only takes the second search's memory caps towards 0
MIN_MEMORY_HEADROOM = 0.01


def check_headroom(memory_headroom: float) -> float:
    if isinstance(memory_headroom, bool) or not isinstance(memory_headroom, (int, float)) \
            or not MIN_MEMORY_HEADROOM <= memory_headroom <= 1:
        raise ArgumentError("memory_headroom", f"expected a fraction of usable GPU memory from {MIN_MEMORY_HEADROOM:g} "
                                               "to 1", memory_headroom)
    return float(memory_headroom)


def memory_load(plan: Plan, cluster: Cluster) -> float:
    """The peak memory of a 3D plan over the usable memory of its GPU, on its most loaded stage."""
    stages = plan.stages
    assert stages, "a 3D plan holds its stages"
    return max(s.memory_gib / float(usable_gib(cluster, s.memory_capacity_gib)) for s in stages)


def over_headroom(plan: Plan, cluster: Cluster, memory_headroom: float) -> bool:
    return memory_load(plan, cluster) > memory_headroom * (1 + HEADROOM_TOLERANCE)


def _key(plan: Plan) -> tuple[tuple, tuple]:
    """(the plan's fasop.search.space.plan_key, each stage's degrees in a stage-group plan, else ())."""
    degrees = tuple((s.tp, s.dp) for s in plan.stages or []) if plan.is_stage_groups else ()
    return (plan.tp, plan.dp, plan.pp, tuple(plan.placement), plan.mbs, plan.cp or 1, plan.ep or 1,
            plan.etp or plan.tp), degrees


def search_within_headroom(model: Model, cluster: Cluster, gbs: int | None = None, profiles_dir: str | None = None, *,
                           memory_headroom: float = DEFAULT_MEMORY_HEADROOM, keep: int | None = None,
                           places: int | None = None, **options: Any) -> SearchResult:
    """search_plans (its arguments in `options`) with the plans below `memory_headroom` of usable GPU memory ranked
    first, each at its best below it, then the others (flagged: over_headroom). The counts of plans evaluated and
    out of memory are those of a search on the whole memory, the partitions solved, pruned and skipped those of
    both searches; or, where the plans below the headroom fill every place kept, those below it (headroom_only)."""
    memory_headroom = check_headroom(memory_headroom)
    if memory_headroom == 1:
        return search_plans(model, cluster, gbs, profiles_dir, keep=keep, places=places, **options)
    options["geometries"] = {}  # built once for both searches: geometry does not depend on memory
    tight = search_plans(model, replace(cluster, memory_margin=cluster.memory_margin / memory_headroom), gbs,
                         profiles_dir, keep=keep, places=places, **options)
    if not tight.out_of_memory:  # every plan fits below the headroom (with `keep`: of those it did not prune)
        return tight
    options.pop("progress", None)  # the bar followed the longer search
    below = frozenset(key for key, stages in map(_key, tight.plans) if not stages)
    # with a cut: the flagged plans fill the places left, and the search counts the plans out of memory
    sort = options.get("sort", "time")
    cut = cut_of(keep, places, sort)

    def value(plan: Plan) -> tuple[float]:
        return (getattr(plan, SORT_KEYS[sort]),)

    left = cut and cut._replace(size=cut.size - cut.places(tight.plans, value))
    if left is not None and left.size == 0:  # the table is full below the headroom
        return _idle_above(tight, model, cluster, gbs, profiles_dir, left, below, options)
    rest = search_plans(model, cluster, gbs, profiles_dir, exclude=below, only_combos=frozenset(tight.unfit_combos),
                        **(left.arguments() if left else {}), **options)
    known = {_key(plan) for plan in tight.plans}
    flagged = [plan for plan in rest.plans if _key(plan) not in known]
    plans = tight.plans + (left.kept(flagged, value) if left else flagged)
    rest.plans = [plan.model_copy(update={"rank": rank}) for rank, plan in enumerate(plans, start=1)]
    rest.plans_evaluated = tight.plans_evaluated
    rest.partitions_solved += tight.partitions_solved
    rest.pruned += tight.pruned
    rest.dominated += tight.dominated
    rest.idle_bests = merge_idle_bests(rest.idle_bests, tight.idle_bests)
    if tight.plans:
        rest.closest_memory_factor = rest.closest_plan = None
    return rest


def _idle_above(tight: SearchResult, model: Model, cluster: Cluster, gbs: int | None, profiles_dir: str | None,
                cut: Cut, below: frozenset, options: dict[str, Any]) -> SearchResult:
    """The search below the headroom whose plans fill every place `cut` keeps: no plan above it can enter the
    table, so only the node-type sets with no plan below it are searched above it, for the best plan of each
    (SearchResult.idle_bests); the counts stay those below the headroom (headroom_only)."""
    unfit = frozenset(item for item in tight.unfit_combos if idle_types(cluster, item[0]) not in tight.idle_bests)
    if unfit:
        rest = search_plans(model, cluster, gbs, profiles_dir, **cut._replace(size=1).arguments(), exclude=below,
                            only_combos=unfit, **options)
        tight.idle_bests = merge_idle_bests(tight.idle_bests, rest.idle_bests)
    tight.headroom_only = True
    return tight
