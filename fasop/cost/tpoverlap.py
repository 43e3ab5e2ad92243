"""Tensor-parallel communication overlap (Megatron-LM's --tp-comm-overlap, Transformer Engine's userbuffers):
where a plan can run it, and the share of a layer's forward and backward time it hides (docs/cost-model.md
section 2.2).

With sequence parallelism each layer all-gathers its input before the QKV and FC1 GEMMs and reduce-scatters
after the attention projection and FC2 (forward), and all-gathers the output gradient before the projection's
and FC2's input-gradient GEMMs (backward). Userbuffers split each such collective and its GEMM into chunks and
pipeline them:

- ring exchange (the all-gathers): tp chunks, the local one first; chunk k's GEMM runs while chunk k + 1
  arrives. With C the collective's time and G the GEMM's, the critical path is k transfers of C / (tp - 1) then
  tp - k GEMM chunks of G / tp, longest at k = 0 or k = tp - 1: exposed = max(G, C + G / tp).
- pipeline (the reduce-scatters): n chunks, each GEMM chunk then its reduce-scatter, a two-machine flow shop:
  exposed = max(G', C) + min(G', C) / n, where G' = G S / (S - k) is the GEMM on the S - k SMs the
  communication's k SMs leave it.

The hidden time is C + G - exposed; the pipeline's can be negative (a small C does not pay for the SMs given
up). The backward's reduce-scatters of the QKV and FC1 input gradients (userbuffers' bulk overlap with the
weight-gradient GEMMs) are left out: Megatron-LM already runs them asynchronously beside those GEMMs without
the flag. Times come from the roofline of the stage's GPU (fasop.cost.roofline); a profile's measured time
is reduced by the same share of it, as selective recomputation's attention core is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field

from fasop.cost.roofline import Kernel, Rates, UnitWork, pass_s, unit_times, unit_work
from fasop.inputs import bundled
from fasop.inputs.model import Model
from fasop.inputs.profiles import GpuProfile, RooflineShape
from fasop.inputs.tomlfile import Range, Table, read_toml, validated

# (collective, the GEMM kernel it overlaps, ring exchange?) per pass, as Transformer Engine's initialize_ub
# assigns its methods: qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad ring exchange; proj_fprop, fc2_fprop pipeline
FORWARD = (("QKV", True), ("attention output", False), ("FFN in", True), ("FFN out", False))
BACKWARD = (("attention output input grad", True), ("FFN out input grad", True))


class OverlapFile(Table):
    pipeline_splits: Annotated[int, Range(2, 1024)]
    pipeline_sm_margin: Annotated[int, Range(0, 1024)]
    gpus: list[str] = Field(min_length=1)
    source: str
    date: str


@dataclass(frozen=True)
class OverlapFigures:
    """Transformer Engine's default chunking and SM margin, and the GPU types fasop offers the overlap on."""

    pipeline_splits: int
    pipeline_sm_margin: int
    gpus: tuple[str, ...]


def figures_path() -> Path:
    return bundled.data_dir("clusters") / "catalogue" / "tp-comm-overlap.toml"


@cache
def bundled_figures() -> OverlapFigures:
    path = figures_path()
    data = validated(OverlapFile, read_toml(path), str(path))
    return OverlapFigures(data.pipeline_splits, data.pipeline_sm_margin, tuple(data.gpus))


def overlap_error(model: Model, tp: int, sequence_parallel: bool, gpus: tuple[str, ...], cp: int = 1) -> str | None:
    """Why a plan of `model` at `tp` on GPU types `gpus` cannot run --tp-comm-overlap, or None. Megatron-LM
    needs sequence parallelism (so tp > 1) and Transformer Engine; the userbuffers need the tensor group in one
    NVLink domain (fasop keeps it in one node). Encoder-decoder models are refused: Megatron turns the overlap
    off for the whole shared config at the first linear layer without a userbuffer (cross-attention's)."""
    if tp == 1 or not sequence_parallel:
        return "needs tensor parallelism (tp > 1) with sequence parallelism, as Megatron-LM does"
    if model.is_encoder_decoder:
        return "not for encoder-decoder models (Megatron-LM turns it off at their cross-attention)"
    if model.is_moe or cp > 1:
        return "not modelled with experts or context parallelism"
    offered = bundled_figures().gpus
    missing = sorted(set(gpus) - set(offered))
    if missing:
        return (f"not modelled on {', '.join(missing)} (offered on {', '.join(offered)}: "
                "clusters/catalogue/tp-comm-overlap.toml)")
    return None


def hidden_s(comm_s: float, gemm_s: float, ring: bool, chunks: int, gemm_slowdown: float = 1.0) -> float:
    """Seconds a chunked overlap of a collective of `comm_s` with a GEMM of `gemm_s` saves against running them
    one after the other (module docstring): ring exchange in `chunks` = tp pieces, or a pipeline of `chunks` whose
    GEMM runs `gemm_slowdown` times slower on the SMs the communication leaves."""
    if ring:
        exposed = max(gemm_s, comm_s + gemm_s / chunks)
    else:
        slowed = gemm_s * gemm_slowdown
        exposed = max(slowed, comm_s) + min(slowed, comm_s) / chunks
    return comm_s + gemm_s - exposed


def pass_hidden_s(work: UnitWork, tp: int, rates: Rates, figures: OverlapFigures) -> tuple[float, float]:
    """(forward, backward) seconds the overlap hides in one layer on the roofline of `rates`."""
    kernels: dict[str, Kernel] = {k.name: k for k in (*work.forward, *work.backward)}
    payload = work.collectives[0]  # each of the four is b s h elements
    comm_s = (tp - 1) / tp * payload / rates.collective_bytes_per_s(payload)
    sms = rates.sm_count
    slowdown = sms / (sms - figures.pipeline_sm_margin) if sms and sms > figures.pipeline_sm_margin else 1.0

    def total(pairs: tuple[tuple[str, bool], ...]) -> float:
        return sum(hidden_s(comm_s, pass_s((kernels[name],), rates), ring,
                            tp if ring else figures.pipeline_splits, slowdown) for name, ring in pairs)

    return total(FORWARD), total(BACKWARD)


def hidden_shares(model: Model, profile: GpuProfile, tp: int, kind: str, sizes: tuple[int, ...]) -> np.ndarray:
    """(K, 2): the share of a layer's forward and backward time the overlap hides at each micro-batch size, on
    the roofline of the profile's GPU; zeros where the profile has none (a GPU the catalogue lacks)."""
    shape = profile.curves[(tp, kind)].shape if (tp, kind) in profile.curves else None
    if not isinstance(shape, RooflineShape):
        return np.zeros((len(sizes), 2))
    figures = bundled_figures()
    rows = []
    for b in sizes:
        work = unit_work(model, tp, b)[kind]
        rows.append(np.array(pass_hidden_s(work, tp, shape.rates, figures)) / np.array(unit_times(work, tp, shape.rates)))
    return np.array(rows)


def overlap_pays(model: Model, profiles: dict[str, GpuProfile], tp: int, sizes: tuple[int, ...]) -> bool:
    """Whether the overlap hides time in every layer kind, pass and micro-batch size on every GPU type of
    `profiles` and is never slower: the search turns it on only then, so a plan with it is never slower."""
    shares = np.array([hidden_shares(model, profile, tp, kind, sizes) for profile in profiles.values()
                       for kind in model.layer_kinds])
    return bool((shares >= 0).all() and (shares.sum(-1) > 0).all())
