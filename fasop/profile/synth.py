"""Synthetic layer profiles: forward and backward seconds of each unit from its FLOPs, the bytes it moves, its
kernel launches and a GPU spec table (clusters/catalogue/gpus.toml), for GPU types nobody has profiled yet.

Each unit (embedding, transformer layer, head) is its kernels' rooflines in eager PyTorch's launch queue, one
micro-batch of b samples of s tokens on one GPU of a tp-way tensor-parallel group (fasop.cost.roofline counts them):

    g_k    = max(FLOPs / (peak x efficiency x waves), bytes / memory_bandwidth), or (tp - 1) / tp x C / busbw(C)
    pass_s = max over k of (k x kernel_launch_s + g_k + ... + g_n)

The matmuls (2 x weights x tokens, and the attention scores and context over the s x s matrix, half of it in a
causal flash kernel) run at the achievable fraction of peak in full waves, times `waves`, the share of the SMs
their 256 x 128 output tiles keep busy (tile and wave quantization, given the table's sm_count); a flash
attention kernel at the table's measured attention_tflops for its head dim and key length where it has them;
the element-wise kernels (norms, softmax and dropout on the scores when attention is not flash, bias-dropout-add,
bias-GeLU or SwiGLU, rotary embedding, embedding gather, cross-entropy) are memory-bound; the host launches one
kernel every kernel_launch_us, and the GPU runs each once launched and the one before has finished (a pass of
tiny kernels takes the host's launches, one of large kernels their GPU time). Backward does twice the forward's
FLOPs (flash attention 2.5 times) and accumulates weight gradients into fp32 main gradients (8 bytes per weight).
C: the payload of each all-gather or reduce-scatter over the tensor-parallel group per pass, each moving
(tp - 1) / tp of it over the GPU's intra-node link (ring) at busbw(C), the bus bandwidth a measured all-reduce of the
same payload reached (the table's allreduce_busbw; nominal link without one), the same in forward and backward:
per transformer layer 2 all-gathers and 2 reduce-scatters of b x s x h elements (sequence parallelism; without
it, 2 all-reduces of the same traffic), the embedding's reduce-scatter and the head's all-gather of b x s x h
each. Encoder-decoder decoder layers add the cross-attention's all-gathers of its query input and of the encoder
output and its reduce-scatter. No overlap of communication with compute; a measured curve includes NCCL's
latency, the nominal link none.

What it leaves out: cuBLAS's choice of smaller tiles or split-K for matmuls of few tiles, and the framework's
Python overhead beyond the table's time per launch (a measured profile carries its own: `fasop profile layers`).
docs/cost-model.md section 2.1 compares it with FASOP's measured profiles."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import NamedTuple

from fasop.cost.roofline import Rates, unit_times, unit_work
from fasop.errors import ArgumentError
from fasop.files import comment_line, write_atomically
from fasop.inputs.bandwidth import parse_bandwidth
from fasop.inputs.catalogue import MIN_EFFICIENCY, GpuSpec, load_gpu_spec
from fasop.inputs.model import Model
from fasop.inputs.profiles import COLUMNS, DEFAULT_DEGREES, MAX_DEGREE, MAX_UNIT_TIME_S, MIN_UNIT_TIME_S, identity_line

FORMULA = ("per kernel g = max(F / (peak x efficiency x waves), B / memory_bandwidth), or (tp-1)/tp x C / busbw(C) "
           "per collective, in the launch queue: max over k of (k x kernel_launch_s + g_k + ... + g_n); waves: "
           "share of the SMs busy with 256 x 128 "
           "output tiles; F: matmul FLOPs per GPU (2 x weights x tokens + 4 b s^2 x heads x kv_channels, "
           "half of it in a causal flash kernel, / tp; backward 2F, flash attention 2.5F at the table's "
           "attention_tflops where it has them); B: each kernel's reads and writes (element-wise kernels: norms, "
           "softmax, dropout, activations, bias-dropout-add; backward + 8 bytes per weight); C: b s h x bytes per "
           "all-gather or reduce-scatter (4 per layer); busbw: a measured all-reduce's bus bandwidth at C, else "
           "the link")


# -- times ------------------------------------------------------------------------------------------------
class ProfileRow(NamedTuple):
    tp: int
    mbs: int
    kind: str
    forward_s: float
    backward_s: float


def check_degrees(model: Model, tps, mbss) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sorted, distinct tensor degrees and micro-batch sizes; degrees must split heads, groups and FFN."""
    tps, mbss = tuple(sorted(set(tps))), tuple(sorted(set(mbss)))
    if not tps or tps[0] < 1 or tps[-1] > MAX_DEGREE:
        raise ArgumentError("tps", f"expected tensor-parallel degrees from 1 to {MAX_DEGREE} (what a profile holds), "
                                   f"got {','.join(map(str, tps))}")
    if not mbss or mbss[0] < 1 or mbss[-1] > MAX_DEGREE:
        raise ArgumentError("mbss", f"expected micro-batch sizes from 1 to {MAX_DEGREE} (what a profile holds), got "
                                    f"{','.join(map(str, mbss))}")
    for tp in tps:
        for what, value in (("num_attention_heads", model.num_attention_heads),
                            ("num_query_groups", model.num_query_groups),
                            ("ffn_hidden_size", model.ffn_hidden_size)):
            if value % tp:
                raise ArgumentError("tps", f"must divide the model's {what} ({value}), as Megatron-LM requires", tp)
    return tps, mbss


