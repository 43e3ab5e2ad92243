"""Synthetic layer profiles: forward and backward seconds of each unit from its FLOPs, the bytes it moves and a
GPU spec table (catalogue/gpus.toml), for GPU types nobody has profiled yet.

The estimate is a roofline per unit (embedding, transformer layer, head), for one micro-batch of b samples of
s tokens on one GPU of a tp-way tensor-parallel group:

    forward_s  = max(F / (peak x efficiency), B_fwd / memory_bandwidth) + (tp - 1) / tp x C / link
    backward_s = max(2F / (peak x efficiency), B_bwd / memory_bandwidth) + (tp - 1) / tp x C / link

F, FLOPs of the matrix multiplications, per GPU (everything divided by tp; element-wise work is left out):
  - transformer layer: 2 x (weights of its matmuls) x b x s, plus attention scores Q.K^T and the
    context (scores x V), 2 x 2 x b x s^2 x (heads x kv_channels). The full s x s matrix is counted: no
    saving for causal masking. Megatron-LM's unfused attention computes the whole matrix; flash attention
    with a causal mask skips the blocks above the diagonal and does about half of this attention work,
    so for causal models with flash attention the estimate is slightly high (by s / (12 h + 2 s) of a GPT
    layer with FFN 4h; 3.6% of a Llama-2-70B layer at s = 4096). This matches the usual
    24 b s h^2 + 4 b s^2 h of a GPT layer.
    Grouped-query attention shrinks the K and V projections (2 x h x groups x kv_channels weights), not the
    score work, which is per query head. SwiGLU has three h x ffn matrices, GELU two. Decoder layers of
    encoder-decoder models add cross-attention: Q and output projections over the decoder tokens, K and V
    projections over the encoder tokens, and 2 x 2 x b x s_dec x s_enc x (heads x kv_channels).
  - embedding: no FLOPs (a gather, memory-bound).
  - head: logits, 2 x b x s x h x vocab_padded / tp; the final norm only moves bytes. BERT's head adds its
    LM-head transform (2 x b x s x h^2) and pooler (2 x b x h^2), which Megatron does not split over tp.
  - backward: 2 x F (the gradients of the input and of the weights each cost one forward matmul).

B, bytes read from or written to GPU memory, per GPU:
  - forward: the unit's weights read once per micro-batch (1/tp of them, in the training precision), its
    input read, the activations it keeps for the backward pass (fasop.inputs.model's memory model) and its output
    written. The embedding reads only the rows it owns (b s h / tp) and writes a full b s h output before the
    reduce-scatter; the head's kept activations include its fp32 logits.
  - backward: the forward's bytes again (weights read, kept activations read back, output gradient read,
    input gradient written) plus 8 bytes per weight: Megatron-LM accumulates weight gradients into fp32
    main gradients (4 bytes read, 4 written). The embedding's gradient is dense over the rank's part of
    the vocabulary (PyTorch's embedding backward), so it also writes 2 bytes per weight of that part.

C, bytes of the tensors all-gathered or reduce-scattered over the tensor-parallel group per pass, each
moving (tp - 1) / tp of the tensor over the GPU's intra-node link (ring algorithm), the same in forward and
backward. With sequence parallelism Megatron-LM does, per transformer layer and pass, 2 all-gathers and 2
reduce-scatters of b x s x h elements (without it, 2 all-reduces of the same total traffic): C = 4 b s h x
bytes. Encoder-decoder decoder layers add the cross-attention's all-gather of its query input and of the
encoder output and its reduce-scatter. The embedding reduce-scatters its output (1 x b s h) and the head
all-gathers its input (1 x b s h); the vocabulary-parallel cross-entropy's all-reduces of b x s numbers are
left out. No overlap of communication with compute is assumed.

What the roofline leaves out: kernel launch overheads, unfused element-wise kernels, lower matmul efficiency
of small or tensor-split matrices, and collective latency. It is a lower bound for small layers: FASOP's
measured gpt2-xl layer on an A100 (1.64 ms forward at tp=1, b=1) runs about 6 times slower than this
estimate. Lower --efficiency to calibrate it against one measured GPU type before mixing synthetic and
measured profiles in one search.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from fasop.cost.flops import layer_forward_flops
from fasop.cost.memory import DROPOUT_MASK_BYTES, FP32_BYTES, head_activation_bytes, layer_activation_bytes
from fasop.errors import InputError
from fasop.files import write_atomically
from fasop.inputs.catalogue import GpuSpec, load_gpu_spec
from fasop.inputs.cluster import parse_bandwidth
from fasop.inputs.model import Model
from fasop.inputs.profiles import COLUMNS, identity_line, required_kinds

MAIN_GRAD_BYTES_PER_WEIGHT = 2 * FP32_BYTES  # fp32 main gradient read and written once per micro-batch
DEFAULT_DEGREES = (1, 2, 4, 8)
FORMULA = ("forward_s = max(F / (peak x efficiency), B / memory_bandwidth) + (tp-1)/tp x C / link; "
           "backward_s: 2F, B + 8 bytes per weight, same C; F: matmul FLOPs per GPU (2 x weights x tokens "
           "+ 4 b s^2 x heads x kv_channels, no causal saving, / tp); B: weights + input + kept activations "
           "+ output; C: b s h x bytes per all-gather or reduce-scatter (4 per layer)")


# -- FLOPs, bytes and collectives of one unit -------------------------------------------------------------
@dataclass(frozen=True)
class UnitCost:
    """What one unit does for one micro-batch on one GPU of a tp-way group (see the module docstring)."""

    kind: str
    forward_flops: float
    forward_bytes: float
    backward_bytes: float
    collective_bytes: float  # per pass: bytes of the tensors all-gathered or reduce-scattered over tp

    @property
    def backward_flops(self) -> float:
        return 2 * self.forward_flops


def head_forward_flops(model: Model, mbs: int, tp: int = 1) -> float:
    b, s, h = mbs, model.seq_length, model.hidden_size
    flops = 2.0 * b * s * h * model.padded_vocab(tp) / tp
    if model.architecture == "encoder":  # Megatron BERT: LM-head transform, pooler and binary head, not split
        flops += 2.0 * b * s * h * h + 2.0 * b * h * h + 2.0 * b * h * 2
    return flops


def unit_costs(model: Model, tp: int, mbs: int) -> dict[str, UnitCost]:
    """FLOPs, bytes and collective bytes of every profile kind of `model` at (tp, mbs)."""
    b, h, p = mbs, model.hidden_size, model.precision_bytes
    mask = DROPOUT_MASK_BYTES if model.dropout else 0
    costs: dict[str, UnitCost] = {}

    def embedding(kind: str, seq: int, weights: float) -> UnitCost:
        positions = p * seq * h if model.position_embedding == "learned" else 0
        forward = p * b * seq * h / tp + p * b * seq * h + positions + mask * seq * b * h / tp
        backward = forward + (p + MAIN_GRAD_BYTES_PER_WEIGHT) * weights
        return UnitCost(kind, 0.0, forward, backward, p * b * seq * h)

    costs["embedding"] = embedding("embedding", model.input_seq_length, model.embedding_params(tp))
    if model.is_encoder_decoder:
        costs["decoder_embedding"] = embedding("decoder_embedding", model.decoder_seq_length,
                                               model.decoder_embedding_params(tp))

    for kind in model.layer_kinds:
        weights = model.layer_params(kind) / tp
        cross = kind == "decoder" and model.is_encoder_decoder
        s = model.decoder_seq_length if cross else (model.encoder_seq_length if kind == "encoder" else model.seq_length)
        boundary = p * b * s * h / tp  # input or output, sequence-parallel shard
        forward = p * weights + boundary + layer_activation_bytes(model, kind, mbs, tp) + boundary
        collective = 4 * p * b * s * h
        if cross:
            s_enc = model.encoder_seq_length
            forward += p * b * s_enc * h / tp  # reads the encoder output
            # cross-attention: all-gathers of its query input and of the encoder output, one reduce-scatter
            collective += p * b * h * (2 * s + s_enc)
        backward = forward + MAIN_GRAD_BYTES_PER_WEIGHT * weights
        costs[kind] = UnitCost(kind, layer_forward_flops(model, kind, mbs, tp), forward, backward, collective)

    s = model.seq_length
    weights = model.head_params(tp, shares_stage_with_embedding=False)
    forward = p * weights + p * b * s * h / tp + head_activation_bytes(model, mbs, tp)
    backward = forward + MAIN_GRAD_BYTES_PER_WEIGHT * weights
    costs["head"] = UnitCost("head", head_forward_flops(model, mbs, tp), forward, backward, p * b * s * h)
    return {kind: costs[kind] for kind in required_kinds(model)}


# -- times ------------------------------------------------------------------------------------------------
class ProfileRow(NamedTuple):
    tp: int
    mbs: int
    kind: str
    forward_s: float
    backward_s: float


def unit_times(cost: UnitCost, tp: int, flops_per_s: float, memory_bytes_per_s: float,
               link_bytes_per_s: float) -> tuple[float, float]:
    """(forward_s, backward_s) of one unit; flops_per_s is the achievable rate (peak x efficiency)."""
    collective = (tp - 1) / tp * cost.collective_bytes / link_bytes_per_s
    forward = max(cost.forward_flops / flops_per_s, cost.forward_bytes / memory_bytes_per_s) + collective
    backward = max(cost.backward_flops / flops_per_s, cost.backward_bytes / memory_bytes_per_s) + collective
    return forward, backward


def check_degrees(model: Model, tps, mbss) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sorted, distinct tensor degrees and micro-batch sizes; degrees must split heads, groups and FFN."""
    tps, mbss = tuple(sorted(set(tps))), tuple(sorted(set(mbss)))
    if not tps or tps[0] < 1:
        raise InputError("--tp", f"expected tensor-parallel degrees >= 1, got {','.join(map(str, tps))}")
    if not mbss or mbss[0] < 1:
        raise InputError("--mbs", f"expected micro-batch sizes >= 1, got {','.join(map(str, mbss))}")
    for tp in tps:
        for what, value in (("num_attention_heads", model.num_attention_heads),
                            ("num_query_groups", model.num_query_groups),
                            ("ffn_hidden_size", model.ffn_hidden_size)):
            if value % tp:
                raise InputError(f"--tp {tp}", f"must divide the model's {what} ({value}), as Megatron-LM requires")
    return tps, mbss


