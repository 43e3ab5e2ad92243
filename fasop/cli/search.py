"""`fasop search`: rank every plan of a model on a cluster."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import click

from fasop.cli import common
from fasop.cli.run_options import run_options, run_settings
from fasop.cli.tables import band_line, format_table, headroom_line, noise_report
from fasop.cost.config import RECOMPUTE_MODES, check_recompute_modules
from fasop.errors import InputError
from fasop.files import MIB, PLANS_LIMIT_BYTES, check_finite, pending_write
from fasop.inputs.cluster import load_cluster
from fasop.plans import PlanFile
from fasop.search.robust import CANDIDATES, DEFAULT_TRIALS, MAX_SEED, MAX_TRIALS


def noise_options(command):
    """The search command's --noise, --trials and --seed options."""
    command = click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
                           help="Seed of the --noise trials, 0 to 2^32 - 1 (default 0): the same seed gives the same "
                                "report.")(command)
    command = click.option("--trials", type=click.IntRange(1, MAX_TRIALS), default=None,
                           help=f"Perturbed re-estimates for --noise, 1 to {MAX_TRIALS:,} (default "
                                f"{DEFAULT_TRIALS}).")(command)
    return click.option("--noise", type=common.FiniteRange(0, 1, min_open=True, max_open=True), default=None,
                        metavar="F",
                        help=f"Also perturb every profile time and link bandwidth by up to this fraction (0.2: "
                             f"+-20%) in --trials trials, re-estimate the best {CANDIDATES} plans in each and "
                             "report how often each is best and how much slower than the best it can be "
                             "(fasop/search/robust.py).")(command)


TIMING_LEGEND = ("step s: Megatron-LM's 1F1B schedule timed exactly (interleaved over vp chunks when vp > 1), then each "
                 "stage's gradient reduction, optimizer step and parameter gather (docs/cost-model.md 4.2)")


@click.command()
@common.model_option
@common.cluster_option
@common.gbs_option
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Rows to print: distinct plans, unless --all-placements.")
@click.option("--all-placements", is_flag=True,
              help="Print every plan: by default a plan that differs from a better-ranked one only in placement "
                   "and layer order, with the same figures, is counted in that one's `plans` column instead.")
@click.option("--sort", type=click.Choice(["time", "cost"]), default="time", show_default=True,
              help="Rank by step time or by dollars per step.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"Write every feasible plan to plans.csv, or to plans.json best first up to the "
                   f"{PLANS_LIMIT_BYTES // MIB} MiB that fasop reads back.")
@common.force_option
@click.option("--train-steps", type=click.IntRange(min=1), default=None,
              help="Steps of the whole run, for its time and price.")
@click.option("--train-tokens", type=click.FloatRange(min=1), default=None,
              help="Tokens of the whole run (instead of --train-steps).")
@click.option("--prune/--no-prune", default=None,
              help="Solve only plans that can reach the --top rows of the table (sound lower bounds skip the rest; "
                   "the table is the full search's, the counts above it those of the plans solved). Default: "
                   "--prune, unless --output or --noise asks for every plan; with --prune, --output holds only those "
                   "plans.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes to search with, at most one per core (default: one per core for clusters of 32 nodes or "
                   "more, else one).")
@click.option("--emit", "emit_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write the best plan's Slurm and Megatron-LM launch scripts into this directory "
                   "(site options from the cluster file's [launch] table; `fasop emit` offers them all).")
@common.profiles_option
@common.mismatch_option
@common.optimizer_option
@common.overlap_option
@click.option("--recompute", "recompute_modes", default=",".join(RECOMPUTE_MODES), show_default=True,
              metavar="MODE,MODE,...",
              help="Activation recomputation modes to consider (Megatron's --recompute-granularity; full as "
                   "--recompute-method uniform --recompute-num-layers 1); each plan takes its best.")
@common.recompute_modules_option(default="core_attn")
@click.option("--no-sequence-parallel", "no_sequence_parallel", is_flag=True,
              help="Leave Megatron's --sequence-parallel off (by default on whenever tp > 1: the same traffic, "
                   "less activation memory).")
@click.option("--no-tp-comm-overlap", "no_tp_comm_overlap", is_flag=True,
              help="Leave Megatron's --tp-comm-overlap off (by default on where it runs and hides time: tp > 1 with "
                   "sequence parallelism on the GPU types of clusters/catalogue/tp-comm-overlap.toml).")
@click.option("--use-all", is_flag=True,
              help="Only plans on every node (by default plans that leave whole node types idle compete too).")
@click.option("--stage-groups", is_flag=True,
              help="Also search stage-group plans, each pipeline stage with its own GPU type, tp and dp, chosen by "
                   "an integer program (run with FlagScale's heterogeneous mode: fasop emit).")
