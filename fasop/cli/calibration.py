"""The `fasop validate` and `fasop calibrate` commands (fasop/calibration/ does the work)."""

from __future__ import annotations

import datetime
import os
from contextlib import ExitStack
from pathlib import Path

import click

from fasop.calibration.measured import WARMUP_ITERS, input_files, merge_repeats, read_measured
from fasop.cli.common import (
    check_outputs,
    force_option,
    note_model_defaults,
    note_synthesised,
    progress_bar,
    reports_input_errors,
)
from fasop.errors import InputError
from fasop.files import pending_write


def _measured_options(command):
    options = [
        click.option("--measured", "measured", required=True, type=click.Path(path_type=Path), metavar="CSV|DIR",
                     help="A CSV of plan columns (as in plans.csv) plus measured_step_s, or a folder of run folders "
                          "that each hold fasop emit's plan.json and the job's Megatron-LM log (*.out, *.log, *.txt)."),
        click.option("--warmup-iters", type=click.IntRange(min=0), default=None,
                     help=f"Iterations at the start of each log of a run folder left out of its median step time "
                          f"(default {WARMUP_ITERS})."),
        click.option("--model", "model_name", default=None, metavar="NAME|FILE",
                     help="Model of every run (default: each run's model_file or model)."),
        click.option("--cluster", "cluster_name", default=None, metavar="NAME|FILE",
                     help="Cluster of every run (default: each run's cluster_file or cluster)."),
        click.option("--profiles", "profiles_dir", default=None, metavar="DIR",
                     help="Folder of <gpu>.csv profiles (default: the bundled profiles/<model>)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _runs_and_settings(measured, warmup_iters, model_name, cluster_name, profiles_dir):
    """The runs, each plan once (repeats merged, said once on stderr), and the setting of each."""
    from fasop.calibration.validate import load_settings

    if warmup_iters is not None and not measured.is_dir():
        raise InputError("--warmup-iters", f"applies to the logs of run folders; --measured {measured} is a CSV of "
                                           "step times")
    runs, note = merge_repeats(read_measured(measured, WARMUP_ITERS if warmup_iters is None else warmup_iters,
                                             model_name, cluster_name))
    settings = load_settings(runs, profiles_dir)
    if note:
        click.echo(note, err=True)
    for setting in {id(s): s for s in settings}.values():
        note_synthesised(setting.model, setting.profiles)
        note_model_defaults(setting.model)
    return runs, settings


def _inputs(measured, settings) -> list[Path]:
    """Every file the runs were read or estimated from: no output may replace one."""
    return input_files(measured) + [path for setting in {id(s): s for s in settings}.values()
                                    for path in setting.input_paths]


@click.command()
@_measured_options
@click.option("--chart", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="Also draw estimated against measured step time (.png or .svg).")
@force_option
@reports_input_errors
def validate(measured, warmup_iters, model_name, cluster_name, profiles_dir, chart, force):
    """Compare fasop's estimates with measured step times: each run's plan is estimated afresh from its
    model, cluster and profiles; prints estimate and measurement per run, the mean absolute percentage
    error (MAPE), the Spearman rank correlation and whether the plan fasop ranks first was the fastest. A run
    folder with torch.profiler traces also gets its stages' compute, communication and idle time beside the
    estimate's."""
    from fasop.calibration.validate import compare, format_comparison, format_stages, predict_runs
    from fasop.plot import stage_times

    if chart is not None and chart.suffix.lower() not in (".png", ".svg"):
        raise InputError(f"--chart {chart}", "expected a file name ending in .png or .svg")
    runs, settings = _runs_and_settings(measured, warmup_iters, model_name, cluster_name, profiles_dir)
    if chart is not None:
        check_outputs([(chart, "--chart")], _inputs(measured, settings), force)
    with progress_bar("estimating runs") as progress:
        plans = predict_runs(runs, settings, progress)
    comparison = compare(runs, [plan.step_time_s for plan in plans])
    click.echo(format_comparison(comparison))
    for run, plan in zip(runs, plans):
        if run.stages and run.kind == "3d":
            click.echo("\n" + format_stages(run, stage_times(plan)))
    if chart is not None:
        from fasop.plot import plot_validation

        plot_validation(comparison.labels, comparison.predicted_s, comparison.measured_s, chart, argument="chart")
        click.echo(f"chart written to {chart}")


def _check_profiles_folder(out: Path, profiles_out: Path | None) -> None:
    """Refuse a --profiles-out that is --out or lies inside it: writing the profiles would make a folder where the
    cluster file goes (check_outputs compares the files, not the folders that hold them)."""
    if profiles_out is None:
        return
    folder = Path(os.path.realpath(profiles_out))
    if Path(os.path.realpath(out)) in (folder, *folder.parents):
        raise InputError(f"--profiles-out {profiles_out}", f"is --out {out} or a folder inside it; expected a folder "
                                                           "apart from the calibrated cluster file")


@click.command()
@_measured_options
@click.option("--out", type=click.Path(path_type=Path), required=True, metavar="FILE",
              help="Calibrated cluster file to write (.toml): the input cluster with fitted derating.")
@click.option("--profiles-out", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Also write each GPU type's profile with its fitted compute_time_scale and host_time_scale "
                   "applied, as DIR/<gpu>.csv (use with --profiles DIR).")
@force_option
@reports_input_errors
def calibrate(measured, warmup_iters, model_name, cluster_name, profiles_dir, out, profiles_out, force):
    """Fit compute_time_scale per GPU type, host_time_scale per GPU type with a spec (where the host's kernel
    launches matter to some run) and bandwidth_scale per link kind (inside a node, between nodes) to measured step
    times by robust least squares; print the error before and after, and with leave-one-out cross-validation;
    write the calibrated cluster file (and profiles)."""
    from fasop.calibration import calibrate as cal

    if out.suffix != ".toml":
        raise InputError(f"--out {out}", "expected a cluster file name ending in .toml")
    _check_profiles_folder(out, profiles_out)
    runs, settings = _runs_and_settings(measured, warmup_iters, model_name, cluster_name, profiles_dir)
    pairs = sorted({(r.model, r.cluster) for r in runs})
    if len({id(s) for s in settings}) > 1:
        raise InputError(f"--measured {measured}", "calibrate fits one model on one cluster; the runs name "
                                                   + ", ".join(f"{m} on {c}" for m, c in pairs))
    setting = settings[0]
    outputs = [(out, "--out")]
    if profiles_out is not None:
        outputs += [(profiles_out / f"{gpu}.csv", "--profiles-out") for gpu in sorted(setting.profiles)]
    check_outputs(outputs, _inputs(measured, settings), force)
    with progress_bar("fitting") as progress:
        outcome = cal.calibrate(cal.Calibration(runs, setting), progress)
    for line in cal.factor_lines(outcome):
        click.echo(line)
    if len(runs) <= len(outcome.free):
        click.echo(f"note: {len(runs)} runs for {len(outcome.free)} factors: the runs cannot pin the factors "
                   "down (see the leave-one-out error); measure more plans of different shapes")
    loo = "n/a (one run)" if outcome.mape_loo_pct is None else f"{outcome.mape_loo_pct:.1f}%"
    click.echo(f"MAPE over {len(runs)} runs: {outcome.mape_before_pct:.1f}% before, {outcome.mape_after_pct:.1f}% "
               f"after (fitted on all runs), {loo} leave-one-out (each run estimated by a fit on the others)")
    if outcome.held_out_ratios:
        click.echo(f"error band: the runs took {min(outcome.held_out_ratios):.2f}-{max(outcome.held_out_ratios):.2f}x "
                   f"their leave-one-out estimates; written to {out} as [cluster.error_band], which search, estimate "
                   "and pareto on it use instead of the published runs' band")
    else:
        click.echo("error band: one run has no leave-one-out estimate; answers on the calibrated file keep the "
                   "published runs' band")
    today = datetime.date.today().isoformat()
    comments = cal.provenance(outcome, str(measured), today, len(runs), setting)
    texts = [(out, cal.calibrated_cluster_text(setting.cluster_path, setting.cluster, outcome, comments, str(measured),
                                                today), "--out")]
    if profiles_out is not None:
        texts += [(profiles_out / f"{gpu}.csv",
                   cal.calibrated_profile_text(setting, gpu, outcome.values, comments),
                   "--profiles-out") for gpu in sorted(setting.profiles)]
    # every file is written beside its place first and moved in only once all of them are written
    with ExitStack() as stack:
        for path, text, option in texts:
            stack.enter_context(pending_write(path, text, f"{option} {path}"))
    click.echo(f"calibrated cluster written to {out}")
    if profiles_out is not None:
        click.echo(f"calibrated profiles written to {profiles_out}")
    elif any(outcome.values[f] != 1.0 for f in outcome.free if f.kind in ("compute", "host")):
        click.echo("note: the compute and host factors are not applied to any profile (the cluster file has them "
                   "in its comments, and as matmul_efficiency and kernel_launch_us of [[gpu]] tables for profile "
                   "synth); pass --profiles-out DIR to write profiles with them applied")
