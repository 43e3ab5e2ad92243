"""Roofline estimate of one unit's forward and backward seconds (embedding, transformer layer, head) for one
micro-batch of b samples of s tokens on one GPU of a tp-way tensor-parallel group, kernel by kernel:

    g_k    = max(FLOPs / (peak x efficiency x waves), bytes / memory_bandwidth)      (kernel k on the GPU)
           or (tp - 1) / tp x C / busbw(C)                                      (a collective of C bytes)
    pass_s = max over k of (k x kernel_launch_s + g_k + g_k+1 + ... + g_n)       (the launch queue)

The last line is eager PyTorch's launch queue: the host spends kernel_launch_s issuing each kernel, and the GPU
runs kernel k once it is issued and kernel k - 1 has finished, so a pass of large kernels takes their GPU time
(plus one launch) and a pass of tiny ones the host's n launches, its floor (PassQueue).

`fasop profile synth` writes these times; the profile reader (fasop.inputs.profiles) uses their shape over
micro-batch sizes to scale measured times between and beyond the profiled sizes. The counting rules are in
docs/cost-model.md section 2.1; in short, per GPU (weights, heads and FFN split over tp; element-wise work on
the sequence-parallel shard of b s / tp tokens; matmul inputs gathered to all b s tokens):

- matmul of an m x k input by a k x n weight: 2 m k n FLOPs, reads input and weight, writes the output (one
  kernel). Backward: the input gradient (same FLOPs and bytes) and the weight gradient (same FLOPs; reads input
  and output gradient, adds into the fp32 main gradient: 8 bytes per weight), two kernels.
- attention core: flash attention is one kernel reading Q, K, V and writing the output; its backward, two
  kernels (a preprocessing pass and the main one) moving twice the forward's bytes and doing 2.5 times its
  FLOPs (it recomputes the scores: five matmuls to the forward's two), at the GPU table's measured fused
  attention speed for its head dim and key length where it has one (Rates.attention_flops_per_s). Unfused (Megatron's
  legacy path): Q.K^T, a fused scale-mask-softmax, dropout on the scores and scores x V, each writing or reading
  the b x heads x s x s scores; the two batched matmuls take two kernels each backward.
- element-wise kernels (norms, rotary embedding, fused bias-dropout-add, bias-GeLU or SwiGLU, embedding
  gather, cross-entropy): no FLOPs counted, reads its inputs and writes its outputs, plus one byte per element
  of a dropout mask; backward reads the saved inputs and the output gradient and writes the input gradients.
  A norm's backward is two kernels (input gradient, weight-gradient reduction).
- FLOPs of the attention scores count the full s x s matrix, but a causal flash kernel's half; backward does
  twice the forward's FLOPs, flash attention's 2.5 times.
- waves: tile and wave quantization of a matmul's output (wave_efficiency); flash attention is not tiled here.
- C: the payload of each tensor-parallel all-gather or reduce-scatter; busbw(C) the GPU table's measured
  all-reduce bus bandwidth at that payload (allreduce_busbw), or the nominal intra-node link without one. Each
  is one NCCL kernel in the pass's stream, after its compute kernels.
- a Kernel of several launches is that many kernels, its GPU time split evenly among them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import NamedTuple

import numpy as np

from fasop.cost.fp8 import FP8_BYTES, cast_bytes_per_element, recipe_error
from fasop.errors import InputError
from fasop.inputs.catalogue import GpuSpec
from fasop.inputs.model import Model

FP32_BYTES = 4
MAIN_GRAD_BYTES_PER_WEIGHT = 2 * FP32_BYTES  # the fp32 main gradient read and written once per micro-batch
DROPOUT_MASK_BYTES_PER_ELEMENT = 1
# Vocabulary-parallel cross-entropy over the rank's logits: cast to fp32 (reads p, writes 4 bytes), max (reads
# 4), subtract the max (reads 4, writes 4), exp (reads 4, writes 4), sum (reads 4); six kernels with the
# gather of the target logits. Backward: softmax minus one-hot (reads 4, writes p), two kernels.
CROSS_ENTROPY_FP32_BYTES = 4 + 4 + 8 + 8 + 4
CROSS_ENTROPY_KERNELS = (6, 2)
# The output tile one SM computes at a time: cuBLAS's largest tensor-core tile, the A100 example of NVIDIA's
# "Matrix Multiplication Background User's Guide" (tile and wave quantization; stas00/ml-engineering,
# training/performance/README.md, retells it). Either orientation, whichever wastes less.
MATMUL_TILE = (256, 128)
# An MoE router's kernels after its linear layer, forward and backward: the score function (softmax or sigmoid),
# top-k, the routing map's scatter, the probabilities' gather and the load-balancing loss's reductions
# (megatron/core/transformer/moe/router.py and moe_utils.py, counted from their torch calls; fused variants fewer).
ROUTING_KERNELS = (8, 6)
# A flash attention backward's FLOPs over its forward's: it recomputes Q.K^T, then the gradients of V, of the
# scores, of Q and of K, five matmuls to the forward's two (Dao 2023, "FlashAttention-2", Algorithm 2; the
# FLOPs its benchmarks/benchmark_flash_attention.py counts).
FLASH_BACKWARD_FLOPS = 2.5
# Megatron-LM's --recompute-modules that fasop prices (TransformerConfig.recompute_modules, with Transformer
# Engine's layer specs, megatron/core/models/gpt/gpt_layer_specs.py): the attention core; the norms that are
# modules of their own (an MoE layer's pre-FFN norm, multi-latent attention's input norm; the others are fused
# into the next linear layer and have none); an MoE layer's expert activation; multi-latent attention's
# up-projections, their norms and the rotary embedding; a dense layer's FFN with its fused norm; the shared
# experts. Not "moe", which reruns the expert all-to-alls too.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "shared_experts")


@dataclass(frozen=True)
class Kernel:
    """One kernel (or a group launched together): its FLOPs, the bytes it moves, how many launches."""

    name: str
    flops: float
    bytes: float
    launches: int = 1
    output: tuple[float, float, float] | None = None  # a matmul's (batch, rows, columns) of output tiles to fill
    module: str = ""  # the --recompute-modules entry (RECOMPUTE_MODULES) whose rerun repeats it, if any
    fp8: bool = False  # a GEMM on the FP8 tensor cores (fasop.cost.fp8)
    attention: AttentionShape | None = None  # a fused attention kernel's shape, for its measured speed


class AttentionShape(NamedTuple):
    """What a fused attention kernel's speed depends on: head dim, keys per query, causal mask, direction."""

    head_dim: float
    key_length: float
    causal: bool
    backward: bool