@common.memory_headroom_option
@common.precision_options(several=True)
@common.seq_length_option
@noise_options
@run_options
@common.reports_input_errors
def search(model_name, seq_length, cluster_name, gbs, top, all_placements, sort, output, force, train_steps, train_tokens, prune,
           workers, emit_dir, profiles_dir, allow_profile_mismatch, distributed_optimizer, overlap, recompute_modes,
           recompute_modules, no_sequence_parallel, no_tp_comm_overlap, use_all, stage_groups, memory_headroom,
           precision, fp8_recipe, fp8_param_gather, noise, trials, seed, **run):
    """Rank every parallel plan of MODEL on CLUSTER by estimated step time, plans above the memory headroom
    after those below it."""
    from fasop.search.precision import parse_precisions, precision_spaces, search_precisions

    recompute = tuple(mode.strip() for mode in recompute_modes.split(","))
    for value, option in ((trials, "--trials"), (seed, "--seed")):
        if value is not None and noise is None:
            raise InputError(option, "applies to the --noise trials only; give --noise F as well")
    common.check_run_length(train_steps, train_tokens)
    if output is not None and output.suffix not in (".json", ".csv"):
        raise InputError(f"--output {output}", "expected a file name ending in .json or .csv")
    model, cluster = common.load_model_at(model_name, seq_length), load_cluster(cluster_name)
    check_recompute_modules(model, recompute_modules)  # before any profile is read or noted
    inputs = common.input_paths(model_name, cluster_name, model, cluster, profiles_dir)
    outputs = _checked_outputs(output, emit_dir, inputs, force)
    prune = output is None and noise is None if prune is None else prune  # every plan where one is written or perturbed
    spaces = precision_spaces(model, cluster, None if precision is None else parse_precisions(precision), fp8_recipe,
                              fp8_param_gather, use_all, distributed_optimizer)
    space_profiles = common.space_profiles(spaces, profiles_dir, allow_profile_mismatch)
    started = time.perf_counter()
    with common.progress_bar("searching") as progress:
        result = search_precisions(spaces, space_profiles, gbs, profiles_dir, memory_headroom=memory_headroom,
                                   distributed_optimizer=distributed_optimizer, train_steps=train_steps,
                                   train_tokens=train_tokens, sort=sort, progress=progress,
                                   **_cut(prune, top, all_placements), workers=workers, overlap=overlap,
                                   recompute=recompute, recompute_modules=recompute_modules,
                                   sequence_parallel=not no_sequence_parallel, tp_comm_overlap=not no_tp_comm_overlap,
                                   use_all=use_all, stage_groups=stage_groups, bound_placements=top)
    elapsed = time.perf_counter() - started
    plans = result.plans
    if not plans:
        closest = result.closest_plan
        hint = ""
        if closest is not None:
            hint = (f"; the closest plan (tp={closest.tp} dp={closest.dp} pp={closest.pp} mbs={closest.mbs}) "
                    f"needs {result.closest_memory_factor:.2f}x the GPU memory")
        raise InputError(f"--cluster {cluster_name}", f"no plan fits in memory ({result.out_of_memory} plans tried){hint}")
    report = None
    if noise is not None:  # before anything is written: nothing is left behind when it fails
        settings = (distributed_optimizer, overlap, recompute, not no_sequence_parallel, not no_tp_comm_overlap, None,
                    recompute_modules)
        report = _noise(spaces, space_profiles, plans, profiles_dir, settings, noise, trials, seed, sort, top)
    plan_file = PlanFile(plans, output) if output is not None else None
    notes = _write_outputs(plans, model, cluster, plan_file, emit_dir, outputs, inputs, run_settings(run))
    click.echo(f"{model.name} on {cluster.name}: {cluster.num_gpus} GPUs, global batch {plans[0].gbs}; "
               f"{result.plans_evaluated} plans evaluated in {elapsed:.2f} s ({result.partitions_solved} layer partitions "
               f"solved), {len(plans)} {'best kept' if prune else 'fit in memory'}, {result.out_of_memory} "
               f"{'found no room below the memory headroom' if result.headroom_only else 'removed as out of memory'}.")
    click.echo(TIMING_LEGEND)
    _echo_table(plans, top, all_placements, cluster, memory_headroom)
    _echo_notes(result, top, cluster)
    common.note_left_out(spaces)
    if report is not None:
        click.echo(report)
    if plan_file is not None:
        click.echo(f"{plan_file.written} plans written to {output}{plan_file.left_out()}")
    if emit_dir is not None:
        click.echo(f"launch scripts of plan 1 written to {emit_dir}; submit with: cd {emit_dir} && sbatch sbatch.sh")
        for note in notes:
            click.echo(note, err=True)


def _checked_outputs(output: Path | None, emit_dir: Path | None, inputs: list[Path],
                     force: bool) -> list[tuple[Path, str]]:
    """The files the search writes, refused before it runs where they would replace an input, one another or (without
    --force) what exists."""
    outputs = [(output, "--output")] if output is not None else []
    if emit_dir is not None:
        from fasop.launch.write import check_out_dir  # the launch code is loaded only for --emit

        check_out_dir(emit_dir, force, "emit_dir")
        if output is not None and output.resolve() == emit_dir.resolve():
            raise InputError(f"--output {output}", "is the folder --emit writes the launch scripts into; choose "
                                                   "another file")
    common.check_outputs(outputs, inputs, force)
    return outputs


