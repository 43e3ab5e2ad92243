"""Matmul FLOPs of one transformer layer, and the share of them in the attention core (what selective
recomputation reruns). fasop.profile.synth times whole units from these counts; the cost model needs the
attention core's share to time selective recomputation (docs/cost-model.md section 10)."""

from __future__ import annotations

from functools import cache

from fasop.inputs.model import Model


def _attention_matmul_weights(model: Model) -> int:
    """Q, K, V and output projections (no biases)."""
    h, qa, kv = model.hidden_size, model.attention_width, model.kv_width
    return h * qa + 2 * h * kv + qa * h


def _mlp_matmul_weights(model: Model) -> int:
    h, f = model.hidden_size, model.ffn_hidden_size
    return (3 if model.ffn_activation == "swiglu" else 2) * h * f


def _is_cross(model: Model, kind: str) -> bool:
    return kind == "decoder" and model.is_encoder_decoder


def _query_seq(model: Model, kind: str) -> int:
    if _is_cross(model, kind):
        return model.decoder_seq_length
    return model.encoder_seq_length if kind == "encoder" else model.seq_length


def attention_core_forward_flops(model: Model, kind: str, mbs: int, tp: int = 1) -> float:
    """Scores Q.K^T and context scores.V of one layer's forward (the full s x s matrix; cross-attention too),
    per GPU of a tp group: the attention core that Megatron-LM's selective recomputation reruns."""
    b, qa, s = mbs, model.attention_width, _query_seq(model, kind)
    flops = 2 * 2 * b * s * s * qa
    if _is_cross(model, kind):
        flops += 2 * 2 * b * s * model.encoder_seq_length * qa
    return flops / tp


def layer_forward_flops(model: Model, kind: str, mbs: int, tp: int = 1) -> float:
    """Matmul FLOPs of one transformer layer's forward pass for one micro-batch, per GPU of a tp group."""
    b, h, qa, kv, s = mbs, model.hidden_size, model.attention_width, model.kv_width, _query_seq(model, kind)
    flops = 2.0 * b * s * (_attention_matmul_weights(model) + _mlp_matmul_weights(model))
    if _is_cross(model, kind):  # cross-attention projections: Q and output over the decoder, K and V over the encoder
        flops += 2.0 * b * (s * (h * qa + qa * h) + model.encoder_seq_length * 2 * h * kv)
    return flops / tp + attention_core_forward_flops(model, kind, mbs, tp)


@cache
def attention_core_share(model: Model, kind: str) -> float:
    """The attention core's share of one layer's forward FLOPs (the same for every micro-batch size and tensor
    degree: both scale as b / tp)."""
    return attention_core_forward_flops(model, kind, 1) / layer_forward_flops(model, kind, 1)