Work = tuple[Kernel, tuple[Kernel, ...]]  # a forward kernel and the backward kernels it causes


@dataclass(frozen=True)
class UnitWork:
    """The kernels of one unit's forward and backward pass, and the bytes it all-gathers or reduce-scatters
    over the tensor-parallel group per pass."""

    kind: str
    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    collectives: tuple[float, ...]  # payload bytes of each all-gather or reduce-scatter
    expert_collectives: tuple[float, ...] = ()  # those over the expert-tensor-parallel group (MoE layers)
    expert_tp: int = 1  # that group's ranks

    @property
    def forward_flops(self) -> float:
        return sum(k.flops for k in self.forward)

    @property
    def backward_flops(self) -> float:
        return sum(k.flops for k in self.backward)

    @property
    def forward_bytes(self) -> float:
        return sum(k.bytes for k in self.forward)

    @property
    def backward_bytes(self) -> float:
        return sum(k.bytes for k in self.backward)

    @property
    def forward_launches(self) -> int:
        return sum(k.launches for k in self.forward)

    @property
    def backward_launches(self) -> int:
        return sum(k.launches for k in self.backward)


@dataclass(frozen=True)
class Rates:
    """What one GPU achieves: matmul FLOP/s in full waves (peak x efficiency) and its SM count, memory bytes/s,
    the tensor-parallel link's bytes/s (nominal, or a measured all-reduce's bus bandwidth by payload), and the
    seconds each kernel launch adds."""

    flops_per_s: float
    memory_bytes_per_s: float
    link_bytes_per_s: float
    kernel_launch_s: float
    sm_count: int | None = None
    allreduce_busbw: tuple[tuple[float, float], ...] = ()  # (payload bytes, GB/s), payloads increasing
    fp8_flops_per_s: float = 0.0  # FP8 GEMMs in full waves (FP8 peak x its efficiency); 0 for other models
    attention_speeds: tuple[tuple[float, float, float, float, float], ...] = ()  # the table's, in FLOP/s

    @classmethod
    def of(cls, spec: GpuSpec, model: Model, efficiency: float | None = None,
           link_bytes_per_s: float | None = None) -> Rates:
        """The rates of `spec` for `model`'s precision in training: its matmuls at the efficiency a GEMM sustains at
        the GPU's power limit where the table gives one (the FP8 ones and the fused attention kernels slowed
        alike), else the benchmark's. `efficiency` and `link_bytes_per_s` override the table's (a link bandwidth
        given replaces the table's measured curve too; `efficiency` scales the FP8 and attention rates by the same
        factor)."""
        training = spec.training_matmul_efficiency
        scale = 1.0 if efficiency is None else efficiency / training
        efficiency = training if efficiency is None else efficiency
        link, curve = (spec.link_bytes_per_s, spec.allreduce_busbw) if link_bytes_per_s is None else (link_bytes_per_s, ())
        fp8 = 0.0
        if model.fp8:
            error = recipe_error(spec, model.fp8_recipe)
            if error is not None:
                raise InputError(f"model {model.name}", f"trains in fp8: {error}")
            fp8_efficiency = spec.training_fp8_matmul_efficiency
            assert fp8_efficiency is not None  # the table gives it with dense_fp8_tflops
            fp8 = spec.dense_fp8_tflops * 1e12 * min(1.0, fp8_efficiency * scale)
        per_s = 1e12 * scale * training / spec.matmul_efficiency  # the table's attention speeds are bursts too
        attention = tuple((d, n, per_s * causal, per_s * forward, per_s * backward)
                          for d, n, causal, forward, backward in spec.attention_tflops)
        return cls(spec.peak_flops(model.precision, model.name) * efficiency, spec.memory_bytes_per_s, link,
                   spec.kernel_launch_s, spec.sm_count, curve, fp8, attention)

    def attention_flops_per_s(self, shape: AttentionShape) -> float:
        """A fused attention kernel's FLOP/s: the measured speed at its key length (log-linear between the
        table's lengths) and head dim (linear between its head dims), held at the table's ends; a causal
        backward at the backward's speed times the forward's causal / non-causal ratio. Without a table, the
        matmuls' rate."""
        if not self.attention_speeds:
            return self.flops_per_s
        rows = np.array(self.attention_speeds)
        head_dims = np.unique(rows[:, 0])
        at_length = []
        for d in head_dims:
            own = rows[rows[:, 0] == d]
            causal_fwd, fwd, bwd = (np.interp(math.log(shape.key_length), np.log(own[:, 1]), own[:, column])
                                    for column in (2, 3, 4))
            if shape.backward:
                at_length.append(bwd * (causal_fwd / fwd if shape.causal else 1.0))
            else:
                at_length.append(causal_fwd if shape.causal else fwd)
        return float(np.interp(shape.head_dim, head_dims, at_length))

    def collective_bytes_per_s(self, payload_bytes: float) -> float:
        """Bus bandwidth of a ring all-gather or reduce-scatter of `payload_bytes`: the measured all-reduce's at
        the same payload, interpolated in log-log; below the smallest measured payload the time stays that
        payload's (latency-bound), above the largest the bandwidth stays its. Without a curve, the nominal link."""
        if not self.allreduce_busbw:
            return self.link_bytes_per_s
        payloads, busbw = np.log([p for p, _ in self.allreduce_busbw]), np.log([b for _, b in self.allreduce_busbw])
        smallest, first = self.allreduce_busbw[0]
        if payload_bytes < smallest:
            return first * 1e9 * payload_bytes / smallest
        return float(np.exp(np.interp(math.log(payload_bytes), payloads, busbw))) * 1e9


