"""What a plan fixes before its layers are partitioned, and the stage layout that follows from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fasop.inputs.model import Model


@dataclass(frozen=True)
class Config:
    tp: int
    dp: int
    pp: int
    mbs: int
    gbs: int
    encoder_stages: int  # encoder-decoder models: stages holding the encoder; else 0
    distributed_optimizer: bool
    overlap_grad_reduce: bool = False  # --overlap-grad-reduce: gradients reduced bucket by bucket during the backward
    overlap_param_gather: bool = False  # --overlap-param-gather (distributed optimizer): during the next forward
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B)

    @staticmethod
    def overlaps(overlap: bool, distributed_optimizer: bool) -> dict[str, bool]:
        """The overlap fields for `--overlap/--no-overlap`: the parameter gather exists only with the
        distributed optimizer."""
        return {"overlap_grad_reduce": overlap, "overlap_param_gather": overlap and distributed_optimizer}


def segments(model: Model, config: Config) -> tuple[np.ndarray, np.ndarray]:
    """(segment of each stage (pp,), layers of each segment): encoder-decoder models put the encoder on the
    first `encoder_stages` stages and the decoder on the rest; one stage alone holds the whole model, and its
    layers are not partitioned (no segment layers)."""
    whole = config.pp == 1
    if model.is_encoder_decoder and not whole:
        return (np.arange(config.pp) >= config.encoder_stages).astype(int), np.array(model.segment_layers)
    return np.zeros(config.pp, dtype=int), np.array([0 if whole else model.num_layers])


def embedding_stages(model: Model, config: Config) -> tuple[int, ...]:
    """Stages holding a copy of the tied word embedding, which Megatron all-reduces after each step."""
    if not model.tie_embeddings or config.pp == 1:
        return ()
    stages = {0, config.pp - 1}
    if model.is_encoder_decoder:
        stages.add(config.encoder_stages)
    return tuple(sorted(stages))
