"""The `fasop` command line: a thin layer of click commands over the Python API."""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import click

from fasop.inputs import bundled
from fasop.cli.calibration import register as register_calibration
from fasop.inputs.catalogue import catalogue_options, gpu_table_path
from fasop.inputs.cluster import load_cluster
from fasop.launch.emit import (FLAVORS, LAUNCH_KEYS, PIPELINE_SPLITS, check_out_dir, launch_options, render_plan, restate_plan,
                        split_flags, write_files)
from fasop.errors import InputError
from fasop.files import check_finite, check_outputs, pending_write
from fasop.cli.profile_layers import register as register_profile_layers
from fasop.cli.profile_links import register as register_profile_links
from fasop.inputs.model import load_model
from fasop.plans import load_plans, plans_text, select_plan
from fasop.inputs.profiles import load_profiles, profile_paths


def _input_paths(model_name: str, cluster_name: str, model, cluster, profiles_dir: str | None) -> list[Path]:
    """The files a search or sweep reads, which its outputs must not replace."""
    profiles = profile_paths(model, [t.gpu for t in cluster.node_types.values()], profiles_dir)
    return [bundled.resolve("models", model_name, ".toml"), bundled.resolve("clusters", cluster_name, ".toml"),
            *profiles.values()]
from fasop.search.robust import check_noise, noise_options, noise_report


