"""`fasop pareto` and `fasop plot`: which machines to rent, and charts of the front or of one plan's stages."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import click

from fasop.cli import common
from fasop.cli.tables import front_table
from fasop.cost.price import run_steps
from fasop.errors import InputError
from fasop.files import pending_write
from fasop.inputs.cluster import load_cluster
from fasop.inputs.errorband import ErrorBand, band_of
from fasop.market.choice import MAX_MARGIN
from fasop.market.rent import RENT_TIME_LIMIT_S
from fasop.plans import Plan, load_plans, select_plan
from fasop.search.space import check_global_batch
from fasop.timeline import MAX_OPERATIONS

margin_option = click.option(
    "--margin", type=common.FiniteRange(0, MAX_MARGIN), default=None, metavar="F",
    help="With --budget or --deadline: count a run as meeting them only when its estimate times 1 + F does (0.3: "
         "30%) [default: the slow end of the error band of measured runs, docs/validation.md].")


def _check_margin(margin: float | None, budget_usd: float | None, deadline_hours: float | None) -> None:
    if margin is not None and budget_usd is None and deadline_hours is None:
        raise InputError("--margin", "applies to a choice within --budget or --deadline; give one of them as well")


def _max_nodes(values: tuple[str, ...]) -> dict[str, int]:
    """('A100=4', 'A10=2') -> {'A100': 4, 'A10': 2}."""
    caps: dict[str, int] = {}
    for value in values:
        name, sep, count = value.partition("=")
        name, count = name.strip(), count.strip()
        try:
            number = int(count)
        except ValueError:
            number = None
        if not sep or not name or number is None:
            raise InputError(f"--max-nodes {value}", "expected TYPE=N, a node type and a number of nodes (for example A100=4)")
        caps[name] = number
    return caps


@click.command()
@common.model_option
@common.cluster_option
@common.gbs_option
@click.option("--train-steps", type=click.IntRange(min=1), default=None,
              help="Steps of the whole run (default 10,000 without --train-tokens).")
@click.option("--train-tokens", type=click.FloatRange(min=1), default=None,
              help="Tokens of the whole run (instead of --train-steps).")
@click.option("--budget", "budget_usd", type=float, default=None, metavar="USD",
              help="Report the fastest run that costs at most this.")
@click.option("--deadline", "deadline_hours", type=float, default=None, metavar="HOURS",
              help="Report the cheapest run that ends within this (with --budget: the cheapest meeting both).")
@margin_option
@click.option("--max-nodes", multiple=True, metavar="TYPE=N", help="Sweep at most N nodes of TYPE (repeatable).")
@click.option("--rent", is_flag=True,
              help="Instead of sweeping compositions, let the integer program choose how many nodes of each type to "
                   "rent, reading each node type's count as its quota (the most one may rent), for a series of caps "
                   "on the price per hour: stage-group plans (each stage its own node type, tp and dp), and quotas "
                   "far beyond what a sweep can reach.")
@click.option("--time-limit", "time_limit_s", type=common.FiniteRange(0, None, min_open=True), default=None,
              metavar="SECONDS", help="With --rent: the integer program's time over every price cap together "
                                      f"[default: {RENT_TIME_LIMIT_S:g}].")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write one row per composition to front.csv.")
@click.option("--chart", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw cost against throughput to chart.png or chart.svg.")
@click.option("--x", "x_axis", type=click.Choice(["throughput", "time"]), default=None,
              help="Horizontal axis of --chart: throughput (default) or time to train.")
@common.force_option
@common.profiles_option
@common.mismatch_option
@common.optimizer_option
@common.precision_options(several=True)
@common.seq_length_option
@common.reports_input_errors
def pareto(model_name, seq_length, cluster_name, gbs, train_steps, train_tokens, budget_usd, deadline_hours, margin, max_nodes,
           rent, time_limit_s, output, chart, x_axis, force, profiles_dir, allow_profile_mismatch, distributed_optimizer,
           precision, fp8_recipe, fp8_param_gather):
    """Sweep every mix of the cluster's node types: the best plan of each, cost against time to train, and
    the Pareto front; with --budget or --deadline, which mix to rent, with a margin for the estimates' error.
    With --rent, the integer program chooses the mix within each type's quota."""
    from fasop.market.pareto import check_limits

    if time_limit_s is not None and not rent:
        raise InputError("--time-limit", "bounds the integer program of --rent; give --rent as well")
    check_limits(budget_usd, deadline_hours)
    _check_margin(margin, budget_usd, deadline_hours)
    common.check_run_length(train_steps, train_tokens)
    if gbs is not None:  # before the sweep's first line
        check_global_batch(gbs)
    if (budget_usd is not None or deadline_hours is not None) and train_steps is None and train_tokens is None:
        raise InputError("--budget" if budget_usd is not None else "--deadline",
                         "a budget or deadline needs the length of the run: give --train-steps or --train-tokens")
    if output is not None and output.suffix != ".csv":
        raise InputError(f"--output {output}", "expected a file name ending in .csv")
    if chart is not None and chart.suffix.lower() not in (".png", ".svg"):
        raise InputError(f"--chart {chart}", "expected a file name ending in .png or .svg")
    if x_axis is not None and chart is None:
        raise InputError("--x", "chooses the axis of --chart; give --chart chart.png as well")
    model, cluster = common.load_model_at(model_name, seq_length), load_cluster(cluster_name)
    outputs = [(path, option) for path, option in ((output, "--output"), (chart, "--chart")) if path is not None]
    common.check_outputs(outputs, common.input_paths(model_name, cluster_name, model, cluster, profiles_dir), force)
    run = dict(budget_usd=budget_usd, deadline_hours=deadline_hours, margin=margin, gbs=gbs, train_steps=train_steps,
               train_tokens=train_tokens, distributed_optimizer=distributed_optimizer)
    run.update(_profiles(model, cluster, profiles_dir, allow_profile_mismatch, distributed_optimizer, rent,
                         precision, fp8_recipe, fp8_param_gather))
    run_length = _run_length(gbs or model.global_batch_size, model, train_steps, train_tokens)
    if rent:
        result = _rent(model, cluster, _max_nodes(max_nodes), time_limit_s, run, run_length)
    else:
        result = _sweep(model, cluster, _max_nodes(max_nodes), run, run_length)
    records = result.records
    feasible = sum(r["feasible"] for r in records)
    if result.choice:
        click.echo(result.choice)
    _write_front(records, output, chart, x_axis, budget_usd, deadline_hours, result.chosen)
    if output is not None:
        click.echo(f"{len(records)} {'points' if rent else 'compositions'} written to {output}")
    if chart is not None and feasible:
        click.echo(f"chart written to {chart}")
    elif chart is not None:
        click.echo("no chart: no composition has a plan that fits", err=True)


