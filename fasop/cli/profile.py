"""`fasop profile`: layer-time profiles for `fasop search`, synthesised (synth) or measured (layers), and the
links between GPUs (links)."""

from __future__ import annotations

from pathlib import Path

import click

from fasop.cli import profile_layers, profile_links
from fasop.cli.common import (
    catalogue_options,
    check_outputs,
    model_option,
    note_model_defaults,
    profile_options,
    reports_input_errors,
)
from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.catalogue import gpu_table_path
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model


@click.group()
def profile():
    """Make layer-time profiles for `fasop search` (profiles/<model>/<gpu>.csv)."""



@profile.command()
@model_option
@profile_options(gpu_help="GPU type of clusters/catalogue/gpus.toml (A100, H100, A10G, L4, ...). It is also the profile's "
                          "file name: a cluster's node_type `gpu` field picks profiles/<model>/<gpu>.csv.",
                 tp_default="1,2,4,8",
                 tp_help="Tensor-parallel degrees to estimate; each must divide the model's heads, query groups and FFN.",
                 mbs_help="Micro-batch sizes to estimate (fasop interpolates between them and scales beyond).")
@click.option("--efficiency", type=float, default=None, metavar="F",
              help="Achievable fraction of the dense peak FLOP/s, from 0.01 to 1 (default: the GPU's "
                   "sustained_matmul_efficiency, or its matmul_efficiency, in clusters/catalogue/gpus.toml). Lower it to "
                   "match a measured profile of another GPU type.")
@click.option("--link-bandwidth", default=None, metavar="BANDWIDTH",
              help='Intra-node link per GPU, one direction, for the tensor-parallel collectives (so with a --tp above '
                   '1), e.g. "450 GB/s" (default: the GPU\'s intra_node_link in clusters/catalogue/gpus.toml).')
@click.option("--out", type=click.Path(path_type=Path), required=True, metavar="FILE",
              help="CSV to write. As profiles/<model>/<gpu>.csv, or <gpu>.csv in a folder passed to "
                   "`fasop search --profiles DIR`, the search uses it.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@catalogue_options
@reports_input_errors
def synth(model_name, gpu, tps, mbss, efficiency, link_bandwidth, out, force, catalogue, cluster_name):
    """Estimate a profile of MODEL on GPU from FLOPs, bytes and the GPU spec table, for GPU types not yet
    measured.

    Each unit (embedding, transformer layer, head) takes, kernel by kernel, max(FLOPs / (peak x efficiency),
    bytes / memory bandwidth) and its tensor-parallel all-gathers and reduce-scatters over the intra-node link,
    each kernel run once the host has launched it (one every kernel_launch_us of the GPU table) and the one
    before has finished; backward does twice the forward FLOPs. See
    fasop/cost/roofline.py for what is counted. Small layers still run slower in practice: measure a profile
    when you can.
    """
    from fasop.profile import synth as synthesis

    model = load_model(model_name)
    note_model_defaults(model)
    spec = synthesis.load_gpu_spec(gpu, catalogue, load_cluster(cluster_name).gpus if cluster_name else None)
    tps, mbss = synthesis.check_degrees(model, synthesis.parse_sizes("tps", tps), synthesis.parse_sizes("mbss", mbss))
    if link_bandwidth is not None and max(tps) == 1:
        raise InputError("--link-bandwidth", "sets the link of the tensor-parallel collectives, and --tp 1 has "
                                             "none; give tensor degrees above 1 as well")
    read = [bundled.resolve("models", model_name, ".toml"), gpu_table_path()]
    read += [Path(catalogue)] if catalogue else []
    read += [bundled.resolve("clusters", cluster_name, ".toml")] if cluster_name else []
    check_outputs([(out, "--out")], read, force)
    rows = synthesis.synthesize(model, spec, tps, mbss, efficiency=efficiency, link_bandwidth=link_bandwidth)
    lines = synthesis.header_lines(model, spec, tps, mbss, efficiency=efficiency, link_bandwidth=link_bandwidth)
    synthesis.write_profile(out, rows, lines, force=force)
    layer = next(r for r in rows if r.kind not in ("embedding", "decoder_embedding", "head"))
    click.echo(f"{len(rows)} rows of {model.name} on {spec.name} written to {out} "
               f"(tp {','.join(map(str, tps))}; mbs {','.join(map(str, mbss))}); "
               f"{layer.kind} at tp={layer.tp} mbs={layer.mbs}: forward {layer.forward_s * 1e3:.4g} ms, "
               f"backward {layer.backward_s * 1e3:.4g} ms")
    if out.name != f"{spec.name}.csv":
        click.echo(f"note: fasop search reads <gpu>.csv; name the file {spec.name}.csv to use it for GPU {spec.name}")



profile.add_command(profile_layers.layers)
profile.add_command(profile_links.links)
