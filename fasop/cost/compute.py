"""Compute: forward and backward seconds of each stage's units for one micro-batch, from the profiles of the
GPU types hosting the stage (the slowest sets the pace)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fasop.cost.config import Config, per_stage, recomputed_layers
from fasop.cost.tpoverlap import hidden_shares
from fasop.inputs.cluster import Cluster
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile


@dataclass(frozen=True)
class StageCompute:
    gpu: tuple[tuple[str, ...], ...]  # per row: GPU types hosting each stage, '+'-joined when a stage spans two
    layer_s: np.ndarray  # (G K, pp) one transformer layer of the stage's segment
    fixed_s: np.ndarray  # (G K, pp) the embedding and head units on the stage (everything when pp = 1)
    layer_forward_s: np.ndarray  # (G K, pp) the forward part of layer_s
    fixed_forward_s: np.ndarray  # (G K, pp) the forward part of fixed_s
    kind_forward_s: tuple[np.ndarray, ...]  # (G K, pp) per layer kind: the forward alone, what recomputation repeats
    # (G K, pp) per layer kind: the attention core's forward (empty unless asked for)
    kind_core_forward_s: tuple[np.ndarray, ...] = ()
    # (G K, pp) per layer kind: the forward of the modules selective recomputation repeats (empty unless asked for)
    kind_rerun_forward_s: tuple[np.ndarray, ...] = ()


def stage_compute(model: Model, cluster: Cluster, profiles: dict[str, GpuProfile],
                  placements: list[tuple[tuple[str, ...], ...]], config: Config, sizes: tuple[int, ...],
                  segment: np.ndarray, encoder_stages: np.ndarray, core: bool = False,
                  rerun: tuple[str, ...] = ()) -> StageCompute:
    """Compute of each stage for G placements (the node types hosting each stage), each with its stages' segments
    (G, pp) and encoder stages (G,), and K micro-batch sizes, row g K + k. Placements share the few GPU sets their
    stages have, so each set's profiles are read once. With `core`, the layers' attention cores too; with
    `rerun`, the forward of those recompute modules (fasop.cost.roofline.RECOMPUTE_MODULES)."""
    tp, pp, whole, layout = config.tp, config.pp, config.pp == 1, config.layout
    segment = np.repeat(segment, len(sizes), axis=0)
    stage_gpus = per_stage(placements, lambda names: tuple(sorted({cluster.node_types[n].gpu for n in names})))
    gpu_sets = sorted({gpus for stages in stage_gpus for gpus in stages})
    stage_set = np.array([[gpu_sets.index(gpus) for gpus in stages] for stages in stage_gpus])  # (G, pp)

    kinds = [*model.layer_kinds, "embedding", "head", *(["decoder_embedding"] if model.is_encoder_decoder else [])]

    def modules_forward(gpus: tuple[str, ...], modules: tuple[str, ...]) -> np.ndarray:
        """(types, kinds, K) the forward of `modules` in the layers of each type (0 without modules)."""
        return np.array([[profiles[g].layer_module_forward_s(model, tp, kind, sizes, layout, modules)
                          if modules and kind in model.layer_kinds else np.zeros(len(sizes)) for kind in kinds]
                         for g in gpus])

    def set_times(gpus: tuple[str, ...]) -> np.ndarray:
        """(4, kinds, K) forward + backward, the forward alone, the attention core's forward and the forward of
        the `rerun` modules (layers, where asked for; else 0) of one unit of each kind for one micro-batch on a
        stage of these GPU types: the slower type's step, and that type's forward, core and rerun."""
        times = np.array([[profiles[g].layer_times_s(model, tp, kind, sizes, layout) if kind in model.layer_kinds
                           else profiles[g].times_s(tp, kind, sizes, layout) for kind in kinds] for g in gpus])
        if config.tp_comm_overlap:  # the layers' collectives hidden behind their GEMMs
            for i, g in enumerate(gpus):
                for j, kind in enumerate(model.layer_kinds):
                    times[i, j] *= 1 - hidden_shares(model, profiles[g], tp, kind, sizes)
        step = times[..., 0] + times[..., 1]
        slowest = step.argmax(0)[None]
        parts = (step, times[..., 0], modules_forward(gpus, ("core_attn",) if core else ()),
                 modules_forward(gpus, rerun))
        return np.stack([np.take_along_axis(part, slowest, 0)[0] for part in parts])

    stage_times = np.array([set_times(gpus) for gpus in gpu_sets])[stage_set]  # (G, pp, 4, kinds, K)

    def unit_s(kind: str, part: int) -> np.ndarray:
        """(G K, pp): of one unit of `kind` for one micro-batch on each stage, part 0 (forward + backward), 1 (the
        forward alone), 2 (the attention core's forward) or 3 (the rerun modules' forward)."""
        return stage_times[:, :, part, kinds.index(kind)].transpose(0, 2, 1).reshape(-1, pp)

    def totals(forward: bool) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        kinds, part = model.layer_kinds, int(forward)
        layer_by_kind = [unit_s(kind, part) for kind in kinds]
        layer_s = np.choose(segment, layer_by_kind) if len(kinds) > 1 else layer_by_kind[0]
        fixed_s = np.zeros(layer_s.shape)
        fixed_s[:, 0] += unit_s("embedding", part)[:, 0]
        fixed_s[:, -1] += unit_s("head", part)[:, -1]
        if model.is_encoder_decoder:
            rows, first_decoder = np.arange(len(fixed_s)), np.repeat(np.minimum(encoder_stages, pp - 1), len(sizes))
            fixed_s[rows, first_decoder] += unit_s("decoder_embedding", part)[rows, first_decoder]
        if whole:
            fixed_s[:, 0] += sum(n * t[:, 0] for n, t in zip(model.segment_layers, layer_by_kind))
        return layer_s, fixed_s, layer_by_kind

    layer_s, fixed_s, _ = totals(forward=False)
    layer_forward_s, fixed_forward_s, kind_forward_s = totals(forward=True)
    gpu = [tuple("+".join(g) for g in stages) for stages in stage_gpus]
    core_s = tuple(unit_s(kind, 2) for kind in model.layer_kinds) if core else ()
    rerun_s = tuple(unit_s(kind, 3) for kind in model.layer_kinds) if rerun else ()
    return StageCompute(tuple(names for names in gpu for _ in sizes), layer_s, fixed_s, layer_forward_s,
                        fixed_forward_s, tuple(kind_forward_s), core_s, rerun_s)


def with_layer_exchange(compute: StageCompute, forward_s: np.ndarray, backward_s: np.ndarray,
                        whole_layers: int = 0) -> StageCompute:
    """`compute` with the seconds each layer's communication adds to its forward and backward passes
    (fasop.cost.communication.layer_exchange_s, (G K, pp) each), part of what recomputation repeats; a stage
    holding the whole model (`whole_layers`, pp = 1) counts its layers' as fixed."""
    extra = dict(fixed_s=compute.fixed_s + whole_layers * (forward_s + backward_s),
                 fixed_forward_s=compute.fixed_forward_s + whole_layers * forward_s) if whole_layers else {}
    return replace(compute, layer_s=compute.layer_s + forward_s + backward_s,
                   layer_forward_s=compute.layer_forward_s + forward_s,
                   kind_forward_s=tuple(f + forward_s for f in compute.kind_forward_s), **extra)


