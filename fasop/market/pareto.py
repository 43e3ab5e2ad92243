"""Which machines to rent: sweep every composition of a cluster's node types, keep each composition's best
plan, and mark the Pareto front of time to train against the cost of the run.

    from fasop.market.pareto import compositions, sweep, choose
    records = sweep(model, cluster, compositions(cluster), train_steps=10_000)
    best, message = choose(records, budget_usd=5_000)

`sweep_and_choose` does both, as `fasop pareto` does; `pareto`, the Python API's `fasop.pareto`, returns its
records as a pandas DataFrame.

A composition is a number of nodes of each node type (`{"A100": 2, "A10": 4}`); the planner searches every
plan that uses all of its GPUs and the composition keeps the fastest (within one composition the fastest
plan is also the cheapest: every plan pays for the same nodes). A composition on which no plan fits in
memory, or no plan can use the global batch size, stays in the sweep as an infeasible row.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from fasop.cost.price import check_run_length
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.market.frontfile import INT_COLUMNS, NODES_PREFIX, TAIL_COLUMNS

DEFAULT_TRAIN_STEPS = 10_000  # run length used when neither train_steps nor train_tokens is given
PARALLEL_COMPOSITIONS = 8  # compositions per process: smaller sweeps stay in one process
MAX_COMPOSITIONS = 4096  # a sweep searches each composition: more would run for hours (or forever)

PLAN_FIELDS = ("mbs", "tp", "dp", "pp", "num_microbatches", "placement", "layers_per_stage", "step_time_s",
               "throughput_samples_per_s", "cost_per_step_usd", "train_steps", "train_hours", "train_cost_usd",
               "peak_memory_gib")


# -- compositions --------------------------------------------------------------------------------------

def compositions(cluster: Cluster, max_nodes: dict[str, int] | None = None) -> list[dict[str, int]]:
    """Every composition of 0 up to the available count of each node type (capped by `max_nodes`), without
    the empty one; more than MAX_COMPOSITIONS are refused. Order: the cluster file's node types as digits, the
    first type most significant, counting up (for A100 and A10: {A100 0, A10 1}, {A100 0, A10 2}, ..., {A100 1, A10 0}, ...)."""
    caps = {name: t.count for name, t in cluster.node_types.items()}
    for name, cap in (max_nodes or {}).items():
        if name not in caps:
            raise ArgumentError("max_nodes", f"unknown node type {name!r} (cluster {cluster.name} has {', '.join(caps)})")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ArgumentError("max_nodes", f"expected a node count >= 0 for {name}, got {cap!r}")
        caps[name] = min(caps[name], cap)
    names = list(caps)
    count = math.prod(caps[n] + 1 for n in names) - 1
    if count > MAX_COMPOSITIONS:
        raise ArgumentError("max_nodes", f"{count:,} compositions to sweep, more than the limit of {MAX_COMPOSITIONS:,} "
                                         "(each is a whole search); cap the node counts of some types")
    result = [dict(zip(names, counts)) for counts in itertools.product(*(range(caps[n] + 1) for n in names))
              if any(counts)]
    if not result:
        raise ArgumentError("max_nodes", "every node type is capped at 0 nodes: nothing to sweep")
    return result


all_compositions = compositions  # the name `sweep` can reach under its parameter of the same name


def composition_label(record: dict, unit: bool = False) -> str:
    """'2 A100 + 4 A10' from the nodes_<type> fields of a record (types at 0 left out); with `unit`,
    '2 A100 nodes + 4 A10 nodes' (a line of text, where '4 A100' could be read as four GPUs)."""
    parts = [f"{n} {name}" + (f" node{'s' if n > 1 else ''}" if unit else "")
             for name, n in node_counts(record).items() if n]
    return " + ".join(parts) if parts else "no nodes"


def node_counts(record: dict) -> dict[str, int]:
    return {key[len(NODES_PREFIX):]: int(value) for key, value in record.items() if key.startswith(NODES_PREFIX)}


def composition_kind(record: dict) -> str | None:
    """The node type of a single-type composition, None for a mixed one."""
    used = [name for name, n in node_counts(record).items() if n]
    return used[0] if len(used) == 1 else None


# -- the sweep -----------------------------------------------------------------------------------------

def _empty_record(model: Model, cluster: Cluster, composition: dict[str, int], gbs: int) -> dict:
    """A row in the order of the front file's columns, its plan fields empty."""
    record: dict = {"model": model.name, "cluster": cluster.name, "gbs": gbs}
    for name in cluster.node_types:
        record[NODES_PREFIX + name] = int(composition.get(name, 0))
    for key in TAIL_COLUMNS:
        record[key] = None
    record["gpus"] = sum(composition.values()) * cluster.gpus_per_node
    record["feasible"] = False
    record["on_front"] = False
    record["cost_per_hour_usd"] = sum(t.price_per_hour_usd * composition.get(n, 0) for n, t in cluster.node_types.items())
    record["plans_evaluated"] = 0
    record["out_of_memory"] = 0
    record["note"] = ""
    return record


