"""What every command shares: one-line input errors, the common options, the files a run reads, and the
progress bar of long runs."""

from __future__ import annotations

import functools
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from fasop import files
from fasop.cost import price
from fasop.errors import ArgumentError, InputError
from fasop.inputs import bundled
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.model import FP8_RECIPES, PRECISIONS
from fasop.inputs.names import NAME, NAME_RULE
from fasop.inputs.profiles import GpuProfile, load_profiles, profile_paths
from fasop.search.headroom import DEFAULT_MEMORY_HEADROOM, MIN_MEMORY_HEADROOM

PROGRESS_DELAY_S = 1.0  # runs shorter than this never show a bar
# The most characters of an error line: a message that quotes a hostile value (a cell of a megabyte, a list of a
# million entries) is cut there, so that the one line stays one readable line.
MAX_ERROR_CHARS = 2000
_NOTES = "fasop.notes"  # the click context's meta key of the notes shown after a command's result (note_after)


def reports_input_errors(command):
    """Bad input ends the command with one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            result = command(*args, **kwargs)
        except InputError as err:  # a path or a value may hold a newline or a terminal's control sequence
            line = files.one_line(_as_given(err))
            if len(line) > MAX_ERROR_CHARS:
                line = f"{line[:MAX_ERROR_CHARS]}... ({len(line) - MAX_ERROR_CHARS:,} more characters)"
            click.echo(f"Error: {line}", err=True)
            raise click.exceptions.Exit(2) from None
        except click.exceptions.Exit:  # a result shown with an exit code of its own
            _show_notes()
            raise
        _show_notes()
        return result

    return wrapper


def note_after(key: str, text: str) -> None:
    """A note on stderr once the command has shown its result, so that bad input found later stays one line;
    one per `key` and command (at once outside a command)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        click.echo(text, err=True)
    else:
        ctx.find_root().meta.setdefault(_NOTES, {})[key] = text


def note_model_defaults(model) -> None:
    """Say which fields that change the estimate the model file leaves out and the values taken for them; once
    per model file and command."""
    if model.defaulted:
        taken = ", ".join(f"{name} = {json.dumps(value)}" for name, value in model.defaults_taken().items())
        note_after(f"defaults {model.file}",
                   f"note: {model.file} leaves out fields that change the estimate; taking {taken} (docs/formats.md)")


def _show_notes() -> None:
    ctx = click.get_current_context(silent=True)
    for note in (ctx.find_root().meta.pop(_NOTES, {}) if ctx is not None else {}).values():
        click.echo(note, err=True)


def _as_given(err: InputError) -> str:
    """The error in the words of the command line: a bad argument of a library function is named by the option
    that gave it (`--train-tokens 1e+30: ...` for `train_tokens=1e+30: ...`); one that no option gives stays as
    the library wrote it."""
    where = err.where
    if isinstance(err, ArgumentError) and (option := _option_of(err.argument)) is not None:
        where = option if err.value is None else f"{option} {err.value}"
    remedy = err.remedy and (_option_of(err.remedy) or err.remedy)
    return f"{where}: {err.problem}" + (f" ({remedy})" if remedy else "")


def _option_of(argument: str) -> str | None:
    """The option of the running command, or of a group above it, whose parameter is named `argument` (--model
    gives model_name) or whose long name is spelled like it (--train-tokens gives train_tokens)."""
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        for param in ctx.command.params:
            if not isinstance(param, click.Option):
                continue
            long_options = [opt for opt in param.opts if opt.startswith("--")]
            if argument == param.name or argument in (opt[2:].replace("-", "_") for opt in long_options):
                return (long_options or param.opts)[0]
        ctx = ctx.parent
    return None


model_option = click.option("--model", "model_name", required=True, metavar="NAME|FILE",
                            help="A bundled model (gpt2-xl, bert, t5, ...) or a model TOML file.")
cluster_option = click.option("--cluster", "cluster_name", required=True, metavar="NAME|FILE",
                              help="A bundled cluster (fasop-1xA100-7xA10, ...) or a cluster TOML file.")
gbs_option = click.option("--gbs", type=int, default=None, help="Global batch size (default: the model file's).")
profiles_option = click.option("--profiles", "profiles_dir", default=None, metavar="DIR",
                               help="Folder of <gpu>.csv profiles, one for every GPU type of the cluster (default: "
                                    "the bundled profiles/<model>, GPU types without one there synthesised from the "
                                    "roofline).")
mismatch_option = click.option("--allow-profile-mismatch", is_flag=True,
                                help="Use profiles whose fasop-profile header line names another model or GPU.")
optimizer_option = click.option("--distributed-optimizer/--no-distributed-optimizer", default=True, show_default=True,
                                help="Shard optimizer state over data parallelism (Megatron's --use-distributed-optimizer).")

