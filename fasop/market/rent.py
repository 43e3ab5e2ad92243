"""What to rent from a catalogue (`fasop pareto --rent`): the integer program of stage-group plans
(fasop.search.stageilp) chooses how many nodes of each type to rent, up to each type's quota (its `count`),
together with the plan, for a series of caps on the price per hour (the epsilon-constraint method).

    from fasop.market.rent import rent_front
    walk = rent_front(model, cluster, train_steps=10_000)
    walk.records  # one front-file record per point, `on_front` marked

At a cap c the best plan over every pipeline depth, micro-batch and recompute mode (each its own program, as
fasop.search.groupsearch solves them, in order of lower bounds) is the fastest stage-group plan whose nodes cost
at most c an hour. The walk starts without a cap; after each optimum at price p it sets the next cap just below
p. The plans' prices per hour form a finite set, so the walk ends, and the points it visits hold every point of
the front of price per hour against step time: a plan on that front is the fastest at its own price, and the
walk passes through every such price it does not skip by being cheaper at the same speed. The front of the run's
cost against its time is part of that front (a plan no dearer per hour and no slower is no dearer per run), so
`mark_front` over the points marks it exactly, in the program's objective (the closed form) and within HiGHS's
gap; each point is then timed by the exact schedule like every plan.

A program's optimum at one cap stays its optimum at a lower cap that still affords it, and a program without a
plan at one cap has none at a lower one: each program is solved again only when the cap has dropped below the
price of its last answer, and its last answer's objective bounds it from below (the cap only takes plans away).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from fasop.cost.price import add_training_run, check_run_length
from fasop.errors import ArgumentError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.market.pareto import DEFAULT_TRAIN_STEPS, PLAN_FIELDS, cluster_profiles, empty_record, mark_front, node_caps
from fasop.search.space import Inputs, prepare

if TYPE_CHECKING:  # the solver and its scipy and pulp imports load when a walk runs, not with `fasop pareto`
    from fasop.search.stageilp import Assignment, StageOptions

RENT_TIME_LIMIT_S = 300.0  # the walk's budget for the solver, all caps together
MAX_POINTS = 64  # caps solved at most: a front of more points than this is more than a choice needs
# prices per hour within this share of each other count as one: the next cap sits this far below a plan's price,
# far beyond HiGHS's feasibility tolerance on the price row (1e-6 of the cap), so the same plan is not found twice
PRICE_RESOLUTION = 1e-5


@dataclass
class _Program:
    """One program (pipeline depth, micro-batch, recompute mode) and what the walk knows of it so far."""

    pp: int
    batch: int
    mode: str
    options: StageOptions
    bound_s: float  # a lower bound on its optimum at the current cap and every lower one
    found: Assignment | None = None  # its optimum at a cap at or above the current one
    price_per_hour_usd: float = np.inf  # of `found`'s nodes
    empty: bool = False  # no plan at the current cap, nor at any lower one


@dataclass(frozen=True)
class RentFront:
    """The walk's points as front-file records (the cheapest per hour first) and as plan records, and how far it
    went."""

    records: list[dict]
    plans: list[dict | None]  # each point's plan record (docs/formats.md) as fasop search returns stage-group
    # plans; None where the nodes that hold several GPU kinds cannot host the program's stages in pipeline order
    quotas: dict[str, int]  # the most nodes of each type it could rent
    programs: int  # programs (depth, micro-batch, recompute mode) with options
    solves: int  # integer programs solved over the walk
    stopped_by: str | None  # "the time limit" or "the point limit"; None when the walk reached a cap no plan meets
    elapsed_s: float

    @property
    def complete(self) -> bool:
        return self.stopped_by is None


def rent_front(model: Model, cluster: Cluster, *, max_nodes: dict[str, int] | None = None, gbs: int | None = None,
               train_steps: int | None = None, train_tokens: float | None = None, profiles_dir: str | None = None,
               distributed_optimizer: bool = True, allow_profile_mismatch: bool = False, profiles: dict | None = None,
               time_limit_s: float = RENT_TIME_LIMIT_S, max_points: int = MAX_POINTS) -> RentFront:
    """The walk of the module docstring over `cluster`'s node types, each up to its `count` (capped by
    `max_nodes`) at its price per hour, with the run of `train_steps` steps or `train_tokens` tokens
    (DEFAULT_TRAIN_STEPS steps without either) for each point's hours and dollars."""
    from fasop.search.groupsearch import plan_record

    if model.is_encoder_decoder:
        raise ArgumentError("model", "an encoder-decoder model: the integer program plans stage-group plans, which "
                                     "are for decoder-only models", model.name)
    if time_limit_s <= 0:
        raise ArgumentError("time_limit_s", "expected a positive number of seconds", time_limit_s)
    if max_points < 1:
        raise ArgumentError("max_points", "expected 1 or more caps", max_points)
    started = time.monotonic()
    check_run_length(train_steps, train_tokens)
    quotas = node_caps(cluster, max_nodes)
    if profiles is None:
        profiles = cluster_profiles(model, cluster, profiles_dir, allow_profile_mismatch)
    inputs = prepare(model, cluster.with_counts(quotas), gbs, profiles_dir, distributed_optimizer, profiles)
    prices = {name: node.price_per_hour_usd for name, node in inputs.cluster.node_types.items()}
    programs = _programs(inputs)
    points, solves, stopped_by = _walk(inputs, programs, prices, started + time_limit_s, max_points)
    if train_steps is None and train_tokens is None:
        train_steps = DEFAULT_TRAIN_STEPS
    plans: list[dict | None] = []
    records = []
    for program, found, solved, gap in reversed(points):
        plan = plan_record(inputs, program.options, found, program.pp, program.batch, program.mode)
        if plan is not None:
            plan["optimality_gap"] = gap  # of the best plan at its cap, not only of its own program
        plans.append(plan)
        if plan is None:
            used: Counter[str] = Counter()
            for j in found.option:
                used[program.options.node_type[j]] += int(program.options.nodes[j])
            record = empty_record(model, cluster, used, inputs.gbs)
            record.update(plans_evaluated=solved, note="its stages do not fit the nodes holding several GPU kinds")
            records.append(record)
            continue
        add_training_run(plan, model, train_steps, train_tokens)
        fits = plan.pop("fits_memory")
        records.append(_front_record(model, cluster, inputs.gbs, plan, fits, solved))
    mark_front(records)
    return RentFront(records, plans, quotas, len(programs), solves, stopped_by, time.monotonic() - started)