def parse_sizes(option: str, text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); positive integers only."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InputError(option, f"expected comma-separated positive integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise InputError(option, f"expected comma-separated positive integers, got {text!r}")
    return values


def check_efficiency(efficiency: float | None, spec: GpuSpec) -> float:
    if efficiency is None:
        return spec.matmul_efficiency
    if not 0 < efficiency <= 1:
        raise InputError("--efficiency", f"expected a fraction of peak in (0, 1], got {efficiency}")
    return float(efficiency)


def link_bytes_per_s(spec: GpuSpec, link_bandwidth: str | None) -> float:
    if link_bandwidth is None:
        return spec.link_bytes_per_s
    return parse_bandwidth(link_bandwidth, "--link-bandwidth")


def synthesize(model: Model, gpu_spec: GpuSpec | str, tps=DEFAULT_DEGREES, mbss=DEFAULT_DEGREES,
               efficiency: float | None = None, link_bandwidth: str | None = None) -> list[ProfileRow]:
    """Profile rows (tp, mbs, kind, forward_s, backward_s) of `model` on `gpu_spec`, ordered by tp, mbs, kind.

    `efficiency` overrides the table's matmul_efficiency; `link_bandwidth` ("450 GB/s") its intra_node_link.
    """
    spec = load_gpu_spec(gpu_spec) if isinstance(gpu_spec, str) else gpu_spec
    tps, mbss = check_degrees(model, tps, mbss)
    flops_per_s = spec.peak_flops(model.precision, model.name) * check_efficiency(efficiency, spec)
    link = link_bytes_per_s(spec, link_bandwidth)
    rows = []
    for tp in tps:
        for mbs in mbss:
            for kind, cost in unit_costs(model, tp, mbs).items():
                forward, backward = unit_times(cost, tp, flops_per_s, spec.memory_bytes_per_s, link)
                rows.append(ProfileRow(tp, mbs, kind, forward, backward))
    return rows