@dataclass(frozen=True)
class _Composition:
    """Finds the fastest plan of one composition (a picklable task, so compositions can run in parallel)."""

    model: Model
    cluster: Cluster
    gbs: int
    train_steps: int | None
    train_tokens: float | None
    distributed_optimizer: bool
    profiles: dict

    def __call__(self, composition: dict[str, int]) -> dict:
        from fasop.search import search_plans

        model, cluster = self.model, self.cluster
        record = _empty_record(model, cluster, composition, self.gbs)
        try:
            # only the fastest plan matters: sound lower bounds skip partitions that cannot beat it
            result = search_plans(model, cluster.with_counts(composition), self.gbs, profiles=self.profiles,
                                  distributed_optimizer=self.distributed_optimizer, train_steps=self.train_steps,
                                  train_tokens=self.train_tokens, sort="time", keep=1, workers=1, use_all=True)
        except InputError as err:  # e.g. no data-parallel degree divides the batch size on these GPUs
            record["note"] = err.problem
            return record
        record["plans_evaluated"] = result.plans_evaluated
        record["out_of_memory"] = result.out_of_memory
        if result.plans:
            best = result.plans[0]
            for key in PLAN_FIELDS:
                record[key] = getattr(best, key)
            record["placement"] = list(best.placement)
            record["layers_per_stage"] = list(best.layers_per_stage)
            record["cost_per_hour_usd"] = best.cost_per_hour_usd
            record["feasible"] = True
        else:
            note = f"no plan fits in memory ({result.out_of_memory} tried)"
            if result.closest_memory_factor is not None:
                note += f"; the closest needs {result.closest_memory_factor:.2f}x the GPU memory"
            record["note"] = note
        return record


def _checked_compositions(cluster: Cluster, compositions: list[dict[str, int]]) -> list[dict[str, int]]:
    for composition in compositions:
        for name in composition:
            if name not in cluster.node_types:
                raise InputError(f"composition {composition}",
                                 f"unknown node type {name!r} (cluster has {', '.join(cluster.node_types)})")
        if any(n < 0 for n in composition.values()) or not any(composition.values()):
            raise InputError(f"composition {composition}", "expected node counts >= 0, at least one of them positive")
    return compositions