overlap_option = click.option("--overlap/--no-overlap", default=True, show_default=True,
                              help="Overlap the data-parallel gradient reduction with the backward pass (Megatron's "
                                   "--overlap-grad-reduce) and, with the distributed optimizer, the parameter "
                                   "all-gather with the next forward (--overlap-param-gather).")


def _names(ctx, param, value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(name.strip() for name in value.split(","))


def recompute_modules_option(default: str | None):
    """--recompute-modules, a comma-separated list (a tuple; None where it has no default and is not given)."""
    return click.option(
        "--recompute-modules", "recompute_modules", default=default, show_default=default is not None,
        metavar="MODULE,...", callback=_names,
        help="What selective recomputation reruns (Megatron's --recompute-modules): core_attn, layernorm (the norms "
             "that are modules of their own), moe_act, mla_up_proj, mlp (a dense layer's FFN), shared_experts.")


seq_length_option = click.option(
    "--seq-length", "seq_length", type=click.IntRange(min=1), default=None, metavar="N",
    help="Tokens per sample, in place of the model file's (long-context plans; context parallelism splits them).")


def load_model_at(model_name: str, seq_length: int | None):
    """The model of --model, at --seq-length where given; a length beyond the model file's is noted (its
    positions must stretch: a learned table grows, rotary ones need scaling such as YaRN)."""
    from fasop.inputs.model import load_model, with_seq_length

    model = load_model(model_name)
    if seq_length is None:
        return model
    stretched = with_seq_length(model, seq_length)  # refused before anything is noted
    if seq_length > model.seq_length:
        note_after(f"seq-length {model.file}",
                   f"note: --seq-length {seq_length} is beyond the {model.seq_length} tokens {model.file} was set up "
                   f"for; its {model.position_embedding} positions must stretch to it")
    return stretched


force_option = click.option("--force", is_flag=True, help="Replace output files that exist (never an input of the run).")


class FiniteRange(click.FloatRange):
    """click.FloatRange that also refuses nan and infinities (nan passes FloatRange: it compares false with both
    bounds)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def precision_options(several: bool):
    """--precision (several precisions ranked together on search and pareto, one on estimate), --fp8-recipe and
    --fp8-param-gather."""
    def add(command):
        command = click.option("--fp8-param-gather", "fp8_param_gather", is_flag=True, default=None,
                               help="With fp8: keep the parameters in FP8 and all-gather them in FP8 (Megatron's "
                                    "--fp8-param-gather; needs the distributed optimizer).")(command)
        command = click.option("--fp8-recipe", type=click.Choice(FP8_RECIPES), default=None,
                               help="With fp8: Transformer Engine's scaling recipe (Megatron's --fp8-recipe) "
                                    "[default: the model file's, else delayed].")(command)
        what = "Precisions to plan in, ranked together" if several else "Precision to train in"
        return click.option("--precision", "precision", default=None,
                            metavar="P,P,..." if several else "P",
                            help=f"{what}: {', '.join(PRECISIONS)} (fp8: Transformer Engine's FP8 GEMMs in the "
                                 "linear layers, bf16 around them, on the GPU types with FP8 tensor cores) "
                                 "[default: the model file's].")(command)
    return add


memory_headroom_option = click.option(
    "--memory-headroom", type=FiniteRange(MIN_MEMORY_HEADROOM, 1), default=DEFAULT_MEMORY_HEADROOM, show_default=True,
    metavar="F", help="Flag plans whose peak memory is above this fraction of a GPU's usable memory, and rank them "
                      "after every plan below it (1: no flag).")


def check_run_length(train_steps: int | None, train_tokens: float | None) -> None:
    """fasop.cost.price.check_run_length, the two options given together refused in their own words."""
    if train_steps is not None and train_tokens is not None:
        raise InputError("--train-tokens", "give either --train-steps or --train-tokens, not both")
    price.check_run_length(train_steps, train_tokens)


def check_outputs(outputs: list[tuple[Path, str]], inputs: list[Path], force: bool) -> None:
    """Refuse outputs (path, option) that would replace an input of the run (with or without --force), that
    cannot be written, or that exist already (without --force)."""
    files.check_outputs(outputs, inputs)
    if not force:
        for path, option in outputs:
            if path.exists() or path.is_symlink():  # a dangling link too: writing replaces it
                raise InputError(f"{option} {path}", "already exists (pass --force to overwrite it)")


def _gpu_name(ctx, param, value: str) -> str:
    """The GPU type names the profile file and is written into its header and the clusters that use it."""
    if not NAME.fullmatch(value):
        raise click.BadParameter(f"expected {NAME_RULE}, got {value!r}")
    return value


def profile_options(gpu_help: str, tp_default: str, tp_help: str, mbs_help: str):
    """--gpu, --tp and --mbs: the GPU type and the sizes a profile command writes a profile of."""
    options = [
        click.option("--gpu", required=True, metavar="NAME", callback=_gpu_name, help=gpu_help),
        click.option("--tp", "tps", default=tp_default, show_default=True, metavar="N,N,...", help=tp_help),
        click.option("--mbs", "mbss", default="1,2,4,8", show_default=True, metavar="N,N,...", help=mbs_help),
    ]

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def input_paths(model_name: str, cluster_name: str, model, cluster, profiles_dir: str | None) -> list[Path]:
    """The files a search or sweep reads, which its outputs must not replace."""
    profiles = profile_paths(model, [t.gpu for t in cluster.node_types.values()], profiles_dir)
    return [bundled.resolve("models", model_name, ".toml"), bundled.resolve("clusters", cluster_name, ".toml"),
            *profiles.values()]


def run_profiles(model, cluster, profiles_dir: str | None, allow_mismatch: bool = False,
                 noted: set[str] | None = None) -> dict[str, GpuProfile]:
    """The profiles of `model` for the GPU types of `cluster` (its own [[gpu]] tables merged over the catalogue),
    with a note on stderr when some were synthesised (but those of `noted`, the GPU types said already, which
    it adds to) or derived from another precision."""
    profiles = load_profiles(model, [t.gpu for t in cluster.node_types.values()], profiles_dir, allow_mismatch,
                             merged_specs(own=cluster.gpus))
    noted = set() if noted is None else noted
    note_synthesised(model, {gpu: p for gpu, p in profiles.items() if gpu not in noted})
    noted.update(profiles)
    derived = sorted(f"{gpu} (from {p.derived_from})" for gpu, p in profiles.items() if p.derived_from)
    if derived:
        note_after(f"derived {model.precision} {' '.join(derived)}",
                   f"note: {model.precision} times of {', '.join(derived)} derived from its profile file by the "
                   f"roofline's ratio of {model.precision} to the file's precision, unit by unit and micro-batch size "
                   "by size (docs/cost-model.md section 12)")
    note_model_defaults(model)
    return profiles


def space_profiles(spaces, profiles_dir: str | None, allow_mismatch: bool = False) -> list[dict[str, GpuProfile]]:
    """run_profiles of each precision's space (fasop.search.precision), each synthesised GPU type noted once."""
    noted: set[str] = set()
    return [run_profiles(space.model, space.cluster, profiles_dir, allow_mismatch, noted) for space in spaces]


def note_left_out(spaces) -> None:
    """One line for each precision that leaves node types out, and why."""
    for space in spaces:
        if space.left_out:
            click.echo(f"note: {space.model.precision} plans leave out "
                       f"{', '.join(sorted(space.left_out))}: {'; '.join(sorted(set(space.left_out.values())))}; "
                       "stock Megatron-LM runs one FP8 recipe for the whole model")


def note_synthesised(model, profiles: dict[str, GpuProfile]) -> None:
    """One line on stderr naming the GPU types whose profiles were synthesised, and how to measure them."""
    synthesised = sorted(gpu for gpu, profile in profiles.items() if profile.synthesised)
    if synthesised:
        model_arg = shlex.quote(model.file or model.name)
        note_after(f"synthesised {model.name} {' '.join(synthesised)}",
                   f"note: no profile of {model.name} for {', '.join(synthesised)}: synthesised from the roofline "
                   "(an estimate; measured runs are slower); to measure instead, run `fasop profile layers --model "
                   f"{model_arg} --gpu GPU --out DIR/GPU.csv` for each GPU type and pass --profiles DIR")


@contextmanager
def progress_bar(label: str) -> Iterator[Callable[..., None]]:
    """A `progress(done, total, item=None)` callback that shows click's progress bar on stderr (with `item`, the
    unit of work just done, beside it), only on a terminal and only once the work has run for PROGRESS_DELAY_S:
    short runs, pipes and files stay free of it (click's own bar would print its label once into a pipe)."""
    started = time.monotonic()
    bar = None

    def progress(done: int, total: int, item: str | None = None) -> None:
        nonlocal bar
        if bar is None:
            if time.monotonic() - started < PROGRESS_DELAY_S or not sys.stderr.isatty():
                return
            bar = click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True,
                                    item_show_func=lambda shown: shown)
        bar.update(done - bar.pos, item)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.render_finish()


def int_list(option: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise InputError(option, f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise InputError(option, f"expected non-negative integers, got {text!r}")
    return values


def catalogue_options(command):
    """--catalogue FILE and --cluster FILE, for commands that read GPU figures."""
    command = click.option("--cluster", "cluster_name", default=None, metavar="NAME|FILE",
                           help="A cluster file whose [[gpu]] tables add or replace GPUs (over --catalogue).")(command)
    return click.option("--catalogue", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        metavar="FILE", help="Your own [[gpu]] tables (clusters/catalogue/gpus.toml's format), merged over "
                                             "the bundled catalogue: they add GPUs or replace one of the same name.")(command)