def recompute_times(model: Model, config: Config, compute: StageCompute,
                    segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per recomputed layer, fixed): seconds of the forward each stage reruns per micro-batch for each layer it
    recomputes (which layers: fasop.cost.config.recomputed_layers), per row of `compute` and its stages' segments
    `segment`: the forward of the recompute modules under selective recomputation (the attention core by
    default; with flash attention too: Megatron checkpoints the fused kernel and reruns its forward), the whole
    forward under full recomputation, nothing otherwise. A stage holding the whole model has no partitioned
    layers: its recomputation is all fixed."""
    if config.recompute == "selective":
        rerun = list(compute.kind_rerun_forward_s)
    elif config.recompute == "full":
        rerun = list(compute.kind_forward_s)
    else:
        rerun = [np.zeros_like(f) for f in compute.kind_forward_s]
    per_layer = np.choose(segment, rerun)
    fixed = np.zeros_like(per_layer)
    if config.pp == 1:  # each segment (encoder, decoder) is a block of its own
        recomputed = recomputed_layers(np.array(model.segment_layers), 1, config.recomputed_per_chunk)[:, 0]
        fixed[:, 0] = sum(r * t[:, 0] for r, t in zip(recomputed, rerun))
        per_layer = np.zeros_like(per_layer)
    return per_layer, fixed
