"""`fasop estimate`: the step time, memory and price of one plan, given by its options or read from a plan file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click
from click.core import ParameterSource

from fasop.cli import common
from fasop.cli.tables import format_estimate
from fasop.cost.config import RECOMPUTE_METHODS, RECOMPUTE_MODES
from fasop.cost.fp8 import check_param_gather
from fasop.cost.memory import usable_gib
from fasop.errors import InputError
from fasop.files import beside, check_finite
from fasop.inputs.cluster import Cluster, load_cluster
from fasop.inputs.model import load_model, with_precision
from fasop.plans import Plan, expand_placement, read_plan_file

# The options that give a plan's shape: required without --plan, refused with it (the plan file gives them).
SHAPE_OPTIONS = ("tp", "dp", "pp", "mbs", "placement", "layers_per_stage", "gbs", "distributed_optimizer", "overlap",
                 "virtual_stages", "recompute", "recompute_method", "recompute_num_layers", "recompute_modules",
                 "sequence_parallel",
                 "tp_comm_overlap", "precision", "fp8_recipe", "fp8_param_gather", "seq_length", "cp", "ep", "etp")
REQUIRED_WITHOUT_PLAN = ("model_name", "cluster_name", "tp", "dp", "pp", "mbs", "placement", "layers_per_stage")
DOES_NOT_FIT_STATUS = 3  # apart from bad input (2): the plan was estimated, and it does not fit GPU memory


@click.command()
@click.option("--plan", "plan_file", default=None, metavar="FILE",
              help="Estimate a plan of a plan file (fasop search --output plans.json, or the plan.json of fasop emit; "
                   "a 3D or stage-groups plan) with the model, cluster and profiles it names, instead of the plan "
                   "options below.")
@click.option("--rank", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --plan: which plan of the list (1 = best).")
@click.option("--model", "model_name", default=None, metavar="NAME|FILE",
              help="A bundled model or a model TOML file (with --plan: instead of the plan's).")
@click.option("--cluster", "cluster_name", default=None, metavar="NAME|FILE",
              help="A bundled cluster or a cluster TOML file (with --plan: instead of the plan's).")
@click.option("--tp", type=click.IntRange(min=1), default=None, help="Tensor-parallel degree.")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="Data-parallel degree.")
@click.option("--cp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Context-parallel degree (Megatron's --context-parallel-size): ranks sharing each sequence.")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
              help="MoE models: expert-parallel degree (--expert-model-parallel-size).")
@click.option("--etp", type=click.IntRange(min=1), default=None,
              help="MoE models: expert-tensor-parallel degree (--expert-tensor-parallel-size) [default: tp].")
@click.option("--pp", type=click.IntRange(min=1), default=None, help="Pipeline-parallel degree.")
@click.option("--mbs", type=click.IntRange(min=1), default=None, help="Micro-batch size.")
@click.option("--placement", default=None, metavar="TYPE,TYPE,...",
              help="Node types in node-rank order; TYPE*N stands for N nodes of a type in a row (A100,A10*3).")
@click.option("--layers", "layers_per_stage", default=None, metavar="N,N,...",
              help="Transformer layers per stage (embedding on the first stage, head on the last).")
@common.gbs_option
@common.profiles_option
@common.mismatch_option
@common.optimizer_option
@common.overlap_option
@click.option("--virtual-stages", type=click.IntRange(min=1, max=1024), default=1, show_default=True,
              help="Model chunks per pipeline rank (interleaved 1F1B when > 1); layers split evenly over them.")
@click.option("--recompute", type=click.Choice(RECOMPUTE_MODES), default="none", show_default=True,
              help="Activation recomputation (Megatron's --recompute-granularity).")
@click.option("--recompute-method", type=click.Choice(RECOMPUTE_METHODS), default=None,
              help="With --recompute full: uniform (every layer) or block (the first N layers of each stage).")
@click.option("--recompute-num-layers", type=click.IntRange(min=1), default=None,
              help="With --recompute full: 1 for uniform, N for block.")
@common.recompute_modules_option(default=None)
@click.option("--sequence-parallel/--no-sequence-parallel", default=None,
              help="Megatron's --sequence-parallel [default: on when tp > 1].")
@click.option("--tp-comm-overlap/--no-tp-comm-overlap", default=False, show_default=True,
              help="Megatron's --tp-comm-overlap: the layers' tensor-parallel collectives overlapped with their GEMMs "
                   "(needs tp > 1, sequence parallelism and a GPU type of clusters/catalogue/tp-comm-overlap.toml).")
@common.memory_headroom_option
@common.precision_options(several=False)
@common.seq_length_option
@click.option("--json", "as_json", is_flag=True, help="Print the breakdown as a JSON object.")
@common.reports_input_errors
def estimate(plan_file, rank, model_name, cluster_name, profiles_dir, allow_profile_mismatch, memory_headroom, as_json,
             precision, fp8_recipe, fp8_param_gather, seq_length, **shape):
    """Break down the step time, memory and price of one plan: given by --tp, --dp, --pp, --mbs, --placement and
    --layers, or read from a plan file with --plan.

    Exit status: 0 when the plan fits GPU memory; 3 when it does not (the breakdown is printed all the same, and
    one line on stderr names the stage over its usable memory); 2 on bad input."""
    from fasop.inputs.errorband import band_of
    from fasop.search import estimate as run_estimate
    from fasop.search.headroom import memory_load
    from fasop.search.precision import plan_model
    from fasop.search.spec import plan_spec, spec_of
    from fasop.search.stagegroups import estimate_stage_groups, spec_of_stage_groups

    ctx = click.get_current_context()
    groups = None  # the stage-group plan of a plan file of that kind
    given = [name for name in ctx.params if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
    if plan_file is None:
        if "rank" in given:
            raise InputError("--rank", "applies to a plan file: give --plan")
        missing = [name for name in REQUIRED_WITHOUT_PLAN if ctx.params[name] is None]
        if missing:
            raise InputError(_option(ctx, missing[0]), "missing: give the plan's options, or a plan file with --plan")
        model, cluster = common.load_model_at(model_name, seq_length), load_cluster(cluster_name)
        if precision is not None or fp8_recipe is not None or fp8_param_gather:
            model = with_precision(model, precision or model.precision, fp8_recipe, fp8_param_gather)
        check_param_gather(model, shape["distributed_optimizer"])  # before the profiles' notes
        shape["placement"] = expand_placement(shape["placement"], "--placement")
        shape["layers_per_stage"] = common.int_list("--layers", shape["layers_per_stage"])
        shape["overlap_grad_reduce"] = shape.pop("overlap")
        spec, shape = plan_spec(model, cluster, **shape), {}  # checked before any profile is read or noted
    else:
        refused = [name for name in SHAPE_OPTIONS if name in given]
        if refused:
            raise InputError(_option(ctx, refused[0]), "the plan file gives the plan; leave it out with --plan")
        plan, where = read_plan_file(plan_file, rank), f"{plan_file}: plan {rank}"
        if plan.is_data_parallel:
            raise InputError(where, f"a {plan.kind} plan: fasop estimate takes 3D and stage-groups plans (fasop "
                                    "emit re-estimates data-parallel ones)")
        model, cluster, profiles_dir = _plan_inputs(plan, Path(plan_file), model_name, cluster_name, profiles_dir, where)
        model = plan_model(model, plan)
        if plan.is_stage_groups:
            groups = spec_of_stage_groups(plan, model, cluster, where)
        else:
            spec, shape = spec_of(plan, model, cluster, where), {}
    placement = groups.placement if groups is not None else spec.placement
    # an fp8 model has profiles only on FP8 GPUs: those of the plan's node types
    used = cluster.with_counts(Counter(placement)) if model.fp8 else cluster
    profiles = common.run_profiles(model, used, profiles_dir, allow_profile_mismatch)
    if groups is None:
        plan = run_estimate(model, cluster, spec, profiles_dir=profiles_dir, profiles=profiles, **shape)
    else:
        plan = estimate_stage_groups(model, cluster, groups, profiles_dir=profiles_dir, profiles=profiles)
    if as_json:
        record = plan.record()
        check_finite(record, "estimate")
        click.echo(json.dumps(record, indent=1, allow_nan=False))
    else:
        click.echo(format_estimate(plan, model.name, cluster.name, cluster.memory_margin, band_of(cluster.error_band),
                                   memory_load(plan, cluster), memory_headroom))
    if not plan.fits_memory:
        click.echo(f"Error: {_over_memory(plan, cluster)}", err=True)
        raise click.exceptions.Exit(DOES_NOT_FIT_STATUS)


def _over_memory(plan: Plan, cluster: Cluster) -> str:
    """Why the plan does not fit: the stage furthest over the memory usable on its GPUs (their memory less the
    cluster's overhead, over its memory margin; the test of fasop.search.estimate)."""
    stage = max(plan.stages or [], key=lambda s: s.memory_gib - usable_gib(cluster, s.memory_capacity_gib))
    return (f"the plan does not fit GPU memory: stage {stage.stage} ({stage.gpu}) peaks at {stage.memory_gib:.2f} "
            f"GiB, {usable_gib(cluster, stage.memory_capacity_gib):.2f} GiB usable of {stage.memory_capacity_gib:.2f} "
            f"GiB (less {cluster.gpu_memory_overhead_gib:g} GiB overhead, over memory margin {cluster.memory_margin:g})")


def _option(ctx: click.Context, name: str) -> str:
    return next(param.opts[0] for param in ctx.command.params if param.name == name)


def _plan_inputs(plan: Plan, path: Path, model_name: str | None, cluster_name: str | None, profiles_dir: str | None,
                 where: str):
    """The model, cluster and profile folder of a plan file: the options given, else those the plan names
    (a relative file beside the plan file)."""
    named = {}
    for kind, option, recorded in (("model", model_name, plan.model_file or plan.model),
                                   ("cluster", cluster_name, plan.cluster_file or plan.cluster)):
        if option is None and recorded is None:
            raise InputError(where, f"names no {kind}_file or {kind}; give --{kind}")
        named[kind] = option or beside(str(recorded), path.parent)
    if profiles_dir is None and plan.profiles is not None:  # the folder the plan was made with
        profiles_dir = beside(plan.profiles, path.parent)
    return load_model(named["model"]), load_cluster(named["cluster"]), profiles_dir
