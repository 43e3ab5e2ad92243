"""Which machines to rent: sweep every composition of a cluster's node types, keep each composition's best
plan, and mark the Pareto front of time to train against the cost of the run.

    from fasop.market.pareto import compositions, sweep
    records = sweep(model, cluster, compositions(cluster), train_steps=10_000)

fasop.market.choice chooses within a budget or a deadline; its `sweep_and_choose` does both, as `fasop pareto`
does, and its `pareto`, the Python API's `fasop.pareto`, returns the records as a pandas DataFrame.

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
from fasop.market.frontfile import NODES_PREFIX, TAIL_COLUMNS

DEFAULT_TRAIN_STEPS = 10_000  # run length used when neither train_steps nor train_tokens is given
PARALLEL_COMPOSITIONS = 8  # compositions per process: smaller sweeps stay in one process
MAX_COMPOSITIONS = 4096  # a sweep searches each composition: more would run for hours (or forever)

PLAN_FIELDS = ("mbs", "tp", "dp", "pp", "num_microbatches", "placement", "layers_per_stage", "step_time_s",
               "throughput_samples_per_s", "cost_per_step_usd", "train_steps", "train_hours", "train_cost_usd",
               "peak_memory_gib")


# -- compositions --------------------------------------------------------------------------------------

def node_caps(cluster: Cluster, max_nodes: dict[str, int] | None = None) -> dict[str, int]:
    """The most nodes of each node type: its available count, capped by `max_nodes`."""
    caps = {name: t.count for name, t in cluster.node_types.items()}
    for name, cap in (max_nodes or {}).items():
        if name not in caps:
            raise ArgumentError("max_nodes", f"unknown node type {name!r} (cluster {cluster.name} has {', '.join(caps)})")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ArgumentError("max_nodes", f"expected a node count >= 0 for {name}, got {cap!r}")
        caps[name] = min(caps[name], cap)
    if not any(caps.values()):
        raise ArgumentError("max_nodes", "every node type is capped at 0 nodes: nothing to sweep")
    return caps


def compositions(cluster: Cluster, max_nodes: dict[str, int] | None = None) -> list[dict[str, int]]:
    """Every composition of 0 up to the available count of each node type (capped by `max_nodes`), without
    the empty one; more than MAX_COMPOSITIONS are refused. Order: the cluster file's node types as digits, the
    first type most significant, counting up (for A100 and A10: {A100 0, A10 1}, {A100 0, A10 2}, ..., {A100 1, A10 0}, ...)."""
    caps = node_caps(cluster, max_nodes)
    names = list(caps)
    count = math.prod(caps[n] + 1 for n in names) - 1
    if count > MAX_COMPOSITIONS:
        raise ArgumentError("max_nodes", f"{count:,} compositions to sweep, more than the limit of {MAX_COMPOSITIONS:,} "
                                         "(each is a whole search); cap the node counts of some types")
    return [dict(zip(names, counts)) for counts in itertools.product(*(range(caps[n] + 1) for n in names))
            if any(counts)]


all_compositions = compositions  # the name `sweep` can reach under its parameter of the same name


def composition_label(record: dict, unit: bool = False) -> str:
    """'2 A100 + 4 A10' from the nodes_<type> fields of a record (types at 0 left out); with `unit`,
    '2 A100 nodes + 4 A10 nodes' (a line of text, where '4 A100' could be read as four GPUs)."""
    parts = [f"{n} {name}" + (f" node{'s' if n > 1 else ''}" if unit else "")
             for name, n in node_counts(record).items() if n]
    return " + ".join(parts) if parts else "no nodes"


def node_counts(record: dict) -> dict[str, int]:
    return {key[len(NODES_PREFIX):]: int(value) for key, value in record.items() if key.startswith(NODES_PREFIX)}


def degrees_text(record: dict) -> tuple[str, str]:
    """The plan's tensor and data-parallel degrees as text: one each, or each stage's of a stage-group plan
    ('4,1,4' and '1,4,1')."""
    if record.get("stage_tp") and record.get("stage_dp"):
        return ",".join(map(str, record["stage_tp"])), ",".join(map(str, record["stage_dp"]))
    return str(record["tp"]), str(record["dp"])


def composition_kind(record: dict) -> str | None:
    """The node type of a single-type composition, None for a mixed one."""
    used = [name for name, n in node_counts(record).items() if n]
    return used[0] if len(used) == 1 else None


# -- the sweep -----------------------------------------------------------------------------------------

def empty_record(model: Model, cluster: Cluster, composition: dict[str, int], gbs: int) -> dict:
    """A row in the order of the front file's columns, its plan fields empty."""
    record: dict = {"model": model.name, "cluster": cluster.name, "gbs": gbs}
    for name in cluster.node_types:
        record[NODES_PREFIX + name] = int(composition.get(name, 0))
    for key in TAIL_COLUMNS:
        record[key] = None
    record["gpus"] = sum(n * cluster.node_types[name].gpus_per_node for name, n in composition.items())
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
    left_out: tuple[tuple[str, str], ...] = ()  # node types the model's precision cannot use, and why

    def __call__(self, composition: dict[str, int]) -> dict:
        from fasop.search import search_plans

        model, cluster = self.model, self.cluster
        record = empty_record(model, cluster, composition, self.gbs)
        reasons = [reason for name, reason in self.left_out if composition.get(name)]
        if reasons:
            record["note"] = f"{model.precision}: {reasons[0]}"
            return record
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


