"""Parameters and memory of each pipeline stage: model state per parameter, activation bytes of each unit, the
micro-batches in flight, and how many layers fit a stage's GPUs. The parameter counts of one Transformer are
the model's own (fasop.inputs.model).

Activation bytes generalise the per-layer formula of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2: 34*s*b*h + 5*a*s^2*b bytes) to other attention widths,
grouped-query attention, SwiGLU, flash attention and models without dropout; docs/cost-model.md derives every
term. They are bytes one GPU holds for one micro-batch, with sequence parallelism when tp > 1.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from fasop.cost.config import Config
from fasop.cost.pipeline import in_flight
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model

GIB = 2.0**30
FP32_BYTES = 4
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
DROPOUT_MASK_BYTES = 1


def bytes_per_param(model: Model, dp: int, distributed_optimizer: bool) -> float:
    """Weights, fp32 main gradients and Adam state (with an fp32 master copy under mixed precision).

    This is Megatron-LM's accounting: 18 bytes per parameter for fp16/bf16, or 6 + 12/dp when the
    distributed optimizer shards the master weights and moments over the data-parallel group.
    """
    sharded = ADAM_STATE_BYTES + (FP32_BYTES if model.precision != "fp32" else 0)
    return model.precision_bytes + FP32_BYTES + sharded / (dp if distributed_optimizer else 1)


def _attention_activation_bytes(model: Model, q_seq: int, kv_seq: int, mbs: int, cross: bool) -> float:
    h, qa, kv, a = model.hidden_size, model.attention_width, model.kv_width, model.num_attention_heads
    p, mask = model.precision_bytes, DROPOUT_MASK_BYTES if model.dropout else 0
    b = mbs
    # input of the norm and of the Q(KV) projection, Q, K, V, input of the output projection, dropout mask
    kv_input = 0 if cross else p * q_seq * b * h  # cross-attention K/V read the shared encoder output
    sbh = p * q_seq * b * h + kv_input + p * q_seq * b * qa + 2 * p * kv_seq * b * kv
    sbh += p * q_seq * b * qa + mask * q_seq * b * h
    if model.flash_attention:
        scores = 0.0
    else:  # softmax output, and with dropout its mask and output
        scores = a * q_seq * kv_seq * b * (p + (mask + p if model.dropout else 0))
    return sbh + scores


def _mlp_activation_bytes(model: Model, seq: int, mbs: int) -> float:
    h, f, p = model.hidden_size, model.ffn_hidden_size, model.precision_bytes
    mask = DROPOUT_MASK_BYTES if model.dropout else 0
    hidden = (3 if model.ffn_activation == "swiglu" else 2) * p * seq * mbs * f
    return p * seq * mbs * h + hidden + mask * seq * mbs * h + p * seq * mbs * h  # + norm input


@cache
def layer_activation_bytes(model: Model, kind: str, mbs: int, tp: int) -> float:
    """Activation bytes one layer keeps for one micro-batch until its backward pass, per GPU."""
    if kind == "decoder" and model.is_encoder_decoder:
        s, s_enc = model.decoder_seq_length, model.encoder_seq_length
        total = _attention_activation_bytes(model, s, s, mbs, cross=False)
        total += _attention_activation_bytes(model, s, s_enc, mbs, cross=True)
        total += model.precision_bytes * s * mbs * model.hidden_size  # the cross-attention norm's input
    else:
        s = model.encoder_seq_length if kind == "encoder" else model.seq_length
        total = _attention_activation_bytes(model, s, s, mbs, cross=False)
    return (total + _mlp_activation_bytes(model, s, mbs)) / tp


@cache
def embedding_activation_bytes(model: Model, mbs: int, tp: int) -> float:
    mask = DROPOUT_MASK_BYTES if model.dropout else 0
    return mask * model.input_seq_length * mbs * model.hidden_size / tp


@cache
def head_activation_bytes(model: Model, mbs: int, tp: int) -> float:
    """Final norm and output-layer inputs, and the fp32 logits that the cross-entropy loss keeps."""
    s, h = model.seq_length, model.hidden_size
    return (2 * model.precision_bytes * s * mbs * h + 4 * s * mbs * model.padded_vocab(tp)) / tp


def stage_params(model: Model, config: Config, segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per layer): (pp,) parameters per rank on each stage beyond its partitioned layers, and those of
    one of its layers."""
    tp, pp, whole = config.tp, config.pp, config.pp == 1
    kind_params = np.array([model.layer_params(kind) / tp for kind in model.layer_kinds])
    fixed_params = np.zeros(pp)
    fixed_params[0] += model.embedding_params(tp)
    fixed_params[-1] += model.head_params(tp, shares_stage_with_embedding=whole)
    if model.is_encoder_decoder and not whole:
        fixed_params[min(config.encoder_stages, pp - 1)] += model.decoder_embedding_params(tp)
    if whole:
        fixed_params[0] += float(np.dot(model.segment_layers, kind_params))
    return fixed_params, kind_params[segment]


def stage_capacity_gib(cluster: Cluster, stage_node_types: tuple[tuple[str, ...], ...]) -> np.ndarray:
    """(pp,) memory of the smallest GPU on each stage."""
    return np.array([min(cluster.node_types[n].gpu_memory_gib for n in names) for names in stage_node_types])


def stage_memory_gib(model: Model, config: Config, segment: np.ndarray, params: tuple[np.ndarray, np.ndarray],
                     mbs: np.ndarray, num_microbatches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per layer): (K, pp) GiB of model state and activations on each stage beyond its layers, and
    what each layer adds; activations are held for the micro-batches in flight under 1F1B."""
    fixed_params, layer_params = params
    tp, pp = config.tp, config.pp
    per_param = bytes_per_param(model, config.dp, config.distributed_optimizer)
    kind_act = np.array([layer_activation_bytes(model, kind, 1, tp) for kind in model.layer_kinds])
    fixed_act = np.zeros(pp)
    fixed_act[0] += embedding_activation_bytes(model, 1, tp)
    fixed_act[-1] += head_activation_bytes(model, 1, tp)
    if pp == 1:
        fixed_act[0] += float(np.dot(model.segment_layers, kind_act))
    held = in_flight(pp, num_microbatches, config.virtual_stages) * mbs[:, None]  # samples whose activations a stage holds
    mem_fixed = (fixed_params * per_param + fixed_act * held) / GIB
    mem_layer = (layer_params * per_param + kind_act[segment] * held) / GIB
    return mem_fixed, mem_layer


def head_fits(model: Model, cluster: Cluster, tp: int, mbs: int) -> bool:
    """Whether the output layer's activations of one micro-batch fit the largest GPU's usable memory (the last
    stage holds them; a size that fails fits no stage)."""
    usable_gib = max(t.gpu_memory_gib for t in cluster.node_types.values()) / cluster.memory_margin
    return mbs * (head_activation_bytes(model, 1, tp) / GIB) <= usable_gib * (1 + 1e-9)


def layers_that_fit(mem_fixed: np.ndarray, mem_layer: np.ndarray, capacity_gib: np.ndarray, margin: float,
                    whole: bool) -> np.ndarray:
    """(K, pp) most layers each stage's memory holds with the cluster's margin; -1 where not even the stage's
    fixed part fits; 0 where it fits and one stage holds the whole model (its layers are fixed)."""
    usable = capacity_gib / margin
    with np.errstate(divide="ignore", invalid="ignore"):
        hi = np.floor((usable - mem_fixed) / mem_layer + 1e-12)
    return np.where(mem_fixed <= usable, 0 if whole else hi, -1).astype(int)