def _programs(inputs: Inputs) -> list[_Program]:
    """Every program of fasop.search.groupsearch's search, with its lower bound."""
    from fasop.search.groupsearch import group_depths, programs

    return [_Program(pp, batch, mode, options, bound) for depth in group_depths(inputs)
            for bound, pp, batch, mode, options in programs(inputs, depth)]


def _walk(inputs: Inputs, programs: list[_Program], prices: dict[str, float], deadline: float,
          max_points: int) -> tuple[list[tuple[_Program, Assignment, int, float]], int, str | None]:
    """The optimum at each cap, from no cap down (program, its assignment, the programs solved for it, the
    relative gap to the least bound at that cap), the programs solved in all, and what stopped the walk before a
    cap no plan meets (None: nothing did)."""
    points: list[tuple[_Program, Assignment, int, float]] = []
    solves = 0
    cap = np.inf
    while len(points) < max_points:
        try:
            best, solved, unproven_s = _best_at(inputs, programs, prices, cap, deadline)
        except TimeoutError:  # the budget ran out within this cap: the points so far stand
            return points, solves, "the time limit"
        solves += solved
        if best is None:  # no plan at this cap, unless a program ran out of time before finding one
            return points, solves, None if np.isinf(unproven_s) else "the time limit"
        assert best.found is not None  # _best_at returns a program with its answer
        found = best.found
        gap = max(found.gap, (found.objective_s - unproven_s) / found.objective_s if found.objective_s else 0.0)
        points.append((best, found, solved, gap))
        if best.price_per_hour_usd <= 0:  # free nodes: no cheaper plan
            return points, solves, None
        cap = best.price_per_hour_usd * (1 - PRICE_RESOLUTION)
    return points, solves, "the point limit"