def _profiles(model, cluster, profiles_dir, allow_profile_mismatch, distributed_optimizer, rent, precision,
              fp8_recipe, fp8_param_gather) -> dict:
    """The sweep's profiles, or with --precision each precision's space and its profiles."""
    if precision is None and fp8_recipe is None and fp8_param_gather is None:
        return {"profiles": common.run_profiles(model, cluster, profiles_dir, allow_profile_mismatch)}
    if rent:
        raise InputError("--precision", "sweeps compositions; --rent plans in the model file's precision")
    from fasop.search.precision import parse_precisions, precision_spaces

    spaces = precision_spaces(model, cluster, None if precision is None else parse_precisions(precision), fp8_recipe,
                              fp8_param_gather, distributed_optimizer=distributed_optimizer)
    return {"spaces": spaces, "space_profiles": common.space_profiles(spaces, profiles_dir, allow_profile_mismatch)}


def _sweep(model, cluster, max_nodes: dict[str, int], run: dict, run_length: str):
    """Every composition swept, its table and what the sweep took."""
    from fasop.market.choice import sweep_and_choose
    from fasop.market.pareto import compositions

    todo = compositions(cluster, max_nodes)
    caps = ", ".join(f"0-{max(c[n] for c in todo)} {n}" for n in cluster.node_types)
    click.echo(f"{model.name} on {cluster.name}: {len(todo)} compositions of {caps} nodes ({cluster.gpus_per_node} GPUs each), "
               f"global batch {run['gbs'] or model.global_batch_size}, a run of {run_length}")
    started = time.perf_counter()
    with common.progress_bar("sweeping") as progress:
        result = sweep_and_choose(model, cluster, todo, progress=progress, **run)
    elapsed = time.perf_counter() - started
    records = result.records
    click.echo(front_table(records))
    click.echo(f"run h and run $: estimates; {band_of(cluster.error_band).describe()}.")
    click.echo(f"{len(records)} compositions swept in {elapsed:.2f} s, {sum(r['plans_evaluated'] for r in records):,} plans "
               f"evaluated; {_front_counts(records)}.")
    return result