@dataclass(frozen=True)
class Layout:
    """How a plan splits a unit's work beyond tensor parallelism: over `cp` context-parallel ranks (each holds
    1/cp of every sequence) and, in MoE layers, over `ep` expert-parallel ranks (each holds num_experts / ep of
    the experts) of `etp`-way tensor-parallel experts (0: Megatron-LM's default, the attention's tp)."""

    cp: int = 1
    ep: int = 1
    etp: int = 0

    def expert_tp(self, tp: int) -> int:
        return self.etp or tp


DENSE = Layout()


def moe_kind(kind: str) -> str:
    """The profile kind of the MoE layers of segment `kind` ("layer", "encoder", "decoder")."""
    return f"moe_{kind}"


def causal(model: Model, kind: str) -> bool:
    """Whether a layer's self-attention is causal and its fused kernel skips the masked half of the scores: a
    decoder's, with flash attention (the unfused path computes every score, then masks)."""
    return model.flash_attention and kind in ("layer", "decoder") and model.architecture != "encoder"


# -- FLOP counts (closed forms; the kernels below add up to them) -----------------------------------------
def _attention_matmul_weights(model: Model) -> int:
    """Q, K, V and output projections (no biases; multi-latent attention's down- and up-projections)."""
    h, qa, kv = model.hidden_size, model.attention_width, model.kv_width
    if model.multi_latent_attention:
        heads, qk = model.num_attention_heads, model.qk_head_dim + model.qk_pos_emb_head_dim
        q = h * heads * qk if not model.q_lora_rank else model.q_lora_rank * (h + heads * qk)
        kv_r = model.kv_lora_rank
        return q + h * (kv_r + model.qk_pos_emb_head_dim) + kv_r * heads * (model.qk_head_dim + model.v_head_dim) \
            + heads * model.v_head_dim * h
    return h * qa + 2 * h * kv + qa * h


def _mlp_matmul_weights(model: Model, kind: str) -> float:
    """The FFN's matmul weights a token passes through: the dense FFN's, or in the mean layer of an MoE model's
    segment its share of MoE layers' top-k routed experts, shared experts and router."""
    glu = 3 if model.ffn_activation == "swiglu" else 2
    h, share = model.hidden_size, model.moe_share(kind)
    moe = h * (glu * (model.moe_router_topk * model.expert_ffn_hidden_size
                      + model.moe_shared_expert_intermediate_size) + model.num_experts)
    return (1 - share) * glu * h * model.ffn_hidden_size + share * moe


def _seq_lengths(model: Model, kind: str) -> tuple[int, int]:
    """(tokens per sample of the layer, of the encoder output its cross-attention reads, or 0)."""
    if kind == "decoder" and model.is_encoder_decoder:
        return model.decoder_seq_length, model.encoder_seq_length
    return model.layer_seq_length(kind), 0


def layer_forward_flops(model: Model, kind: str, mbs: int, tp: int = 1) -> float:
    """Matmul FLOPs of one transformer layer's forward pass for one micro-batch, per GPU of a tp group (the
    segment's mean layer in an MoE model): 2 x weights x tokens, plus the scores and the context
    (attention_core_forward_flops)."""
    b, h, qa, kv = mbs, model.hidden_size, model.attention_width, model.kv_width
    s, s_enc = _seq_lengths(model, kind)
    flops = 2.0 * b * s * (_attention_matmul_weights(model) + _mlp_matmul_weights(model, kind))
    if s_enc:  # cross-attention projections: Q and output over the decoder, K and V over the encoder
        flops += 2.0 * b * (s * (h * qa + qa * h) + s_enc * 2 * h * kv)
    return flops / tp + attention_core_forward_flops(model, kind, mbs, tp)


