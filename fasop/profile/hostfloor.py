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


def tiny_model(model: Model) -> Model:
    """`model` at the TINY shape: one layer of each kind, grouped-query attention kept (2 groups) where it has it."""
    seq, heads = TINY["seq"], TINY["num_attention_heads"]
    return replace(model, encoder_num_layers=min(model.encoder_num_layers, 1),
                   decoder_num_layers=min(model.decoder_num_layers, 1), hidden_size=TINY["hidden_size"],
                   num_attention_heads=heads, kv_channels=TINY["kv_channels"],
                   num_query_groups=heads if model.num_query_groups == model.num_attention_heads else heads // 2,
                   ffn_hidden_size=TINY["ffn_hidden_size"], encoder_seq_length=seq if model.encoder_seq_length else 0,
                   decoder_seq_length=seq if model.decoder_seq_length else 0, vocab_size=TINY["vocab_size"])


def host_floor_us(tiny: Model, seconds: dict[str, float]) -> float:
    """Microseconds per kernel: the forward + backward seconds of each unit of the tiny model, over the kernels
    fasop.cost.roofline counts for those units at tensor degree 1 and micro-batch 1."""
    work = unit_work(tiny, 1, 1)
    launches = sum(work[kind].forward_launches + work[kind].backward_launches for kind in seconds)
    return sum(seconds.values()) / launches * 1e6
