"""Parameters and memory of each pipeline stage: model state per parameter, activation bytes of each unit, the
micro-batches in flight, and how many layers fit a stage's GPUs. The parameter counts of one Transformer are
the model's own (fasop.inputs.model).

Activation bytes generalise the per-layer formula of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2: 34*s*b*h + 5*a*s^2*b bytes) to other attention widths,
grouped-query attention, SwiGLU and squared ReLU, flash attention and models without dropout; docs/cost-model.md
derives every term, and what activation recomputation and sequence parallelism change (section 10). They are
bytes one GPU holds for one micro-batch. The model state is held as Megatron-LM allocates it (section 8): the
fp32 copy of a lower-precision gradient buffer only in the optimizer step, when no activation is held.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache
from typing import TypeVar

import numpy as np

from fasop.cost.config import RECOMPUTE_MODES, Config, per_stage, recomputed_layers
from fasop.cost.fp8 import gemm_input_bytes, weight_memory_bytes
from fasop.cost.pipeline import end_chunks_in_flight, in_flight
from fasop.cost.roofline import DENSE, Layout
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model

Capacity = TypeVar("Capacity", np.ndarray, float)
GIB = 2.0**30
FP32_BYTES = 4
DROPOUT_MASK_BYTES = 1


# Adam keeps two moments per parameter (momentum and variance) and, under mixed precision, fp32 master weights:
# K = 12 bytes (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
# section 3.1), 8 in fp32 training. Megatron-LM's precision-aware optimizer keeps them in the dtypes it is given.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
REMAINDER_BYTES = 2  # the low 16 bits of an fp32 master weight whose high 16 are its bf16 weight


def gradient_bytes(model: Model) -> int:
    """Bytes per gradient element in Megatron-LM's gradient buffer, the one the data-parallel group reduces
    (megatron/core/distributed/distributed_data_parallel.py: fp32 with grad_reduce_in_fp32, else the parameter's
    dtype): fp32 for bf16 training (Megatron-LM turns on --accumulate-allreduce-grads-in-fp32 for bf16 unless
    --grad-reduce-in-bf16), fp16 for fp16's."""
    if model.precision == "fp32" or (model.high_precision == "bf16" and not model.grad_reduce_in_bf16):
        return FP32_BYTES
    return model.precision_bytes


def _stores_remainders(model: Model) -> bool:
    """Whether fp32 master weights are kept as remainders of bf16 weights: Transformer Engine's FusedAdam under
    Megatron-LM's precision-aware optimizer (OptimizerConfig.store_param_remainders, on by default), for weights
    that are bf16 (not FP8-gathered ones)."""
    return (model.use_precision_aware_optimizer and model.main_params_dtype == "fp32"
            and model.high_precision == "bf16" and not model.fp8_param_gather)


def main_params_bytes(model: Model) -> int:
    """Bytes per parameter of the optimizer's master weights: none in fp32 training or without a master copy
    (the weights are what Adam updates), 2 as remainders, else their dtype's."""
    if model.precision == "fp32" or model.main_params_dtype == "none":
        return 0
    return REMAINDER_BYTES if _stores_remainders(model) else DTYPE_BYTES[model.main_params_dtype]


def optimizer_state_bytes(model: Model) -> int:
    """Adam's state per parameter: its two moments and the master weights (12 bytes in mixed precision, 8 in fp32;
    10 with remainders; 4 with bf16 moments and no master copy)."""
    return DTYPE_BYTES[model.exp_avg_dtype] + DTYPE_BYTES[model.exp_avg_sq_dtype] + main_params_bytes(model)