# -- the profile file -------------------------------------------------------------------------------------
def _number(value: float) -> str:
    return f"{value:.12g}"


def header_lines(model: Model, spec: GpuSpec, tps, mbss, efficiency: float | None = None,
                 link_bandwidth: str | None = None, date: str | None = None) -> list[str]:
    """The comment lines of a synthetic profile: what it is, the GPU spec, efficiency, formula, how to redo it."""
    eff = check_efficiency(efficiency, spec)
    precision = model.precision
    tflops = spec.dense_bf16_tflops if precision == "bf16" else spec.dense_fp16_tflops
    link = f"{link_bandwidth} (--link-bandwidth)" if link_bandwidth is not None else spec.intra_node_link
    eff_note = ("the table's matmul_efficiency" if efficiency is None
                else f"--efficiency; the table's matmul_efficiency is {_number(spec.matmul_efficiency)}")
    command = f"fasop profile synth --model {model.file or model.name} --gpu {spec.name}"
    command += f" --tp {','.join(map(str, tps))} --mbs {','.join(map(str, mbss))}"
    if efficiency is not None:
        command += f" --efficiency {_number(eff)}"
    if link_bandwidth is not None:
        command += f' --link-bandwidth "{link_bandwidth}"'
    lines = [
        f"Synthetic profile of {model.name} on {spec.name}: estimated from FLOPs and bytes (fasop.profile.synth), "
        "not measured.",
        f"GPU spec: {spec.file}, gpu {spec.name}: dense {precision} {_number(tflops)} TFLOP/s, memory bandwidth "
        f"{_number(spec.memory_bandwidth_gb_per_s)} GB/s, intra-node link {link}.",
        f"GPU spec source: {spec.source}" + (f" (table date {spec.date})" if spec.date else "") + ".",
        f"Efficiency: {_number(eff)} of peak ({eff_note}).",
        f"Formula: {FORMULA}.",
        "A roofline lower bound: small layers run slower (launch overheads, element-wise kernels); lower "
        "--efficiency to match a measured GPU before mixing with measured profiles.",
        f"Regenerate: {command}",
    ]
    if date:
        lines.append(f"Written {date}.")
    return [*lines, identity_line(model.name, spec.name)]


def format_profile(rows, header_comment_lines) -> str:
    """The profile CSV text: '# ' comment lines, the column header, one row per line (%.12g)."""
    out = []
    for line in header_comment_lines:
        out.append(line if line.startswith("#") else f"# {line}")
    out.append(",".join(COLUMNS))
    for tp, mbs, kind, forward, backward in rows:
        out.append(f"{tp},{mbs},{kind},{_number(forward)},{_number(backward)}")
    return "\n".join(out) + "\n"


def write_profile(path, rows, header_comment_lines, force: bool = False) -> Path:
    """Write the profile CSV (whole or not at all); an existing file is kept unless `force`."""
    path = Path(path)
    if path.exists() and not force:
        raise InputError(str(path), "already exists (pass --force to overwrite it)")
    if path.exists() and path.is_dir():
        raise InputError(str(path), "is a directory; expected a .csv file name")
    write_atomically(path, format_profile(rows, header_comment_lines))
    return path
