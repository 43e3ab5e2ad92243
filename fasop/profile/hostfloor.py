"""The host floor of a measured profile: what the host takes per kernel to run a unit's PyTorch code and launch
its kernels, timed on units too small for their GPU work to count. `fasop profile layers` measures it
(fasop.profile.measure) and writes it on the profile's identity line; the profile reader splits measured times
into the host's part and the GPU's with it (fasop.inputs.profiles, docs/cost-model.md section 2.1).
"""

from __future__ import annotations

from dataclasses import replace

from fasop.cost.roofline import unit_work
from fasop.inputs.model import Model

# The tiny shape of the host-floor units: hidden, heads, FFN, tokens and vocabulary small enough that no kernel
# does measurable work; the model's kinds of layers, attention, activation and flags kept.
TINY = {"hidden_size": 64, "num_attention_heads": 4, "kv_channels": 16, "ffn_hidden_size": 128, "seq": 16,
        "vocab_size": 128}
TINY_EXPERTS = 8


def tiny_model(model: Model) -> Model:
    """`model` at the TINY shape: one layer of each kind, grouped-query attention kept (2 groups) where it has it."""
    seq, heads = TINY["seq"], TINY["num_attention_heads"]
    return replace(model, encoder_num_layers=min(model.encoder_num_layers, 1),
                   decoder_num_layers=min(model.decoder_num_layers, 1), hidden_size=TINY["hidden_size"],
                   num_attention_heads=heads, kv_channels=TINY["kv_channels"],
                   num_query_groups=heads if model.num_query_groups == model.num_attention_heads else heads // 2,
                   ffn_hidden_size=TINY["ffn_hidden_size"], encoder_seq_length=seq if model.encoder_seq_length else 0,
                   decoder_seq_length=seq if model.decoder_seq_length else 0, vocab_size=TINY["vocab_size"],
                   **_tiny_experts(model))


def _tiny_experts(model: Model) -> dict:
    """An MoE model's tiny layers: MoE layers of at most TINY_EXPERTS experts of the tiny FFN (every layer, so
    the floor counts the router's and permutation's kernels), and multi-latent attention of the tiny heads."""
    fields: dict = {}
    if model.is_moe:
        ffn = TINY["ffn_hidden_size"]
        fields.update(num_experts=min(model.num_experts, TINY_EXPERTS), moe_layer_freq=1, moe_ffn_hidden_size=ffn,
                      moe_router_topk=min(model.moe_router_topk, TINY_EXPERTS),
                      moe_shared_expert_intermediate_size=ffn if model.moe_shared_expert_intermediate_size else 0)
    if model.multi_latent_attention:
        d = TINY["kv_channels"]
        fields.update(q_lora_rank=d if model.q_lora_rank else 0, kv_lora_rank=d, qk_head_dim=d,
                      qk_pos_emb_head_dim=d // 2, v_head_dim=d)
    return fields


def host_floor_us(tiny: Model, seconds: dict[str, float]) -> float:
    """Microseconds per kernel: the forward + backward seconds of each unit of the tiny model, over the kernels
    fasop.cost.roofline counts for those units at tensor degree 1 and micro-batch 1."""
    work = unit_work(tiny, 1, 1)
    launches = sum(work[kind].forward_launches + work[kind].backward_launches for kind in seconds)
    return sum(seconds.values()) / launches * 1e6