def bytes_per_param(model: Model, dp: int, distributed_optimizer: bool) -> float:
    """Megatron-LM's model state per parameter held through the forward and backward passes: every rank keeps
    the weights and the gradient buffer; Adam's state is the distributed optimizer's part, sharded over the d
    data-parallel ranks (else kept whole). 16, 18 and 16 bytes for fp16, bf16 and fp32, or 4 + 12/d, 6 + 12/d
    and 8 + 8/d; bf16 with --grad-reduce-in-bf16 as fp16. With main_gradient_bytes, Megatron-LM's
    distributed-optimizer table (docs/cost-model.md section 8)."""
    kept = model.precision_bytes + gradient_bytes(model)
    return kept + optimizer_state_bytes(model) / (dp if distributed_optimizer else 1)


def step_bytes_per_param(model: Model, dp: int, distributed_optimizer: bool) -> float:
    """Model state per parameter in the optimizer step: bytes_per_param and main_gradient_bytes."""
    return bytes_per_param(model, dp, distributed_optimizer) + main_gradient_bytes(model, dp, distributed_optimizer)


def main_gradient_bytes(model: Model, dp: int, distributed_optimizer: bool) -> float:
    """Bytes per parameter the optimizer step adds: the fp32 copy of a gradient buffer of lower precision (4, or
    4/d for the distributed optimizer's shard), 0 where the buffer is fp32 (the copy is the buffer itself).
    The step makes it (`_copy_model_grads_to_main_grads`: `.float()` of the buffer, in megatron/core/optimizer/
    optimizer.py and distrib_optimizer.py) after the last backward, and the next step's `zero_grad(set_to_none)`
    frees it before the first forward: it never coexists with activations."""
    if gradient_bytes(model) >= FP32_BYTES:
        return 0.0
    return FP32_BYTES / (dp if distributed_optimizer else 1)


def optimizer_traffic_bytes(model: Model) -> int:
    """Bytes each parameter of a rank's optimizer shard moves through GPU memory in one Adam step (Megatron-core's
    DistributedOptimizer / Float16OptimizerWithFloat16Params, then a fused Adam): the gradient-norm pass and
    Adam each read the fp32 main gradient; Adam reads and writes the moments and the master weight, and writes
    the updated weight into the model's copy: 34 bytes in mixed precision, 32 in fp32. Without a master copy
    Adam reads and writes the weight itself; from a remainder it reads the weight too, to rebuild the fp32 value."""
    moments = DTYPE_BYTES[model.exp_avg_dtype] + DTYPE_BYTES[model.exp_avg_sq_dtype]
    weight = model.precision_bytes
    if model.precision == "fp32" or model.main_params_dtype == "none":
        return 2 * FP32_BYTES + 2 * (moments + weight)
    read_weight = weight if _stores_remainders(model) else 0
    return 2 * FP32_BYTES + 2 * (moments + main_params_bytes(model)) + read_weight + weight


def usable_gib(cluster: Cluster, capacity_gib: Capacity) -> Capacity:
    """GiB of a GPU the model state and activations may take: the fixed overhead (CUDA context, NCCL and
    allocator buffers) comes off the GPU's memory, and the margin covers what the allocator wastes."""
    return (capacity_gib - cluster.gpu_memory_overhead_gib) / cluster.memory_margin


