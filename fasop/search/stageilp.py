"""The integer program that chooses each pipeline stage's node type, tensor and data degrees and layer count.

A stage-group plan gives each of P pipeline stages s an option j_s (node type, tp, dp: StageOptions) and n_s
layers, Σ n_s = L; with m micro-batches its step time is

    F = Σ_s (sum_fixed[s,j_s] + layer[s,j_s] n_s) + (m - 1) max_s (period_fixed[s,j_s] + layer[s,j_s] n_s)
        + max_s (tail_fixed[s,j_s] + tail_layer[s,j_s] n_s).

The program is in configuration-assignment form: one binary x[s,j,n] for each position, option and layer count
that fits in memory, so every stage term is linear in x with no products of variables or big-M:
Σ_{j,n} x[s,j,n] = 1 at each s, Σ n x = L, the nodes of each type within its capacity, and continuous
Z >= period_s(x) and Y >= tail_s(x) at each s; minimise Σ_s sum_s(x) + (m - 1) Z + Y. This is exact: Z and Y
appear only on the large side of >= rows and with positive weight, so an optimum sets each to its max over the
stages (with m = 1, Z has no weight and is left out). Tied embeddings (same tp and dp at the first and last
stage) are one equality per (tp, dp) pair between the two positions' choices. With `prices` and
`price_cap_per_hour` (what to rent, fasop.market.rent), one more row holds the dollars per hour of the nodes the
stages take at or below the cap: Σ_{s,j,n} price[type_j] nodes_j x[s,j,n] <= cap.

Binaries are left out only where no optimum needs them: layer counts that the other positions' fewest and most
layers rule out, options taking more nodes than their type has, and an option dominated at a position by
another of the same node type (at tied first/last positions also the same tp and dp) that takes no more nodes,
costs no more in any term and fits at least as many layers: swapping it in keeps every constraint and cannot
raise F. The layer range is never narrowed further (a window around L / P loses heterogeneous optima).

HiGHS solves it through PuLP on one thread with a fixed seed, variables and rows created in a fixed order, so
the same inputs give the same assignment (under a time limit the result also depends on the machine's speed).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pulp
from scipy.optimize import Bounds, LinearConstraint, milp

from fasop.errors import ArgumentError

SEED = 0  # HiGHS's random seed, fixed so that repeated solves take the same path
# HiGHS's tolerances (1e-6 by default) let a proven bound stop about that far short of the optimum: a relative
# difference between bound and objective below this is no gap
NO_GAP = 1e-6
_C_LIBRARY = ctypes.CDLL(None)  # the process's C library, for fflush
BRUTE_FORCE_CELLS = 1 << 20  # (assignment, layer split, position) cells brute_force evaluates at once


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no single truth value to compare by
class StageOptions:
    """What every stage of a P-stage pipeline may be: J options (GPU type, tp, dp), each with its costs at
    each stage position as affine functions of the stage's layer count n."""

    node_type: tuple[str, ...]  # (J,) the node type whose nodes option j runs on
    tp: np.ndarray  # (J,) int
    dp: np.ndarray  # (J,) int
    nodes: np.ndarray  # (J,) int: nodes of its type option j takes (whole nodes)
    sum_fixed_s: np.ndarray  # (P, J) seconds added once to the step's sum term at position s, beyond layers
    layer_s: np.ndarray  # (P, J) forward+backward of one layer for one micro-batch at position s
    period_fixed_s: np.ndarray  # (P, J) the stage's steady-state period beyond its layers
    tail_fixed_s: np.ndarray  # (P, J) the stage's post-pipeline tail (gradient reduction, optimizer) beyond layers
    tail_layer_s: np.ndarray  # (P, J) what each layer adds to the tail
    lo: np.ndarray  # (P,) int fewest layers at position s
    hi: np.ndarray  # (P, J) int most layers that fit in memory at position s (< lo: option j cannot be at s)

    def __post_init__(self) -> None:
        positions, count = np.shape(self.layer_s) if np.ndim(self.layer_s) == 2 else (0, 0)
        if positions < 1 or count < 1:
            raise ArgumentError("options", f"layer_s must be a (positions, options) array, not of shape {np.shape(self.layer_s)}")
        shapes = {"tp": (count,), "dp": (count,), "nodes": (count,), "lo": (positions,), "hi": (positions, count),
                  **dict.fromkeys(("sum_fixed_s", "period_fixed_s", "tail_fixed_s", "tail_layer_s"), (positions, count))}
        for name, shape in shapes.items():
            if np.shape(getattr(self, name)) != shape:
                raise ArgumentError("options", f"{name} has shape {np.shape(getattr(self, name))}, expected {shape}")
        if len(self.node_type) != count:
            raise ArgumentError("options", f"node_type names {len(self.node_type)} options, expected {count}")
        for name in ("sum_fixed_s", "layer_s", "period_fixed_s", "tail_fixed_s", "tail_layer_s"):
            if not np.all(np.isfinite(getattr(self, name)) & (np.asarray(getattr(self, name)) >= 0)):
                raise ArgumentError("options", f"{name} must hold finite seconds, 0 or more")  # the floors need it
        if np.any(np.asarray(self.lo) < 0):
            raise ArgumentError("options", "lo must be 0 or more layers at every position")

    @property
    def positions(self) -> int:
        return int(np.shape(self.layer_s)[0])

    @property
    def count(self) -> int:
        return len(self.node_type)


