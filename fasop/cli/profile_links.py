"""`fasop profile links`: time the links of the GPUs this job runs on (fasop.profile.linkbench) and write the
bandwidths as cluster-file fields (fasop.profile.links). torch is imported only when the command runs."""

from __future__ import annotations

import datetime
import itertools
import os
import shlex
import sys
from pathlib import Path

import click
import numpy as np

from fasop.cli.common import progress_bar, reports_input_errors
from fasop.errors import InputError
from fasop.files import write_atomically
from fasop.profile.links import (
    DEFAULT_SIZES,
    KINDS,
    fit_alpha_beta,
    format_bandwidth,
    format_fragment,
    launch_from_env,
    link_bytes,
    measurable,
    parse_message_sizes,
)


def _import_linkbench():
    try:
        from fasop.profile import linkbench
    except ImportError as err:
        if err.name is None or not err.name.startswith("torch"):
            raise
        raise InputError("fasop profile links", "needs PyTorch, which is not importable here") from None
    return linkbench


def _out_problem(out: Path, force: bool) -> str | None:
    if out.is_dir():
        return "is a directory; expected a .toml file name"
    if out.exists() and not force:
        return "already exists (pass --force to overwrite it)"
    return None



@click.command("links")
@click.option("--out", type=click.Path(path_type=Path), required=True, metavar="FILE",
              help="TOML fragment to write (by rank 0): the node type's bandwidth fields, with comments.")
@click.option("--sizes", "sizes_text", default=DEFAULT_SIZES, show_default=True, metavar="BYTES,...",
              help="Message sizes, with binary K, M, G suffixes.")
@click.option("--repeat", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed repetitions per operation and size; the median is kept.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed repetitions before them.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="GPUs with NCCL, or the processor with gloo; auto: GPUs when torch sees one.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@reports_input_errors
def links(out, sizes_text, repeat, warmup, device, force):
    """Time point-to-point sends and all-reduces inside a node and between nodes, fit latency and
    bandwidth (t = alpha + bytes / beta) and write them as cluster-file fields for this node type.

    Start one process per GPU with torchrun (torchrun --nnodes 2 --nproc-per-node 8 -m fasop profile
    links --out links.toml) or srun (with MASTER_ADDR and MASTER_PORT exported). Ranks are grouped into
    nodes by host name and node rank. See fasop/profile/links.py for what each operation times.
    """
    launch = launch_from_env(os.environ)
    sizes = parse_message_sizes(sizes_text)
    linkbench = _import_linkbench()
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda", f"torch {torch.__version__} sees no CUDA GPU; pass --device cpu")
    bench = linkbench.Bench(launch, linkbench.Settings(device, sizes, repeat, warmup))
    try:
        problem = [_out_problem(out, force) if launch.rank == 0 else None]
        linkbench.dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            if launch.rank == 0:
                raise InputError(f"--out {out}", problem[0])
            raise click.exceptions.Exit(2)
        kinds = measurable(bench.nodes)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        with progress_bar("timing links") as progress:
            for done, (kind, size) in enumerate(itertools.product(kinds, sizes), start=1):
                times[kind].append(bench.time(kind, size))
                if launch.rank == 0:
                    progress(done, len(kinds) * len(sizes), kind)
        version = linkbench.versions(bench.cuda)
    finally:
        bench.close()
    if launch.rank != 0:
        return
    fits = {kind: fit_alpha_beta(np.array([link_bytes(kind, s, bench.nodes) for s in sizes]), np.array(times[kind]),
                                 f"{kind} times") for kind in kinds}
    command = shlex.join(["fasop", "profile", "links", "--sizes", sizes_text, "--repeat", str(repeat),
                          "--warmup", str(warmup), "--device", device, "--out", str(out)])
    per_node = min(len(n) for n in bench.nodes)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"Measured by fasop profile links on {stamp}: {len(bench.nodes)} node(s) x {per_node} process(es) "
        f"({', '.join(bench.hosts)}), {'NCCL' if bench.cuda else 'gloo'}; {version}.",
        f"Message sizes {', '.join(map(str, sizes))} bytes; median of {repeat} repetitions after {warmup} "
        "warm-up, slowest rank; fit t = alpha + link bytes / beta (fasop/profile/links.py).",
        f"Command: {command}",
    ]
    write_atomically(out, format_fragment(fits, header))
    for kind in KINDS:
        if kind in fits:
            click.echo(f"{kind:<21} latency {fits[kind].latency_s * 1e6:9.2f} us  "
                       f"bandwidth {format_bandwidth(fits[kind].bytes_per_s)}")
    click.echo(f"cluster-file fields written to {out}")
    sys.stdout.flush()