def attention_core_forward_flops(model: Model, kind: str, mbs: int, tp: int = 1) -> float:
    """Scores Q.K^T and context scores.V of one layer's forward (2 b s s_k heads (d_qk + d_v): the full s x s
    matrix, half of it for a causal fused kernel; cross-attention too), per GPU of a tp group: the attention core
    that Megatron-LM's selective recomputation reruns."""
    s, s_enc = _seq_lengths(model, kind)
    qk, v = _head_dims(model)
    self_attention = s * s / (2 if causal(model, kind) else 1)
    return 2 * mbs * (self_attention + s * s_enc) * model.num_attention_heads * (qk + v) / tp


def _head_dims(model: Model) -> tuple[int, int]:
    """(query-key, value) dimensions of one attention head."""
    if model.multi_latent_attention:
        return model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    return model.kv_channels, model.kv_channels


@cache
def attention_core_share(model: Model, kind: str) -> float:
    """The attention core's share of one layer's forward FLOPs (the same for every micro-batch size and tensor
    degree: both scale as b / tp)."""
    return attention_core_forward_flops(model, kind, 1) / layer_forward_flops(model, kind, 1)


def head_forward_flops(model: Model, mbs: int, tp: int = 1) -> float:
    b, s, h = mbs, model.seq_length, model.hidden_size
    flops = 2.0 * b * s * h * model.padded_vocab(tp) / tp
    if model.architecture == "encoder":  # Megatron BERT: LM-head transform, pooler and binary head, not split
        flops += 2.0 * b * s * h * h + 2.0 * b * h * h + 2.0 * b * h * 2
    return flops


# -- kernels ----------------------------------------------------------------------------------------------
def _matmul(name: str, m: float, k: float, n: float, p: int) -> tuple[Kernel, tuple[Kernel, ...]]:
    """(forward, backward kernels) of an m x k input times a k x n weight."""
    flops = 2.0 * m * k * n
    forward = Kernel(name, flops, p * (m * k + k * n + m * n), output=(1, m, n))
    return forward, (Kernel(f"{name} input grad", flops, forward.bytes, output=(1, m, k)),
                     Kernel(f"{name} weight grad", flops, p * (m * k + m * n) + MAIN_GRAD_BYTES_PER_WEIGHT * k * n,
                            output=(1, k, n)))


def _linear(model: Model, name: str, m: float, k: float, n: float, after_norm: bool = False) -> list[Work]:
    """A linear layer's GEMMs, m x k input by k x n weight: in bf16 (or fp16), or for an fp8 model on the FP8
    tensor cores, reading one-byte operands and writing bf16, with the cast of its input forward and of its
    output gradient backward (fasop.cost.fp8; weights are cast once a step, not per micro-batch). After a norm
    (`after_norm`: Megatron-LM's TELayerNormColumnParallelLinear) Transformer Engine's norm kernel writes the
    FP8 copies itself, unless tensorwise scaling needs the output's amax first."""
    p = model.precision_bytes
    if not model.fp8:
        return [_matmul(name, m, k, n, p)]
    flops, q = 2.0 * m * k * n, FP8_BYTES
    cast = cast_bytes_per_element(model)
    forward = Kernel(name, flops, q * (m * k + k * n) + p * m * n, output=(1, m, n), fp8=True)
    backward = (Kernel(f"{name} input grad", flops, q * (m * n + k * n) + p * m * k, output=(1, m, k), fp8=True),
                Kernel(f"{name} weight grad", flops, q * (m * k + m * n) + MAIN_GRAD_BYTES_PER_WEIGHT * k * n,
                       output=(1, k, n), fp8=True))
    gradient_cast = (Kernel(f"{name} output grad cast", 0.0, cast * m * n),)
    if after_norm and model.fp8_recipe != "tensorwise":
        return [(forward, gradient_cast + backward)]
    return [(Kernel(f"{name} input cast", 0.0, cast * m * k), gradient_cast), (forward, backward)]


def _elementwise(name: str, read: float, written: float, p: int, mask: float = 0.0,
                 launches: tuple[int, int] = (1, 1)) -> tuple[Kernel, tuple[Kernel, ...]]:
    """(forward, backward) of element-wise work reading `read` and writing `written` elements (`mask`: bytes
    of a dropout mask written forward and read backward)."""
    return (Kernel(name, 0.0, p * (read + written) + mask, launches[0]),
            (Kernel(f"{name} grad", 0.0, p * (2 * read + written) + mask, launches[1]),))


