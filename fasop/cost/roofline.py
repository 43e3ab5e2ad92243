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
  kernels (a preprocessing pass and the main one) moving twice the forward's bytes. Unfused (Megatron's
  legacy path): Q.K^T, a fused scale-mask-softmax, dropout on the scores and scores x V, each writing or reading
  the b x heads x s x s scores; the two batched matmuls take two kernels each backward.
- element-wise kernels (norms, rotary embedding, fused bias-dropout-add, bias-GeLU or SwiGLU, embedding
  gather, cross-entropy): no FLOPs counted, reads its inputs and writes its outputs, plus one byte per element
  of a dropout mask; backward reads the saved inputs and the output gradient and writes the input gradients.
  A norm's backward is two kernels (input gradient, weight-gradient reduction).
- FLOPs of the attention scores count the full s x s matrix (no causal saving); backward does twice the
  forward's FLOPs everywhere, also for flash attention (whose recomputation of the scores is left out).
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


@dataclass(frozen=True)
class Kernel:
    """One kernel (or a group launched together): its FLOPs, the bytes it moves, how many launches."""

    name: str
    flops: float
    bytes: float
    launches: int = 1
    output: tuple[float, float, float] | None = None  # a matmul's (batch, rows, columns) of output tiles to fill
    attention_core: bool = False  # what Megatron-LM's selective recomputation reruns
    fp8: bool = False  # a GEMM on the FP8 tensor cores (fasop.cost.fp8)


Work = tuple[Kernel, tuple[Kernel, ...]]  # a forward kernel and the backward kernels it causes


@dataclass(frozen=True)
class UnitWork:
    """The kernels of one unit's forward and backward pass, and the bytes it all-gathers or reduce-scatters
    over the tensor-parallel group per pass."""

    kind: str
    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    collectives: tuple[float, ...]  # payload bytes of each all-gather or reduce-scatter

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

    @classmethod
    def of(cls, spec: GpuSpec, model: Model, efficiency: float | None = None,
           link_bytes_per_s: float | None = None) -> Rates:
        """The rates of `spec` for `model`'s precision; `efficiency` and `link_bytes_per_s` override the table's
        (a link bandwidth given replaces the table's measured curve too; `efficiency` scales the FP8 one by the
        same factor)."""
        scale = 1.0 if efficiency is None else efficiency / spec.matmul_efficiency
        efficiency = spec.matmul_efficiency if efficiency is None else efficiency
        link, curve = (spec.link_bytes_per_s, spec.allreduce_busbw) if link_bytes_per_s is None else (link_bytes_per_s, ())
        fp8 = 0.0
        if model.fp8:
            error = recipe_error(spec, model.fp8_recipe)
            if error is not None:
                raise InputError(f"model {model.name}", f"trains in fp8: {error}")
            assert spec.fp8_matmul_efficiency is not None  # the table gives it with dense_fp8_tflops
            fp8 = spec.dense_fp8_tflops * 1e12 * min(1.0, spec.fp8_matmul_efficiency * scale)
        return cls(spec.peak_flops(model.precision, model.name) * efficiency, spec.memory_bytes_per_s, link,
                   spec.kernel_launch_s, spec.sm_count, curve, fp8)

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


# -- FLOP counts (closed forms; the kernels below add up to them) -----------------------------------------
def _attention_matmul_weights(model: Model) -> int:
    """Q, K, V and output projections (no biases)."""
    h, qa, kv = model.hidden_size, model.attention_width, model.kv_width
    return h * qa + 2 * h * kv + qa * h


def _mlp_matmul_weights(model: Model) -> int:
    h, f = model.hidden_size, model.ffn_hidden_size
    return (3 if model.ffn_activation == "swiglu" else 2) * h * f


def _seq_lengths(model: Model, kind: str) -> tuple[int, int]:
    """(tokens per sample of the layer, of the encoder output its cross-attention reads, or 0)."""
    if kind == "decoder" and model.is_encoder_decoder:
        return model.decoder_seq_length, model.encoder_seq_length
    return (model.encoder_seq_length if kind == "encoder" else model.seq_length), 0


