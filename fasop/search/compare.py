"""One row per training strategy on one cluster: data parallelism with even and uneven batches, ZeRO stages 1 to
3, the best pipeline plan without tensor parallelism and the best 3D plan, or why a strategy has no plan."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from dataclasses import dataclass

from fasop.errors import InputError
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile, load_profiles
from fasop.plans import Plan, Stage, TypeShare
from fasop.search.dataparallel import NoPlan, best_plan_row
from fasop.search.engine import search_plans
from fasop.search.space import check_global_batch

# (family, kind, even split) of the data-parallel families, in table order
DATA_PARALLEL = (("DDP even", "ddp", True), ("DDP uneven", "ddp", False), ("ZeRO-1 uneven", "zero1", False),
                 ("ZeRO-2 uneven", "zero2", False), ("ZeRO-3 uneven", "zero3", False))
PIPELINE, THREE_D = "pipeline (tp=1)", "3D (best)"


@dataclass
class Family:
    name: str
    plan: Plan | None
    reason: str = ""


def plan_list(families: list[Family]) -> list[Plan]:
    """The families' plans fastest first, ranked; a plan that is the best of two families is listed once, its
    `family` naming both."""
    unique: dict[str, dict] = {}
    for family in families:
        if family.plan is not None:
            plan = {k: v for k, v in family.plan.record().items() if k not in ("rank", "family")}
            key = json.dumps(plan, sort_keys=True)
            if key in unique:
                unique[key]["family"] += f"; {family.name}"
            else:
                unique[key] = {"family": family.name, **plan}
    ranked = sorted(unique.values(), key=lambda p: p["step_time_s"])
    return [Plan.trusted({"rank": rank, **plan}) for rank, plan in enumerate(ranked, start=1)]


def memory_by_gpu(plan: Plan) -> dict[str, float]:
    """Peak memory of each GPU type of a plan (GiB); a pipeline stage spanning two types counts for both."""
    parts: list[Stage] | list[TypeShare] = plan.per_type or plan.stages or []
    memory: dict[str, float] = {}
    for part in parts:
        for gpu in part.gpu.split("+"):
            memory[gpu] = max(memory.get(gpu, 0.0), part.memory_gib)
    return memory


def compare(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile] | None = None, gbs: int | None = None, *,
            profiles_dir: str | None = None, allow_profile_mismatch: bool = False, distributed_optimizer: bool = True,
            overlap: bool = True, progress: Callable[[int, int], None] | None = None) -> list[Family]:
    """The strategies `fasop compare` tables (fasop.compare in Python): one Family per strategy, in the table's
    order (DATA_PARALLEL, PIPELINE, THREE_D), with its best plan on every GPU of `cluster` or the reason it has
    none. `profiles`: already loaded (by GPU type) instead of reading profiles_dir (default: the model's bundled
    ones, GPU types without one synthesised from the roofline). `progress(done, total)`: the 3D search's, by far the
    longest part."""
    batch = check_global_batch(model.global_batch_size if gbs is None else gbs)
    if profiles is None:  # the cluster's own [[gpu]] tables over the catalogue, as the command line reads them
        profiles = load_profiles(model, [t.gpu for t in cluster.node_types.values()], profiles_dir,
                                 allow_profile_mismatch, merged_specs(own=cluster.gpus))
    families = []
    for name, kind, even in DATA_PARALLEL:
        try:
            families.append(Family(name, best_plan_row(model, cluster, profiles, kind, batch, even, overlap)))
        except NoPlan as reason:
            families.append(Family(name, None, str(reason)))
    try:
        plans = search_plans(model, cluster, batch, distributed_optimizer=distributed_optimizer, profiles=profiles,
                             overlap=overlap, use_all=True, progress=progress).plans  # every family on the same GPUs
    except InputError as err:
        plans, why = [], err.problem.split(" (")[0]
    else:
        why = "out of memory"
    pipeline = next((p for p in plans if p.tp == 1), None)
    families.append(Family(PIPELINE, pipeline, "" if pipeline else (why if not plans else "no tp=1 plan")))
    families.append(Family(THREE_D, plans[0] if plans else None, "" if plans else why))
    for family in families:
        if family.plan is not None:
            family.plan = family.plan.model_copy(update={"family": family.name})
    return families


def _micro_batches(item: TypeShare) -> str:
    """16 samples in micro-batches of 10: '10+6'; of 4: '4x4'."""
    size, rest = item.micro_batch_size, item.samples_per_gpu % item.micro_batch_size
    full = item.samples_per_gpu // size
    return f"{size}x{full}" if not rest else (f"{size}x{full}+{rest}" if full > 1 else f"{size}+{rest}")


def describe(plan: Plan) -> str:
    """The plan in a few words: per node type, samples per GPU as micro-batch size x count, or the 3D degrees."""
    if plan.per_type is not None:
        return " ".join(f"{t.node_type}:{t.samples_per_gpu}={_micro_batches(t)}" for t in plan.per_type)
    return f"tp={plan.tp} dp={plan.dp} pp={plan.pp} mbs={plan.mbs}"


def records(families: list[Family]) -> list[dict]:
    """Flat rows of the comparison (the CSV output)."""
    gpus = sorted({g for f in families if f.plan for g in memory_by_gpu(f.plan)})
    rows = []
    for f in families:
        p = f.plan
        row = {"family": f.name, "kind": p.kind if p else "", "plan": describe(p) if p else "",
               "step_time_s": p.step_time_s if p else "",
               "throughput_samples_per_s": p.throughput_samples_per_s if p else "",
               "cost_per_step_usd": p.cost_per_step_usd if p else ""}
        memory = memory_by_gpu(p) if p else {}
        row.update({f"memory_gib_{g}": memory.get(g, "") for g in gpus})
        row["recompute"] = (p.recompute or "none") if p else ""
        row["no_plan_reason"] = f.reason
        rows.append(row)
    return rows


def as_csv(families: list[Family]) -> str:
    rows = records(families)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def table(families: list[Family]) -> str:
    rows = records(families)
    gpus = [key for key in rows[0] if key.startswith("memory_gib_")]
    titles = ["strategy", "step s", "samples/s", "$/step", *(f"{k[len('memory_gib_'):]} GiB" for k in gpus),
              "recompute", "plan"]
    cells = [titles]
    for row in rows:
        if row["plan"]:
            line = [row["family"], f"{row['step_time_s']:.4f}", f"{row['throughput_samples_per_s']:.1f}",
                    f"{row['cost_per_step_usd']:.5f}"]
            line += [f"{row[k]:.1f}" if row[k] != "" else "-" for k in gpus] + [row["recompute"], row["plan"]]
        else:
            line = [row["family"], "-", "-", "-", *["-"] * len(gpus), "-", f"no plan: {row['no_plan_reason']}"]
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(titles) - 1)]
    return "\n".join(("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:])])
                      + "  " + r[-1]).rstrip() for r in cells)
