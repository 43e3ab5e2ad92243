"""The text tables the commands print: ranked plans, one plan's breakdown, the robust ranking, a sweep."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from fasop.inputs.errorband import ErrorBand
from fasop.plans import PRINTED_DECIMALS, Plan, compress_placement

HEADROOM_MARK = "!"  # beside used/cap GiB: the plan is above the memory headroom


def aligned(cells: list[list[str]]) -> str:
    """Rows of cells, each column right-aligned to its widest cell."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def format_table(plans: list[Plan], top: int, all_placements: bool = False,
                 flagged: Callable[[Plan], bool] | None = None) -> str:
    """The ranked plans as a fixed-width table (vp: model chunks per pipeline rank, interleaved when > 1); the
    plans `flagged` (above the memory headroom) carry HEADROOM_MARK beside their memory.

    Unless `all_placements`, a plan is left out when a better-ranked one differs from it only in placement and in
    the order of its layers per stage, with the same figures as printed: the rotations of one plan over the nodes
    would fill the table. The `plans` column counts the plans of `plans` each row stands for. Ranks are the plans'
    own, as the plan file numbers them, so `fasop emit --rank K` names the row shown."""
    columns = [
        ("rank", "rank", "{}"), ("mbs", "mbs", "{}"), ("tp", "tp", "{}"), ("dp", "dp", "{}"), ("pp", "pp", "{}"),
        ("virtual_stages", "vp", "{}"), ("recompute", "recompute", ""), ("sequence_parallel", "sp", ""),
        ("placement", "placement", ""), ("layers_per_stage", "layers/stage", ""),
        ("step_time_s", "step s", f"{{:.{PRINTED_DECIMALS['step_time_s']}f}}"),
        ("throughput_samples_per_s", "samples/s", "{:.1f}"),
        ("tokens_per_s", "tokens/s", "{:,.0f}"), ("peak_memory_gib", "used/cap GiB", "{:.1f}"),
        ("cost_per_step_usd", "$/step", f"{{:.{PRINTED_DECIMALS['cost_per_step_usd']}f}}"),
    ]
    if plans[0].train_cost_usd is not None:
        columns += [("train_hours", "run h", "{:.1f}"), ("train_cost_usd", "run $", "{:,.0f}")]
    if any(plan.precision is not None for plan in plans[:top]):  # FP8 plans among them: say which
        columns.insert(1, ("precision", "prec", ""))
    at = [key for key, _, _ in columns].index("pp") + 1
    if any(plan.ep is not None for plan in plans[:top]):  # an MoE model's: its expert degrees
        columns[at:at] = [("ep", "ep", "{}"), ("etp", "etp", "{}")]
    if any((plan.cp or 1) > 1 for plan in plans[:top]):  # context parallelism among them
        columns.insert(at, ("cp", "cp", "{}"))
    cells = [[title for _, title, _ in columns]]
    if all_placements:
        cells += [[_cell(row, key, fmt, flagged) for key, _, fmt in columns] for row in plans[:top]]
        return aligned(cells)
    at = [key for key, _, _ in columns].index("layers_per_stage") + 1  # the count beside the placement it stands for
    cells[0].insert(at, "plans")
    for row, count in _distinct(plans, columns, top, flagged):
        cells.append([_cell(row, key, fmt, flagged) for key, _, fmt in columns])
        cells[-1].insert(at, str(count))
    return aligned(cells)


def _cell(row: Plan, key: str, fmt: str, flagged: Callable[[Plan], bool] | None = None) -> str:
    """One column of one row of the ranked table."""
    value = getattr(row, key)
    if key == "placement":
        return compress_placement(value)
    if key == "layers_per_stage":
        return ",".join(map(str, value))
    if key in ("virtual_stages", "cp"):
        return str(value or 1)
    if key == "recompute":
        return recompute_label(row)
    if key == "sequence_parallel":
        return "on" if value else "-"
    if key == "precision":
        return value or "-"
    if key == "peak_memory_gib":
        mark = HEADROOM_MARK if flagged is not None and flagged(row) else ""
        return f"{fmt.format(value)}/{fmt.format(row.memory_capacity_gib)}{mark}"
    return fmt.format(value)