def _rent(model, cluster, max_nodes: dict[str, int], time_limit_s: float | None, run: dict, run_length: str):
    """The integer program's walk over price caps, its table (each stage's tp and dp) and what the walk took."""
    from fasop.market.choice import rent_and_choose
    from fasop.market.pareto import degrees_text, node_caps

    quotas = node_caps(cluster, max_nodes)
    # the walk first: what it refuses (an encoder-decoder model, quotas of more GPUs than a plan spans) is refused
    # before any line is printed
    result = rent_and_choose(model, cluster, max_nodes=max_nodes, time_limit_s=time_limit_s or RENT_TIME_LIMIT_S, **run)
    click.echo(f"{model.name} on {cluster.name}: what to rent, at most "
               f"{', '.join(f'{n} {name}' for name, n in quotas.items())} nodes, global batch "
               f"{run['gbs'] or model.global_batch_size}, a run of {run_length}")
    walk = result.rent
    assert walk is not None  # rent_and_choose returns its walk
    records = result.records
    shown = [{**r, **dict(zip(("tp", "dp"), degrees_text(r)))} if r["feasible"] else r for r in records]
    click.echo(front_table(shown) if records else "no stage-group plan within the quotas")
    click.echo(f"run h and run $: estimates; {band_of(cluster.error_band).describe()}.")
    gap = max((r["optimality_gap"] for r in records if r.get("optimality_gap") is not None), default=0.0)
    click.echo(f"{len(records)} points, each the integer program's fastest stage-group plan under a cap on the price "
               f"per hour (tp and dp per stage; gap at most {gap:.3%}), found in {walk.elapsed_s:.2f} s, "
               f"{walk.solves:,} programs solved; {_front_counts(records)}.")
    if walk.stopped_by is not None:
        cheapest = min((r["cost_per_hour_usd"] for r in records), default=None)
        below = f" below ${cheapest:,.2f} an hour" if cheapest is not None else ""
        more = " (raise --time-limit)" if walk.stopped_by == "the time limit" else ""
        click.echo(f"the walk stopped at {walk.stopped_by}: plans{below} were not sought{more}")
    return result


def _front_counts(records: list[dict]) -> str:
    feasible = sum(r["feasible"] for r in records)
    return (f"{sum(r['on_front'] for r in records)} on the Pareto front (*), {len(records) - feasible} without a plan "
            "that fits")


def _run_length(batch: int, model, train_steps: int | None, train_tokens: float | None) -> str:
    """The run as the sweep's first line states it."""
    from fasop.market.pareto import DEFAULT_TRAIN_STEPS

    if train_tokens is not None:
        length = f"{train_tokens:,.0f} tokens"
        if batch > 0:
            length += f" = {run_steps(batch, model, train_tokens):,} steps"
        return length
    length = f"{train_steps or DEFAULT_TRAIN_STEPS:,} steps"
    if train_steps is None:
        length += " (default; set --train-steps or --train-tokens)"
    return length


def _write_front(records, output, chart, x_axis, budget_usd, deadline_hours, chosen) -> None:
    """The front file and the chart; the front file is moved into place only once the chart is written."""
    from fasop.market.frontfile import front_as_csv

    with pending_write(output, front_as_csv(records), f"--output {output}") if output else nullcontext():
        if chart is not None and any(r["feasible"] for r in records):
            from fasop.plot import plot_front

            plot_front(records, chart, x=x_axis or "throughput", budget=budget_usd, deadline=deadline_hours,
                       chosen=chosen, argument="chart")


def _load_plan(plan_file: Path, rank: int) -> Plan:
    """Plan `rank` of a `fasop search --output plans.json` file, with the per-stage breakdown a chart needs."""
    from fasop.plot import check_plan

    plan = select_plan(load_plans(plan_file), rank, str(plan_file))
    check_plan(plan, f"{plan_file}: plan {rank}")
    return plan


TIMELINE_MICROBATCHES = 1024  # more bars than a chart can show


def _plot_timeline(plan: Plan, out: Path, plan_file: Path) -> None:
    """The exact schedule of `plan`, drawn from the times its plan file holds."""
    from fasop.plot import stage_names
    from fasop.timeline import plan_op_times, plot_timeline, timeline_title, write_trace

    where = f"{plan_file}: plan {plan.rank}"
    m = plan.num_microbatches
    assert m is not None  # _load_plan checked it
    if m > TIMELINE_MICROBATCHES:
        raise InputError(f"{where}: num_microbatches", f"{m} micro-batches: a timeline draws at most "
                                                       f"{TIMELINE_MICROBATCHES}")
    times = plan_op_times(plan, where)
    names = stage_names(plan)
    if out.suffix.lower() == ".json":  # a Chrome trace, to open beside a measured one in Perfetto
        drawn = write_trace(times, out, stage_names=names, inputs=[plan_file], argument="timeline")
    else:
        drawn = plot_timeline(times, out, inputs=[plan_file], argument="timeline", stage_names=names,
                              title=timeline_title(plan, times))
    idle = drawn["idle"]["seconds"] / (plan.pp * float(times.makespan_s[0]))
    click.echo(f"schedule of plan {plan.rank} ({plan.pp} stages, {m} micro-batches, "
               f"{idle:.0%} idle) written to {out}")


