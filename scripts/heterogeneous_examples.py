"""The comparisons of docs/heterogeneous.md: on each example cluster, the best plan of one tensor and data degree
on every node, the best one on any set of whole node types (by step time and by price per sample), and the best
stage-group plan of the integer programs (fasop.search.groupsearch, with the solver's time and gap); the best
uniform and the best stage-group plan's schedules drawn side by side under docs/img/.

    python scripts/heterogeneous_examples.py [--case NAME ...] [--images DIR]

Prints the tables as Markdown. The stage-group search runs within its time budget (60 s): on a slower machine it
may stop with fewer programs solved, so its row can differ there.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.plans import Plan
from fasop.plot import stage_names
from fasop.search.engine import search_plans
from fasop.search.groupsearch import search_stage_groups
from fasop.search.space import prepare
from fasop.timeline import plan_op_times, plot_timeline, timeline_title

# name: (model, cluster, node counts of the cluster's types (None: every node), global batch (None: the model's))
CASES = {
    "llama3-8b-h100-a10g": ("llama3-8b", "h100-a100-a10g", {"H100": 4, "A10G": 8}, None),
    "llama2-70b-h100-a100-a10g": ("llama2-70b", "h100-a100-a10g", None, None),
    "llama2-70b-16k": ("llama2-70b", "h100-a100-a10g-l4", None, 16384),
}


def _nodes(plan: Plan) -> str:
    return ", ".join(f"{count} {name}" for name, count in Counter(plan.placement).items())


def _shape(plan: Plan) -> str:
    if plan.is_stage_groups:
        assert plan.stages is not None
        return " / ".join(f"{s.gpu} {s.tp}x{s.dp}" for s in plan.stages)
    vp = f" vp {plan.virtual_stages}" if (plan.virtual_stages or 1) > 1 else ""
    return f"tp {plan.tp} dp {plan.dp} pp {plan.pp}{vp}"


def _row(label: str, plan: Plan, solver: str = "") -> str:
    assert plan.cost_per_step_usd is not None
    layers = ",".join(map(str, plan.layers_per_stage))
    per_million = plan.cost_per_step_usd / plan.gbs * 1e6
    return (f"| {label} | {_nodes(plan)} | {_shape(plan)} | {layers} | {plan.step_time_s:.4f} | "
            f"{plan.gbs / plan.step_time_s:,.1f} | {per_million:,.0f} | {solver} |")


def _timeline(plan: Plan, path: Path) -> None:
    times = plan_op_times(plan, str(path))
    plot_timeline(times, path, stage_names=stage_names(plan), title=timeline_title(plan, times))


def run_case(name: str, images: Path) -> None:
    model_name, cluster_name, counts, gbs = CASES[name]
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    if counts is not None:
        cluster = cluster.with_counts(counts)
    every = search_plans(model, cluster, gbs, keep=1, use_all=True).plans[0]
    fastest = search_plans(model, cluster, gbs, keep=1).plans[0]
    cheapest = search_plans(model, cluster, gbs, keep=1, sort="cost").plans[0]
    started = time.perf_counter()
    rows = search_stage_groups(prepare(model, cluster, gbs))
    solved_s = time.perf_counter() - started
    print(f"### {model.name} on {cluster.name}" + (f" ({_nodes(every)})" if counts else ""))
    print()
    print("| best | nodes used | degrees (stage-group: type tp x dp per stage) | layers per stage | step s | "
          "samples/s | $ per 1M samples | search |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | --- |")
    print(_row("uniform, every node", every))
    print(_row("uniform, by step time", fastest))
    print(_row("uniform, by price per sample", cheapest))
    if rows:
        best = Plan.trusted({"rank": 1, **min(rows, key=lambda row: row["step_time_s"])})
        print(_row("stage-group", best, f"{solved_s:.0f} s, {len(rows)} program{'s' if len(rows) > 1 else ''}, "
                                 f"gap {best.optimality_gap:.2%}"))
        _timeline(fastest, images / f"timeline-{name}-uniform.png")
        _timeline(best, images / f"timeline-{name}-stage-groups.png")
    else:
        print(f"| stage-group | none fits | | | | | | {solved_s:.0f} s |")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--images", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    args.images.mkdir(parents=True, exist_ok=True)
    for name in args.case:
        run_case(name, args.images)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
