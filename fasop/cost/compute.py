"""Compute: forward and backward seconds of each stage's units for one micro-batch, from the profiles of the
GPU types hosting the stage (the slowest sets the pace)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fasop.cost.config import Config
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile


@dataclass(frozen=True)
class StageCompute:
    gpu: tuple[str, ...]  # GPU types hosting each stage, '+'-joined when a stage spans two types
    layer_s: np.ndarray  # (K, pp) one transformer layer of the stage's segment
    fixed_s: np.ndarray  # (K, pp) the embedding and head units on the stage (everything when pp = 1)
    layer_forward_s: np.ndarray  # (K, pp) the forward part of layer_s
    fixed_forward_s: np.ndarray  # (K, pp) the forward part of fixed_s
    kind_forward_s: tuple[np.ndarray, ...]  # (K, pp) per layer kind: the forward alone, what recomputation repeats
    # (K, pp) per layer kind: the attention core's forward, what selective recomputation repeats (empty unless
    # asked for)
    kind_core_forward_s: tuple[np.ndarray, ...] = ()


def stage_compute(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile],
                  stage_node_types: tuple[tuple[str, ...], ...], config: Config, sizes: tuple[int, ...],
                  segment: np.ndarray, selective: bool = False) -> StageCompute:
    """Compute of each stage for each micro-batch size in `sizes`; with `selective`, the attention cores'
    forwards too."""
    tp, pp, whole = config.tp, config.pp, config.pp == 1
    stage_gpus = [tuple(sorted({cluster.node_types[n].gpu for n in names})) for names in stage_node_types]
    gpu_sets = sorted(set(stage_gpus))
    stage_set = np.array([gpu_sets.index(g) for g in stage_gpus])

    def unit_s(kind: str, part: str = "step") -> np.ndarray:
        """(K, pp): forward + backward ("step"), the forward alone ("forward") or the attention core's forward
        ("core") of one unit of `kind` for one micro-batch on each stage; a stage of two GPU types takes the
        slower type's step, and that type's forward and core."""
        steps = [np.array([profiles[g].step_s(tp, kind, sizes) for g in gpus]) for gpus in gpu_sets]
        if part == "step":
            per_set = np.array([s.max(0) for s in steps])
        else:
            def part_s(g: str) -> np.ndarray:
                if part == "core":
                    return profiles[g].attention_core_forward_s(model, tp, kind, sizes)
                return profiles[g].forward_s(tp, kind, sizes)
            per_set = np.array([np.array([part_s(g) for g in gpus])[s.argmax(0), range(len(sizes))]
                                for gpus, s in zip(gpu_sets, steps)])
        return per_set[stage_set].T

    def totals(forward: bool) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        kinds = model.layer_kinds
        layer_by_kind = [unit_s(kind, "forward" if forward else "step") for kind in kinds]
        layer_s = np.choose(segment, layer_by_kind) if len(kinds) > 1 else layer_by_kind[0]
        first_decoder = min(config.encoder_stages, pp - 1)
        fixed_s = np.zeros((len(sizes), pp))
        part = "forward" if forward else "step"
        fixed_s[:, 0] += unit_s("embedding", part)[:, 0]
        fixed_s[:, -1] += unit_s("head", part)[:, -1]
        if model.is_encoder_decoder:
            fixed_s[:, first_decoder] += unit_s("decoder_embedding", part)[:, first_decoder]
        if whole:
            fixed_s[:, 0] += sum(n * t[:, 0] for n, t in zip(model.segment_layers, layer_by_kind))
        return layer_s, fixed_s, layer_by_kind

    layer_s, fixed_s, _ = totals(forward=False)
    layer_forward_s, fixed_forward_s, kind_forward_s = totals(forward=True)
    core = tuple(unit_s(kind, "core") for kind in model.layer_kinds) if selective else ()
    return StageCompute(tuple("+".join(g) for g in stage_gpus), layer_s, fixed_s, layer_forward_s, fixed_forward_s,
                        tuple(kind_forward_s), core)


def recompute_times(model: Model, config: Config, compute: StageCompute,
                    segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per layer, fixed): (K, pp) seconds of forwards each stage recomputes per micro-batch, for each of its
    layers and whatever its layers (the block method's k layers; everything when one stage holds the model).
    Per layer: the attention core's forward under selective recomputation (with flash attention too: Megatron
    checkpoints the fused kernel and reruns its forward), the whole forward under full uniform recomputation,
    nothing otherwise (the block method recomputes a fixed number of layers per stage instead)."""
    if config.recompute == "selective":
        recomputed = list(compute.kind_core_forward_s)
    else:
        full = config.recompute == "full" and not config.blocked_layers
        recomputed = [f if full else 0.0 * f for f in compute.kind_forward_s]
    per_layer = np.choose(segment, recomputed)
    blocked = config.blocked_layers
    fixed = blocked * np.choose(segment, compute.kind_forward_s)
    if config.pp == 1:  # one stage: every layer as above, and the block's k layers of each segment
        fixed[:, 0] = sum((n * r + blocked * f)[:, 0] for n, r, f in
                          zip(model.segment_layers, recomputed, compute.kind_forward_s))
    return per_layer, fixed