def reports_input_errors(command):
    """Bad input ends the command with one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except InputError as err:
            click.echo(f"Error: {err}", err=True)
            raise click.exceptions.Exit(2) from None

    return wrapper


class Progress:
    """A progress bar on stderr that appears only once a search has run for about a second."""

    def __init__(self, label: str, delay_s: float = 1.0):
        self.label, self.delay_s, self.start = label, delay_s, time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if time.monotonic() - self.start < self.delay_s or not sys.stderr.isatty():
            return
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


def compress_placement(placement: list[str]) -> str:
    """['A100', 'A10', 'A10'] -> 'A100,A10*2' (runs of one node type)."""
    runs: list[list] = []
    for name in placement:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ",".join(name if count == 1 else f"{name}*{count}" for name, count in runs)


def format_table(plans: list[dict], top: int) -> str:
    """The ranked plans as a fixed-width table."""
    columns = [
        ("rank", "rank", "{}"), ("mbs", "mbs", "{}"), ("tp", "tp", "{}"), ("dp", "dp", "{}"), ("pp", "pp", "{}"),
        ("placement", "placement", None), ("layers_per_stage", "layers/stage", None),
        ("step_time_s", "step s", "{:.4f}"), ("throughput_samples_per_s", "samples/s", "{:.1f}"),
        ("peak_memory_gib", "mem GiB", "{:.1f}"), ("cost_per_step_usd", "$/step", "{:.5f}"),
    ]
    if "train_cost_usd" in plans[0]:
        columns += [("train_hours", "run h", "{:.1f}"), ("train_cost_usd", "run $", "{:,.0f}")]
    cells = [[title for _, title, _ in columns]]
    for row in plans[:top]:
        line = []
        for key, _, fmt in columns:
            value = row[key]
            if key == "placement":
                line.append(compress_placement(value))
            elif key == "layers_per_stage":
                line.append(",".join(map(str, value)))
            else:
                line.append(fmt.format(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


model_option = click.option("--model", "model_name", required=True, metavar="NAME|FILE",
                            help="A bundled model (gpt2-xl, bert, t5, ...) or a model TOML file.")
cluster_option = click.option("--cluster", "cluster_name", required=True, metavar="NAME|FILE",
                              help="A bundled cluster (fasop-1xA100-7xA10, ...) or a cluster TOML file.")
gbs_option = click.option("--gbs", type=int, default=None, help="Global batch size (default: the model file's).")
profiles_option = click.option("--profiles", "profiles_dir", default=None, metavar="DIR",
                               help="Folder of <gpu>.csv profiles (default: the bundled profiles/<model>).")
mismatch_option = click.option("--allow-profile-mismatch", is_flag=True,
                                help="Use profiles whose fasop-profile header line names another model or GPU.")
optimizer_option = click.option("--distributed-optimizer/--no-distributed-optimizer", default=True, show_default=True,
                                help="Shard optimizer state over data parallelism (Megatron's --use-distributed-optimizer).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fasop")
def main():
    """Plan data, tensor and pipeline parallelism for Megatron-LM on heterogeneous GPU clusters."""


@main.command()
@model_option
@cluster_option
@gbs_option
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Plans to print.")
@click.option("--sort", type=click.Choice(["time", "cost"]), default="time", show_default=True,
              help="Rank by step time or by dollars per step.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write every feasible plan to plans.json or plans.csv.")
@click.option("--train-steps", type=click.IntRange(min=1), default=None, help="Steps of the whole run, for its time and price.")
@click.option("--train-tokens", type=click.FloatRange(min=1), default=None, help="Tokens of the whole run (instead of --train-steps).")
@click.option("--prune", is_flag=True,
              help="Solve only plans that can reach the --top best (sound lower bounds skip the rest): faster on "
                   "large clusters; --output then holds only those plans.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes to search with (default: one per core for clusters of 32 nodes or more, else one).")
@click.option("--emit", "emit_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write the best plan's Slurm and Megatron-LM launch scripts into this directory "
                   "(site options from the cluster file's [launch] table; `fasop emit` offers them all).")
@profiles_option
@mismatch_option
@optimizer_option
@noise_options
@reports_input_errors
def search(model_name, cluster_name, gbs, top, sort, output, train_steps, train_tokens, prune, workers, emit_dir,
           profiles_dir, allow_profile_mismatch, distributed_optimizer, noise, trials, seed):
    """Rank every parallel plan of MODEL on CLUSTER by estimated step time."""
    from fasop.search.engine import prepare, search_plans

    if noise is not None:
        check_noise(noise, trials)
    if train_steps is not None and train_tokens is not None:
        raise InputError("--train-tokens", "give either --train-steps or --train-tokens, not both")
    if train_tokens is not None and not math.isfinite(train_tokens):
        raise InputError("--train-tokens", f"expected a finite number of tokens, got {train_tokens}")
    if output is not None and output.suffix not in (".json", ".csv"):
        raise InputError(f"--output {output}", "expected a file name ending in .json or .csv")
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    inputs = _input_paths(model_name, cluster_name, model, cluster, profiles_dir)
    outputs = [(output, "--output")] if output is not None else []
    if emit_dir is not None:
        check_out_dir(emit_dir, force=False)
    check_outputs(outputs, inputs)
    profiles = load_profiles(model, [t.gpu for t in cluster.node_types.values()], profiles_dir, allow_profile_mismatch)
    progress = Progress("searching")
    started = time.perf_counter()
    result = search_plans(model, cluster, gbs, profiles_dir, distributed_optimizer=distributed_optimizer,
                          train_steps=train_steps, train_tokens=train_tokens, sort=sort, progress=progress,
                          keep=top if prune else None, workers=workers, profiles=profiles)
    progress.close()
    elapsed = time.perf_counter() - started
    plans = result.plans
    if not plans:
        closest = result.closest_plan
        hint = ""
        if closest is not None:
            hint = (f"; the closest plan (tp={closest.tp} dp={closest.dp} pp={closest.pp} mbs={closest.mbs}) "
                    f"needs {result.closest_memory_factor:.2f}x the GPU memory")
        raise InputError(f"--cluster {cluster_name}", f"no plan fits in memory ({result.out_of_memory} plans tried){hint}")
    # everything that can fail is done before the first file is written: the plan list is moved into place
    # only once the launch scripts are written
    emitted = {}
    if emit_dir is not None:
        options = launch_options(cluster.launch, f"{cluster.file or cluster.name}: launch")
        check_finite(plans[0], "--emit plan 1")
        emitted = render_plan(plans[0], model, cluster, options, where="plan 1")
        check_outputs(outputs + [(emit_dir / name, "--emit") for name in emitted], inputs)
    with pending_write(output, plans_text(plans, output), f"--output {output}") if output else nullcontext():
        if emit_dir is not None:
            # force: the directory was empty before the search; the plan list's temporary file may be there now
            write_files(emit_dir, emitted, force=True)
    click.echo(f"{model.name} on {cluster.name}: {cluster.num_gpus} GPUs, global batch {plans[0]['gbs']}; "
               f"{result.plans_evaluated} plans evaluated in {elapsed:.2f} s ({result.partitions_solved} layer partitions "
               f"solved), {len(plans)} {'best kept' if prune else 'fit in memory'}, {result.out_of_memory} removed "
               f"as out of memory.")
    click.echo(format_table(plans, top))
    if result.pruned:
        click.echo(f"{result.pruned} layer partitions skipped: their lower bound cannot reach the best {top}.")
    if any(plan["placement_search"] != "exhaustive" for plan in plans[:top]):
        click.echo("note: placements of some plans were searched as type blocks and their rotations, a heuristic "
                   "(within 1% of exhaustive search on the tested clusters; docs/cost-model.md section 1).")
    if noise is not None:
        prepared = prepare(model, cluster, plans[0]["gbs"], profiles_dir, distributed_optimizer, profiles)
        click.echo(noise_report(prepared, plans, noise, trials, seed, sort, top))
    if output is not None:
        click.echo(f"{len(plans)} plans written to {output}")
    if emit_dir is not None:
        click.echo(f"launch scripts of plan 1 written to {emit_dir}; submit with: cd {emit_dir} && sbatch sbatch.sh")


def _int_list(option: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise InputError(option, f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise InputError(option, f"expected non-negative integers, got {text!r}")
    return values


@main.command()
@model_option
@cluster_option
@click.option("--tp", type=click.IntRange(min=1), required=True, help="Tensor-parallel degree.")
@click.option("--dp", type=click.IntRange(min=1), required=True, help="Data-parallel degree.")
@click.option("--pp", type=click.IntRange(min=1), required=True, help="Pipeline-parallel degree.")
@click.option("--mbs", type=click.IntRange(min=1), required=True, help="Micro-batch size.")
@click.option("--placement", required=True, metavar="TYPE,TYPE,...", help="Node types in node-rank order.")
@click.option("--layers", required=True, metavar="N,N,...",
              help="Transformer layers per stage (embedding on the first stage, head on the last).")
@gbs_option
@profiles_option
@mismatch_option
@optimizer_option
@click.option("--json", "as_json", is_flag=True, help="Print the breakdown as a JSON object.")
@reports_input_errors
def estimate(model_name, cluster_name, tp, dp, pp, mbs, placement, layers, gbs, profiles_dir, allow_profile_mismatch,
             distributed_optimizer, as_json):
    """Break down the step time, memory and price of one explicit plan."""
    from fasop.search.engine import estimate as run_estimate

    model, cluster = load_model(model_name), load_cluster(cluster_name)
    profiles = load_profiles(model, [t.gpu for t in cluster.node_types.values()], profiles_dir, allow_profile_mismatch)
    row = run_estimate(model, cluster, tp=tp, dp=dp, pp=pp, mbs=mbs, placement=[p.strip() for p in placement.split(",")],
                       layers=_int_list("--layers", layers), gbs=gbs, profiles_dir=profiles_dir,
                       distributed_optimizer=distributed_optimizer, profiles=profiles)
    if as_json:
        check_finite(row, "estimate")
        click.echo(json.dumps(row, indent=1, allow_nan=False))
        return
    click.echo(f"{model.name} on {cluster.name}: tp={tp} dp={dp} pp={pp} mbs={mbs} "
               f"({row['num_microbatches']} micro-batches), placement {compress_placement(row['placement'])}")
    header = f"{'stage':>5}  {'gpu':>9}  {'layers':>6}  {'compute s':>9}  {'p2p s':>8}  {'allreduce s':>11}  {'mem GiB':>7}  {'of GiB':>6}"
    click.echo(header)
    for s in row["stages"]:
        click.echo(f"{s['stage']:>5}  {s['gpu']:>9}  {s['layers']:>6}  {s['compute_s']:>9.5f}  {s['p2p_s']:>8.5f}  "
                   f"{s['dp_allreduce_s']:>11.5f}  {s['memory_gib']:>7.2f}  {s['memory_capacity_gib']:>6.2f}")
    click.echo(f"step time        {row['step_time_s']:.4f} s  ({row['throughput_samples_per_s']:.1f} samples/s)")
    click.echo(f"  pipeline       {row['pipeline_time_s']:.4f} s  (bubble {row['bubble_s']:.4f} s, p2p {row['p2p_s']:.4f} s)")
    click.echo(f"  dp all-reduce  {row['dp_allreduce_s']:.4f} s")
    click.echo(f"  emb all-reduce {row['embedding_allreduce_s']:.4f} s")
    click.echo(f"peak memory      {row['peak_memory_gib']:.2f} of {row['memory_capacity_gib']:.2f} GiB"
               + ("" if row["fits_memory"] else f"  (does NOT fit with margin {cluster.memory_margin})"))
    click.echo(f"price            ${row['cost_per_step_usd']:.5f} per step, ${row['cost_per_hour_usd']:.2f} per hour")


# -- fasop emit ---

def _resolve_input(value: str, plans_path: Path) -> str:
    """A file named in the plan list: as given if it exists, else beside the plan list, else as given (a name)."""
    if Path(value).exists():
        return value
    beside = plans_path.parent / value
    return str(beside) if beside.exists() else value


def _type_map(values: tuple[str, ...], option: str) -> tuple[str | None, dict[str, str]]:
    """`NAME` (every node type) and `TYPE=NAME` (one node type or GPU) -> (default, per-type map)."""
    default, per_type = None, {}
    for value in values:
        key, sep, name = value.partition("=")
        if not sep:
            default = value
        elif not key or not name:
            raise InputError(f"{option} {value}", "expected NAME or TYPE=NAME")
        else:
            per_type[key] = name
    return default, per_type


_SITE_HELP = "Overrides the [launch] table of the cluster file."


@main.command("emit")
@click.option("--plans", "plans_file", required=True, metavar="FILE",
              help="Plan list written by `fasop search --output plans.json`.")
@click.option("--rank", type=int, default=1, show_default=True, help="Which plan of the list (1 = the best).")
@click.option("--out", "out_dir", required=True, metavar="DIR",
              help="Directory to write sbatch.sh, run_inter.sh and plan.json into (created if missing).")
@click.option("--force", is_flag=True,
              help="Overwrite the files of a directory that holds files already, and emit a plan whose figures "
                   "disagree with a fresh estimate (with a warning; plan.json gets the fresh figures).")
@click.option("--model", "model_name", default=None, metavar="NAME|FILE",
              help="Model file (default: the plan's model_file).")
@click.option("--cluster", "cluster_name", default=None, metavar="NAME|FILE",
              help="Cluster file (default: the plan's cluster_file); its [launch] table gives site defaults.")
@click.option("--partition", "partitions", multiple=True, metavar="NAME|TYPE=NAME",
              help="Slurm partition for every node type, or TYPE=NAME for one node type or GPU; repeatable. " + _SITE_HELP)
@click.option("--gres-type", "gres_types", multiple=True, metavar="NAME|TYPE=NAME",
              help="GRES type (as in --gres=gpu:TYPE:N) for every node type, or TYPE=NAME for one node type or GPU; "
                   "repeatable. Default: the node type's gres_type, else its GPU name in lower case.")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node, instead of the cluster's. " + _SITE_HELP)
@click.option("--cpus-per-task", type=int, default=None,
              help="CPUs for the one task per node that runs torchrun and its workers. " + _SITE_HELP)
@click.option("--account", default=None, help="Slurm account to charge. " + _SITE_HELP)
@click.option("--exclusive/--no-exclusive", default=None,
              help="Ask for whole nodes (default: yes). " + _SITE_HELP)
@click.option("--job-name", default=None, help="Slurm job name (default: fasop-<model>). " + _SITE_HELP)
@click.option("--time-limit", default=None, metavar="TIME",
              help="Slurm time limit such as 01:00:00 or 1-12:00:00 (default 01:00:00). " + _SITE_HELP)
@click.option("--megatron-path", default=None, metavar="DIR",
              help="Megatron-LM checkout on the nodes (default Megatron-LM, relative to the run directory; "
                   "the MEGATRON_PATH variable overrides it at run time). " + _SITE_HELP)
@click.option("--entry-script", default=None, metavar="FILE",
              help="Training script, relative to the Megatron-LM path unless absolute (default pretrain_gpt.py, "
                   "pretrain_bert.py or pretrain_t5.py by model). " + _SITE_HELP)
@click.option("--data-path", default=None, metavar="PREFIX",
              help="Megatron-LM --data-path (default: --mock-data). " + _SITE_HELP)
@click.option("--tokenizer-type", default=None,
              help="Megatron-LM --tokenizer-type (default: NullTokenizer without a vocabulary file, else "
                   "GPT2BPETokenizer or BertWordPieceLowerCase by model). " + _SITE_HELP)
@click.option("--vocab-file", default=None, metavar="FILE", help="Megatron-LM --vocab-file. " + _SITE_HELP)
@click.option("--merge-file", default=None, metavar="FILE", help="Megatron-LM --merge-file. " + _SITE_HELP)
@click.option("--tokenizer-model", default=None, metavar="FILE", help="Megatron-LM --tokenizer-model. " + _SITE_HELP)
@click.option("--container-image", default=None, metavar="IMAGE",
              help="Run in this enroot/pyxis container image (srun --container-image); default: no container. "
                   + _SITE_HELP)
@click.option("--container-mounts", default=None, metavar="SRC:DST[,...]",
              help="pyxis --container-mounts besides the run directory, which is always mounted. " + _SITE_HELP)
@click.option("--extra-flags", "extra_flags", multiple=True, metavar="'FLAGS'",
              help="More Megatron-LM flags, split as a shell would; appended last, so they win over the emitted "
                   "ones; repeatable, added to the [launch] table's.")
@click.option("--train-iters", type=int, default=None, help="Megatron-LM --train-iters (default 50). " + _SITE_HELP)
@click.option("--master-port", type=int, default=None,
              help="Rendezvous port on the first node (default 6000). " + _SITE_HELP)
@click.option("--megatron-flavor", type=click.Choice(FLAVORS), default=None,
              help="stock: Megatron-LM's own flags (default); fasop-fork: FASOP's fork with --balance. " + _SITE_HELP)
@click.option("--pipeline-split", type=click.Choice(PIPELINE_SPLITS), default=None,
              help="How uneven layers per stage are passed (stock flavour): auto (default) uses "
                   "--decoder-first/last-pipeline-num-layers when the split has that form, else "
                   "--pipeline-model-parallel-layout; layout or first-last force one. " + _SITE_HELP)
@profiles_option
@reports_input_errors
def emit(plans_file: str, rank: int, out_dir: str, force: bool, model_name: str | None, cluster_name: str | None,
         partitions: tuple[str, ...], gres_types: tuple[str, ...], extra_flags: tuple[str, ...],
         profiles_dir: str | None, **site) -> None:
    """Write Slurm and Megatron-LM launch scripts for one plan of a plan list.

    DIR gets sbatch.sh (one Slurm job, a heterogeneous-job component per run of node types in the plan's
    placement order), run_inter.sh (torchrun and Megatron-LM flags, one per node) and plan.json (the plan and
    its estimate). The plan is estimated afresh from the model, cluster and profiles first, and refused when
    the figures in the plan file disagree. Submit with: cd DIR && sbatch sbatch.sh
    """
    written = _emit(plans_file, rank, out_dir, force, model_name, cluster_name, partitions, gres_types,
                    extra_flags, profiles_dir, site)
    for path in written:
        click.echo(str(path))
    click.echo(f"Submit with: cd {out_dir} && sbatch sbatch.sh", err=True)


def _emit(plans_file, rank, out_dir, force, model_name, cluster_name, partitions, gres_types, extra_flags,
          profiles_dir, site):
    plans_path = Path(plans_file)
    plans = load_plans(plans_path)
    plan = select_plan(plans, rank, plans_file)
    out = Path(out_dir)
    check_out_dir(out, force)
    where = f"{plans_file}: plan {rank}"
    for key, option in (("model_file", model_name), ("cluster_file", cluster_name)):
        if option is None and not isinstance(plan.get(key), str):
            raise InputError(where, f"names no {key}; give --{key.split('_')[0]}")
    model_file = model_name or _resolve_input(plan["model_file"], plans_path)
    cluster_file = cluster_name or _resolve_input(plan["cluster_file"], plans_path)
    model, cluster = load_model(model_file), load_cluster(cluster_file)
    plan, warning = restate_plan(plan, model, cluster, profiles_dir, force, where)
    # A plain NAME on the command line applies to every node type, over what the cluster file says.
    partition, partition_map = _type_map(partitions, "--partition")
    gres_type, gres_map = _type_map(gres_types, "--gres-type")
    for default, mapping in ((partition, partition_map), (gres_type, gres_map)):
        for node_type in cluster.node_types.values():
            if default is not None and node_type.name not in mapping and node_type.gpu not in mapping:
                mapping[node_type.name] = default
    flags: list[str] = []
    for value in extra_flags:
        flags += split_flags(value, "--extra-flags")
    overrides = {key: value for key, value in site.items() if key in LAUNCH_KEYS}
    options = launch_options(
        getattr(cluster, "launch", {}), f"{getattr(cluster, 'file', '') or cluster.name}: launch",
        partition=partition, partitions=partition_map, gres_type=gres_type, gres_types=gres_map,
        extra_flags=tuple(flags), **overrides)
    files = render_plan(plan, model, cluster, options, where)
    inputs = [plans_path, bundled.resolve("models", model_file, ".toml"), bundled.resolve("clusters", cluster_file, ".toml")]
    check_outputs([(out / name, "--out") for name in files], inputs)
    written = write_files(out, files, force)
    if warning:
        click.echo(warning, err=True)
    return written


# -- fasop profile ---
@main.group()
def profile():
    """Make layer-time profiles for `fasop search` (profiles/<model>/<gpu>.csv)."""


@profile.command()
@model_option
@click.option("--gpu", required=True, metavar="NAME",
              help="GPU type of catalogue/gpus.toml (A100, H100, A10G, L4, ...). It is also the profile's file "
                   "name: a cluster's node_type `gpu` field picks profiles/<model>/<gpu>.csv.")
@click.option("--tp", "tp_text", default="1,2,4,8", show_default=True, metavar="N,N,...",
              help="Tensor-parallel degrees to estimate; each must divide the model's heads, query groups and FFN.")
@click.option("--mbs", "mbs_text", default="1,2,4,8", show_default=True, metavar="N,N,...",
              help="Micro-batch sizes to estimate (fasop interpolates between them and scales beyond).")
@click.option("--efficiency", type=float, default=None, metavar="F",
              help="Achievable fraction of the dense peak FLOP/s, in (0, 1] (default: the GPU's matmul_efficiency "
                   "in catalogue/gpus.toml). Lower it to match a measured profile of another GPU type.")
@click.option("--link-bandwidth", default=None, metavar="BANDWIDTH",
              help='Intra-node link per GPU, one direction, for the tensor-parallel collectives, e.g. "450 GB/s" '
                   "(default: the GPU's intra_node_link in catalogue/gpus.toml).")
@click.option("--out", type=click.Path(path_type=Path), required=True, metavar="FILE",
              help="CSV to write. As profiles/<model>/<gpu>.csv, or <gpu>.csv in a folder passed to "
                   "`fasop search --profiles DIR`, the search uses it.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@catalogue_options
@reports_input_errors
def synth(model_name, gpu, tp_text, mbs_text, efficiency, link_bandwidth, out, force, catalogue, gpus_cluster):
    """Estimate a profile of MODEL on GPU from FLOPs, bytes and the GPU spec table, for GPU types not yet
    measured.

    Each unit (embedding, transformer layer, head) takes max(FLOPs / (peak x efficiency), bytes / memory
    bandwidth) plus its tensor-parallel all-gathers and reduce-scatters over the intra-node link; backward
    does twice the forward FLOPs. See fasop/profile/synth.py for what is counted. Small layers run slower in practice:
    measure a profile when you can.
    """
    from fasop.profile import synth as synthesis

    model = load_model(model_name)
    spec = synthesis.load_gpu_spec(gpu, catalogue, load_cluster(gpus_cluster).gpus if gpus_cluster else None)
    tps = synthesis.parse_sizes("--tp", tp_text)
    mbss = synthesis.parse_sizes("--mbs", mbs_text)
    tps, mbss = synthesis.check_degrees(model, tps, mbss)
    if out.exists() and not force:
        raise InputError(f"--out {out}", "already exists (pass --force to overwrite it)")
    read = [bundled.resolve("models", model_name, ".toml"), gpu_table_path()]
    read += [Path(catalogue)] if catalogue else []
    read += [bundled.resolve("clusters", gpus_cluster, ".toml")] if gpus_cluster else []
    check_outputs([(out, "--out")], read)
    rows = synthesis.synthesize(model, spec, tps, mbss, efficiency=efficiency, link_bandwidth=link_bandwidth)
    lines = synthesis.header_lines(model, spec, tps, mbss, efficiency=efficiency, link_bandwidth=link_bandwidth)
    synthesis.write_profile(out, rows, lines, force=force)
    layer = next(r for r in rows if r.kind in model.layer_kinds)
    click.echo(f"{len(rows)} rows of {model.name} on {spec.name} written to {out} "
               f"(tp {','.join(map(str, tps))}; mbs {','.join(map(str, mbss))}); "
               f"{layer.kind} at tp={layer.tp} mbs={layer.mbs}: forward {layer.forward_s * 1e3:.4g} ms, "
               f"backward {layer.backward_s * 1e3:.4g} ms")
    if out.name != f"{spec.name}.csv":
        click.echo(f"note: fasop search reads <gpu>.csv; name the file {spec.name}.csv to use it for GPU {spec.name}")


register_profile_layers(profile, model_option, reports_input_errors)
register_calibration(main, reports_input_errors)
register_profile_links(profile, reports_input_errors)


# -- fasop pareto / fasop plot ------------------------------------------------------------------------


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


def _front_table(records: list[dict]) -> str:
    """One line per composition: node counts, best plan, speed, price, the run, and '*' on the front."""
    from fasop.market.pareto import node_counts

    types = list(node_counts(records[0]))
    titles = [*types, "gpus", "mbs", "tp", "dp", "pp", "placement", "step s", "samples/s", "$/hour", "run h", "run $", "front"]
    cells = [titles]
    for r in records:
        line = [str(n) for n in node_counts(r).values()] + [str(r["gpus"])]
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


@main.command()
@model_option
@cluster_option
@gbs_option
@click.option("--train-steps", type=int, default=None, help="Steps of the whole run (default 10,000 without --train-tokens).")
@click.option("--train-tokens", type=float, default=None, help="Tokens of the whole run (instead of --train-steps).")
@click.option("--budget", type=float, default=None, metavar="USD", help="Report the fastest run that costs at most this.")
@click.option("--deadline", type=float, default=None, metavar="HOURS",
              help="Report the cheapest run that ends within this (with --budget: the cheapest meeting both).")
@click.option("--max-nodes", multiple=True, metavar="TYPE=N", help="Sweep at most N nodes of TYPE (repeatable).")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write one row per composition to front.csv.")
@click.option("--chart", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Draw cost against throughput to chart.png or chart.svg.")
@click.option("--x", "x_axis", type=click.Choice(["throughput", "time"]), default="throughput", show_default=True,
              help="Horizontal axis of --chart.")
@profiles_option
@mismatch_option
@optimizer_option
@reports_input_errors
def pareto(model_name, cluster_name, gbs, train_steps, train_tokens, budget, deadline, max_nodes, output, chart, x_axis,
           profiles_dir, allow_profile_mismatch, distributed_optimizer):
    """Sweep every mix of the cluster's node types: the best plan of each, cost against time to train, and
    the Pareto front; with --budget or --deadline, which mix to rent."""
    import math

    from fasop.market.pareto import DEFAULT_TRAIN_STEPS, check_limits, choose, compositions, front_as_csv, sweep

    check_limits(budget, deadline)
    if train_steps is not None and train_tokens is not None:
        raise InputError("--train-tokens", "give either --train-steps or --train-tokens, not both")
    if train_tokens is not None and not math.isfinite(train_tokens):
        raise InputError("--train-tokens", f"expected a finite number of tokens, got {train_tokens}")
    if train_steps is not None and train_steps < 1:
        raise InputError("--train-steps", f"expected a positive number of steps, got {train_steps}")
    if train_tokens is not None and not train_tokens > 0:
        raise InputError("--train-tokens", f"expected a positive number of tokens, got {train_tokens:g}")
    if (budget is not None or deadline is not None) and train_steps is None and train_tokens is None:
        raise InputError("--budget" if budget is not None else "--deadline",
                         "a budget or deadline needs the length of the run: give --train-steps or --train-tokens")
    if output is not None and output.suffix != ".csv":
        raise InputError(f"--output {output}", "expected a file name ending in .csv")
    if chart is not None and chart.suffix.lower() not in (".png", ".svg"):
        raise InputError(f"--chart {chart}", "expected a file name ending in .png or .svg")
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    outputs = [(path, option) for path, option in ((output, "--output"), (chart, "--chart")) if path is not None]
    check_outputs(outputs, _input_paths(model_name, cluster_name, model, cluster, profiles_dir))
    todo = compositions(cluster, _max_nodes(max_nodes))
    batch = gbs or model.global_batch_size
    if train_tokens is not None:
        length = f"{train_tokens:,.0f} tokens"
        if batch > 0:
            length += f" = {math.ceil(train_tokens / (batch * model.seq_length)):,} steps"
    else:
        length = f"{train_steps or DEFAULT_TRAIN_STEPS:,} steps"
        if train_steps is None:
            length += " (default; set --train-steps or --train-tokens)"
    caps = ", ".join(f"0-{max(c[n] for c in todo)} {n}" for n in cluster.node_types)
    click.echo(f"{model.name} on {cluster.name}: {len(todo)} compositions of {caps} nodes ({cluster.gpus_per_node} GPUs each), "
               f"global batch {batch}, a run of {length}")
    progress = Progress("sweeping")
    started = time.perf_counter()
    records = sweep(model, cluster, todo, gbs=gbs, train_steps=train_steps, train_tokens=train_tokens,
                    profiles_dir=profiles_dir, distributed_optimizer=distributed_optimizer,
                    allow_profile_mismatch=allow_profile_mismatch, progress=progress)
    progress.close()
    elapsed = time.perf_counter() - started
    feasible = [r for r in records if r["feasible"]]
    click.echo(_front_table(records))
    on_front = sum(r["on_front"] for r in records)
    click.echo(f"{len(records)} compositions swept in {elapsed:.2f} s, {sum(r['plans_evaluated'] for r in records):,} plans "
               f"evaluated; {on_front} on the Pareto front (*), {len(records) - len(feasible)} without a plan that fits.")
    chosen, message = choose(records, budget, deadline)
    if message:
        click.echo(message)
    # the front file is moved into place only once the chart is written
    with pending_write(output, front_as_csv(records), f"--output {output}") if output else nullcontext():
        if chart is not None and feasible:
            from fasop.plot import plot_front

            plot_front(records, chart, x=x_axis, budget=budget, deadline=deadline, chosen=chosen)
    if output is not None:
        click.echo(f"{len(records)} compositions written to {output}")
    if chart is not None and feasible:
        click.echo(f"chart written to {chart}")
    elif chart is not None:
        click.echo("no chart: no composition has a plan that fits", err=True)


def _load_plan(plan_file: Path, rank: int) -> dict:
    """Plan `rank` of a `fasop search --output plans.json` file, with the per-stage breakdown a chart needs."""
    from fasop.plot import check_plan

    plan = select_plan(load_plans(plan_file), rank, str(plan_file))
    check_plan(plan, f"{plan_file}: plan {rank}")
    return plan


@main.command()
@click.argument("front_file", required=False, type=click.Path(dir_okay=False, path_type=Path), metavar="[FRONT.csv]")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="chart.png or chart.svg")
@click.option("--x", "x_axis", type=click.Choice(["throughput", "time"]), default=None,
              help="Horizontal axis of a front chart: throughput (default) or time to train.")
@click.option("--budget", type=float, default=None, metavar="USD", help="Draw the budget and highlight the fastest run within it.")
@click.option("--deadline", type=float, default=None, metavar="HOURS", help="Draw the deadline and highlight the cheapest run within it.")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Instead of a front: chart the stages of one plan of a fasop search --output plans.json file.")
@click.option("--rank", type=int, default=None, help="Which plan of --plan (default 1, the best).")
@reports_input_errors
def plot(front_file, out, x_axis, budget, deadline, plan_file, rank):
    """Chart a front file of fasop pareto (cost against throughput), or with --plan the compute,
    communication and idle time of each pipeline stage of one plan."""
    if (front_file is None) == (plan_file is None):
        raise InputError("fasop plot", "give either a front file (FRONT.csv from fasop pareto --output) or --plan plans.json")
    if out.suffix.lower() not in (".png", ".svg"):
        raise InputError(f"--out {out}", "expected a file name ending in .png or .svg")
    check_outputs([(out, "--out")], [plan_file or front_file])
    if plan_file is not None:
        if budget is not None or deadline is not None or x_axis is not None:
            raise InputError("--plan", "--budget, --deadline and --x apply to a front chart, not to a plan's stages")
        from fasop.plot import plot_stages

        plan = _load_plan(plan_file, 1 if rank is None else rank)
        plot_stages(plan, out)
        click.echo(f"stages of plan {plan.get('rank', rank or 1)} ({plan['pp']} stages) written to {out}")
        return
    if rank is not None:
        raise InputError("--rank", "applies to --plan only")
    from fasop.market.pareto import check_limits, choose, read_front_csv
    from fasop.plot import plot_front

    check_limits(budget, deadline)
    records = read_front_csv(front_file)
    chosen, message = choose(records, budget, deadline)
    counts = plot_front(records, out, x=x_axis or "throughput", budget=budget, deadline=deadline, chosen=chosen)
    if message:
        click.echo(message)
    series = ", ".join(f"{n} {k}" for k, n in counts.items() if k not in ("front", "chosen", "not shown"))
    click.echo(f"chart of {len(records)} compositions ({series}; {counts['front']} on the front) written to {out}")