def _attention(model: Model, b: int, s_q: float, s_k: int, tp: int, masked: bool = False, steps: int = 1) -> list[Work]:
    """The attention core for s_q query and s_k key tokens per sample (`masked`: a causal fused kernel computes
    half the scores; `steps`: one kernel per step of context parallelism's ring, each on its share)."""
    p = model.precision_bytes
    qk, v = _head_dims(model)
    heads = model.num_attention_heads / tp
    kv_heads = heads if model.multi_latent_attention else model.num_query_groups / tp
    q, out = b * s_q * heads * qk, b * s_q * heads * v  # elements of Q and of the output
    k, kv = b * s_k * kv_heads * qk, b * s_k * kv_heads * v  # of K and of V
    scored = b * s_q * s_k * heads / (2 if masked else 1)  # query-key pairs computed
    if model.flash_attention:
        flops = 2.0 * scored * (qk + v)  # Q.K^T and scores x V
        shape = AttentionShape((qk + v) / 2, s_k / steps, masked, False)
        forward = Kernel("flash attention", flops, p * (q + k + kv + out), steps, module="core_attn",
                         attention=shape)
        return [(forward, (Kernel("flash attention grad", FLASH_BACKWARD_FLOPS * flops, 2 * forward.bytes,
                                  2 * steps, attention=shape._replace(backward=True)),))]
    flops = 2.0 * scored * qk
    kv = k  # the unfused path: keys and values are kv_channels wide alike
    scores = b * heads * s_q * s_k
    mask = DROPOUT_MASK_BYTES_PER_ELEMENT * scores if model.dropout else 0.0
    batch, d = b * heads, qk
    # backward: Q.K^T gives the gradients of Q (s_q x d) and K (s_k x d), scores x V those of the scores
    # (s_q x s_k) and of V (s_k x d)
    qk_kernel = Kernel("scores Q.K^T", flops, p * (q + kv + scores), output=(batch, s_q, s_k))
    qk_grads = (Kernel("scores grad Q", flops, qk_kernel.bytes, output=(batch, s_q, d)),
                Kernel("scores grad K", flops, qk_kernel.bytes, output=(batch, s_k, d)))
    context = Kernel("context scores.V", flops, p * (scores + kv + q), output=(batch, s_q, d))
    context_grads = (Kernel("context grad scores", flops, context.bytes, output=(batch, s_q, s_k)),
                     Kernel("context grad V", flops, context.bytes, output=(batch, s_k, d)))
    work = [(qk_kernel, qk_grads), _elementwise("scale-mask-softmax", scores, scores, p)]
    if model.dropout:
        work.append(_elementwise("attention dropout", scores, scores, p, mask))
    return _in_module("core_attn", [*work, (context, context_grads)])


def _in_module(module: str, work: list[Work]) -> list[Work]:
    """`work` with its forward kernels tagged as part of `module` (RECOMPUTE_MODULES)."""
    return [(replace(forward, module=module), backward) for forward, backward in work]


def _self_attention(model: Model, kind: str, b: int, s: int, tp: int, cp: int) -> list[Work]:
    """Norm, query-key-value projections (multi-latent attention's low-rank ones, their down-projections on
    every tensor-parallel rank), rotary embedding, the attention core of the rank's s / cp queries over all s
    keys, output projection and residual."""
    p, h = model.precision_bytes, model.hidden_size
    tokens = b * s / cp
    shard = tokens * h / tp  # sequence-parallel shard of the hidden states
    norm = [_elementwise("norm", shard, shard, p, 0.0, (1, 2))]
    qk, v = _head_dims(model)
    heads = model.num_attention_heads / tp
    if model.multi_latent_attention:  # its input norm is a module of its own
        rope, q_rank, kv_rank = model.qk_pos_emb_head_dim, model.q_lora_rank, model.kv_lora_rank
        work = _in_module("layernorm", norm)
        if q_rank:
            work += [*_linear(model, "Q down", tokens, h, q_rank, after_norm=True),
                     *_in_module("mla_up_proj", [_elementwise("Q norm", tokens * q_rank, tokens * q_rank, p, 0.0, (1, 2)),
                                                 *_linear(model, "Q up", tokens, q_rank, heads * qk)])]
        else:
            work += _in_module("mla_up_proj", _linear(model, "Q", tokens, h, heads * qk, after_norm=True))
        work += [*_linear(model, "KV down", tokens, h, kv_rank + rope),
                 *_in_module("mla_up_proj", [
                     _elementwise("KV norm", tokens * kv_rank, tokens * kv_rank, p, 0.0, (1, 2)),
                     *_linear(model, "KV up", tokens, kv_rank, heads * (model.qk_head_dim + v)),
                     _elementwise("rotary", tokens * (heads + 1) * rope, tokens * (heads + 1) * rope, p, launches=(2, 2))])]
        width = heads * v
    else:  # its norm fused into the QKV projection (TELayerNormColumnParallelLinear)
        qa, kv = model.attention_width / tp, model.kv_width / tp
        work = [*norm, *_linear(model, "QKV", tokens, h, qa + 2 * kv, after_norm=True)]
        if model.position_embedding == "rope":  # applied to Q and to K
            work.append(_elementwise("rotary", tokens * (qa + kv), tokens * (qa + kv), p, launches=(2, 2)))
        width = qa
    work += [*_attention(model, b, s / cp, s, tp, causal(model, kind), cp), *_linear(model, "attention output", tokens, width, h),
             _residual(model, shard)]
    return work


def _residual(model: Model, shard: float) -> Work:
    """The fused bias-dropout-add after attention and after the FFN: one kernel each way."""
    mask = DROPOUT_MASK_BYTES_PER_ELEMENT * shard if model.dropout else 0.0
    return _elementwise("bias-dropout-add", 2 * shard, shard, p=model.precision_bytes, mask=mask)


def _mlp(model: Model, name: str, tokens: float, ffn: float, tp: int) -> list[Work]:
    """An FFN of width `ffn` split over tp on `tokens` tokens: its input projection (2 ffn wide for SwiGLU), the
    activation and its output projection."""
    ffn_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    h, p = model.hidden_size, model.precision_bytes
    return [*_linear(model, f"{name} in", tokens, h, ffn_in / tp, after_norm=True),
            _elementwise(model.ffn_activation, tokens * ffn_in / tp, tokens * ffn / tp, p),
            *_linear(model, f"{name} out", tokens, ffn / tp, h)]


