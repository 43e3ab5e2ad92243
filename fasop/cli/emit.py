"""`fasop emit`: Slurm and Megatron-LM launch scripts for one plan of a plan list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from fasop.cli.common import note_model_defaults, profiles_option, reports_input_errors
from fasop.cli.run_options import run_options, run_settings
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch import write
from fasop.launch.launchers import LAUNCHERS, RENDEZVOUS, launcher_hint
from fasop.launch.options import FLAVORS, PIPELINE_SPLITS, split_flags
from fasop.plans import load_plans, select_plan


def launcher_options(command):
    """The `fasop emit` options of this module, added to the command's keyword arguments."""
    options = [
        click.option("--launcher", type=click.Choice(LAUNCHERS), default="slurm", show_default=True,
                     help="slurm: sbatch.sh; ssh: hosts and launch.sh (starts every node over SSH); manual: "
                          "commands.txt, one command per node to paste."),
        click.option("--hosts", "hosts_file", default=None, metavar="FILE",
                     help="ssh and manual: the hosts, one 'HOST NODE_TYPE' line per node in node-rank order; "
                          "checked against the plan's placement and copied to DIR/hosts."),
        click.option("--rendezvous", type=click.Choice(RENDEZVOUS), default="tcp", show_default=True,
                     help="ssh and manual: meet at the first host (tcp), or through a file on a file system "
                          "every node sees (file, with --rendezvous-file)."),
        click.option("--rendezvous-file", default=None, metavar="PATH",
                     help="Absolute path on the shared file system for --rendezvous file."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _input_file(option: str | None, recorded: str | None, kind: str, where: str, plans_path: Path) -> str:
    """The --model or --cluster given, else the file the plan names: as named if it exists, else beside the
    plan list, else as named (a bundled name); an error when neither names one."""
    if option is not None:
        return option
    if recorded is None:
        raise InputError(where, f"names no {kind}_file; give --{kind}")
    if Path(recorded).exists():
        return recorded
    beside = plans_path.parent / recorded
    return str(beside) if beside.exists() else recorded


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


# The site options after --partition and --gres-type, in --help order: (flag [parameter name], help, click
# keywords). Each overrides the cluster file's [launch] table; its default None leaves the table's value.
_SITE_OPTIONS: tuple[tuple[str | None, str, dict[str, Any]], ...] = (
    ("--gpus-per-node", "GPUs per node, instead of the cluster's.", {"type": int}),
    ("--cpus-per-task", "CPUs for the one task per node that runs torchrun and its workers.", {"type": int}),
    ("--account", "Slurm account to charge.", {}),
    ("--exclusive/--no-exclusive", "Ask for whole nodes (default: yes).", {}),
    ("--job-name", "Slurm job name (default: fasop-<model>).", {}),
    ("--time-limit", "Slurm time limit of each job such as 01:00:00 or 1-12:00:00, at most 365 days (default "
                     "01:00:00); a full run longer than that requeues itself.", {"metavar": "TIME"}),
    ("--megatron-path", "Megatron-LM checkout on the nodes (default Megatron-LM, relative to the run directory; "
                        "the MEGATRON_PATH variable overrides it at run time).", {"metavar": "DIR"}),
    ("--entry-script", "Training script, relative to the Megatron-LM path unless absolute (default "
                       "pretrain_gpt.py, pretrain_bert.py or pretrain_t5.py by model).", {"metavar": "FILE"}),
    ("--container-image", "Run in this enroot/pyxis container image (srun --container-image); default: no "
                          "container.", {"metavar": "IMAGE"}),
    ("--container-mounts", "pyxis --container-mounts besides the run directory, which is always mounted.",
     {"metavar": "SRC:DST[,...]"}),
    (None, "", {}),  # --extra-flags sits here: it adds to the table's flags instead of replacing them
    ("--train-iters", "Megatron-LM --train-iters (default: the plan's train_steps, from `fasop search "
                      "--train-tokens/--train-steps`; 50 for --smoke-test).", {"type": int}),
    ("--checkpoint-dir", "Megatron-LM --save and --load of a full run, relative to the run directory unless "
                         "absolute (default checkpoints).", {"metavar": "DIR"}),
    ("--save-interval", "Iterations between checkpoints (default: about an hour of steps).", {"type": int}),
    ("--stop-margin stop_margin_s", "Seconds before the time limit by which each job has saved and stopped; it then "
                                    "requeues itself (default 600).", {"type": int, "metavar": "SECONDS"}),
    ("--master-port", "Rendezvous port on the first node (default 6000).", {"type": int}),
    ("--megatron-flavor", "stock: Megatron-LM's own flags (default); fasop-fork: FASOP's fork with --balance.",
     {"type": click.Choice(FLAVORS)}),
    ("--pipeline-split", "How uneven layers per stage are passed (stock flavour): auto (default) uses "
                         "--decoder-first/last-pipeline-num-layers when the split has that form, else "
                         "--pipeline-model-parallel-layout; layout or first-last force one.",
     {"type": click.Choice(PIPELINE_SPLITS)}),
)


def _site_options(command):
    """The site options of _SITE_OPTIONS, with --extra-flags in its place."""
    extra = click.option("--extra-flags", "extra_flags", multiple=True, metavar="'FLAGS'",
                         help="More Megatron-LM flags, split as a shell would; appended last, so they win over the "
                              "emitted ones; repeatable, added to the [launch] table's.")
    for flag, help_text, keywords in reversed(_SITE_OPTIONS):
        option = extra if flag is None else click.option(*flag.split(), default=None,
                                                         help=f"{help_text} {_SITE_HELP}", **keywords)
        command = option(command)
    return command


@click.command("emit")
@click.option("--plans", "plans_file", required=True, metavar="FILE",
              help="Plan list written by `fasop search --output plans.json`.")
@click.option("--rank", type=click.IntRange(min=1), default=1, show_default=True, help="Which plan of the list (1 = the best).")
@click.option("--out", "out_dir", required=True, metavar="DIR",
              help="Directory to write sbatch.sh (or launch.sh, or commands.txt), run_inter.sh and plan.json into "
                   "(created if missing).")
@click.option("--force", is_flag=True,
              help="Overwrite the files of a directory that holds files already (removing those an earlier emit "
                   "wrote that this one does not), and emit a plan whose figures disagree with a fresh estimate (with "
                   "a warning; plan.json gets the fresh figures).")
@click.option("--model", "model_name", default=None, metavar="NAME|FILE",
              help="Model file (default: the plan's model_file).")
@click.option("--cluster", "cluster_name", default=None, metavar="NAME|FILE",
              help="Cluster file (default: the plan's cluster_file); its [launch] table gives site defaults.")
@click.option("--partition", "partitions", multiple=True, metavar="NAME|TYPE=NAME",
              help="Slurm partition for every node type, or TYPE=NAME for one node type or GPU; repeatable. " + _SITE_HELP)
@click.option("--gres-type", "gres_types", multiple=True, metavar="NAME|TYPE=NAME",
              help="GRES type (as in --gres=gpu:TYPE:N) for every node type, or TYPE=NAME for one node type or GPU; "
                   "repeatable. Default: the node type's gres_type, else its GPU name in lower case.")
@_site_options
@run_options
@launcher_options
@profiles_option
@reports_input_errors
def emit(plans_file: str, rank: int, out_dir: str, force: bool, model_name: str | None, cluster_name: str | None,
         partitions: tuple[str, ...], gres_types: tuple[str, ...], extra_flags: tuple[str, ...],
         profiles_dir: str | None, training: tuple[str, ...], **site) -> None:
    """Write Slurm and Megatron-LM launch scripts for one plan of a plan list.

    DIR gets sbatch.sh (one Slurm job, a heterogeneous-job component per run of node types in the plan's
    placement order), run_inter.sh (torchrun and Megatron-LM flags, one per node) and plan.json (the plan and
    its estimate). The plan is estimated afresh from the model, cluster and profiles first (the plan's
    `profiles` folder unless --profiles is given), and refused when the figures in the plan file disagree.
    A full run trains for the plan's train_steps (search with --train-tokens or --train-steps) on --data-path
    with a tokenizer, saves checkpoints, stops before each job's time limit and requeues itself until done;
    --smoke-test makes a short run instead. Submit with: cd DIR && sbatch sbatch.sh
    """
    written = _emit(plans_file, rank, out_dir, force, model_name, cluster_name, partitions, gres_types,
                    extra_flags, profiles_dir, run_settings({**site, "training": training}))
    for path in written:
        click.echo(str(path))
    commands, hint = launcher_hint(site, out_dir)
    if commands:
        click.echo(commands)
    click.echo(hint, err=True)


def _emit(plans_file, rank, out_dir, force, model_name, cluster_name, partitions, gres_types, extra_flags,
          profiles_dir, site):
    plans_path = Path(plans_file)
    plan = select_plan(load_plans(plans_path), rank, plans_file)
    where = f"{plans_file}: plan {rank}"
    model_file = _input_file(model_name, plan.model_file, "model", where, plans_path)
    cluster_file = _input_file(cluster_name, plan.cluster_file, "cluster", where, plans_path)
    model, cluster = load_model(model_file), load_cluster(cluster_file)
    note_model_defaults(model)
    if profiles_dir is None and plan.profiles is not None:  # the folder the plan was made with, or beside the list
        profiles_dir = _input_file(None, plan.profiles, "profiles", where, plans_path)
    partition, partition_map = _type_map(partitions, "--partition")
    gres_type, gres_map = _type_map(gres_types, "--gres-type")
    flags = tuple(flag for value in extra_flags for flag in split_flags(value, "--extra-flags"))
    return write.emit(plan, model, cluster, out_dir, force=force, profiles_dir=profiles_dir, inputs=[plans_path],
                      where=where, warn=lambda warning: click.echo(warning, err=True), partition=partition,
                      partitions=partition_map, gres_type=gres_type, gres_types=gres_map, extra_flags=flags, **site)