def layer_forward_flops(model: Model, kind: str, mbs: int, tp: int = 1) -> float:
    """Matmul FLOPs of one transformer layer's forward pass for one micro-batch, per GPU of a tp group:
    2 x weights x tokens, plus 2 x 2 x b s^2 x heads x kv_channels for the scores and the context."""
    b, h, qa, kv = mbs, model.hidden_size, model.attention_width, model.kv_width
    s, s_enc = _seq_lengths(model, kind)
    flops = 2.0 * b * s * (_attention_matmul_weights(model) + _mlp_matmul_weights(model))
    if s_enc:  # cross-attention projections: Q and output over the decoder, K and V over the encoder
        flops += 2.0 * b * (s * (h * qa + qa * h) + s_enc * 2 * h * kv)
    return flops / tp + attention_core_forward_flops(model, kind, mbs, tp)


def attention_core_forward_flops(model: Model, kind: str, mbs: int, tp: int = 1) -> float:
    """Scores Q.K^T and context scores.V of one layer's forward (the full s x s matrix; cross-attention too),
    per GPU of a tp group: the attention core that Megatron-LM's selective recomputation reruns."""
    s, s_enc = _seq_lengths(model, kind)
    return 2 * 2 * mbs * s * (s + s_enc) * model.attention_width / tp


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


def _attention(model: Model, b: int, s_q: int, s_k: int, tp: int) -> list[Work]:
    """The attention core for s_q query and s_k key tokens per sample."""
    p, d = model.precision_bytes, model.kv_channels
    heads, groups = model.num_attention_heads / tp, model.num_query_groups / tp
    q, kv = b * s_q * heads * d, b * s_k * groups * d  # elements of Q (and of the output), of K (and of V)
    flops = 2.0 * b * s_q * s_k * heads * d  # each of Q.K^T and scores x V
    if model.flash_attention:
        forward = Kernel("flash attention", 2 * flops, p * (2 * q + 2 * kv), attention_core=True)
        return [(forward, (Kernel("flash attention grad", 4 * flops, 2 * forward.bytes, 2),))]
    scores = b * heads * s_q * s_k
    mask = DROPOUT_MASK_BYTES_PER_ELEMENT * scores if model.dropout else 0.0
    batch = b * heads
    # backward: Q.K^T gives the gradients of Q (s_q x d) and K (s_k x d), scores x V those of the scores
    # (s_q x s_k) and of V (s_k x d)
    qk = Kernel("scores Q.K^T", flops, p * (q + kv + scores), output=(batch, s_q, s_k), attention_core=True)
    qk_grads = (Kernel("scores grad Q", flops, qk.bytes, output=(batch, s_q, d)),
                Kernel("scores grad K", flops, qk.bytes, output=(batch, s_k, d)))
    context = Kernel("context scores.V", flops, p * (scores + kv + q), output=(batch, s_q, d), attention_core=True)
    context_grads = (Kernel("context grad scores", flops, context.bytes, output=(batch, s_q, s_k)),
                     Kernel("context grad V", flops, context.bytes, output=(batch, s_k, d)))
    work = [(qk, qk_grads), _core(_elementwise("scale-mask-softmax", scores, scores, p))]
    if model.dropout:
        work.append(_core(_elementwise("attention dropout", scores, scores, p, mask)))
    return [*work, (context, context_grads)]


def _core(work: Work) -> Work:
    forward, backward = work
    return replace(forward, attention_core=True), backward