def _grouped(model: Model, name: str, experts: float, m: float, k: float, n: float) -> list[Work]:
    """A grouped GEMM (Transformer Engine's GroupedLinear): each of `experts` local experts multiplies its m x k
    tokens by its k x n weight, in one launch, in the model's precision as a linear layer's GEMMs (an fp8
    model's on the FP8 tensor cores, with their casts). Each expert's output is tiled on its own, so few tokens
    per expert leave tiles part-empty (wave_efficiency): how its efficiency falls with the tokens per expert."""
    def grouped(kernel: Kernel) -> Kernel:
        output = None if kernel.output is None else (experts, *kernel.output[1:])
        return replace(kernel, flops=experts * kernel.flops, bytes=experts * kernel.bytes, output=output)

    return [(grouped(forward), tuple(grouped(kernel) for kernel in backward))
            for forward, backward in _linear(model, name, m, k, n)]


def _moe(model: Model, b: int, s: int, tp: int, layout: Layout) -> tuple[list[Work], list[float], list[float]]:
    """An MoE layer's FFN on one rank, as Megatron-core's alltoall token dispatcher runs it: the router, the
    permutation of the rank's sequence-parallel tokens into expert order, the experts' grouped GEMMs on the
    tokens the dispatch brings (top-k of every token of the expert-parallel group, spread over the experts, the
    busiest rank's moe_load_imbalance times the mean), the unpermutation and weighted sum, and the shared experts on every token
    (split over tp like a dense FFN). The expert-parallel all-to-alls are the plan's (fasop.cost.communication);
    the kernels, and the payloads of the tensor-parallel collectives (the shared experts') and of the
    expert-tensor-parallel ones."""
    p, h, k = model.precision_bytes, model.hidden_size, model.moe_router_topk
    experts, etp = model.num_experts, layout.expert_tp(tp)
    tokens = b * s / layout.cp
    shard = tokens / tp  # the MoE layer's tokens: the sequence-parallel shard
    # the tokens the rank's experts process, each expert's tokens gathered over etp: the busiest rank's
    routed = shard * k * etp * model.moe_load_imbalance
    local = experts / layout.ep
    ffn = model.expert_ffn_hidden_size / etp
    ffn_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    work: list[Work] = [*_in_module("layernorm", [_elementwise("norm", shard * h, shard * h, p, 0.0, (1, 2))]),
                        _matmul("router", shard, h, experts, p),
                        _elementwise("routing", shard * experts, shard * experts, FP32_BYTES, launches=ROUTING_KERNELS),
                        _elementwise("permute", shard * h, shard * k * h, p),
                        *_grouped(model, "experts in", local, routed / local, h, ffn_in),
                        *_in_module("moe_act", [_elementwise(model.ffn_activation, routed * ffn_in, routed * ffn, p)]),
                        *_grouped(model, "experts out", local, routed / local, ffn, h),
                        _elementwise("unpermute", shard * k * h, shard * h, p)]
    collectives: list[float] = []
    if model.moe_shared_expert_intermediate_size:
        work += _in_module("shared_experts",
                           _mlp(model, "shared experts", tokens, model.moe_shared_expert_intermediate_size, tp))
        collectives = [float(p * tokens * h)] * 2  # their all-gather and reduce-scatter
    expert_collectives = [float(p * routed * h)] * 2 if etp > 1 else []
    return [*work, _residual(model, shard * h)], collectives, expert_collectives


def _layer(model: Model, kind: str, b: int, tp: int, layout: Layout = DENSE,
           moe: bool = False) -> tuple[list, tuple[float, ...], tuple[float, ...]]:
    """(forward, backward) pairs of one transformer layer (an MoE layer with `moe`) on one rank, and the payload
    bytes of its tensor-parallel and its expert-tensor-parallel collectives per pass."""
    p, h, cp = model.precision_bytes, model.hidden_size, layout.cp
    s, s_enc = _seq_lengths(model, kind)
    tokens = b * s / cp
    shard = tokens * h / tp
    work = _self_attention(model, kind, b, s, tp, cp)
    # 2 all-gathers (of the norms' outputs: FP8 for an fp8 model, Transformer Engine gathers the quantized
    # tensor) and 2 reduce-scatters of b s h (or 2 all-reduces); an MoE layer's FFN has its own
    gathered = FP8_BYTES if model.fp8 else p
    cross: list[float] = []
    if s_enc:
        enc_tokens = b * s_enc
        qa, kv = model.attention_width / tp, model.kv_width / tp
        work += [_elementwise("norm", shard, shard, p, 0.0, (1, 2)),
                 *_linear(model, "cross Q", tokens, h, qa, after_norm=True),
                 *_linear(model, "cross KV", enc_tokens, h, 2 * kv), *_attention(model, b, s, s_enc, tp),
                 *_linear(model, "cross output", tokens, qa, h), _residual(model, shard)]
        # all-gathers of the query input and of the encoder output, one reduce-scatter
        cross = [gathered * tokens * h, p * enc_tokens * h, p * tokens * h]
    if moe:
        ffn_work, ffn_collectives, expert_collectives = _moe(model, b, s, tp, layout)
        return (work + ffn_work, (gathered * tokens * h, p * tokens * h, *cross, *ffn_collectives),
                tuple(expert_collectives))
    # the FFN with its norm (fused into its first linear layer): the "mlp" module
    work += [*_in_module("mlp", [_elementwise("norm", shard, shard, p, 0.0, (1, 2)),
                                 *_mlp(model, "FFN", tokens, model.ffn_hidden_size, tp)]), _residual(model, shard)]
    return work, (*[float(gathered * tokens * h)] * 2, *[float(p * tokens * h)] * 2, *cross), ()


