"""What a plan fixes before its layers are partitioned, and the stage layout that follows from it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from fasop.cost.roofline import RECOMPUTE_MODULES, Layout
from fasop.cost.schedule import interleaving_error
from fasop.errors import ArgumentError
from fasop.inputs.model import Model

T = TypeVar("T")

# Megatron-LM's --recompute-granularity, lightest first (none: the flag left out)
RECOMPUTE_MODES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)  # Megatron-LM's --recompute-modules default


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
    # --overlap-param-gather (only with the distributed optimizer): during the next step's forward
    overlap_param_gather: bool = False
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B)
    recompute: str = "none"  # --recompute-granularity: none, selective or full
    # selective only: --recompute-modules (fasop.cost.roofline.RECOMPUTE_MODULES), Megatron-LM's default the core
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES
    recompute_method: str | None = None  # full only: --recompute-method uniform or block
    recompute_num_layers: int | None = None  # full only: --recompute-num-layers
    sequence_parallel: bool = False  # --sequence-parallel; only meaningful when tp > 1
    tp_comm_overlap: bool = False  # --tp-comm-overlap (fasop.cost.tpoverlap): with sequence parallelism
    cp: int = 1  # --context-parallel-size: ranks sharing each sequence (world = tp cp dp pp)
    ep: int = 1  # --expert-model-parallel-size: ranks sharing each MoE layer's experts
    etp: int = 0  # --expert-tensor-parallel-size: each expert's tensor-parallel ranks (0: tp, Megatron-LM's default)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_split(self) -> int:
        """The ranks one MoE layer's routed experts are split over: etp x ep."""
        return self.expert_tp * self.ep

    @property
    def dense_dp(self) -> int:
        """The ranks that reduce a dense parameter's gradient and shard its optimizer state: dp x cp (Megatron's
        data-parallel group with context parallelism)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel degree: the ranks holding the same experts, tp cp dp / (etp ep) (Megatron's
        expert grid folded out of tp x cp x dp)."""
        return self.tp * self.cp * self.dp // self.expert_split

    @property
    def layout(self) -> Layout:
        return Layout(self.cp, self.ep, 0 if self.expert_tp == self.tp else self.etp)

    @property
    def blocked_layers(self) -> int:
        """The block method's N: layers it recomputes in each model chunk (0 for other settings)."""
        return (self.recompute_num_layers or 0) if self.recompute_method == "block" else 0

    @property
    def recomputed_per_chunk(self) -> float:
        """Most layers of a model chunk whose forward reruns before their backward (the attention core's alone
        under selective recomputation): every one (inf), the block method's N, or none."""
        if self.recompute == "none":
            return 0.0
        return float(self.blocked_layers) if self.blocked_layers else math.inf


def param_gather_overlaps(overlap_grad_reduce: bool, distributed_optimizer: bool, asked: bool | None = None) -> bool:
    """Whether parameters are gathered during the next forward (--overlap-param-gather): Megatron-LM does so only
    with the distributed optimizer and the gradient reduction overlapped; `asked`: a plan's own choice (None: on
    wherever it can be)."""
    return asked is not False and distributed_optimizer and overlap_grad_reduce


def sequence_parallel_on(tp: int, asked: bool | None = None) -> bool:
    """Whether a plan runs Megatron-LM's --sequence-parallel: as `asked`, else whenever tensor parallelism splits
    the layers (tp > 1), where it only saves memory and time."""
    return tp > 1 if asked is None else asked


def with_recompute(config: Config, mode: str) -> Config:
    """`config` under recompute mode `mode`, full recomputation as the search takes it: uniform, one layer per
    checkpoint (every layer recomputed, the least memory)."""
    full = mode == "full"
    return replace(config, recompute=mode, recompute_method="uniform" if full else None,
                   recompute_num_layers=1 if full else None)


def recompute_error(recompute: str, method: str | None, num_layers: int | None, model_layers: int) -> str | None:
    """Why a recompute setting is not one fasop models for a model of `model_layers` layers, or None. Megatron-LM's
    own rules (TransformerConfig): full needs a method and a layer count, selective neither. fasop times full
    uniform recomputation with one layer per checkpoint (every layer's input kept), and block with any count up
    to the model's layers (a model chunk holds no more)."""
    if recompute not in RECOMPUTE_MODES:
        return f"expected one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
    if recompute != "full":
        return None if method is None and num_layers is None else f"{recompute} takes no method and no layer count"
    if method not in RECOMPUTE_METHODS:
        return f"full recomputation needs a method, one of {', '.join(RECOMPUTE_METHODS)}, got {method!r}"
    if num_layers is None or not 1 <= num_layers <= model_layers:
        return f"full recomputation needs a layer count from 1 to the model's {model_layers} layers, got {num_layers!r}"
    if method == "uniform" and num_layers != 1:
        return "fasop models the uniform method with one layer per checkpoint (--recompute-num-layers 1)"
    return None


def checked_recompute(model: Model, recompute: str, method: str | None, num_layers: int | None,
                      modules: Sequence[str] | None,
                      refuse: Callable[[str, str], Exception]) -> tuple[str | None, int | None, tuple[str, ...]]:
    """(method, layer count, modules) of a plan's recomputation, checked (recompute_error,
    recompute_modules_error; `refuse(field, problem)` makes the error): full without a method is uniform over
    every layer, as the search takes it, selective without modules reruns the attention core."""
    if recompute == "full" and method is None and num_layers is None:
        method, num_layers = "uniform", 1
    problem = recompute_error(recompute, method, num_layers, model.num_layers)
    if problem:
        raise refuse("recompute", problem)
    chosen = DEFAULT_RECOMPUTE_MODULES if modules is None else tuple(modules)
    problem = recompute_modules_error(model, recompute, chosen)
    if problem:
        raise refuse("recompute_modules", problem)
    return method, num_layers, canonical_modules(chosen)