def _best_at(inputs: Inputs, programs: list[_Program], prices: dict[str, float], cap: float,
             deadline: float) -> tuple[_Program | None, int, float]:
    """The program with the fastest plan whose nodes cost at most `cap` an hour (None: no plan does), the
    programs solved to find it, and the least lower bound of the programs whose optimum at this cap is not proven
    (each program gets at most groupsearch's PROGRAM_TIME_LIMIT_S: one hard program cannot hold up the walk; its
    bound then widens the point's gap); raises TimeoutError when the deadline passes first."""
    from fasop.search.groupsearch import PROGRAM_TIME_LIMIT_S
    from fasop.search.stageilp import solve_stage_ilp

    model = inputs.model
    capacity = {name: node.count for name, node in inputs.cluster.node_types.items()}
    # the fastest answer the cap still affords bounds every program from above before any is solved again
    affordable = [p for p in programs if not p.empty and p.found is not None and p.price_per_hour_usd <= cap]
    best = min(affordable, key=lambda p: (p.found.objective_s if p.found else np.inf, p.bound_s, p.pp, p.batch, p.mode),
               default=None)
    solved = 0
    unproven_s = np.inf
    for program in sorted(programs, key=lambda p: (p.bound_s, p.pp, p.batch, p.mode)):
        best_s = best.found.objective_s if best is not None and best.found is not None else None
        if program.empty or (best_s is not None and program.bound_s >= best_s):
            continue
        if program.found is None or program.price_per_hour_usd > cap:  # its last answer is beyond the cap
            program.bound_s = max(program.bound_s, _capped_bound(program, prices, cap, model.num_layers, inputs.gbs))
            if np.isinf(program.bound_s):  # no option within the cap at some position
                program.empty = True
            if program.empty or (best_s is not None and program.bound_s >= best_s):
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the walk's time limit passed")
            capped = not np.isinf(cap)
            solved += 1
            try:
                found = solve_stage_ilp(program.options, model.num_layers, inputs.gbs // program.batch, capacity,
                                        same_degrees_first_last=model.tie_embeddings,
                                        time_limit_s=min(left, PROGRAM_TIME_LIMIT_S), cutoff_s=best_s,
                                        prices=prices if capped else None, price_cap_per_hour=cap if capped else None)
            except TimeoutError:  # its share ran out before it found a plan
                unproven_s = min(unproven_s, program.bound_s)
                continue
            program.found = found
            if found is None:  # none at this cap, or none as fast as the best so far
                program.empty = best_s is None
                program.bound_s = max(program.bound_s, best_s or 0.0)
                program.price_per_hour_usd = np.inf
                continue
            program.price_per_hour_usd = _price(program.options, found, prices)
            program.bound_s = max(program.bound_s, found.bound_s)
        assert program.found is not None
        if program.found.status != "optimal":
            unproven_s = min(unproven_s, program.bound_s)
        if best_s is None or program.found.objective_s < best_s:
            best = program
    return best, solved, unproven_s


def _capped_bound(program: _Program, prices: dict[str, float], cap: float, num_layers: int, gbs: int) -> float:
    """groupsearch's lower bound over the options whose nodes alone cost at most `cap`; infinite when some
    position has none, or when the cheapest option at every position together cost more."""
    from fasop.search.groupsearch import lower_bound_s

    options = program.options
    price = np.array([prices[name] for name in options.node_type]) * options.nodes
    usable = (options.hi >= options.lo[:, None]) & (price <= cap)
    if not usable.any(axis=1).all() or np.where(usable, price, np.inf).min(axis=1).sum() > cap:
        return np.inf
    return lower_bound_s(replace(options, hi=np.where(usable, options.hi, -1)), num_layers, gbs // program.batch)


def _price(options: StageOptions, found: Assignment, prices: dict[str, float]) -> float:
    return float(sum(prices[options.node_type[j]] * int(options.nodes[j]) for j in found.option))


def _front_record(model: Model, cluster: Cluster, gbs: int, plan: dict, fits: bool, solved: int) -> dict:
    """The front-file record of one point: its composition and the stage-group plan the program chose, timed by
    the exact schedule (fasop.search.groupsearch's record), with the run's hours and dollars."""
    record = empty_record(model, cluster, Counter(plan["placement"]), gbs)
    record.update({key: plan[key] for key in PLAN_FIELDS})
    record.update(cost_per_hour_usd=plan["cost_per_hour_usd"], feasible=fits, plans_evaluated=solved,
                  kind=plan["kind"], stage_tp=[s["tp"] for s in plan["stages"]],
                  stage_dp=[s["dp"] for s in plan["stages"]], placement_search=plan["placement_search"],
                  optimality_gap=plan["optimality_gap"])
    if not fits:
        record["note"] = "the exact memory of the program's plan exceeds a GPU's"
    return record