def _cut(prune: bool, top: int, all_placements: bool) -> dict[str, int]:
    """The search's keep or places (fasop.search.evaluation.Cut) to print the table's first `top` rows: every
    plan's row with --all-placements, else the distinct rows."""
    return {} if not prune else {"keep": top} if all_placements else {"places": top}


def _noise(spaces, space_profiles, plans, profiles_dir, settings, noise, trials, seed, sort, top) -> str:
    """The --noise report of the plans of one precision."""
    from fasop.search.space import prepare

    if len(spaces) > 1:
        raise InputError("--noise", "perturbs the plans of one precision: give one --precision")
    prepared = prepare(spaces[0].model, spaces[0].cluster, plans[0].gbs, profiles_dir, settings[0], space_profiles[0],
                       *settings[1:])
    with common.progress_bar("noise trials") as progress:
        return noise_report(prepared, plans, noise, trials or DEFAULT_TRIALS, seed or 0, sort, top, progress)


def _echo_table(plans, top, all_placements, cluster, memory_headroom) -> None:
    """The ranked plans, the plans above the memory headroom marked, and the error band of the best."""
    from fasop.inputs.errorband import band_of
    from fasop.search.headroom import over_headroom

    def flagged(plan) -> bool:
        return over_headroom(plan, cluster, memory_headroom)

    click.echo(format_table(plans, top, all_placements, flagged))
    over = sum(map(flagged, plans))
    if over:
        click.echo(headroom_line(over, len(plans), memory_headroom))
    click.echo(band_line(band_of(cluster.error_band), plans[0]))


def _echo_notes(result, top, cluster) -> None:
    """What the table does not show: the partitions skipped, placements searched by a heuristic, and node types
    better left idle."""
    if result.pruned:
        click.echo(f"{result.pruned} layer partitions skipped: their lower bound cannot reach the best {top}.")
    if result.dominated:
        click.echo(f"{result.dominated} layer partitions skipped: another recompute mode, virtual size or encoder split "
                   "of the same plan is provably never slower.")
    blocks = [plan for plan in result.plans[:top] if plan.placement_search == "type-blocks"]
    if blocks:
        bounded = [plan for plan in blocks if plan.optimality_gap is not None]
        gaps = ("; the integer program bounds the best placement of each one's shape: plan "
                + ", plan ".join(f"{plan.rank} within {plan.optimality_gap:.2%}" for plan in bounded)
                if bounded else "")
        click.echo(f"note: placements of {len(blocks)} of these plans were searched as type blocks and their "
                   f"rotations, a heuristic{gaps} (docs/cost-model.md sections 1 and 11).")
    for choice in result.idle:
        counts = {name: cluster.node_types[name].count for name in choice.idle}
        idle = ", ".join(f"{name} ({n} node{'s' if n > 1 else ''})" for name, n in counts.items())
        if choice.every_node is None:
            click.echo(f"note: no plan uses every node; the best leaves {idle} idle.")
            break
        if choice.metric == "step_time_s":
            gain = f"faster: {choice.value:.4f} s per step against {choice.every_node:.4f} s"
        else:
            gain = f"cheaper per sample: ${choice.value:.5f} per step against ${choice.every_node:.5f}"
        click.echo(f"note: leaving {idle} idle is {gain} on every node (--use-all keeps every node).")


def _write_outputs(plans, model, cluster, plan_file, emit_dir, outputs, inputs, run) -> list[str]:
    """The plan list (`plan_file`) and the best plan's launch scripts. Everything that can fail is done before
    the first file is written: the plan list is moved into place only once the launch scripts are written.
    Returns what the user must know about the emitted run (fasop.launch.resume)."""
    emitted, notes = {}, []
    if emit_dir is not None:
        from fasop.inputs.errorband import band_of
        from fasop.launch.options import launch_options  # the launch code is loaded only for --emit
        from fasop.launch.resume import run_notes
        from fasop.launch.write import render_plan, write_files

        options = launch_options(cluster.launch, f"{cluster.file or cluster.name}: launch", **run)
        check_finite(plans[0].record(), "--emit plan 1")
        emitted = render_plan(plans[0], model, cluster, options, where="plan 1")
        notes = run_notes(plans[0], options, band_of(cluster.error_band))
        # force: whether files may be replaced was settled before the search
        common.check_outputs(outputs + [(emit_dir / name, "--emit") for name in emitted], inputs, force=True)
    writing = (pending_write(plan_file.output, plan_file.chunks(), f"--output {plan_file.output}")
               if plan_file is not None else nullcontext())
    with writing:
        if emit_dir is not None:
            # force: whether its files may be replaced was settled before the search, and the plan list's
            # temporary file may be there now
            write_files(emit_dir, emitted, force=True, argument="emit_dir", keep=inputs)
    return notes