def parse_sizes(argument: str, text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8), the value of `argument` (tps or mbss); positive integers only."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ArgumentError(argument, f"expected comma-separated positive integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ArgumentError(argument, f"expected comma-separated positive integers, got {text!r}")
    return values


def check_efficiency(efficiency: float | None, spec: GpuSpec) -> float:
    if efficiency is None:
        return spec.training_matmul_efficiency
    if not MIN_EFFICIENCY <= efficiency <= 1:
        raise ArgumentError("efficiency", f"expected a fraction of peak from {MIN_EFFICIENCY:g} to 1", efficiency)
    return float(efficiency)


def synthesize(model: Model, gpu_spec: GpuSpec | str, tps=DEFAULT_DEGREES, mbss=DEFAULT_DEGREES,
               efficiency: float | None = None, link_bandwidth: str | None = None) -> list[ProfileRow]:
    """Profile rows (tp, mbs, kind, forward_s, backward_s) of `model` on `gpu_spec`, ordered by tp, mbs, kind.

    `efficiency` overrides the table's efficiency in training (GpuSpec.training_matmul_efficiency);
    `link_bandwidth` ("450 GB/s") its intra_node_link.
    """
    spec = load_gpu_spec(gpu_spec) if isinstance(gpu_spec, str) else gpu_spec
    tps, mbss = check_degrees(model, tps, mbss)
    link = None if link_bandwidth is None else parse_bandwidth(link_bandwidth, "link_bandwidth")
    rates = Rates.of(spec, model, check_efficiency(efficiency, spec), link)
    rows = []
    for tp in tps:
        for mbs in mbss:
            for kind, work in unit_work(model, tp, mbs).items():
                row = ProfileRow(tp, mbs, kind, *unit_times(work, tp, rates))
                if not MIN_UNIT_TIME_S <= min(row[3:]) <= max(row[3:]) <= MAX_UNIT_TIME_S:  # what a profile holds
                    raise ArgumentError("mbss", f"the roofline gives {kind} at tp {tp} {min(row[3:]):.4g} to "
                                                f"{max(row[3:]):.4g} s per pass, outside the {MIN_UNIT_TIME_S:g} to "
                                                f"{MAX_UNIT_TIME_S:g} s a profile holds", mbs)
                rows.append(row)
    return rows


# -- the profile file -------------------------------------------------------------------------------------
def _number(value: float) -> str:
    return f"{value:.12g}"