def _layer(model: Model, kind: str, b: int, tp: int) -> tuple[list, tuple[float, ...]]:
    """(forward, backward) pairs of one transformer layer, and the payload bytes of its collectives per pass."""
    p, h = model.precision_bytes, model.hidden_size
    s, s_enc = _seq_lengths(model, kind)
    tokens, qa, kv = b * s, model.attention_width / tp, model.kv_width / tp
    shard = tokens * h / tp  # sequence-parallel shard of the hidden states
    mask = DROPOUT_MASK_BYTES_PER_ELEMENT * shard if model.dropout else 0.0
    norm = ("norm", shard, shard, p, 0.0, (1, 2))
    residual = ("bias-dropout-add", 2 * shard, shard, p, mask)  # fused in Megatron: one kernel each way
    work = [_elementwise(*norm), *_linear(model, "QKV", tokens, h, qa + 2 * kv, after_norm=True)]
    if model.position_embedding == "rope":  # applied to Q and to K
        work.append(_elementwise("rotary", tokens * (qa + kv), tokens * (qa + kv), p, launches=(2, 2)))
    work += [*_attention(model, b, s, s, tp), *_linear(model, "attention output", tokens, qa, h),
             _elementwise(*residual)]
    # 2 all-gathers (of the norms' outputs: FP8 for an fp8 model, Transformer Engine gathers the quantized
    # tensor) and 2 reduce-scatters of b s h (or 2 all-reduces)
    gathered = FP8_BYTES if model.fp8 else p
    collectives: list[float] = [float(gathered * tokens * h)] * 2 + [float(p * tokens * h)] * 2
    if s_enc:
        enc_tokens = b * s_enc
        work += [_elementwise(*norm), *_linear(model, "cross Q", tokens, h, qa, after_norm=True),
                 *_linear(model, "cross KV", enc_tokens, h, 2 * kv), *_attention(model, b, s, s_enc, tp),
                 *_linear(model, "cross output", tokens, qa, h), _elementwise(*residual)]
        # all-gathers of the query input and of the encoder output, one reduce-scatter
        collectives += [gathered * tokens * h, p * enc_tokens * h, p * tokens * h]
    ffn = model.ffn_hidden_size / tp
    ffn_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    work += [_elementwise(*norm), *_linear(model, "FFN in", tokens, h, ffn_in, after_norm=True),
             _elementwise(model.ffn_activation, tokens * ffn_in, tokens * ffn, p),
             *_linear(model, "FFN out", tokens, ffn, h), _elementwise(*residual)]
    return work, tuple(collectives)


def _embedding(model: Model, b: int, s: int, weights: float, tp: int) -> list[Work]:
    """Vocabulary-parallel gather (the rank's rows; a full b s h output before the reduce-scatter), learned
    positions added, dropout on the shard. Backward: the dense gradient of the rank's table (zeroed, then the
    rows added), 2 bytes written and the fp32 main gradient accumulated per weight."""
    p, h, tokens = model.precision_bytes, model.hidden_size, b * s
    gather = Kernel("embedding gather", 0.0, p * (tokens * h / tp + tokens * h))
    gather_grad = Kernel("embedding grad", 0.0, p * (tokens * h + tokens * h / tp)
                         + (p + MAIN_GRAD_BYTES_PER_WEIGHT) * weights, 2)
    work: list[Work] = [(gather, (gather_grad,))]
    if model.position_embedding == "learned":
        work.append(_elementwise("positions", tokens * h + s * h, tokens * h, p))
    if model.dropout:
        shard = tokens * h / tp
        work.append(_elementwise("embedding dropout", shard, shard, p, DROPOUT_MASK_BYTES_PER_ELEMENT * shard))
    return work


def _head(model: Model, b: int, tp: int) -> list:
    """Final norm, (BERT: LM-head transform, its GeLU and norm), logits, cross-entropy; BERT's pooler and
    binary head."""
    p, h, s = model.precision_bytes, model.hidden_size, model.seq_length
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


def _unit(kind: str, work: list, collectives: tuple[float, ...]) -> UnitWork:
    """The forward kernels in order, and the backward ones in the order autograd runs them: the last forward
    kernel's first."""
    return UnitWork(kind, tuple(f for f, _ in work), tuple(k for _, bwd in reversed(work) for k in bwd), collectives)


