"""Charts: the cost of a run against its speed for every composition of a sweep (`plot_front`), where
the time of one step goes on each pipeline stage of one plan (`plot_stages`), and estimated against measured
step times (`plot_validation`).

matplotlib is imported only inside these functions, so that the rest of fasop starts without it. The
figures are drawn headless (Agg) and written as PNG or SVG, chosen by the file suffix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from fasop.chart import MAX_ROWS, check_out, figure, fit_title, plain_text, save, scale
from fasop.errors import ArgumentError, InputError
from fasop.plans import Plan, compress_placement

SINGLE_MARKERS = ("o", "s", "D", "p", "h", "*", "P", "X")  # single-type compositions, cheapest node type first
MIXED_MARKER = "^"
MIXED = "mixed"
SERIES_GID = "series-"  # SVG group id of each scatter series: series-<label with spaces as dashes>
COLORS = ("#1f77b4", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
MIXED_COLOR = "#2ca02c"


# What a front chart's title and deadline take from its first row: the same in every row of one sweep.
FRONT_RUN = ("model", "cluster", "gbs", "train_steps")


def check_one_run(rows: Sequence[Mapping], keys: Sequence[str], where: str) -> None:
    """Refuse rows that give different values of any of `keys` (a row may leave one out: a composition without a
    plan has no run length): a chart or page names them once, from the first row, for all."""
    for key in keys:
        values = list(dict.fromkeys(value for row in rows if (value := row.get(key)) is not None))
        if len(values) > 1:
            raise InputError(f"{where}: {key}", f"expected one value in every row (the results of one run), got "
                                                f"{values[0]!r} and {values[1]!r}")


def series_label(kind: str | None) -> str:
    return MIXED if kind is None else f"{kind} only"


def _short(record: dict) -> str:
    from fasop.market.pareto import node_counts

    return "+".join(f"{n}{name}" for name, n in node_counts(record).items() if n)


def plot_front(records: list[dict], out_path, *, x: str = "throughput", budget: float | None = None,
               deadline: float | None = None, chosen: dict | None = None, title: str | None = None,
               argument: str = "out_path") -> dict[str, int]:
    """Draw front_chart to out_path (.png or .svg); `argument` names the chart file in errors. Returns what
    front_chart returns."""
    path = check_out(out_path, argument)
    fig, counts = front_chart(records, x=x, budget=budget, deadline=deadline, chosen=chosen, title=title)
    save(fig, path, argument)
    return counts


@plain_text()
def front_chart(records: list[dict], *, x: str = "throughput", budget: float | None = None,
                deadline: float | None = None, chosen: dict | None = None, title: str | None = None):
    """Cost of the run (USD) against throughput (samples/s) or time to train (hours), one point per
    feasible composition: the figure and what it shows.

    Marker shape by composition kind: one shape per single-type composition (circle for the node type
    with the lowest price per node, then square, diamond, ...), a triangle for mixed compositions. The
    Pareto front is a step line (the least cost at which each throughput or each deadline can be had),
    the budget and the deadline are dashed lines, and `chosen` (one of `records`) is circled. The chosen point
    and the front's (of a longer front, fasop.chart.MAX_LABELS spread evenly along it) are labelled without
    overlap (fasop.chart); a label with no room is a number on the chart, named in the legend beside it. Every
    record names the same model, cluster, global batch and run length (FRONT_RUN). An axis whose values span more
    than LOG_SPAN is logarithmic.

    Returns the figure and the number of points drawn in each series, read back from the figure: one key per
    scatter series ('A100 only', 'mixed', ...), 'front' (points on the step line), 'chosen' (0 or 1), 'not
    shown' (compositions without a plan that fits). In an SVG each scatter series is the group with id
    'series-<label>' ('series-A100-only', 'series-mixed').
    """
    from fasop.market.pareto import check_limits, mark_front

    if x not in ("throughput", "time"):
        raise ArgumentError("x", "expected throughput or time", x)
    check_limits(budget, deadline)
    check_one_run(records, FRONT_RUN, "front")
    records = [dict(r) for r in records]
    mark_front(records)  # the front of the points drawn (a front file may have been filtered by hand)
    feasible = [r for r in records if r.get("feasible")]
    if not feasible:
        raise InputError("front", "no composition has a plan that fits in memory: nothing to plot")
    xkey = "throughput_samples_per_s" if x == "throughput" else "train_hours"

    fig = figure(9.0, 5.4)
    ax = fig.add_subplot()
    _draw_series(ax, feasible, xkey)
    front = sorted((r for r in feasible if r.get("on_front")), key=lambda r: (r[xkey], r["train_cost_usd"]))
    if front:
        # throughput: the cheapest way to reach at least x is the next front point to the right ("pre");
        # time: the cheapest way to finish within x is the last front point to the left ("post")
        (line,) = ax.step([r[xkey] for r in front], [r["train_cost_usd"] for r in front],
                          where="pre" if x == "throughput" else "post", color="black", lw=1.2, zorder=2,
                          marker="o", markersize=9, markerfacecolor="none", markeredgecolor="black",
                          markeredgewidth=0.8, label=f"Pareto front ({len(front)})")
        line.set_gid("front")
    _draw_limits(ax, feasible, x, xkey, budget, deadline)
    if chosen is not None and not (chosen.get("feasible") and chosen.get(xkey) is not None):
        chosen = None  # a composition without a plan is not drawn
    if chosen is not None:
        mark = ax.scatter([chosen[xkey]], [chosen["train_cost_usd"]], s=260, facecolors="none",
                          edgecolors="#ff0000", linewidths=2.2, zorder=4, label="chosen")
        mark.set_gid("chosen")
    hidden = len(records) - len(feasible)
    _label_axes(ax, feasible, x, xkey, hidden)
    _label_points(fig, ax, feasible, front, chosen, xkey, title or _title(feasible, x))

    counts: dict[str, int] = {}
    for collection in ax.collections:
        gid = collection.get_gid() or ""
        if gid.startswith(SERIES_GID):
            counts[gid[len(SERIES_GID):].replace("-", " ")] = len(collection.get_offsets())
    counts["front"] = len(line.get_xdata()) if front else 0
    counts["chosen"] = sum(len(c.get_offsets()) for c in ax.collections if c.get_gid() == "chosen")
    counts["not shown"] = hidden
    return fig, counts


def _label_points(fig, ax, feasible: list[dict], front: list[dict], chosen: dict | None, xkey: str,
                  title: str) -> None:
    """The chosen composition (nodes, hours, dollars) and each front point (node counts) labelled, and the legend
    drawn beside the axes, the title fitted to what the legend leaves."""
    from matplotlib.lines import Line2D

    from fasop.chart import MAX_LABELS, Label, place_labels, spread
    from fasop.market.pareto import composition_label

    unit = "samples/s" if xkey == "throughput_samples_per_s" else "h"

    def value(r: dict) -> str:
        return f"{r[xkey]:,.4g} {unit}, ${r['train_cost_usd']:,.0f}"

    labels = []
    if chosen is not None:
        labels.append(Label(chosen[xkey], chosen["train_cost_usd"], f"{composition_label(chosen)}\n"
                            f"{chosen['train_hours']:,.1f} h, ${chosen['train_cost_usd']:,.0f}", value(chosen),
                            radius_pt=13, color="#b00000", fontsize=8.5, weight="bold"))
    others = [r for r in front if chosen is None or _short(r) != _short(chosen)]  # the chosen one has its own
    labels += [Label(r[xkey], r["train_cost_usd"], _short(r), value(r), radius_pt=6)
               for r in spread(others, MAX_LABELS - len(labels))]
    handles, names = ax.get_legend_handles_labels()

    def legend(entries: list[str]) -> None:
        for old in fig.legends:
            old.remove()
        blank = [Line2D([], [], linestyle="none") for _ in entries]
        fig.legend([*handles, *blank], [*names, *entries], loc="outside right upper", fontsize=8, frameon=False)
        fit_title(ax, title, 11)

    points = np.array([(r[xkey], r["train_cost_usd"]) for r in feasible], dtype=float).reshape(-1, 2)
    place_labels(fig, ax, labels, points, legend)


def _draw_series(ax, feasible: list[dict], xkey: str) -> None:
    """One scatter series per single-type composition kind, cheapest node type first, then the mixed ones."""
    from fasop.market.pareto import composition_kind, node_counts

    price: dict[str, float] = {}
    for r in feasible:
        kind = composition_kind(r)
        if kind is not None:
            price.setdefault(kind, r["cost_per_hour_usd"] / node_counts(r)[kind])
    singles = sorted(price, key=lambda k: (price[k], k))
    style: dict[str | None, tuple[str, str]] = {
        k: (SINGLE_MARKERS[i % len(SINGLE_MARKERS)], COLORS[i % len(COLORS)]) for i, k in enumerate(singles)}
    style[None] = (MIXED_MARKER, MIXED_COLOR)
    for kind in [*singles, None]:
        points = [r for r in feasible if composition_kind(r) == kind]
        if not points:
            continue
        marker, color = style[kind]
        label = series_label(kind)
        dots = ax.scatter([r[xkey] for r in points], [r["train_cost_usd"] for r in points], marker=marker, s=42,
                          color=color, alpha=0.85, edgecolors="none", label=f"{label} ({len(points)})", zorder=3)
        dots.set_gid(SERIES_GID + label.replace(" ", "-"))


def _draw_limits(ax, feasible: list[dict], x: str, xkey: str, budget: float | None, deadline: float | None) -> None:
    """The budget and the deadline as dashed lines."""
    if budget is not None:
        ax.axhline(budget, ls="--", lw=1.2, color="#ff7f0e", label=f"budget ${budget:,.0f}", zorder=1)
    if deadline is not None:
        if x == "time":
            at, label = deadline, f"deadline {deadline:,.4g} h"
        else:  # the throughput that finishes the run in time: samples / (deadline), the same for every row
            samples_over_3600 = feasible[0][xkey] * feasible[0]["train_hours"]  # samples of the run / 3600 s
            at = samples_over_3600 / deadline
            label = f"deadline {deadline:,.4g} h (>= {at:,.1f} samples/s)"
        ax.axvline(at, ls="--", lw=1.2, color="#8c564b", label=label, zorder=1)


def _title(feasible: list[dict], x: str) -> str:
    first = feasible[0]
    run = ""
    if first.get("train_steps") and first.get("gbs"):
        run = f", {int(first['train_steps']):,} steps of {int(first['gbs'])} samples"
    what = "cost against throughput" if x == "throughput" else "cost against time to train"
    name = f"{first.get('model', '')} on {first.get('cluster', '')}".strip()
    return f"{name}: {what}{run}"


def _label_axes(ax, feasible: list[dict], x: str, xkey: str, hidden: int) -> None:
    """Axis labels and scales, grid, the count of compositions not shown."""
    ax.set_xlabel("throughput (samples/s)" if x == "throughput" else "time to train (hours)")
    ax.set_ylabel("cost of the run (USD)")
    scale(ax, "x", [r[xkey] for r in feasible], money=False)
    scale(ax, "y", [r["train_cost_usd"] for r in feasible], money=True)
    ax.grid(True, lw=0.4, alpha=0.5)
    ax.margins(x=0.07, y=0.06)  # room for the labels of the outermost points
    if hidden:
        ax.text(0.99, 0.01, f"{hidden} composition{'s' if hidden > 1 else ''} without a plan that fits: not shown",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=7.5, color="#555555")


MAX_SECONDS = 1e9  # a stage time or step time of a plan to chart


def check_times(plan: Plan, where: str) -> None:
    """The times a chart of a plan draws in range, where the plan gives them: each stage's compute_s, p2p_s and
    dp_allreduce_s, step_time_s and num_microbatches."""
    for index, stage in enumerate(plan.stages or []):
        for key in ("compute_s", "p2p_s", "dp_allreduce_s"):
            if not 0 <= getattr(stage, key) <= MAX_SECONDS:
                raise InputError(f"{where}: stages[{index}].{key}",
                                 f"expected seconds from 0 to {MAX_SECONDS:g}, got {getattr(stage, key)!r}")
    for key in ("step_time_s", "num_microbatches"):
        value = getattr(plan, key)
        if value is not None and not 0 < value <= MAX_SECONDS:
            raise InputError(f"{where}: {key}", f"expected a positive number up to {MAX_SECONDS:g}, got {value!r}")


def check_plan(plan: Plan, where: str) -> None:
    """What a stage chart needs beyond the plan schema: the per-stage breakdown of a 3D plan, times in range, at
    most MAX_ROWS stages."""
    check_times(plan, where)
    if not plan.stages or plan.num_microbatches is None or plan.step_time_s is None:
        raise InputError(where, "not a 3D plan as fasop search writes them: a chart needs its stages, "
                                "step_time_s and num_microbatches")
    if len(plan.stages) > MAX_ROWS:
        raise InputError(f"{where}: pp", f"{len(plan.stages):,} stages: a chart draws at most {MAX_ROWS}")


def stage_times(plan: Plan) -> dict[str, list[float]]:
    """Seconds of one step spent by each stage (its busiest GPU) computing, sending and receiving
    activations (p2p), in the data-parallel all-reduce, and idle: m = num_microbatches micro-batches of
    compute_s and p2p_s each, the stage's all-reduce once, and the rest of the step (pipeline bubble,
    waiting for slower stages, the embedding all-reduce)."""
    check_plan(plan, "plan")
    assert plan.stages and plan.num_microbatches and plan.step_time_s  # checked above, for the type checker
    m, step = plan.num_microbatches, plan.step_time_s
    compute = [m * s.compute_s for s in plan.stages]
    p2p = [m * s.p2p_s for s in plan.stages]
    allreduce = [s.dp_allreduce_s for s in plan.stages]
    idle = [max(0.0, step - c - p - a) for c, p, a in zip(compute, p2p, allreduce)]
    return {"compute": compute, "p2p": p2p, "dp all-reduce": allreduce, "idle": idle}


def plot_stages(plan: Plan, out_path, *, title: str | None = None) -> dict[str, list[float]]:
    """Draw stage_chart to out_path (.png or .svg). Returns what stage_chart returns."""
    path = check_out(out_path, "out_path")
    fig, drawn = stage_chart(plan, title=title)
    save(fig, path, "out_path")
    return drawn


def stage_names(plan: Plan) -> list[str]:
    """'stage 0 · A100 · layers 1-4' for each stage of a 3D plan: the model's layers numbered from 1 in
    pipeline order (encoder, then decoder); an interleaved stage lists the layers of each of its model chunks; a
    stage of a stage-group plan also names its degrees ('stage 0 · A10G tp2 dp32 · layers 1-3')."""
    pp, v = plan.pp, plan.virtual_stages or 1
    counts = plan.layers_per_virtual_stage if v > 1 and plan.layers_per_virtual_stage else plan.layers_per_stage
    ends = np.cumsum(counts)
    names = []
    for stage in plan.stages or []:
        spans = [(int(ends[k] - counts[k]) + 1, int(ends[k])) for k in range(stage.stage, len(counts), pp)]
        layers = ",".join(f"{a}-{b}" if b > a else str(b) for a, b in spans if b >= a) or "none"
        degrees = f" tp{stage.tp} dp{stage.dp}" if plan.is_stage_groups else ""
        names.append(f"stage {stage.stage} · {stage.gpu}{degrees} · layers {layers}")
    return names


@plain_text()
def stage_chart(plan: Plan, *, title: str | None = None):
    """A horizontal stacked bar per pipeline stage: compute, p2p communication, data-parallel all-reduce
    and idle time within one step, in seconds. Returns the figure and the seconds drawn per series, one per
    stage (read back from the bars)."""
    times = stage_times(plan)
    stages = plan.stages or []
    labels = [name + (f" · {node_range(stage.nodes)}" if stage.nodes else "")
              for name, stage in zip(stage_names(plan), stages)]
    colors = {"compute": "#1f77b4", "p2p": "#ff7f0e", "dp all-reduce": "#2ca02c", "idle": "#d0d0d0"}
    fig = figure(8.0, max(2.6, 1.4 + 0.42 * len(stages)))
    ax = fig.add_subplot()
    rows = list(range(len(stages)))
    left = [0.0] * len(stages)
    drawn: dict[str, list[float]] = {}
    for name, values in times.items():
        bars = ax.barh(rows, values, left=left, color=colors[name], edgecolor="white", linewidth=0.5, label=name,
                       hatch="//" if name == "idle" else None, height=0.7)
        for index, patch in enumerate(bars.patches):
            patch.set_gid(f"bar-{name.replace(' ', '-')}-{index}")
        drawn[name] = [float(patch.get_width()) for patch in bars.patches]
        left = [a + b for a, b in zip(left, values)]
    ax.axvline(plan.step_time_s, color="black", lw=1, ls="--", label=f"step {plan.step_time_s:.3f} s")
    ax.set_yticks(rows, labels, fontsize=8)
    ax.invert_yaxis()  # stage 0 on top
    ax.set_xlabel("time per training step (s)")
    ax.grid(True, axis="x", lw=0.4, alpha=0.5)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    fit_title(ax, title or (f"{plan.model or 'plan'}: tp={plan.tp} dp={plan.dp} pp={plan.pp} mbs={plan.mbs}, "
                            f"{plan.num_microbatches} micro-batches, placement {compress_placement(plan.placement)}"), 10)
    return fig, drawn


def node_range(nodes: list[int]) -> str:
    """[0] -> 'node 0'; [2, 3, 4] -> 'nodes 2-4'; [0, 2] -> 'nodes 0,2'."""
    if len(nodes) == 1:
        return f"node {nodes[0]}"
    if all(isinstance(n, int) for n in nodes) and list(nodes) == list(range(nodes[0], nodes[0] + len(nodes))):
        return f"nodes {nodes[0]}-{nodes[-1]}"
    return "nodes " + ",".join(map(str, nodes))


@plain_text()
def plot_validation(labels: list[str], predicted_s, measured_s, out_path, *, title: str | None = None,
                    argument: str = "out_path") -> None:
    """Estimated against measured step time, one labelled point per run, with the line where they agree;
    `argument` names the chart file in errors."""
    path = check_out(out_path, argument)
    fig = figure(6.0, 5.4)
    ax = fig.add_subplot()
    low, high = min(*predicted_s, *measured_s), max(*predicted_s, *measured_s)
    pad = 0.05 * (high - low) if high > low else 0.05 * high
    ax.plot([low - pad, high + pad], [low - pad, high + pad], color="#7f7f7f", linestyle="--", linewidth=1,
            label="estimate = measurement")
    ax.scatter(measured_s, predicted_s, color=COLORS[0], s=36, zorder=3)
    for label, m, p in zip(labels, measured_s, predicted_s):
        ax.annotate(label, (m, p), xytext=(4, 4), textcoords="offset points", fontsize=7)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("estimated step time (s)")
    fit_title(ax, title or "fasop estimates against measured runs", 12)
    ax.legend(loc="upper left", fontsize=8)
    save(fig, path, argument)


@plain_text()
def plot_comparison(families: list, out_path, title: str, argument: str = "out_path") -> None:
    """Throughput of each strategy as horizontal bars; strategies without a plan show their reason. `argument`
    names the chart file in errors."""
    path = check_out(out_path, argument)
    fig = figure(8.0, 0.5 * len(families) + 1.2)
    ax = fig.add_subplot()
    names = [f.name for f in families][::-1]
    values = [f.plan.throughput_samples_per_s if f.plan else 0.0 for f in families][::-1]
    bars = ax.barh(names, values, color=["#1f77b4" if v else "#cccccc" for v in values])
    top = max(values) or 1.0
    for bar, family in zip(bars, families[::-1]):
        label = f" ${family.plan.cost_per_step_usd:.4f}/step" if family.plan else f" no plan: {family.reason}"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel("throughput (samples/s)")
    fit_title(ax, title, 12)
    save(fig, path, argument)
