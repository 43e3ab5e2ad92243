"""`fasop compare`: the strategies of fasop/search/compare.py side by side on one cluster."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import click

from fasop.cli import common
from fasop.errors import InputError
from fasop.files import pending_write
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.plans import PlanFile
from fasop.plot import plot_comparison
from fasop.search.compare import as_csv, plan_list, table
from fasop.search.compare import compare as run_compare


@click.command()
@common.model_option
@common.cluster_option
@common.gbs_option
@common.profiles_option
@common.mismatch_option
@common.optimizer_option
@common.overlap_option
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the comparison, one row per strategy, to a .csv file.")
@click.option("--plans-out", "plans_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the best plan of each strategy that has one to plans.json, fastest first "
                   "(fasop emit --plans plans.json --rank N launches one).")
@click.option("--chart", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw the throughput of each strategy to chart.png or chart.svg.")
@common.force_option
@common.reports_input_errors
def compare(model_name, cluster_name, gbs, profiles_dir, allow_profile_mismatch, distributed_optimizer, overlap,
            output, plans_out, chart, force):
    """Compare training strategies for MODEL on CLUSTER: PyTorch DDP with an even and an uneven batch split,
    ZeRO stages 1 to 3 (FSDP) with uneven batches, each without activation recomputation or with every layer
    checkpointed, the best pipeline plan without tensor parallelism and the best 3D plan: step time,
    throughput, price, memory per GPU type and the recomputation of each, or why a strategy has no plan."""
    checks = ((output, "--output", (".csv",)), (plans_out, "--plans-out", (".json",)), (chart, "--chart", (".png", ".svg")))
    for path, option, suffixes in checks:
        if path is not None and path.suffix.lower() not in suffixes:
            raise InputError(f"{option} {path}", f"expected a file name ending in {' or '.join(suffixes)}")
    for name, option, what in ((model_name, "--model", "model"), (cluster_name, "--cluster", "cluster")):
        if not name:  # an empty path would name the current folder
            raise InputError(option, f"an empty name is no {what}: expected a bundled {what}'s name or a {what} TOML file")
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    outputs = [(path, option) for path, option, _ in checks if path is not None]
    common.check_outputs(outputs, common.input_paths(model_name, cluster_name, model, cluster, profiles_dir), force)
    profiles = common.run_profiles(model, cluster, profiles_dir, allow_profile_mismatch)
    with common.progress_bar("comparing") as progress:
        families = run_compare(model, cluster, profiles, gbs, distributed_optimizer=distributed_optimizer,
                               overlap=overlap, progress=progress)
    batch = gbs or model.global_batch_size
    click.echo(f"{model.name} on {cluster.name}: {cluster.num_gpus} GPUs, global batch {batch}")
    click.echo(table(families))
    plans = plan_list(families)
    # every output is written beside its place first and moved in only once all of them are written
    with ExitStack() as stack:
        if output is not None:
            stack.enter_context(pending_write(output, as_csv(families), f"--output {output}"))
        if plans_out is not None:
            if not plans:
                raise InputError(f"--plans-out {plans_out}", "no strategy has a plan to write")
            plan_file = PlanFile(plans, plans_out, "--plans-out")
            stack.enter_context(pending_write(plans_out, plan_file.chunks(), f"--plans-out {plans_out}"))
        if chart is not None:
            plot_comparison(families, chart, f"{model.name} on {cluster.name}, global batch {batch}", "chart")
    for path, what in ((output, "comparison"), (plans_out, f"{len(plans)} plans"), (chart, "chart")):
        if path is not None:
            click.echo(f"{what} written to {path}")