def _distinct(plans: list[Plan], columns: list[tuple[str, str, str]], top: int,
              flagged: Callable[[Plan], bool] | None = None) -> list[tuple[Plan, int]]:
    """The first `top` plans that no better-ranked plan equals up to placement, each with the number of plans
    it stands for: those with the same cells but rank, placement and layers/stage, and the same layers per stage
    once sorted (and encoder stages), which is the same plan on other nodes."""
    shown = [(key, fmt) for key, _, fmt in columns if key not in ("rank", "placement", "layers_per_stage")]
    # keys as strings, which the cyclic collector does not track: tuples kept for every plan of a large search
    # would make it scan the plans' whole heap again and again
    keys = [" ".join([*(_cell(row, key, fmt, flagged) for key, fmt in shown), *map(str, sorted(row.layers_per_stage)),
                      f"encoder {row.encoder_stages}"]) for row in plans]
    counts = Counter(keys)
    first: dict[str, Plan] = {}
    for row, key in zip(plans, keys):
        if key not in first:
            first[key] = row
            if len(first) == top:
                break
    return [(row, counts[key]) for key, row in first.items()]


def recompute_label(row: Plan) -> str:
    """none, selective, full (uniform, every layer) or full:block=K."""
    if row.recompute_method == "block":
        return f"full:block={row.recompute_num_layers}"
    return row.recompute or "none"


def format_estimate(row: Plan, model_name: str, cluster_name: str, memory_margin: float, band: ErrorBand,
                    memory_load: float, memory_headroom: float) -> str:
    """One plan's per-stage table and the terms of its step time, memory and price; the step time stretched over
    the error `band`, and its memory load (peak over usable memory) against the headroom."""
    groups = row.is_stage_groups  # its rows show each stage's degrees and micro-batch per GPU
    shape = (f"stage groups pp={row.pp}, {row.mbs * row.dp} samples per micro-batch" if groups else
             f"tp={row.tp} dp={row.dp} pp={row.pp}" + (f" cp={row.cp}" if (row.cp or 1) > 1 else "")
             + (f" ep={row.ep} etp={row.etp}" if row.ep is not None else "") + f" mbs={row.mbs}")
    degrees = f"  {'tp':>3}  {'dp':>3}  {'mbs':>4}" if groups else ""
    lines = [f"{model_name} on {cluster_name}: {shape} "
             f"({row.num_microbatches} micro-batches), placement {compress_placement(row.placement)}"
             + (f", {row.virtual_stages} virtual stages" if (row.virtual_stages or 1) > 1 else "")
             + f", recompute {recompute_label(row)}, sequence parallelism {'on' if row.sequence_parallel else 'off'}"
             + (f", fp8 ({row.fp8_recipe} scaling{', parameters gathered in fp8' if row.fp8_param_gather else ''})"
                if row.precision == "fp8" else ""),
             f"{'stage':>5}  {'gpu':>9}{degrees}  {'layers':>6}  {'compute s':>9}  {'p2p s':>8}  {'allreduce s':>11}  "
             f"{'mem GiB':>7}  {'of GiB':>6}"]
    for s in row.stages or []:
        degrees = f"  {s.tp:>3}  {s.dp:>3}  {s.mbs:>4}" if groups else ""
        lines.append(f"{s.stage:>5}  {s.gpu:>9}{degrees}  {s.layers:>6}  {s.compute_s:>9.5f}  {s.p2p_s:>8.5f}  "
                     f"{s.dp_allreduce_s:>11.5f}  {s.memory_gib:>7.2f}  {s.memory_capacity_gib:>6.2f}")
    over = memory_load > memory_headroom
    assert row.step_time_s is not None  # an estimate times its plan
    lines += [
        f"step time        {row.step_time_s:.4f} s  ({row.throughput_samples_per_s:.1f} samples/s)",
        f"  error band     {band.range_of(row.step_time_s, '{:.4f}')} s: {band.describe()}",
        f"  pipeline       {row.pipeline_time_s:.4f} s  (bubble {row.bubble_s:.4f} s, p2p {row.p2p_s:.4f} s)",
        f"  dp all-reduce  {row.dp_allreduce_s:.4f} s  (exposed after overlap {row.dp_exposed_s or 0:.4f} s)",
        f"  optimizer      {row.optimizer_s or 0:.4f} s",
        f"  emb all-reduce {row.embedding_allreduce_s:.4f} s",
        f"  recomputation  {row.recompute_s or 0.0:.4f} s  (on the stage of most compute, inside the pipeline time)",
        f"peak memory      {row.peak_memory_gib:.2f} of {row.memory_capacity_gib:.2f} GiB, {memory_load:.0%} of usable"
        + (f" ({HEADROOM_MARK} above the {memory_headroom:.0%} headroom)" if over else
           f" (headroom {memory_headroom:.0%})")
        + ("" if row.fits_memory else f"  (does NOT fit with margin {memory_margin})"),
        f"price            ${row.cost_per_step_usd:.5f} per step, ${row.cost_per_hour_usd:.2f} per hour",
    ]
    return "\n".join(lines)