def header_lines(model: Model, spec: GpuSpec, tps, mbss, efficiency: float | None = None,
                 link_bandwidth: str | None = None, date: str | None = None) -> list[str]:
    """The comment lines of a synthetic profile: what it is, the GPU spec, efficiency, formula, how to redo it."""
    eff = check_efficiency(efficiency, spec)
    precision = model.high_precision
    tflops = spec.dense_bf16_tflops if precision == "bf16" else spec.dense_fp16_tflops
    fp8 = (f"; the linear layers' GEMMs in FP8 ({model.fp8_recipe} scaling) at dense {_number(spec.dense_fp8_tflops)} "
           f"TFLOP/s x {_number(spec.training_fp8_matmul_efficiency or 0.0)}, with their casts (fasop.cost.fp8)"
           if model.fp8 else "")
    if link_bandwidth is not None:
        link = f"{link_bandwidth} (--link-bandwidth)"
    else:
        link = spec.intra_node_link + (f" (collectives at the measured all-reduce bus bandwidth of its "
                                       f"{len(spec.allreduce_busbw)}-point allreduce_busbw)" if spec.allreduce_busbw else "")
    field = "matmul_efficiency" if spec.sustained_matmul_efficiency is None else "sustained_matmul_efficiency"
    if efficiency is not None:
        eff_note = f"--efficiency; the table's {field} is {_number(spec.training_matmul_efficiency)}"
    elif spec.sustained_matmul_efficiency is None:
        eff_note = "the table's matmul_efficiency"
    else:
        eff_note = f"the table's {field}, at the power limit; {_number(spec.matmul_efficiency)} timed alone"
    # The model file is the one path here: quoted as a shell word (format_profile escapes what cannot be printed).
    command = f"fasop profile synth --model {shlex.quote(model.file or model.name)} --gpu {spec.name}"
    command += f" --tp {','.join(map(str, tps))} --mbs {','.join(map(str, mbss))}"
    if efficiency is not None:
        command += f" --efficiency {_number(eff)}"
    if link_bandwidth is not None:  # a number and a unit (parse_bandwidth has read it)
        command += f' --link-bandwidth "{link_bandwidth}"'
    lines = [
        f"Synthetic profile of {model.name} on {spec.name}: estimated from FLOPs and bytes (fasop.profile.synth), "
        "not measured.",
        f"GPU spec: {spec.file}, gpu {spec.name}: dense {precision} {_number(tflops)} TFLOP/s{fp8}, memory bandwidth "
        f"{_number(spec.memory_bandwidth_gb_per_s)} GB/s, intra-node link {link}, kernel launch "
        f"{_number(spec.kernel_launch_us)} us, " + (f"{spec.sm_count} SMs" if spec.sm_count else "no SM count (no wave "
                                                     "quantization)")
        + (f", flash attention at its {len(spec.attention_tflops)}-point attention_tflops." if spec.attention_tflops
           else "."),
        f"GPU spec source: {spec.source}" + (f" (table date {spec.date})" if spec.date else "") + ".",
        f"Efficiency: {_number(eff)} of peak ({eff_note}).",
        f"Formula: {FORMULA}.",
        "A roofline estimate kernel by kernel: measured runs are slower (framework overhead, small matmuls); "
        "lower --efficiency to match a measured GPU before mixing with measured profiles.",
        f"Regenerate: {command}",
    ]
    if date:
        lines.append(f"Written {date}.")
    return [*lines, identity_line(model.name, spec.name, model.precision).removeprefix("# ")]  # format_profile adds the mark


def format_profile(rows, header_comment_lines) -> str:
    """The profile CSV text: '# ' comment lines (comment_line: a newline in a path would start a CSV row), the
    column header, one row per line (%.12g)."""
    out = [comment_line(line) for line in header_comment_lines]
    out.append(",".join(COLUMNS))
    for tp, mbs, kind, forward, backward in rows:
        out.append(f"{tp},{mbs},{kind},{_number(forward)},{_number(backward)}")
    return "\n".join(out) + "\n"


def write_profile(path, rows, header_comment_lines, force: bool = False) -> Path:
    """Write the profile CSV (whole or not at all); an existing file is kept unless `force`."""
    path = Path(path)
    if path.exists() and not force:
        raise ArgumentError("path", "already exists (pass force=True to overwrite it)", path)
    if path.exists() and path.is_dir():
        raise ArgumentError("path", "is a directory; expected a .csv file name", path)
    write_atomically(path, format_profile(rows, header_comment_lines))
    return path