def sweep(model: Model, cluster: Cluster, compositions: list[dict[str, int]] | None = None, *,
          gbs: int | None = None, train_steps: int | None = None, train_tokens: float | None = None,
          profiles_dir: str | None = None, distributed_optimizer: bool = True, allow_profile_mismatch: bool = False,
          progress: Callable[[int, int], None] | None = None, profiles: dict | None = None) -> list[dict]:
    """One record per composition (in the order given; default: every composition of `cluster`) with its
    fastest plan, the time and cost of the whole run, and `on_front`, the Pareto flag over
    (train_hours, train_cost_usd); `profiles`: already loaded (by GPU type) instead of reading profiles_dir.

    The run is `train_steps` steps, or `train_tokens` tokens (steps = tokens / (gbs * sequence length),
    rounded up); with neither, DEFAULT_TRAIN_STEPS steps. The front does not depend on the run length (time
    and cost of every composition scale with it alike); budgets and deadlines do.
    """
    from fasop.inputs.catalogue import merged_specs
    from fasop.inputs.profiles import load_profiles
    from fasop.search.space import check_global_batch

    check_run_length(train_steps, train_tokens)
    if train_steps is None and train_tokens is None:
        train_steps = DEFAULT_TRAIN_STEPS
    gbs = check_global_batch(model.global_batch_size if gbs is None else gbs)
    compositions = all_compositions(cluster) if compositions is None else _checked_compositions(cluster, compositions)
    # problems common to every composition (a missing or malformed profile) are errors, raised once here;
    # the profiles, and the per-size times they memoise, then serve every composition
    if profiles is None:
        profiles = load_profiles(model, [t.gpu for t in cluster.node_types.values()], profiles_dir,
                                 allow_profile_mismatch, merged_specs(own=cluster.gpus))
    task = _Composition(model, cluster, gbs, train_steps, train_tokens, distributed_optimizer, profiles)
    workers = min(os.cpu_count() or 1, len(compositions) // PARALLEL_COMPOSITIONS)
    if workers <= 1:
        records = []
        for done, composition in enumerate(compositions, start=1):
            records.append(task(composition))
            if progress:
                progress(done, len(compositions))
    else:
        with ProcessPoolExecutor(workers) as pool:
            futures = [pool.submit(task, composition) for composition in compositions]
            for done, _ in enumerate(as_completed(futures), start=1):
                if progress:
                    progress(done, len(compositions))
            records = [future.result() for future in futures]
    mark_front(records)
    return records


# -- the Pareto front ------------------------------------------------------------------------------------

def pareto_front(times, costs) -> np.ndarray:
    """Which points are on the Pareto front when both coordinates are minimised.

    A point is on the front iff no other point is <= in both coordinates and < in at least one; equal
    points therefore are all on the front or all off it. Points with a NaN or infinite coordinate are
    never on it and dominate nothing.
    """
    t = np.asarray(times, dtype=float).ravel()
    c = np.asarray(costs, dtype=float).ravel()
    if t.shape != c.shape:
        raise ValueError(f"times and costs differ in length ({t.size} and {c.size})")
    on = np.zeros(t.size, dtype=bool)
    valid = np.flatnonzero(np.isfinite(t) & np.isfinite(c))
    order = valid[np.lexsort((c[valid], t[valid]))]  # by time, then cost
    best_before = math.inf  # least cost among points strictly faster than the current time
    start = 0
    while start < order.size:
        end = start
        while end < order.size and t[order[end]] == t[order[start]]:
            end += 1
        group = order[start:end]
        least = c[group].min()
        # dominated by a strictly faster point that costs no more, or an equally fast one that costs less
        on[group] = (c[group] < best_before) & (c[group] == least)
        best_before = min(best_before, least)
        start = end
    return on


def mark_front(records: list[dict]) -> None:
    """Set each record's `on_front` from the feasible records' (train_hours, train_cost_usd)."""
    times = [r["train_hours"] if r.get("feasible") else math.nan for r in records]
    costs = [r["train_cost_usd"] if r.get("feasible") else math.nan for r in records]
    for record, on in zip(records, pareto_front(times, costs)):
        record["on_front"] = bool(on)


# -- budget and deadline ----------------------------------------------------------------------------------

def _describe(record: dict) -> str:
    return (f"{composition_label(record, unit=True)} (tp={record['tp']} dp={record['dp']} pp={record['pp']} "
            f"mbs={record['mbs']}): {record['train_hours']:,.2f} h, ${record['train_cost_usd']:,.2f}")


def check_limits(budget_usd: float | None = None, deadline_hours: float | None = None) -> None:
    """A budget and a deadline, when given, must be positive finite numbers."""
    for value, argument, unit in ((budget_usd, "budget_usd", "dollars"), (deadline_hours, "deadline_hours", "hours")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ArgumentError(argument, f"expected a positive number of {unit}, got {value:g}"
                                if isinstance(value, (int, float)) else f"expected a positive number of {unit}, got {value!r}")


def _hours(record: dict) -> float:
    return record["train_hours"]


def _cost(record: dict) -> float:
    return record["train_cost_usd"]


def _choose_within(feasible: list[dict], limit: float, measure, other, texts: tuple[str, str]) -> tuple[dict | None, str]:
    """One limit on `measure` (cost or hours): the run that is best by `other` within it (ties: the better by
    `measure`), else None and how far the best run by `measure` misses it; texts: (found, missed as a format
    of near, miss and pct)."""
    meets = [r for r in feasible if measure(r) <= limit]
    if meets:
        best = min(meets, key=lambda r: (other(r), measure(r)))
        return best, f"{texts[0]}: {_describe(best)}"
    near = min(feasible, key=lambda r: (measure(r), other(r)))
    miss = measure(near) - limit
    return None, texts[1].format(near=_describe(near), miss=miss, pct=100 * miss / limit)


def choose(records: list[dict], budget_usd: float | None = None,
           deadline_hours: float | None = None) -> tuple[dict | None, str]:
    """The composition that meets the constraint best, and a one-line message saying so.

    - budget only: the fastest run whose cost is within the budget (ties: the cheaper);
    - deadline only: the cheapest run that ends within the deadline (ties: the faster);
    - both: the cheapest run that meets both (ties: the faster).
    When none qualifies: (None, a message naming the closest composition and how far it misses: the
    cheapest for a budget, the fastest for a deadline, and for both the one whose worse overshoot, in
    percent of its limit, is smallest). With neither limit: (None, "").
    """
    check_limits(budget_usd, deadline_hours)
    if budget_usd is None and deadline_hours is None:
        return None, ""
    feasible = [r for r in records if r.get("feasible")]
    if not feasible:
        return None, "no composition has a plan that fits in memory"
    if budget_usd is not None and deadline_hours is not None:
        return _choose_within_both(feasible, budget_usd, deadline_hours)
    if budget_usd is not None:
        return _choose_within(feasible, budget_usd, _cost, _hours, (
            f"fastest within the budget of ${budget_usd:,.2f}",
            f"no composition fits the budget of ${budget_usd:,.2f}; the cheapest, {{near}}, is ${{miss:,.2f}} "
            "({pct:.1f}%) over"))
    assert deadline_hours is not None  # one of the two limits is given (checked above)
    return _choose_within(feasible, deadline_hours, _hours, _cost, (
        f"cheapest within the deadline of {deadline_hours:,.2f} h",
        f"no composition meets the deadline of {deadline_hours:,.2f} h; the fastest, {{near}}, takes "
        "{miss:,.2f} h ({pct:.1f}%) longer"))


def _choose_within_both(feasible: list[dict], budget_usd: float, deadline_hours: float) -> tuple[dict | None, str]:
    """Both limits: the cheapest run that meets both, else the one whose worse overshoot is smallest."""
    hours, cost = _hours, _cost
    meets = [r for r in feasible if cost(r) <= budget_usd and hours(r) <= deadline_hours]
    limits = f"the budget of ${budget_usd:,.2f} and the deadline of {deadline_hours:,.2f} h"
    if meets:
        best = min(meets, key=lambda r: (cost(r), hours(r)))
        return best, f"cheapest within {limits}: {_describe(best)}"

    def overshoot(r: dict) -> float:
        return max(cost(r) / budget_usd, hours(r) / deadline_hours) - 1.0

    near = min(feasible, key=lambda r: (overshoot(r), cost(r), hours(r)))
    misses = []
    if cost(near) > budget_usd:
        over = cost(near) - budget_usd
        misses.append(f"${over:,.2f} ({100 * over / budget_usd:.1f}%) over budget")
    if hours(near) > deadline_hours:
        late = hours(near) - deadline_hours
        misses.append(f"{late:,.2f} h ({100 * late / deadline_hours:.1f}%) late")
    return None, f"no composition meets {limits}; the closest, {_describe(near)}, is {' and '.join(misses)}"


# -- what `fasop pareto` computes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    """A sweep's records, `on_front` marked, and the composition that meets the budget or deadline best."""

    records: list[dict]
    chosen: dict | None  # one of `records`; None without a budget or deadline, or when no composition meets it
    choice: str  # the line that says which and why ("" without a budget or deadline)


def sweep_and_choose(model: Model, cluster: Cluster, compositions: list[dict[str, int]] | None = None, *,
                     budget_usd: float | None = None, deadline_hours: float | None = None, gbs: int | None = None,
                     train_steps: int | None = None, train_tokens: float | None = None, profiles_dir: str | None = None,
                     distributed_optimizer: bool = True, allow_profile_mismatch: bool = False,
                     progress: Callable[[int, int], None] | None = None, profiles: dict | None = None) -> Sweep:
    """`sweep` of `compositions`, then `choose` within `budget_usd` and `deadline_hours`. A budget or a deadline
    needs the length of the run: the default length would decide which composition meets it."""
    check_limits(budget_usd, deadline_hours)
    if (budget_usd is not None or deadline_hours is not None) and train_steps is None and train_tokens is None:
        raise ArgumentError("budget_usd" if budget_usd is not None else "deadline_hours",
                            "a budget or deadline needs the length of the run: give train_steps or train_tokens")
    records = sweep(model, cluster, compositions, gbs=gbs, train_steps=train_steps, train_tokens=train_tokens,
                    profiles_dir=profiles_dir, distributed_optimizer=distributed_optimizer,
                    allow_profile_mismatch=allow_profile_mismatch, progress=progress, profiles=profiles)
    chosen, choice = choose(records, budget_usd, deadline_hours)
    return Sweep(records, chosen, choice)


def pareto(model: Model, cluster: Cluster, *, max_nodes: dict[str, int] | None = None, gbs: int | None = None,
           train_steps: int | None = None, train_tokens: float | None = None, budget_usd: float | None = None,
           deadline_hours: float | None = None, profiles_dir: str | None = None, distributed_optimizer: bool = True,
           allow_profile_mismatch: bool = False):
    """`fasop pareto` in Python: every composition of `cluster` (at most `max_nodes` nodes of a type, {"A100": 4})
    with its fastest plan and the time and cost of the run, as a pandas DataFrame of one row per composition in
    sweep order, in the columns of a front file (docs/formats.md); `on_front` marks the Pareto front.

    Node counts and the other integer columns are pandas' nullable Int64 (<NA> where a composition has no plan,
    like the front file's empty cells). `frame.attrs`: `chosen`, the row of the composition that meets
    `budget_usd` / `deadline_hours` best (None without either, or when none meets them), and `choice`, the line
    `fasop pareto` prints about it.
    """
    import pandas as pd  # only the Python API needs pandas; the command line starts faster without it

    result = sweep_and_choose(model, cluster, compositions(cluster, max_nodes), budget_usd=budget_usd,
                              deadline_hours=deadline_hours, gbs=gbs, train_steps=train_steps,
                              train_tokens=train_tokens, profiles_dir=profiles_dir,
                              distributed_optimizer=distributed_optimizer, allow_profile_mismatch=allow_profile_mismatch)
    frame = pd.DataFrame(result.records)
    frame = frame.astype({column: "Int64" for column in frame.columns
                          if column in INT_COLUMNS or column.startswith(NODES_PREFIX)})
    frame.attrs.update(chosen=next((row for row, record in enumerate(result.records) if record is result.chosen), None),
                       choice=result.choice)
    return frame