def band_line(band: ErrorBand, best: Plan) -> str:
    """The error band under a table of plans, applied to its first plan's step (and run)."""
    assert best.step_time_s is not None  # a search times its plans
    run = ""
    if best.train_hours is not None and best.train_cost_usd is not None:
        run = (f", its run {band.range_of(best.train_hours, '{:,.1f}')} h and "
               f"${band.range_of(best.train_cost_usd, '{:,.0f}')}")
    return (f"error band: {band.describe()}; plan {best.rank} would take "
            f"{band.range_of(best.step_time_s, '{:.4f}')} s per step{run}.")


def headroom_line(flagged: int, plans: int, memory_headroom: float) -> str:
    """What HEADROOM_MARK means, and how many plans carry it."""
    return (f"{HEADROOM_MARK}: {flagged} of {plans} plans peak above {memory_headroom:.0%} of a GPU's usable memory "
            "(--memory-headroom) and rank after every plan below it.")


def noise_report(inputs, plans: list[Plan], noise: float, trials: int, seed: int, sort: str, top: int,
                 progress: Callable[[int, int], None] | None = None) -> str:
    """The robust ranking of the best plans as a table; `inputs` is a fasop.search.space.Inputs."""
    from fasop.search.robust import CANDIDATES, robustness

    candidates = plans[:CANDIDATES]
    ranked = robustness(inputs.model, inputs.cluster, inputs.profiles, candidates, noise, trials, seed, sort, progress)
    by_rank = {plan.rank: plan for plan in candidates}
    what = "step time" if sort == "time" else "dollars per step"
    cells = [["robust", "rank", "mbs", "tp", "dp", "pp", "placement", "P(best)", "mean slower", "worst slower"]]
    for position, r in enumerate(ranked[:top], start=1):
        plan = by_rank[r.exact_rank]
        cells.append([str(position), str(r.exact_rank), str(plan.mbs), str(plan.tp), str(plan.dp),
                      str(plan.pp), compress_placement(plan.placement), f"{r.best_fraction:.3f}",
                      f"{r.mean_slowdown:.2%}", f"{r.worst_slowdown:.2%}"])
    return (f"Under +-{noise:g} noise on every profile time and link ({trials} trials, seed {seed}), the best "
            f"{len(candidates)} plans re-estimated; slower: {what} against each trial's best of them.\n{aligned(cells)}")


def front_table(records: list[dict]) -> str:
    """One line per composition: node counts, best plan, speed, price, the run, and '*' on the front."""
    from fasop.market.pareto import node_counts

    types = [f"{name} nodes" for name in node_counts(records[0])]
    precision = any("precision" in r for r in records)  # a sweep in several precisions: each best plan's
    titles = [*types, "gpus", *(["prec"] if precision else []), "mbs", "tp", "dp", "pp", "placement", "step s",
              "samples/s", "$/hour", "run h", "run $", "front"]
    cells = [titles]
    for r in records:
        line = [str(n) for n in node_counts(r).values()] + [str(r["gpus"])]
        if precision:
            line.append(r.get("precision") or "-")
        if r["feasible"]:
            line += [str(r[k]) for k in ("mbs", "tp", "dp", "pp")]
            line += [compress_placement(r["placement"]), f"{r['step_time_s']:.4f}", f"{r['throughput_samples_per_s']:.1f}",
                     f"{r['cost_per_hour_usd']:.2f}", f"{r['train_hours']:,.2f}", f"{r['train_cost_usd']:,.0f}",
                     "*" if r["on_front"] else ""]
        else:
            reason = (r.get("note") or "no plan fits").split(" (")[0].split(";")[0]
            line += ["-"] * 5 + ["-", "-", f"{r['cost_per_hour_usd']:.2f}", "-", "-", reason]
        cells.append(line)
    widths = [max(len(row[i]) for row in cells) for i in range(len(titles) - 1)]
    return "\n".join(("  ".join(c.rjust(w) for c, w in zip(row, widths)) + "  " + row[-1]).rstrip() for row in cells)