def cluster_profiles(model: Model, cluster: Cluster, profiles_dir: str | None, allow_profile_mismatch: bool) -> dict:
    """The profiles of the cluster's GPU types, read once for every composition or program (a missing or malformed
    one is an error raised here); the profiles and the per-size times they memoise then serve them all."""
    from fasop.inputs.catalogue import merged_specs
    from fasop.inputs.profiles import load_profiles

    return load_profiles(model, [t.gpu for t in cluster.node_types.values()], profiles_dir, allow_profile_mismatch,
                         merged_specs(own=cluster.gpus))


def sweep(model: Model, cluster: Cluster, compositions: list[dict[str, int]] | None = None, *,
          gbs: int | None = None, train_steps: int | None = None, train_tokens: float | None = None,
          profiles_dir: str | None = None, distributed_optimizer: bool = True, allow_profile_mismatch: bool = False,
          progress: Callable[[int, int], None] | None = None, profiles: dict | None = None,
          left_out: dict[str, str] | None = None) -> list[dict]:
    """One record per composition (in the order given; default: every composition of `cluster`) with its
    fastest plan, the time and cost of the whole run, and `on_front`, the Pareto flag over
    (train_hours, train_cost_usd); `profiles`: already loaded (by GPU type) instead of reading profiles_dir.
    `left_out`: node types the model's precision cannot use (fasop.search.precision), and why: a composition
    holding one has no plan and says why.

    The run is `train_steps` steps, or `train_tokens` tokens (steps = tokens / (gbs * sequence length),
    rounded up); with neither, DEFAULT_TRAIN_STEPS steps. The front does not depend on the run length (time
    and cost of every composition scale with it alike); budgets and deadlines do.
    """
    from fasop.search.space import check_global_batch

    check_run_length(train_steps, train_tokens)
    if train_steps is None and train_tokens is None:
        train_steps = DEFAULT_TRAIN_STEPS
    gbs = check_global_batch(model.global_batch_size if gbs is None else gbs)
    compositions = all_compositions(cluster) if compositions is None else _checked_compositions(cluster, compositions)
    left_out = left_out or {}
    if profiles is None:
        usable = {name: t.count for name, t in cluster.node_types.items() if name not in left_out}
        profiles = cluster_profiles(model, cluster.with_counts(usable) if left_out else cluster, profiles_dir,
                                    allow_profile_mismatch)
    task = _Composition(model, cluster, gbs, train_steps, train_tokens, distributed_optimizer, profiles,
                        tuple(left_out.items()))
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


def best_of_precisions(sweeps: list[list[dict]], precisions: list[str]) -> list[dict]:
    """One record per composition from the sweeps of several precisions (the same compositions in the same
    order): the fastest feasible one (the first precision's on a tie, or when none is feasible, with every
    precision's note), its precision in `precision`; the counts of plans of every sweep; the front marked again."""
    records = []
    for rows in zip(*sweeps):
        feasible = [(row["step_time_s"], i) for i, row in enumerate(rows) if row["feasible"]]
        at = min(feasible)[1] if feasible else 0
        best = {**rows[at], "precision": precisions[at] if feasible else None,
                "plans_evaluated": sum(row["plans_evaluated"] for row in rows),
                "out_of_memory": sum(row["out_of_memory"] for row in rows)}
        if not feasible:
            best["note"] = "; ".join(f"{precision}: {row['note']}" if not row["note"].startswith(precision) else row["note"]
                                     for precision, row in zip(precisions, rows))
        records.append(best)
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

# A budget (dollars) and a deadline (hours) are shown to the hundredth: from one hundredth, the least not shown as
# 0.00, to 2^53 hundredths (9e13), the most a double counts exactly, as the price code bounds steps and tokens
MIN_LIMIT, MAX_LIMIT = 0.01, 2**53 / 100


def check_limits(budget_usd: float | None = None, deadline_hours: float | None = None) -> None:
    """A budget and a deadline, when given, must be numbers from MIN_LIMIT to MAX_LIMIT."""
    for value, argument, unit in ((budget_usd, "budget_usd", "dollars"), (deadline_hours, "deadline_hours", "hours")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_LIMIT <= value <= MAX_LIMIT:
            shown = f"{value:g}" if isinstance(value, (int, float)) else repr(value)
            raise ArgumentError(argument, f"expected a number of {unit} from {MIN_LIMIT:g} to {MAX_LIMIT:.4g}, got {shown}")