def growth_to_fit(cluster: Cluster, capacity_gib: np.ndarray, fixed_gib: np.ndarray,
                  layer_gib: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per layer): a stage holding fixed_gib + layer_gib n GiB on GPUs of capacity_gib fits once their memory
    grows by the factor fixed + per_layer n, where usable_gib reaches what it holds."""
    return ((cluster.memory_margin * fixed_gib + cluster.gpu_memory_overhead_gib) / capacity_gib,
            cluster.memory_margin * layer_gib / capacity_gib)


def _attention_activation_bytes(model: Model, q_seq: int, kv_seq: int, mbs: int, cross: bool,
                                dropped: tuple[str, ...] = ()) -> np.ndarray:
    """(replicated, split, scores) bytes: what stays whole on every rank of a tensor-parallel group without
    sequence parallelism (norm and projection inputs, dropout mask), what tensor parallelism splits, and the
    attention-score terms (a s^2 b); without what selective recomputation of the `dropped` modules
    (RECOMPUTE_MODULES) frees: the attention core's scores; multi-latent attention's input-norm output (the
    down-projections' input) and its up-projected Q, K and V (Megatron-core's CheckpointWithoutOutput frees
    them and rebuilds them for the backward)."""
    h, qa, kv, a = model.hidden_size, model.attention_width, model.kv_width, model.num_attention_heads
    p, mask, g = model.precision_bytes, DROPOUT_MASK_BYTES if model.dropout else 0, gemm_input_bytes(model)
    b = mbs
    # input of the norm and of the Q(KV) projection (FP8 in an fp8 model: fasop.cost.fp8), dropout mask; Q, K, V
    # and input of the output projection: flash attention keeps its output for its backward in bf16, and an fp8
    # model's projection its own FP8 copy of it beside
    mla = model.multi_latent_attention
    kv_input = 0 if cross or (mla and "layernorm" in dropped) else g * q_seq * b * h  # cross-attention K/V read
    replicated = p * q_seq * b * h + kv_input + mask * q_seq * b * h  # the shared encoder output
    projection_input = (p if model.flash_attention else 0) + g if model.fp8 else p
    qkv = 0 if mla and "mla_up_proj" in dropped else p * q_seq * b * qa + 2 * p * kv_seq * b * kv
    split = qkv + projection_input * q_seq * b * qa
    if model.flash_attention or "core_attn" in dropped:
        scores = 0.0
    else:  # softmax output, and with dropout its mask and output
        scores = a * q_seq * kv_seq * b * (p + (mask + p if model.dropout else 0))
    return np.array([replicated, split, scores], dtype=float)


def _mlp_activation_bytes(model: Model, seq: int, mbs: int, dropped: tuple[str, ...] = ()) -> np.ndarray:
    """(replicated, split, 0) bytes of a dense FFN: its norm's input, fc1's input (the norm's output), the
    residual's dropout mask, fc1's output and fc2's input; recomputing the "mlp" module (`dropped`) keeps its
    input (the norm's) alone."""
    h, f, p, g = model.hidden_size, model.ffn_hidden_size, model.precision_bytes, gemm_input_bytes(model)
    mask = DROPOUT_MASK_BYTES if model.dropout else 0
    if "mlp" in dropped:
        return np.array([(mask + p) * seq * mbs * h, 0.0, 0.0])
    # fc1's output and fc2's input (FP8 in an fp8 model): SwiGLU's fc1 output is 2f wide; squared ReLU keeps
    # relu's output (pow saves it too) and its square, as GeLU its input and output
    hidden = ((2 if model.ffn_activation == "swiglu" else 1) * p + g) * seq * mbs * f
    return np.array([g * seq * mbs * h + mask * seq * mbs * h + p * seq * mbs * h, hidden, 0.0])  # + norm input


@cache
def _layer_parts(model: Model, kind: str, moe: bool = False, dropped: tuple[str, ...] = ()) -> tuple[np.ndarray, float]:
    """(replicated, split, scores) bytes of one layer for one sample at tp = 1 without what recomputing the
    `dropped` modules frees, and the bytes of its input; an MoE layer's without its FFN (moe_ffn_bytes)."""
    p, h = model.precision_bytes, model.hidden_size
    if kind == "decoder" and model.is_encoder_decoder:
        s, s_enc = model.decoder_seq_length, model.encoder_seq_length
        parts = _attention_activation_bytes(model, s, s, 1, cross=False, dropped=dropped)
        parts = parts + _attention_activation_bytes(model, s, s_enc, 1, cross=True, dropped=dropped)
        parts[0] += p * s * h  # the cross-attention norm's input
    else:
        s = model.layer_seq_length(kind)
        parts = _attention_activation_bytes(model, s, s, 1, cross=False, dropped=dropped)
    if moe:
        parts = parts + np.array([p * s * h, 0.0, 0.0])  # the FFN norm's input
    else:
        parts = parts + _mlp_activation_bytes(model, s, 1, dropped)
    return parts, float(p * s * h)


def moe_ffn_bytes(model: Model, kind: str, tp: int, etp: int, dropped: tuple[str, ...] = ()) -> float:
    """Activation bytes an MoE layer's FFN keeps for one sample on one rank without context parallelism (which
    divides them, as every activation, by cp), as Megatron-core's alltoall dispatcher keeps them (read from its
    code: no published formula; the busiest rank's, moe_load_imbalance times the mean routed tokens): on its
    T = s / tp sequence-parallel tokens, the router's input and fp32 scores (T E), the permuted tokens the experts
    take (T k etp, each expert's gathered over etp), their fc1 output (2 F_e / etp wide for SwiGLU) and fc2 input
    (F_e / etp), the experts' outputs the weighted sum reads (T k), and the shared experts' FFN as a dense one's,
    split over tp. Recomputing a module (`dropped`) frees its output: "layernorm" the router's input (the
    pre-FFN norm's output), "moe_act" the experts' fc2 input, "shared_experts" the shared experts' activations."""
    p, h, k = model.precision_bytes, model.hidden_size, model.moe_router_topk
    s = model.layer_seq_length(kind)
    shard = s / tp
    routed, ffn = shard * k * etp * model.moe_load_imbalance, model.expert_ffn_hidden_size / etp
    ffn_in = 2 * ffn if model.ffn_activation == "swiglu" else ffn
    norm_out = 0 if "layernorm" in dropped else p * shard * h
    fc2_in = 0 if "moe_act" in dropped else ffn
    kept = norm_out + FP32_BYTES * shard * model.num_experts + p * routed * (h + ffn_in + fc2_in) + p * shard * k * h
    shared = model.moe_shared_expert_intermediate_size
    if shared and "shared_experts" not in dropped:
        glu = 2 if model.ffn_activation == "swiglu" else 1
        kept += p * s * h + (glu + 1) * p * s * shared / tp  # its gathered input, fc1 out, fc2 in
    return kept


def layer_activation_bytes(model: Model, kind: str, mbs: int, tp: int, sequence_parallel: bool = True,
                           recompute: str = "none", layout: Layout = DENSE,
                           modules: tuple[str, ...] = ("core_attn",)) -> float:
    """Activation bytes one layer keeps for one micro-batch until its backward pass, per GPU (Korthikanti et
    al. 2022, Table 2, generalised): everything / t with sequence parallelism, else the replicated part whole;
    selective recomputation frees what its `modules` keep (the attention scores by default); a fully recomputed
    layer keeps only its input. The mean layer of an MoE model's segment, and on a rank of `layout`: everything
    / cp (context parallelism splits every sequence)."""
    whole = 1 if sequence_parallel else tp  # the replicated part is divided by tp only with sequence parallelism
    share = model.moe_share(kind)
    dropped = modules if recompute == "selective" else ()

    def kept(moe: bool) -> float:
        (replicated, split, scores), layer_input = _layer_parts(model, kind, moe, dropped)
        if recompute == "full":
            return layer_input * whole / tp
        return replicated * whole / tp + split / tp + scores / tp

    per_sample = kept(False) if share < 1 else 0.0
    if share:
        moe = kept(True) + (0.0 if recompute == "full" else moe_ffn_bytes(model, kind, tp, layout.expert_tp(tp),
                                                                          dropped))
        per_sample = (1 - share) * per_sample + share * moe
    return mbs * per_sample / layout.cp


@cache
def _kind_activation_bytes(model: Model, tp: int, sequence_parallel: bool, recompute: str,
                           layout: Layout = DENSE, modules: tuple[str, ...] = ("core_attn",)) -> np.ndarray:
    """layer_activation_bytes of one sample for each layer kind (memoised: searches ask often)."""
    return np.array([layer_activation_bytes(model, kind, 1, tp, sequence_parallel, recompute, layout, modules)
                     for kind in model.layer_kinds])


def embedding_activation_bytes(model: Model, mbs: int, tp: int, sequence_parallel: bool = True, cp: int = 1) -> float:
    """The embedding's dropout mask (after the scatter to the sequence-parallel region when that is on)."""
    mask = DROPOUT_MASK_BYTES if model.dropout else 0
    return mask * model.input_seq_length * mbs * model.hidden_size / (tp if sequence_parallel else 1) / cp


def head_activation_bytes(model: Model, mbs: int, tp: int, sequence_parallel: bool = True, cp: int = 1) -> float:
    """Final norm and output-layer inputs (split only with sequence parallelism), and the fp32 logits that the
    vocabulary-parallel cross-entropy keeps; of the rank's 1/cp of the sequence."""
    s, h = model.seq_length, model.hidden_size
    inputs = 2 * model.precision_bytes * s * mbs * h / (tp if sequence_parallel else 1)
    return (inputs + 4 * s * mbs * model.padded_vocab(tp) / tp) / cp


def stage_params(model: Model, config: Config, segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per layer): (pp,) parameters per rank on each stage beyond its partitioned layers, and those of
    one of its layers (an MoE layer's routed experts split over etp x ep, the rest over tp)."""
    tp, pp, whole = config.tp, config.pp, config.pp == 1
    kind_params = np.array([_rank_layer_params(model, kind, tp, config.expert_split) for kind in model.layer_kinds])
    fixed_params = np.zeros(pp)
    fixed_params[0] += model.embedding_params(tp)
    fixed_params[-1] += model.head_params(tp, shares_stage_with_embedding=whole)
    if model.is_encoder_decoder and not whole:
        fixed_params[min(config.encoder_stages, pp - 1)] += model.decoder_embedding_params(tp)
    if whole:
        fixed_params[0] += all_layer_params(model, tp, config.expert_split)
    return fixed_params, kind_params[segment]


def stage_expert_params(model: Model, config: Config, segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per layer): of stage_params, the routed experts' (their gradients are reduced and their optimizer
    state sharded over the expert-data-parallel group, not the data-parallel one)."""
    split = config.expert_split
    per_layer = np.array([model.layer_expert_params(kind) / split for kind in model.layer_kinds])
    fixed = np.zeros(config.pp)
    if config.pp == 1:
        fixed[0] = sum(n * model.layer_expert_params(kind) / split
                       for n, kind in zip(model.segment_layers, model.layer_kinds))
    return fixed, per_layer[segment]


def _rank_layer_params(model: Model, kind: str, tp: int, expert_split: int) -> float:
    """Parameters one rank holds of the mean layer of segment `kind`."""
    experts = model.layer_expert_params(kind)
    return (model.layer_params(kind) - experts) / tp + experts / expert_split if experts else model.layer_params(kind) / tp


def all_layer_params(model: Model, tp: int, expert_split: int | None = None) -> float:
    """Parameters per rank of every transformer layer: what one stage holding the whole model counts as fixed
    (routed experts split over `expert_split` = etp x ep ranks, default tp)."""
    split = tp if expert_split is None else expert_split
    return float(sum(n * _rank_layer_params(model, kind, tp, split)
                     for n, kind in zip(model.segment_layers, model.layer_kinds)))


def stage_capacity_gib(cluster: Cluster, placements: list[tuple[tuple[str, ...], ...]]) -> np.ndarray:
    """(G, pp) memory of the smallest GPU on each stage of G placements (the node types hosting each stage)."""
    return np.array(per_stage(placements, lambda names: min(cluster.node_types[n].gpu_memory_gib for n in names)))


@dataclass(frozen=True)
class StageMemory:
    """(rows, pp) GiB on each stage: a stage of n layers that recomputes r of them (fasop.cost.config.
    recomputed_layers) holds fixed + layer n + recomputed r, and the layer being rebuilt once r > 0, through the
    forward and backward passes; step_fixed + step_layer n in the optimizer step, after every activation is
    freed. Its peak is the larger of the two."""

    fixed_gib: np.ndarray  # model state and activations beyond the stage's layers (one stage holding the model: all)
    layer_gib: np.ndarray  # what a layer adds: its state, and its activations for the micro-batches in flight
    recomputed_gib: np.ndarray  # what full recomputation of a layer takes off that (<= 0): it keeps only its input
    working_gib: np.ndarray  # the layer being rebuilt, one micro-batch, beyond what it keeps
    step_fixed_gib: np.ndarray  # the optimizer step: model state with the fp32 copies of the gradients
    step_layer_gib: np.ndarray

    def at(self, layers: np.ndarray, recomputed: np.ndarray) -> np.ndarray:
        """GiB on stages of `layers` layers that recompute `recomputed` of them."""
        passes = (self.fixed_gib + self.layer_gib * layers + self.recomputed_gib * recomputed
                  + np.where(recomputed > 0, self.working_gib, 0.0))
        return np.maximum(passes, self.step_fixed_gib + self.step_layer_gib * layers)

    def passes_affine(self, per_layer: float, fixed: float) -> tuple[np.ndarray, np.ndarray]:
        """(fixed, per layer) GiB through the passes of a stage of n >= 1 layers that recomputes per_layer n +
        fixed of them (fasop.cost.config.recomputed_affine)."""
        return (self.fixed_gib + self.recomputed_gib * fixed + self.working_gib,
                self.layer_gib + self.recomputed_gib * per_layer)

    def affine(self, per_layer: float, fixed: float) -> tuple[np.ndarray, np.ndarray]:
        """(fixed, per layer): the affine form the partition takes, the larger coefficients of the passes and the
        step (exact where one of them is the larger at every layer count, else above the peak)."""
        fixed_gib, layer_gib = self.passes_affine(per_layer, fixed)
        return np.maximum(fixed_gib, self.step_fixed_gib), np.maximum(layer_gib, self.step_layer_gib)

    def take(self, rows: np.ndarray) -> StageMemory:
        return StageMemory(*(getattr(self, f.name)[rows] for f in fields(StageMemory)))

    @staticmethod
    def stack(parts: list[StageMemory]) -> StageMemory:
        return StageMemory(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(StageMemory)))


def stage_memory_gib(model: Model, config: Config, segment: np.ndarray, params: tuple[np.ndarray, np.ndarray],
                     mbs: np.ndarray, num_microbatches: np.ndarray) -> StageMemory:
    """(K, pp) memory of model state and activations on each stage, for K micro-batch sizes; activations are
    held for the micro-batches in flight under 1F1B.

    Full recomputation keeps a recomputed layer's input alone for each micro-batch in flight, selective
    recomputation all but what its modules free (the attention scores by default); in the backward one
    recomputed layer at a time is rebuilt whole, for one micro-batch."""
    fixed_params, layer_params = params
    tp, pp, sp, cp = config.tp, config.pp, config.sequence_parallel, config.cp
    fixed_experts, layer_experts = stage_expert_params(model, config, segment)
    per_param, step_per_param = (np.array([state(model, dp, config.distributed_optimizer)
                                           for dp in (config.dense_dp, config.expert_dp)]) for state in
                                 (bytes_per_param, step_bytes_per_param))

    def state_bytes(params: np.ndarray, experts: np.ndarray, per: np.ndarray) -> np.ndarray:
        """Bytes of the model state of `params` parameters per rank, `experts` of them routed experts'."""
        return (params - experts) * per[0] + experts * per[1] if model.is_moe else params * per[0]

    # an fp8 model's cached FP8 weights: its layers' (the embedding and the output layer stay bf16)
    fp8_weights = weight_memory_bytes(model)
    fixed_fp8 = np.zeros(pp)
    if pp == 1:
        fixed_fp8[0] = fp8_weights * all_layer_params(model, tp, config.expert_split)
    whole_act, selective_act, input_act = (_kind_activation_bytes(model, tp, sp, mode, config.layout,
                                                                  config.recompute_modules)
                                           for mode in RECOMPUTE_MODES)
    full = config.recompute == "full"
    kept_act = selective_act if config.recompute == "selective" else whole_act
    recomputed_act = input_act - whole_act if full else np.zeros_like(whole_act)
    working_act = whole_act - (input_act if full else kept_act)
    # the embedding's and the head's activations are held for the micro-batches in flight of their own model
    # chunks (the first stage's first, the last stage's last), the layers' for their stage's
    ends = end_chunks_in_flight(pp, num_microbatches, config.virtual_stages) * mbs[:, None]
    end_act = np.zeros((len(mbs), pp))
    end_act[:, 0] += embedding_activation_bytes(model, 1, tp, sp, cp) * ends[:, 0]
    end_act[:, -1] += head_activation_bytes(model, 1, tp, sp, cp) * ends[:, 1]
    fixed_act = np.zeros(pp)
    fixed_working = 0.0
    if pp == 1:  # one stage: its layers are not partitioned, all fixed; each segment is a block of its own
        recomputed = recomputed_layers(np.array(model.segment_layers), 1, config.recomputed_per_chunk)[:, 0]
        fixed_act[0] += float(np.dot(model.segment_layers, kept_act) + np.dot(recomputed, recomputed_act))
        fixed_working = float(working_act[recomputed > 0].max(initial=0.0))
        recomputed_act, working_act = np.zeros_like(whole_act), np.zeros_like(whole_act)
    held = in_flight(pp, num_microbatches, config.virtual_stages) * mbs[:, None]  # samples whose activations a stage holds
    one = mbs[:, None] / GIB  # the working layer's micro-batch
    return StageMemory(
        fixed_gib=(state_bytes(fixed_params, fixed_experts, per_param) + fixed_fp8 + fixed_act * held + end_act) / GIB
        + fixed_working * one,
        layer_gib=(state_bytes(layer_params, layer_experts, per_param + fp8_weights) + kept_act[segment] * held) / GIB,
        recomputed_gib=recomputed_act[segment] * held / GIB,
        working_gib=working_act[segment] * one,
        step_fixed_gib=np.broadcast_to((state_bytes(fixed_params, fixed_experts, step_per_param) + fixed_fp8) / GIB,
                                       held.shape).copy(),
        step_layer_gib=np.broadcast_to(state_bytes(layer_params, layer_experts, step_per_param + fp8_weights) / GIB,
                                       held.shape).copy())


def head_fits(model: Model, cluster: Cluster, tp: int, mbs: int, sequence_parallel: bool = True, cp: int = 1) -> bool:
    """Whether the output layer's activations of one micro-batch fit the largest GPU's usable memory (the last
    stage holds them; a size that fails fits no stage)."""
    usable = usable_gib(cluster, max(t.gpu_memory_gib for t in cluster.node_types.values()))
    return bool(mbs * (head_activation_bytes(model, 1, tp, sequence_parallel, cp) / GIB) <= usable * (1 + 1e-9))


def layers_that_fit(memory: StageMemory, recomputed: tuple[float, float], usable: np.ndarray,
                    whole: bool) -> np.ndarray:
    """(K, pp) most layers each stage's memory holds, `usable` GiB per stage (fasop.cost.memory.usable_gib), the
    stage recomputing per_layer n + fixed of them (`recomputed`, fasop.cost.config.recomputed_affine); -1 where
    not even the stage without layers fits; 0 where it fits and one stage holds the whole model (its layers are
    fixed). Exact wherever the passes' affine form is, and at no layers (a stage without layers rebuilds none);
    the passes and the optimizer step each bound the layers."""
    with np.errstate(divide="ignore", invalid="ignore"):
        hi = np.minimum(*(np.maximum(np.floor((usable - fixed) / per_layer + 1e-12), 0) for fixed, per_layer in
                          (memory.passes_affine(*recomputed), (memory.step_fixed_gib, memory.step_layer_gib))))
    fits = (memory.fixed_gib <= usable) & (memory.step_fixed_gib <= usable)
    return np.where(fits, 0 if whole else hi, -1).astype(int)