@dataclass(frozen=True)
class Assignment:
    option: tuple[int, ...]  # option index at each position
    layers: tuple[int, ...]  # layers at each position
    objective_s: float  # F of this assignment, recomputed from the arrays (not the solver's float)
    bound_s: float  # the solver's dual bound on F (== objective_s up to tolerance when proven optimal)
    gap: float  # relative gap (objective - bound) / objective, >= 0; at most gap_rel when "optimal"
    status: str  # "optimal" or "time-limit" (a solution without proof)


def _objectives(options: StageOptions, num_microbatches: int, option: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """F of assignments: `option` and `layers` broadcast to (..., P)."""
    position = np.arange(options.positions)
    per_layer = options.layer_s[position, option]
    step = (options.sum_fixed_s[position, option] + per_layer * layers).sum(axis=-1)
    period = (options.period_fixed_s[position, option] + per_layer * layers).max(axis=-1)
    tail = (options.tail_fixed_s[position, option] + options.tail_layer_s[position, option] * layers).max(axis=-1)
    return step + (num_microbatches - 1) * period + tail


def objective(options: StageOptions, num_microbatches: int, option, layers) -> float:
    """F (module docstring) of option j_s and n_s layers at each position s."""
    return float(_objectives(options, num_microbatches, np.asarray(option), np.asarray(layers, dtype=float)))


def _check_arguments(options: StageOptions, num_layers: int, num_microbatches: int, capacity: dict[str, int],
                     prices: dict[str, float] | None, price_cap_per_hour: float | None) -> np.ndarray | None:
    """The arguments checked; the dollars per hour of each option's nodes when a price cap is given."""
    if num_layers < 1:
        raise ArgumentError("num_layers", "must be 1 or more", num_layers)
    if num_microbatches < 1:
        raise ArgumentError("num_microbatches", "must be 1 or more", num_microbatches)
    missing = sorted(set(options.node_type) - set(capacity))
    if missing:
        raise ArgumentError("capacity", f"has no node count for node type {missing[0]}")
    if (prices is None) != (price_cap_per_hour is None):
        raise ArgumentError("price_cap_per_hour", "needs prices, the dollars per hour of a node of each type (and "
                                                  "prices needs the cap)")
    if prices is None or price_cap_per_hour is None:
        return None
    if not (np.isfinite(price_cap_per_hour) and price_cap_per_hour >= 0):
        raise ArgumentError("price_cap_per_hour", "must be a finite number of dollars per hour, 0 or more",
                            price_cap_per_hour)
    unpriced = sorted(set(options.node_type) - set(prices))
    if unpriced:
        raise ArgumentError("prices", f"has no price for node type {unpriced[0]}")
    per_node = np.array([prices[node_type] for node_type in options.node_type], dtype=float)
    if not np.all(np.isfinite(per_node) & (per_node >= 0)):
        raise ArgumentError("prices", "must hold finite dollars per hour, 0 or more")
    return per_node * options.nodes


def _price_row(option_price: np.ndarray | None, price_cap_per_hour: float | None) -> np.ndarray | None:
    """Each option's share of the cap, the price row's coefficients (its bound 1: the solver's tolerance on a
    row is then relative to the cap); None when no cap binds a choice (at a cap of 0 only free options remain)."""
    if option_price is None or price_cap_per_hour is None or price_cap_per_hour == 0:
        return None
    return option_price / price_cap_per_hour


def brute_force(options: StageOptions, num_layers: int, num_microbatches: int, capacity: dict[str, int], *,
                same_degrees_first_last: bool = False, prices: dict[str, float] | None = None,
                price_cap_per_hour: float | None = None) -> Assignment | None:
    """The best assignment by trying every one (small problems only: J^P option tuples times the layer splits);
    of equal ones, the first in lexicographic order of options, then layers. None when none is feasible."""
    option_price = _check_arguments(options, num_layers, num_microbatches, capacity, prices, price_cap_per_hour)
    lo = [int(fewest) for fewest in options.lo]
    heads = list(itertools.product(*(range(fewest, num_layers + 1) for fewest in lo[:-1])))
    splits = np.array(heads, dtype=int).reshape(len(heads), len(lo) - 1)
    splits = np.column_stack([splits, num_layers - splits.sum(axis=1)])
    splits = splits[splits[:, -1] >= lo[-1]]
    tuples = np.array(list(itertools.product(range(options.count), repeat=options.positions)), dtype=int)
    kinds = np.array(options.node_type)
    fits = np.ones(len(tuples), dtype=bool)
    for node_type, nodes in capacity.items():
        fits &= np.where(kinds[tuples] == node_type, options.nodes[tuples], 0).sum(axis=1) <= nodes
    if option_price is not None:
        fits &= option_price[tuples].sum(axis=1) <= price_cap_per_hour
    if same_degrees_first_last:
        fits &= (options.tp[tuples[:, 0]] == options.tp[tuples[:, -1]]) & (options.dp[tuples[:, 0]] == options.dp[tuples[:, -1]])
    tuples = tuples[fits]
    best, best_f = None, np.inf
    chunk = max(1, BRUTE_FORCE_CELLS // max(1, len(splits) * options.positions))
    for start in range(0, len(tuples) if len(splits) else 0, chunk):
        option = tuples[start:start + chunk, None, :]
        f = _objectives(options, num_microbatches, option, splits[None, :, :].astype(float))
        f[~(splits[None] <= options.hi[np.arange(options.positions), option]).all(axis=-1)] = np.inf
        k = np.unravel_index(np.argmin(f), f.shape)
        if f[k] < best_f:
            best_f, best = f[k], (tuples[start + k[0]], splits[k[1]])
    if best is None:
        return None
    return Assignment(tuple(best[0].tolist()), tuple(best[1].tolist()), float(best_f), float(best_f), 0.0, "optimal")


def _undominated(options: StageOptions, position: int, chosen: np.ndarray, most: np.ndarray, tied: bool) -> np.ndarray:
    """The options among `chosen` (indices) that no other of them dominates at `position` (module docstring);
    of options equal in every term the first stays. `most`: each chosen option's most layers there."""
    s = position
    cost = np.column_stack([options.nodes[chosen], options.sum_fixed_s[s, chosen], options.layer_s[s, chosen],
                            options.period_fixed_s[s, chosen], options.tail_fixed_s[s, chosen],
                            options.tail_layer_s[s, chosen], -most])
    kind = np.array(options.node_type)[chosen]
    same_group = kind[:, None] == kind[None, :]
    if tied:
        same_group &= (options.tp[chosen][:, None] == options.tp[chosen]) & (options.dp[chosen][:, None] == options.dp[chosen])
    no_worse = (cost[:, None, :] <= cost[None, :, :]).all(axis=-1)  # [k, i]: k no worse than i in every term
    equal = (cost[:, None, :] == cost[None, :, :]).all(axis=-1)
    earlier = np.arange(len(chosen))[:, None] < np.arange(len(chosen))[None, :]
    dominated = (same_group & no_worse & (~equal | earlier)).any(axis=0)
    return chosen[~dominated]


def _candidates(options: StageOptions, num_layers: int, capacity: dict[str, int], tied: bool,
                option_price: np.ndarray | None = None,
                price_cap_per_hour: float | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(option, layers) of every binary at each position, by option then layers."""
    lo = options.lo.astype(int)
    hi = np.minimum(options.hi, num_layers).astype(int)
    most_elsewhere = hi.max(axis=1).sum() - hi.max(axis=1)
    fewest = np.maximum(lo, num_layers - most_elsewhere)  # what the other positions cannot take
    most = num_layers - (lo.sum() - lo)  # leaves the other positions their fewest
    fits_nodes = options.nodes <= np.array([capacity[node_type] for node_type in options.node_type])
    if option_price is not None:
        fits_nodes &= option_price <= price_cap_per_hour
    found = []
    for s in range(options.positions):
        upper = np.minimum(hi[s], most[s])
        chosen = np.flatnonzero(fits_nodes & (upper >= fewest[s]))
        tied_here = tied and s in (0, options.positions - 1)
        kept = _undominated(options, s, chosen, upper[chosen], tied_here)
        counts = upper[kept] - fewest[s] + 1
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        found.append((np.repeat(kept, counts), fewest[s] + offsets))
    return found


def _row(variables: list[pulp.LpVariable], coefficients: np.ndarray) -> pulp.LpAffineExpression:
    return pulp.LpAffineExpression((variable, c) for variable, c in zip(variables, coefficients.tolist()) if c)


def _floor(options: StageOptions, candidates: list[tuple[np.ndarray, np.ndarray]], terms: list[np.ndarray],
           num_layers: int, capacity: dict[str, int], price_row: np.ndarray | None = None) -> float | None:
    """A lower bound on max_s term_s over every assignment of the candidates, None when none is feasible.

    At a threshold θ, option j at position s can hold n_sj(θ) layers: its most there with term <= θ. Were the
    max θ or less, one whole option at each position (binaries y_sj) within the node capacities (and the price
    cap) would hold L layers: Σ y_sj n_sj(θ) >= L. The floor is the least candidate term at which that small integer program
    (no layer count to choose, no max) is feasible: a bisection, as feasibility grows with θ."""
    positions, count = len(candidates), options.count
    cell = np.concatenate([s * count + js for s, (js, _) in enumerate(candidates)])  # (position, option) of each
    layers = np.concatenate([ns for _, ns in candidates])
    term = np.concatenate(terms)
    kinds = sorted(set(options.node_type))
    uses = np.array([np.where(np.array(options.node_type) == kind, options.nodes, 0) for kind in kinds])
    rows = [LinearConstraint(np.kron(np.eye(positions), np.ones(count)), 1, 1),
            LinearConstraint(np.tile(uses, positions), -np.inf, [capacity[kind] for kind in kinds])]
    if price_row is not None:
        rows.append(LinearConstraint(np.tile(price_row, positions), -np.inf, 1.0))

    def holds(threshold: float) -> bool:
        most = np.full(positions * count, -1)
        np.maximum.at(most, cell[term <= threshold], layers[term <= threshold])
        with _quiet_stdout():  # scipy's own copy of HiGHS prints debugging lines too
            done = milp(-np.maximum(most, 0), integrality=np.ones(len(most)),
                        bounds=Bounds(0, (most >= 0).astype(float)), constraints=rows)
        return done.status == 0 and -done.fun >= num_layers - 0.5

    levels = np.unique(term)
    if not holds(levels[-1]):
        return None
    low, high = 0, len(levels) - 1  # the least level that holds is in levels[low:high + 1]
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(levels[middle]) else (middle + 1, high)
    return float(levels[low])


def _stage_max(prob: pulp.LpProblem, x: list[list[pulp.LpVariable]], candidates: list[tuple[np.ndarray, np.ndarray]],
               terms: list[np.ndarray], floor: float, name: str) -> pulp.LpVariable:
    """A variable at least each stage's term (`terms[s]`: its value at each candidate of position s), and at
    least `floor` (_floor).

    Besides the row per stage, a row per (stage, option): the variable is at least the option's term when the
    stage takes it and at least the floor otherwise (the hull of that disjunction). Without them the relaxation
    takes a fraction of a fast, many-node option with many layers at its full speed per layer; with them a
    fraction w of the option costs (1 - w) floor besides."""
    variable = prob.add_variable(name, lowBound=floor)
    for s, ((js, _), term) in enumerate(zip(candidates, terms)):
        prob += (_row(x[s], term) - variable <= 0, f"{name}_{s:03d}")
        options, starts = np.unique(js, return_index=True)  # candidates come grouped by option
        for j, start, end in zip(options.tolist(), starts.tolist(), [*starts[1:].tolist(), len(js)]):
            if term[start:end].max() > floor:
                prob += (_row(x[s][start:end], term[start:end] - floor) - variable <= -floor, f"{name}_{s:03d}_{j:05d}")
    return variable


def _program(options: StageOptions, candidates: list[tuple[np.ndarray, np.ndarray]], num_layers: int,
             num_microbatches: int, capacity: dict[str, int], tied: bool,
             cutoff_s: float | None = None,
             price_row: np.ndarray | None = None) -> tuple[pulp.LpProblem, list[list[pulp.LpVariable]]] | None:
    """The program of the module docstring over the candidate binaries, with F <= `cutoff_s` when given and the
    options' shares of the price cap (`price_row`) adding up to at most 1; None when a relaxation is infeasible."""
    periods = [options.period_fixed_s[s, js] + options.layer_s[s, js] * ns for s, (js, ns) in enumerate(candidates)]
    tails = [options.tail_fixed_s[s, js] + options.tail_layer_s[s, js] * ns for s, (js, ns) in enumerate(candidates)]
    period_floor = _floor(options, candidates, periods, num_layers, capacity, price_row)
    tail_floor = _floor(options, candidates, tails, num_layers, capacity, price_row)
    if period_floor is None or tail_floor is None:
        return None
    prob = pulp.LpProblem("stage_group_plan", pulp.LpMinimize)
    x = [[prob.add_variable(f"x_{s:03d}_{j:05d}_{n:04d}", cat=pulp.LpBinary) for j, n in zip(js.tolist(), ns.tolist())]
         for s, (js, ns) in enumerate(candidates)]
    objective_terms: list[tuple[pulp.LpVariable, float]] = []
    for s, (js, ns) in enumerate(candidates):
        objective_terms += zip(x[s], (options.sum_fixed_s[s, js] + options.layer_s[s, js] * ns).tolist())
        prob += (_row(x[s], np.ones(len(js))) == 1, f"one_{s:03d}")
    if num_microbatches > 1:
        objective_terms.append((_stage_max(prob, x, candidates, periods, period_floor, "z_period"), num_microbatches - 1))
    objective_terms.append((_stage_max(prob, x, candidates, tails, tail_floor, "y_tail"), 1))
    prob += pulp.LpAffineExpression(objective_terms)
    if cutoff_s is not None:  # a row, not HiGHS's objective_bound, which a solution found in presolve ignores
        prob += (pulp.LpAffineExpression(objective_terms) <= cutoff_s, "cutoff")
    every_x = [variable for row in x for variable in row]
    prob += (_row(every_x, np.concatenate([ns for _, ns in candidates])) == num_layers, "layers")
    kinds = np.array(options.node_type)
    for number, node_type in enumerate(sorted(set(options.node_type))):
        taken = [np.where(kinds[js] == node_type, options.nodes[js], 0) for js, _ in candidates]
        if sum(int(row.max()) for row in taken) > capacity[node_type]:  # a row that can bind
            prob += (_row(every_x, np.concatenate(taken)) <= capacity[node_type], f"capacity_{number:03d}")
    if price_row is not None:
        shares = [price_row[js] for js, _ in candidates]
        if sum(float(row.max()) for row in shares) > 1:  # a row that can bind
            prob += (_row(every_x, np.concatenate(shares)) <= 1, "price_cap")
    if tied:
        (first_j, _), (last_j, _) = candidates[0], candidates[-1]
        pairs = sorted({(int(options.tp[j]), int(options.dp[j])) for j in np.concatenate([first_j, last_j])})
        for number, (tp, dp) in enumerate(pairs):
            first = (options.tp[first_j] == tp) & (options.dp[first_j] == dp)
            last = (options.tp[last_j] == tp) & (options.dp[last_j] == dp)
            prob += (_row(x[0], first.astype(float)) - _row(x[-1], last.astype(float)) == 0, f"tied_{number:03d}")
    return prob, x


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints its banner to the process's standard output on its first use whatever its options say, and
    some solver paths (in pulp's highspy and in scipy's own copy) print debugging lines with C's printf; output
    that a command writes to stdout must not carry them. C's stdout buffer is flushed before the descriptor comes
    back (into a file or a pipe it is fully buffered, and would otherwise reach the real stdout at exit)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        _C_LIBRARY.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def solve_stage_ilp(options: StageOptions, num_layers: int, num_microbatches: int, capacity: dict[str, int], *,
                    same_degrees_first_last: bool = False, time_limit_s: float = 60.0, gap_rel: float = 1e-4,
                    cutoff_s: float | None = None, prices: dict[str, float] | None = None,
                    price_cap_per_hour: float | None = None) -> Assignment | None:
    """The best assignment (module docstring) within `time_limit_s` and relative gap `gap_rel`. None when no
    assignment is feasible, or when `cutoff_s` is given and none has F at or below it. With `prices` (dollars
    per hour of a node of each type) and `price_cap_per_hour`, only assignments whose nodes cost at most the cap
    (within HiGHS's feasibility tolerance, 1e-6 of the cap) are feasible.
    Raises TimeoutError when the time limit passes before any assignment is found."""
    option_price = _check_arguments(options, num_layers, num_microbatches, capacity, prices, price_cap_per_hour)
    if time_limit_s <= 0:
        raise ArgumentError("time_limit_s", "must be more than 0 seconds", time_limit_s)
    if gap_rel < 0:
        raise ArgumentError("gap_rel", "must be 0 or more", gap_rel)
    tied = same_degrees_first_last and options.positions > 1
    candidates = _candidates(options, num_layers, capacity, tied, option_price, price_cap_per_hour)
    if any(len(js) == 0 for js, _ in candidates):
        return None
    program = _program(options, candidates, num_layers, num_microbatches, capacity, tied, cutoff_s,
                       _price_row(option_price, price_cap_per_hour))
    if program is None:
        return None
    prob, x = program
    solver = pulp.HiGHS(msg=False, threads=1, random_seed=SEED, timeLimit=time_limit_s, gapRel=gap_rel, gapAbs=0.0)
    with _quiet_stdout():
        prob.solve(solver)
    if prob.sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionUnbounded):
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise TimeoutError(f"no assignment found within time_limit_s={time_limit_s}")
    picked = [next(k for k, variable in enumerate(row) if variable.varValue > 0.5) for row in x]
    option = tuple(int(js[k]) for (js, _), k in zip(candidates, picked))
    layers = tuple(int(ns[k]) for (_, ns), k in zip(candidates, picked))
    f = objective(options, num_microbatches, option, layers)
    dual_bound = min(float(prob.solverModel.getInfo().mip_dual_bound), f)
    gap = (f - dual_bound) / abs(f) if f else 0.0
    if gap < NO_GAP:
        gap, dual_bound = 0.0, f
    # PuLP maps HiGHS's time limit with an incumbent to status Optimal: only sol_status tells a proof
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time-limit"
    return Assignment(option, layers, f, dual_bound, gap, status)