def recompute_modules_error(model: Model, recompute: str, modules: tuple[str, ...]) -> str | None:
    """Why `modules` (--recompute-modules) are not a setting Megatron-LM runs and fasop models, or None: some of
    RECOMPUTE_MODULES, once each, with selective recomputation (Megatron-LM reads them with no other); moe_act
    and mla_up_proj only where the model has experts and multi-latent attention (TransformerConfig's checks)."""
    if recompute != "selective" and modules != DEFAULT_RECOMPUTE_MODULES:
        return f"--recompute-modules go with selective recomputation, not {recompute}"
    if "moe" in modules:
        return ("fasop does not model recomputing a whole MoE layer (moe), which reruns its expert all-to-alls; "
                f"its parts are {', '.join(m for m in RECOMPUTE_MODULES if m != 'core_attn')}")
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown or not modules or len(set(modules)) != len(modules):
        return f"expected some of {', '.join(RECOMPUTE_MODULES)}, each once, got {','.join(modules)!r}"
    if "moe_act" in modules and not model.is_moe:
        return f"moe_act recomputes an MoE layer's expert activation; {model.name} has no experts"
    if "mla_up_proj" in modules and not model.multi_latent_attention:
        return f"mla_up_proj recomputes multi-latent attention's up-projections; {model.name} has no such attention"
    return None


def check_recompute_modules(model: Model, modules: tuple[str, ...]) -> tuple[str, ...]:
    """A search's --recompute-modules, checked for its selective plans and in canonical order (ArgumentError)."""
    problem = recompute_modules_error(model, "selective", modules)
    if problem:
        raise ArgumentError("recompute_modules", problem)
    return canonical_modules(modules)


def recompute_modules_field(config: Config) -> list[str] | None:
    """A plan record's recompute_modules: a selective plan's, unless Megatron-LM's default (left out)."""
    modules = config.recompute_modules
    return list(modules) if config.recompute == "selective" and modules != DEFAULT_RECOMPUTE_MODULES else None


def canonical_modules(modules: tuple[str, ...]) -> tuple[str, ...]:
    """Recompute modules in RECOMPUTE_MODULES' order (the same set, the same plan and flags)."""
    return tuple(sorted(modules, key=RECOMPUTE_MODULES.index))


def virtual_stages_error(model: Model, pp: int, virtual_stages: int, num_microbatches: int) -> str | None:
    """Why `virtual_stages` model chunks per pipeline rank are not a plan Megatron-LM runs and fasop models, or
    None (fasop splits only decoder and encoder stacks into chunks)."""
    if virtual_stages == 1:
        return None
    refusal = interleaving_error(pp, virtual_stages, num_microbatches)
    if refusal is None and model.is_encoder_decoder:
        refusal = "fasop interleaves decoder and encoder models only"
    return refusal


def chunk_layers(counts: np.ndarray, virtual_stages: int) -> np.ndarray:
    """(..., P) layers per stage -> (..., P, v) layers per model chunk: as even as can be, the first chunks
    taking one more when the count does not divide."""
    n = np.asarray(counts)[..., None]
    chunk = np.arange(virtual_stages)
    return n // virtual_stages + (chunk < n % virtual_stages)


def recomputed_layers(counts: np.ndarray, virtual_stages: int, per_chunk: float | np.ndarray) -> np.ndarray:
    """(..., P) layers per stage -> (..., P, v) layers each model chunk recomputes: at most `per_chunk` (one value,
    or one per row (...)) of the chunk's (Config.recomputed_per_chunk). Megatron-LM builds each model chunk as a
    TransformerBlock of its own, whose `_checkpointed_forward` checkpoints, with the block method, its layers
    numbered below --recompute-num-layers; the encoder and the decoder of a stage holding both are two blocks."""
    most = np.asarray(per_chunk, dtype=float)
    return np.minimum(chunk_layers(counts, virtual_stages), most.reshape(most.shape + (1, 1)))


def recomputed_affine(per_chunk: float, virtual_stages: int) -> tuple[float, float]:
    """(per layer, fixed): the layers a stage of n layers recomputes, summed over its chunks, as the affine
    per_layer n + fixed that the partition takes. The sum of min(N, chunk layers) over v even chunks is
    min(n, N v): n when every layer is recomputed, else N v, exact once n >= N v (= fixed)."""
    if math.isinf(per_chunk):
        return 1.0, 0.0
    return 0.0, per_chunk * virtual_stages


def fewest_layers(model: Model, config: Config) -> np.ndarray:
    """(pp,) fewest layers each stage may hold: one, but none on the first and the last stage of a decoder or
    encoder model (the embedding or the head alone) and on a stage holding the whole model (its layers are
    not partitioned); with the block method, its N on every stage (as `fasop emit` asks)."""
    if config.pp == 1:
        return np.zeros(1, dtype=int)
    fewest = np.ones(config.pp, dtype=int)
    if not model.is_encoder_decoder:
        fewest[0] = fewest[-1] = 0
    return np.maximum(fewest, config.blocked_layers)


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


def per_stage(placements: list[tuple[tuple[str, ...], ...]], of: Callable[[tuple[str, ...]], T]) -> list[list[T]]:
    """of(node types) for every stage of every placement (the node types hosting each stage), computed once for
    each distinct set of node types: placements share a few."""
    value = {names: of(names) for names in {names for stages in placements for names in stages}}
    return [[value[names] for names in stages] for stages in placements]
