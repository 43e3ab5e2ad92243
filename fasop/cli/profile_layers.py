"""`fasop profile layers`: measure a layer profile with PyTorch (fasop.profile.measure). torch is imported only when
the command runs, so the rest of fasop works without it."""

from __future__ import annotations

import itertools
import shlex
from pathlib import Path

import click

from fasop.cli.common import check_outputs, model_option, note_model_defaults, profile_options, progress_bar, reports_input_errors
from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.model import load_model
from fasop.inputs.profiles import MAX_KERNEL_LAUNCH_US
from fasop.profile.synth import check_degrees, parse_sizes


def _import_measure():
    try:
        from fasop.profile import measure
    except ImportError as err:
        if err.name is None or not err.name.startswith("torch"):
            raise
        raise InputError("fasop profile layers", "needs PyTorch, which is not importable here "
                                                 "(install torch, with CUDA for --device cuda)") from None
    return measure


def _check_device(device: str, tps: tuple[int, ...]) -> None:
    import torch

    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise InputError("--device cuda", f"torch {torch.__version__} sees no CUDA GPU; "
                                          "pass --device cpu to time on the processor")
    count = torch.cuda.device_count()
    if tps[-1] > count:
        raise InputError(f"--tp {tps[-1]}", f"needs {tps[-1]} GPUs (one per tensor-parallel rank); "
                                            f"this machine has {count}")


@click.command("layers")
@model_option
@profile_options(gpu_help="GPU type the profile is for; also the file name a search looks for: a cluster's "
                          "node_type `gpu` field picks <gpu>.csv.",
                 tp_default="1", tp_help="Tensor-parallel degrees; each runs one process per rank (one GPU each on cuda).",
                 mbs_help="Micro-batch sizes to measure.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Time on GPUs in the model's precision, or on the processor in float32 (for tests).")
@click.option("--repeat", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed passes per unit and size; the profile keeps the median.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True,
              help="Untimed passes before them.")
@click.option("--out", type=click.Path(path_type=Path), required=True, metavar="FILE",
              help="CSV to write (profiles/<model>/<gpu>.csv, or <gpu>.csv in a `--profiles DIR`).")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@reports_input_errors
def layers(model_name, gpu, tps, mbss, device, repeat, warmup, out, force):
    """Measure a profile of MODEL: time its embedding, transformer layer and head in PyTorch, forward and
    backward apart, at each tensor degree and micro-batch size, and write them in the profile format.

    Tensor degrees above 1 split each unit over local processes as Megatron-LM does, so the
    tensor-parallel all-reduces are inside the times. On GPUs the file also records each unit's peak
    memory. Every unit is also timed at a tiny shape: the host's time per kernel, which the file carries
    (kernel_launch_us) and fasop uses to scale the times to other micro-batch sizes. See
    fasop/profile/measure.py for how the times are taken.
    """
    model = load_model(model_name)
    note_model_defaults(model)
    tps, mbss = check_degrees(model, parse_sizes("tps", tps), parse_sizes("mbss", mbss))
    check_outputs([(out, "--out")], [bundled.resolve("models", model_name, ".toml")], force)
    measure = _import_measure()
    _check_device(device, tps)
    settings = measure.Settings(device=device, repeat=repeat, warmup=warmup)
    command = shlex.join(["fasop", "profile", "layers", "--model", model.file or model.name, "--gpu", gpu,
                          "--tp", ",".join(map(str, tps)), "--mbs", ",".join(map(str, mbss)),
                          "--device", device, "--repeat", str(repeat), "--warmup", str(warmup),
                          "--out", str(out)])
    sizes = [(tp, mbs) for tp in tps for mbs in mbss]
    with progress_bar(f"measuring {model.name}") as progress:
        measured = itertools.count(1)

        def on_size(tp, mbs):
            progress(next(measured), len(sizes), f"tp={tp} mbs={mbs}")

        try:
            rows, out_of_memory = measure.measure(model, tps, mbss, settings, on_size)
        except measure.MeasureError as err:
            raise click.ClickException(f"measuring {model.name} failed: {err}") from None
        floor_us = measure.measure_host_floor(model, settings)
    if floor_us > MAX_KERNEL_LAUNCH_US:  # a host this slow was busy: the profile records the most it reads back
        click.echo(f"note: the host took {floor_us:,.0f} us per kernel of the tiny units, more than the "
                   f"{MAX_KERNEL_LAUNCH_US:g} a profile records; written as {MAX_KERNEL_LAUNCH_US:g} (measure again on "
                   "an idle machine for a truer floor)", err=True)
        floor_us = MAX_KERNEL_LAUNCH_US
    lines = measure.header_lines(model, gpu, tps, mbss, settings, out_of_memory, command, floor_us)
    measure.write_measured(out, rows, lines)
    layer = next(r for r in rows if r.kind in model.layer_kinds)
    click.echo(f"{len(rows)} rows of {model.name} for {gpu} written to {out}; {layer.kind} at tp={layer.tp} "
               f"mbs={layer.mbs}: forward {layer.forward_s * 1e3:.4g} ms, backward {layer.backward_s * 1e3:.4g} ms; "
               f"host floor {floor_us:.4g} us per kernel")
    if out.name != f"{gpu}.csv":
        click.echo(f"note: fasop search reads <gpu>.csv; name the file {gpu}.csv to use it for GPU {gpu}")