@lru_cache(maxsize=4096)
def unit_work(model: Model, tp: int, mbs: int) -> dict[str, UnitWork]:
    """The kernels of every profile kind of `model` at (tp, mbs), in pipeline order."""
    p, h, b = model.precision_bytes, model.hidden_size, mbs
    s = model.input_seq_length
    units = {"embedding": _unit("embedding", _embedding(model, b, s, model.embedding_params(tp), tp), (p * b * s * h,))}
    for kind in model.layer_kinds:
        if kind == "decoder" and model.is_encoder_decoder:
            s = model.decoder_seq_length
            units["decoder_embedding"] = _unit("decoder_embedding", _embedding(
                model, b, s, model.decoder_embedding_params(tp), tp), (p * b * s * h,))
        units[kind] = _unit(kind, *_layer(model, kind, b, tp))
    units["head"] = _unit("head", _head(model, b, tp), (p * b * model.seq_length * h,))
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
    rate = (rates.fp8_flops_per_s if kernel.fp8 else rates.flops_per_s) * wave_efficiency(kernel.output, rates.sm_count)
    return max(kernel.flops / rate, kernel.bytes / rates.memory_bytes_per_s)


def pass_queue(kernels: tuple[Kernel, ...], rates: Rates, collectives_s: tuple[float, ...] = ()) -> PassQueue:
    """The launch queue of `kernels`, then of the collectives (GPU seconds each), in stream order."""
    gpu = [kernel_gpu_s(k, rates) / k.launches for k in kernels for _ in range(k.launches)]
    gpu_s = np.array(gpu + list(collectives_s), dtype=float)
    return PassQueue(rates.kernel_launch_s * np.arange(1, len(gpu_s) + 1), np.cumsum(gpu_s[::-1])[::-1])


def pass_s(kernels: tuple[Kernel, ...], rates: Rates) -> float:
    """Seconds of the kernels of one pass: each at its roofline, in the launch queue."""
    return pass_queue(kernels, rates).seconds()


def attention_core_time_share(work: UnitWork, tp: int, rates: Rates) -> float:
    """The attention core's share of a layer's forward time (its matmuls, softmax and dropout on the scores, or
    the flash kernel): what selective recomputation adds to the backward, per second of forward. More than its
    share of the FLOPs (attention_core_share) wherever the s x s scores make the core memory-bound."""
    core = tuple(k for k in work.forward if k.attention_core)
    return pass_s(core, rates) / unit_times(work, tp, rates)[0] if core else 0.0


@lru_cache(maxsize=2**16)
def unit_seconds(model: Model, tp: int, mbs: int, kind: str, rates: Rates) -> tuple[float, float]:
    """unit_times of one unit of `model` (memoised: the micro-batch scaling of profiles asks again and again)."""
    forward, backward = unit_pass_queues(model, tp, mbs, kind, rates)
    return forward.seconds(), backward.seconds()


@lru_cache(maxsize=2**16)
def unit_attention_core_share(model: Model, tp: int, mbs: int, kind: str, rates: Rates) -> float:
    """attention_core_time_share of one unit of `model` (memoised)."""
    return attention_core_time_share(unit_work(model, tp, mbs)[kind], tp, rates)


def unit_queues(work: UnitWork, tp: int, rates: Rates) -> tuple[PassQueue, PassQueue]:
    """The forward and the backward launch queue of one unit, each pass's tensor-parallel collectives (ring:
    (tp - 1) / tp of each payload at the link's bus bandwidth for that payload, not overlapped) after its
    compute kernels."""
    collectives = tuple((tp - 1) / tp * payload / rates.collective_bytes_per_s(payload)
                        for payload in work.collectives) if tp > 1 else ()  # one GPU launches no collective
    return pass_queue(work.forward, rates, collectives), pass_queue(work.backward, rates, collectives)


@lru_cache(maxsize=2**16)
def unit_pass_queues(model: Model, tp: int, mbs: int, kind: str, rates: Rates) -> tuple[PassQueue, PassQueue]:
    """unit_queues of one unit of `model` (memoised: what measured profiles are fitted to and scaled by)."""
    return unit_queues(unit_work(model, tp, mbs)[kind], tp, rates)


def unit_times(work: UnitWork, tp: int, rates: Rates) -> tuple[float, float]:
    """(forward_s, backward_s) of one unit."""
    forward, backward = unit_queues(work, tp, rates)
    return forward.seconds(), backward.seconds()