def _own_band(cluster_name: str | None, records: list[dict], front_file: Path) -> ErrorBand | None:
    """The error band of the --cluster file, which must be of the cluster the front was made for."""
    if cluster_name is None:
        return None
    cluster = load_cluster(cluster_name)
    made_for = sorted({r["cluster"] for r in records if r.get("cluster")})
    if made_for and made_for != [cluster.name]:
        raise InputError(f"--cluster {cluster_name}", f"is cluster {cluster.name}, but {front_file} was made for cluster "
                                                      f"{', '.join(made_for)}: give that cluster's file")
    return cluster.error_band


@click.command()
@click.argument("front_file", required=False, type=click.Path(dir_okay=False, path_type=Path), metavar="[FRONT.csv]")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="chart.png or chart.svg")
@click.option("--x", "x_axis", type=click.Choice(["throughput", "time"]), default=None,
              help="Horizontal axis of a front chart: throughput (default) or time to train.")
@click.option("--budget", "budget_usd", type=float, default=None, metavar="USD",
              help="Draw the budget and highlight the fastest run within it.")
@click.option("--deadline", "deadline_hours", type=float, default=None, metavar="HOURS",
              help="Draw the deadline and highlight the cheapest run within it.")
@margin_option
@click.option("--cluster", "cluster_name", default=None, metavar="NAME|FILE",
              help="With --budget or --deadline: the cluster whose error band sets the default margin (a file "
                   "fasop calibrate wrote carries its runs' band); default: the published runs' band.")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Instead of a front: chart the stages of one plan of a fasop search --output plans.json file.")
@click.option("--rank", type=click.IntRange(min=1), default=None, help="Which plan of --plan (default 1, the best).")
@click.option("--timeline", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --plan, instead of --out: the plan's pipeline schedule as a Gantt chart (png or svg), or as "
                   "a Chrome trace (json) that Perfetto and chrome://tracing open; at most "
                   f"{MAX_OPERATIONS:,} forwards and backwards (2 x stages x model chunks x micro-batches).")
@common.force_option
@common.reports_input_errors
def plot(front_file, out_path, x_axis, budget_usd, deadline_hours, margin, cluster_name, plan_file, rank, timeline,
         force):
    """Chart a front file of fasop pareto (cost against throughput), or with --plan the compute,
    communication and idle time of each pipeline stage of one plan (--out), or its schedule (--timeline)."""
    if (front_file is None) == (plan_file is None):
        raise InputError("fasop plot", "give either a front file (FRONT.csv from fasop pareto --output) or --plan plans.json")
    if (out_path is None) == (timeline is None) or (timeline is not None and plan_file is None):
        raise InputError("fasop plot", "give --out chart.png, or with --plan either --out or --timeline schedule.png")
    if cluster_name is not None and budget_usd is None and deadline_hours is None:
        raise InputError("--cluster", "sets the margin of a --budget or --deadline choice: give one of them")
    if out_path is not None and out_path.suffix.lower() not in (".png", ".svg"):
        raise InputError(f"--out {out_path}", "expected a file name ending in .png or .svg")
    common.check_outputs([(out_path, "--out") if out_path is not None else (timeline, "--timeline")],
                         [plan_file or front_file], force)
    if plan_file is not None:
        if budget_usd is not None or deadline_hours is not None or margin is not None or x_axis is not None:
            raise InputError("--plan", "--budget, --deadline, --margin and --x apply to a front chart, not to a plan's "
                                       "stages")
        plan = _load_plan(plan_file, 1 if rank is None else rank)
        if timeline is not None:
            _plot_timeline(plan, timeline, plan_file)
            return
        from fasop.plot import plot_stages

        plot_stages(plan, out_path)
        click.echo(f"stages of plan {plan.rank} ({plan.pp} stages) written to {out_path}")
        return
    if rank is not None:
        raise InputError("--rank", "applies to --plan only")
    from fasop.market.choice import choose
    from fasop.market.frontfile import read_front_csv
    from fasop.market.pareto import check_limits
    from fasop.plot import plot_front

    check_limits(budget_usd, deadline_hours)
    _check_margin(margin, budget_usd, deadline_hours)
    records = read_front_csv(front_file)
    if not any(r["feasible"] for r in records):
        raise InputError(str(front_file), "no composition has a plan that fits in memory: nothing to plot")
    chosen, message = choose(records, budget_usd, deadline_hours, margin, _own_band(cluster_name, records, front_file))
    counts = plot_front(records, out_path, x=x_axis or "throughput", budget=budget_usd, deadline=deadline_hours,
                        chosen=chosen)
    if message:
        click.echo(message)
    series = ", ".join(f"{n} {k}" for k, n in counts.items() if k not in ("front", "chosen", "not shown"))
    click.echo(f"chart of {len(records)} compositions ({series}; {counts['front']} on the front) written to {out_path}")