def _embedding(model: Model, b: int, s: int, weights: float, tp: int, cp: int = 1) -> list[Work]:
    """Vocabulary-parallel gather (the rank's rows; a full b s h output before the reduce-scatter), learned
    positions added, dropout on the shard. Backward: the dense gradient of the rank's table (zeroed, then the
    rows added), 2 bytes written and the fp32 main gradient accumulated per weight."""
    p, h, tokens = model.precision_bytes, model.hidden_size, b * s / cp
    gather = Kernel("embedding gather", 0.0, p * (tokens * h / tp + tokens * h))
    gather_grad = Kernel("embedding grad", 0.0, p * (tokens * h + tokens * h / tp)
                         + (p + MAIN_GRAD_BYTES_PER_WEIGHT) * weights, 2)
    work: list[Work] = [(gather, (gather_grad,))]
    if model.position_embedding == "learned":
        work.append(_elementwise("positions", tokens * h + s / cp * h, tokens * h, p))
    if model.dropout:
        shard = tokens * h / tp
        work.append(_elementwise("embedding dropout", shard, shard, p, DROPOUT_MASK_BYTES_PER_ELEMENT * shard))
    return work


def _head(model: Model, b: int, tp: int, cp: int = 1) -> list:
    """Final norm, (BERT: LM-head transform, its GeLU and norm), logits, cross-entropy; BERT's pooler and
    binary head."""
    p, h, s = model.precision_bytes, model.hidden_size, model.seq_length / cp
    tokens, shard, vocab = b * s, b * s * h / tp, model.padded_vocab(tp) / tp
    work = [_elementwise("final norm", shard, shard, p, 0.0, (1, 2))]
    if model.architecture == "encoder":  # not split over tp
        work += [_matmul("LM transform", tokens, h, h, p), _elementwise("gelu", tokens * h, tokens * h, p),
                 _elementwise("LM norm", tokens * h, tokens * h, p, 0.0, (1, 2))]
    work.append(_matmul("logits", tokens, h, vocab, p))
    logits = tokens * vocab
    work.append((Kernel("cross-entropy", 0.0, logits * (p + CROSS_ENTROPY_FP32_BYTES), CROSS_ENTROPY_KERNELS[0]),
                 (Kernel("cross-entropy grad", 0.0, logits * (FP32_BYTES + p), CROSS_ENTROPY_KERNELS[1]),)))
    if model.architecture == "encoder":
        work += [_matmul("pooler", b, h, h, p), _matmul("binary head", b, h, 2, p)]
    return work


def _unit(kind: str, work: list, collectives: tuple[float, ...], expert_collectives: tuple[float, ...] = (),
          expert_tp: int = 1) -> UnitWork:
    """The forward kernels in order, and the backward ones in the order autograd runs them: the last forward
    kernel's first."""
    return UnitWork(kind, tuple(f for f, _ in work), tuple(k for _, bwd in reversed(work) for k in bwd), collectives,
                    expert_collectives, expert_tp)


@lru_cache(maxsize=4096)
def unit_work(model: Model, tp: int, mbs: int, layout: Layout = DENSE) -> dict[str, UnitWork]:
    """The kernels of every profile kind of `model` at (tp, mbs) on one rank of `layout`, in pipeline order
    (fasop.inputs.profiles.required_kinds): an MoE model's segments have a kind for their MoE layers (moe_kind),
    beside the dense one where they have dense layers."""
    p, h, b = model.precision_bytes, model.hidden_size, mbs
    s = model.input_seq_length
    shard = b * s / layout.cp
    units = {"embedding": _unit("embedding", _embedding(model, b, s, model.embedding_params(tp), tp, layout.cp),
                                (p * shard * h,))}
    for kind in model.layer_kinds:
        if kind == "decoder" and model.is_encoder_decoder:
            s = model.decoder_seq_length
            units["decoder_embedding"] = _unit("decoder_embedding", _embedding(
                model, b, s, model.decoder_embedding_params(tp), tp, layout.cp), (p * b * s / layout.cp * h,))
        if model.moe_share(kind) < 1:  # the segment's dense layers
            units[kind] = _unit(kind, *_layer(model, kind, b, tp, layout))
        if model.moe_layers(kind):
            units[moe_kind(kind)] = _unit(moe_kind(kind), *_layer(model, kind, b, tp, layout, moe=True),
                                          layout.expert_tp(tp))
    units["head"] = _unit("head", _head(model, b, tp, layout.cp), (p * b * model.seq_length / layout.cp * h,))
    return units


# -- times ------------------------------------------------------------------------------------------------
def wave_efficiency(output: tuple[float, float, float] | None, sm_count: int | None) -> float:
    """The share of the GPU's tensor cores a matmul keeps busy when each SM computes one MATMUL_TILE of its
    output at a time: its tiles run in waves of sm_count, the last wave part-empty and edge tiles part-filled
    (tile and wave quantization). 1 without an SM count or for a kernel that is no tiled matmul."""
    if output is None or sm_count is None:
        return 1.0
    batch, rows, cols = output
    useful = batch * rows * cols / (MATMUL_TILE[0] * MATMUL_TILE[1])
    tiles = min(batch * math.ceil(rows / a) * math.ceil(cols / b) for a, b in (MATMUL_TILE, MATMUL_TILE[::-1]))
    return useful / (math.ceil(tiles / sm_count) * sm_count)


@dataclass(frozen=True)
class PassQueue:
    """One pass as eager PyTorch runs it: the host issues kernel k (k = 1..n) at k kernel_launch_s, and the GPU
    starts it once it is issued and kernel k - 1 has finished. The pass then ends at max over k of
    (k kernel_launch_s + the GPU seconds of kernels k..n): the last issue after which the GPU never waits again.
    `seconds(host, gpu)` runs the host's launches and every kernel's GPU time `host` and `gpu` times as long
    (what a measured profile says of its host and GPU: fasop.inputs.profiles)."""

    issue_s: np.ndarray  # when the host has issued kernel k
    suffix_gpu_s: np.ndarray  # GPU seconds of kernels k..n

    def seconds(self, host: float = 1.0, gpu: float = 1.0) -> float:
        if not len(self.issue_s):
            return 0.0
        return float(np.max(host * self.issue_s + gpu * self.suffix_gpu_s))


def kernel_gpu_s(kernel: Kernel, rates: Rates) -> float:
    """GPU seconds of one kernel (all its launches): its roofline."""
    if kernel.attention is not None:
        rate = rates.attention_flops_per_s(kernel.attention)
    else:
        rate = (rates.fp8_flops_per_s if kernel.fp8 else rates.flops_per_s) * wave_efficiency(kernel.output,
                                                                                            rates.sm_count)
    return max(kernel.flops / rate, kernel.bytes / rates.memory_bytes_per_s)


def pass_queue(kernels: tuple[Kernel, ...], rates: Rates, collectives_s: tuple[float, ...] = ()) -> PassQueue:
    """The launch queue of `kernels`, then of the collectives (GPU seconds each), in stream order."""
    gpu = [kernel_gpu_s(k, rates) / k.launches for k in kernels for _ in range(k.launches)]
    gpu_s = np.array(gpu + list(collectives_s), dtype=float)
    return PassQueue(rates.kernel_launch_s * np.arange(1, len(gpu_s) + 1), np.cumsum(gpu_s[::-1])[::-1])


def pass_s(kernels: tuple[Kernel, ...], rates: Rates) -> float:
    """Seconds of the kernels of one pass: each at its roofline, in the launch queue."""
    return pass_queue(kernels, rates).seconds()


def module_time_share(work: UnitWork, tp: int, rates: Rates, modules: tuple[str, ...] = ("core_attn",)) -> float:
    """The share of a layer's forward time taken by the kernels of `modules` (RECOMPUTE_MODULES; the attention
    core: its matmuls, softmax and dropout on the scores, or the flash kernel): what selective recomputation of
    them adds to the backward, per second of forward. The attention core's is more than its share of the FLOPs
    (attention_core_share) wherever the s x s scores make it memory-bound."""
    rerun = tuple(k for k in work.forward if k.module in modules)
    return pass_s(rerun, rates) / unit_times(work, tp, rates)[0] if rerun else 0.0


@lru_cache(maxsize=2**16)
def unit_seconds(model: Model, tp: int, mbs: int, kind: str, rates: Rates,
                 layout: Layout = DENSE) -> tuple[float, float]:
    """unit_times of one unit of `model` (memoised: the micro-batch scaling of profiles asks again and again)."""
    forward, backward = unit_pass_queues(model, tp, mbs, kind, rates, layout)
    return forward.seconds(), backward.seconds()


@lru_cache(maxsize=2**16)
def unit_module_share(model: Model, tp: int, mbs: int, kind: str, rates: Rates, layout: Layout = DENSE,
                      modules: tuple[str, ...] = ("core_attn",)) -> float:
    """module_time_share of one unit of `model` (memoised)."""
    return module_time_share(unit_work(model, tp, mbs, layout)[kind], tp, rates, modules)


def unit_queues(work: UnitWork, tp: int, rates: Rates) -> tuple[PassQueue, PassQueue]:
    """The forward and the backward launch queue of one unit, each pass's tensor-parallel collectives (ring:
    (tp - 1) / tp of each payload at the link's bus bandwidth for that payload, not overlapped) after its
    compute kernels."""
    collectives = tuple((group - 1) / group * payload / rates.collective_bytes_per_s(payload)
                        for payloads, group in ((work.collectives, tp), (work.expert_collectives, work.expert_tp))
                        if group > 1 for payload in payloads)  # one GPU launches no collective
    return pass_queue(work.forward, rates, collectives), pass_queue(work.backward, rates, collectives)


@lru_cache(maxsize=2**16)
def unit_pass_queues(model: Model, tp: int, mbs: int, kind: str, rates: Rates,
                     layout: Layout = DENSE) -> tuple[PassQueue, PassQueue]:
    """unit_queues of one unit of `model` (memoised: what measured profiles are fitted to and scaled by)."""
    return unit_queues(unit_work(model, tp, mbs, layout)[kind], tp, rates)


def unit_times(work: UnitWork, tp: int, rates: Rates) -> tuple[float, float]:
    """(forward_s, backward_s) of one unit."""
    forward, backward = unit_queues(work, tp, rates)
    return forward.seconds(), backward.seconds()
