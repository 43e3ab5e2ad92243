"""Layer-wise time profiles: seconds per unit (embedding, transformer layer, head) per GPU type, tensor
degree and micro-batch size, read from `profiles/<model>/<gpu>.csv`.

At a profiled micro-batch size the time is the profile's. Elsewhere, for a GPU type of the spec table (the
catalogue's, or one the cluster file gives), each measured pass is split into the host's part, which does not
grow with the micro-batch, and the GPU's work, which does (docs/cost-model.md section 2.1): the unit's roofline
launch queue (fasop.cost.roofline.PassQueue) is fitted to the measured times with a factor on the host's launches
and one on the GPU's kernels (fit_scales), f(b) = Q_b(a, c). Beyond the profiled sizes t(b) = f(b) times the
nearest profiled size's measured-to-fitted ratio; between two profiled sizes the measured times are mapped along
f. The host's launches count the GPU's kernel_launch_us, or the host floor a measured profile carries
(`kernel_launch_us=` on its identity line, measured by `fasop profile layers`). For a GPU type without a spec,
times are interpolated linearly between profiled sizes and the nearest profiled time is scaled per sample beyond
them.

A GPU type with no bundled profile of the model gets one synthesised from the roofline on its spec, as
`fasop profile synth` writes it (synthesised_profile); a profile folder given must hold every GPU type's.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from fasop.cost.roofline import (
    DENSE,
    Layout,
    PassQueue,
    Rates,
    attention_core_share,
    moe_kind,
    unit_module_share,
    unit_pass_queues,
    unit_seconds,
)
from fasop.errors import ArgumentError, InputError
from fasop.files import CSV_LIMIT_BYTES, read_text
from fasop.inputs import bundled
from fasop.inputs.catalogue import GPU_TABLE, GpuSpec, load_gpu_specs
from fasop.inputs.csvfile import csv_rows
from fasop.inputs.model import PRECISIONS, Model, with_precision

COLUMNS = ("tp", "mbs", "kind", "forward_s", "backward_s")
MEMORY_COLUMN = "peak_memory_bytes"  # optional last column of measured profiles; the search does not read it
IDENTITY_PREFIX = "# fasop-profile:"
# Ranges of a profile row (docs/formats.md).
MAX_DEGREE = 2**16  # tp and mbs
# One unit, one micro-batch: from a picosecond, below any kernel's time (a roofline of tiny units on a host of no
# launch time comes near a nanosecond), so that the partition's ratios of times stay finite
MIN_UNIT_TIME_S, MAX_UNIT_TIME_S = 1e-12, 3600.0
MAX_MEMORY_BYTES = 2**50  # one unit's peak memory
MAX_KERNEL_LAUNCH_US = 1000.0  # the host's time per kernel, as the GPU table's kernel_launch_us
# The tensor degrees and micro-batch sizes `fasop profile synth` estimates by default, and so those of the
# profiles synthesised for GPU types without one.
DEFAULT_DEGREES = (1, 2, 4, 8)
# A row's numbers in ASCII digits (int() and float() also take "1_0", other scripts' digits, "inf" and "nan")
INTEGER = re.compile(r"[0-9]+")
DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# fit_scales: the weight of the pull of log(host) and log(GPU) towards 0 (the spec's figures) against the fit of
# the measured times' logarithms: small, so that it decides only what the measurements leave open; and the
# bound on either logarithm (factors from e^-12 to e^12).
FIT_PRIOR = 1e-3
FIT_BOUND = 12.0
FIT_GRID, FIT_GRIDS = 97, 4  # GPU-to-host ratios tried on each grid, and grids (the last about 1e-5 wide in logarithm)


@dataclass(frozen=True)
class Curve:
    """Times of one (GPU, tensor degree, kind) at the profiled micro-batch sizes, ascending, and the roofline
    shape that scales them to other sizes (None: linear, and per sample beyond the profiled sizes)."""

    mbs: np.ndarray
    forward_s: np.ndarray
    backward_s: np.ndarray
    shape: RooflineShape | None = field(default=None, compare=False, repr=False)
    # per pass, the (host, GPU) factors and the fitted times at the profiled sizes, where they were set rather than
    # fitted (host_scaled: a calibrated host, whose split a refit of one size would not keep)
    fitted: tuple[tuple[tuple[float, float], np.ndarray], ...] | None = field(default=None, compare=False, repr=False)
    # host_scaled: how many times as slow per kernel the host is than the curve's times were measured with
    host_factor: float = field(default=1.0, compare=False, repr=False)

    def at(self, mbs: int) -> tuple[float, float]:
        """(forward_s, backward_s) of one micro-batch of size `mbs`."""
        index = int(np.searchsorted(self.mbs, mbs))
        if index < len(self.mbs) and self.mbs[index] == mbs:
            return float(self.forward_s[index]), float(self.backward_s[index])
        if self.shape is not None:
            return self._roofline_scaled(mbs, index)
        lo, hi = self.mbs[0], self.mbs[-1]
        if mbs <= lo or mbs >= hi:
            edge = 0 if mbs <= lo else -1
            scale = mbs / self.mbs[edge]
            return float(self.forward_s[edge] * scale), float(self.backward_s[edge] * scale)
        return (float(np.interp(mbs, self.mbs, self.forward_s)), float(np.interp(mbs, self.mbs, self.backward_s)))

    def scaled(self, factor: float) -> Curve:
        """Every time multiplied by `factor`, the shape kept (a set split too: the queue is homogeneous)."""
        fitted = None if self.fitted is None else tuple(((host * factor, gpu * factor), times * factor)
                                                        for (host, gpu), times in self.fitted)
        return replace(self, forward_s=self.forward_s * factor, backward_s=self.backward_s * factor, fitted=fitted)

    def host_scaled(self, factor: float) -> Curve:
        """The times of a host `factor` times as slow per kernel: each pass at every size times its launch queue's
        Q(factor a, c) / Q(a, c) at its fitted host and GPU factors (a, c), never below 1 for a slower host; that
        split is kept (a refit of one size would not keep it). Unchanged without a roofline shape: no host part
        to scale."""
        if self.shape is None or factor == 1.0:
            return self
        queues = [self.shape.queues(int(b)) for b in self.mbs]
        times, fitted = [], []
        for column, measured in enumerate((self.forward_s, self.backward_s)):
            (host, gpu), before = self._fits[column]
            after = np.array([q[column].seconds(host * factor, gpu) for q in queues])
            times.append(measured * after / before)
            fitted.append(((host * factor, gpu), after))
        return replace(self, forward_s=times[0], backward_s=times[1], fitted=tuple(fitted),
                       host_factor=self.host_factor * factor)

    def _roofline_scaled(self, mbs: int, index: int) -> tuple[float, float]:
        """Each pass at `mbs`: its launch queue at the profile's fitted host and GPU factors (fit_scales), f(b).
        Beyond the profiled sizes, f times the measured-to-fitted ratio of the nearest one; between two, the
        measured times mapped along f (t_lo + (t_hi - t_lo) (f(b) - f(lo)) / (f(hi) - f(lo)), linear in b where
        f is flat), so that time never falls as the micro-batch grows where the measurements do not. A curve of a
        host `host_factor` f times as slow takes its measured curve's time at `mbs` times Q_b(f a, c) / Q_b(a, c),
        as at the profiled sizes: a slower host makes no size faster."""
        shape = self.shape
        assert shape is not None  # at() calls this only with a shape
        queues = shape.queues(mbs)
        anchors = [shape.queues(int(b)) for b in self.mbs] if self.host_factor != 1.0 else []
        times = []
        for column, measured in enumerate((self.forward_s, self.backward_s)):
            (host, gpu), fitted = self._fits[column]
            scale = 1.0
            if anchors:  # back to the measured curve: its host, and its times at the profiled sizes
                host /= self.host_factor
                before = np.array([q[column].seconds(host, gpu) for q in anchors])
                measured, fitted = measured * before / fitted, before
                scale = queues[column].seconds(host * self.host_factor, gpu) / queues[column].seconds(host, gpu)
            time = queues[column].seconds(host, gpu)
            if index == 0 or index == len(self.mbs):
                edge = min(index, len(self.mbs) - 1)
                time *= measured[edge] / fitted[edge]
            else:
                lo, hi = index - 1, index
                rise = fitted[hi] - fitted[lo]
                share = (time - fitted[lo]) / rise if rise > 0 else (mbs - self.mbs[lo]) / (self.mbs[hi] - self.mbs[lo])
                time = measured[lo] + (measured[hi] - measured[lo]) * share
            times.append(float(time * scale))
        return times[0], times[1]

    @cached_property
    def _anchors(self) -> np.ndarray:
        """(profiled sizes, 2) the roofline at the profiled sizes."""
        assert self.shape is not None
        return np.array([self.shape(int(b)) for b in self.mbs])

    @cached_property
    def _fits(self) -> tuple[tuple[tuple[float, float], np.ndarray], ...]:
        """Per pass: the (host, GPU) factors fitted to the measured times (or set: `fitted`) and the fitted times
        at the profiled sizes."""
        assert self.shape is not None
        if self.fitted is not None:
            return self.fitted
        queues = [self.shape.queues(int(b)) for b in self.mbs]
        fits = []
        for column, measured in enumerate((self.forward_s, self.backward_s)):
            passes = [q[column] for q in queues]
            host, gpu = fit_scales(passes, measured)
            fits.append(((host, gpu), np.array([q.seconds(host, gpu) for q in passes])))
        return tuple(fits)


def fit_scales(queues: list[PassQueue], measured_s: np.ndarray) -> tuple[float, float]:
    """(host, GPU): the factors a and c on the host's launches and on the GPU's kernel times of one unit's pass with
    which its launch queues at the profiled sizes take the measured seconds t_i, in least squares of the
    logarithms, each pulled towards 1 (the spec's figures) with weight FIT_PRIOR. One size fixes only a curve of
    such pairs, and the one nearest (1, 1) in logarithms is taken: a time the queue puts on the host (a small
    micro-batch) moves mostly the host's factor, one it puts on the GPU the GPU's. (1, 1) where the measurement is
    the roofline itself (a synthesised profile).

    Exact in one dimension: the queue is homogeneous, Q_i(a, c) = a f_i(r) with r = c / a and f_i(r) = max over k
    of (issue_k + r suffix_ik), so for each u = ln r the best ln a is the closed form below, and u is searched on
    a grid, then on finer grids around its best point. The queue's max has kinks, so a descent could stop in a
    local minimum; the grid does not."""
    if np.allclose(measured_s, [q.seconds() for q in queues], rtol=1e-9, atol=0):  # as written, to 11 digits
        return 1.0, 1.0
    issue = np.array([q.issue_s for q in queues])  # (sizes, kernels): a unit launches the same kernels at every size
    suffix = np.array([q.suffix_gpu_s for q in queues])
    logged, weight = np.log(measured_s), FIT_PRIOR ** 2
    sizes = len(queues)

    def best(log_ratio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(misfit, log host) at each log GPU-to-host ratio: with g_i = ln f_i - ln t_i, the misfit
        sum (ln a + g_i)^2 + w ((ln a)^2 + (ln a + u)^2) is least at ln a = -(sum g_i + w u) / (n + 2 w)."""
        ends = issue[None] + np.exp(log_ratio)[:, None, None] * suffix[None]  # (grid, sizes, kernels)
        g = np.log(np.maximum(ends.max(axis=2), 1e-300)) - logged
        log_host = -(g.sum(axis=1) + weight * log_ratio) / (sizes + 2 * weight)
        misfit = ((log_host[:, None] + g) ** 2).sum(axis=1) + weight * (log_host ** 2 + (log_host + log_ratio) ** 2)
        return misfit, log_host

    lo, hi = -2 * FIT_BOUND, 2 * FIT_BOUND
    for _ in range(FIT_GRIDS):  # a grid, then finer ones around its best point
        grid = np.linspace(lo, hi, FIT_GRID)
        at = int(np.argmin(best(grid)[0]))
        lo, hi = grid[max(at - 1, 0)], grid[min(at + 1, FIT_GRID - 1)]
    log_ratio = np.array([(lo + hi) / 2])
    log_host = float(np.clip(best(log_ratio)[1][0], -FIT_BOUND, FIT_BOUND))
    return math.exp(log_host), math.exp(float(np.clip(log_host + log_ratio[0], -FIT_BOUND, FIT_BOUND)))


@dataclass(frozen=True)
class RooflineShape:
    """r(b) of one unit (the times `fasop profile synth` writes at the table's figures) and its launch queues; a
    plain object, so that profiles pickle to the search's worker processes."""

    model: Model
    rates: Rates
    tp: int
    kind: str

    def __call__(self, mbs: int, layout: Layout = DENSE) -> tuple[float, float]:
        return unit_seconds(self.model, self.tp, mbs, self.kind, self.rates, layout)

    def queues(self, mbs: int) -> tuple[PassQueue, PassQueue]:
        """The forward and backward launch queues of the roofline (fasop.cost.roofline.PassQueue)."""
        return unit_pass_queues(self.model, self.tp, mbs, self.kind, self.rates)

    def module_share(self, mbs: int, layout: Layout = DENSE, modules: tuple[str, ...] = ("core_attn",)) -> float:
        """The share of the forward time the kernels of `modules` take (fasop.cost.roofline.module_time_share)."""
        return unit_module_share(self.model, self.tp, mbs, self.kind, self.rates, layout, modules)


def roofline_shape(model: Model, spec: GpuSpec, tp: int, kind: str) -> RooflineShape:
    return RooflineShape(model, Rates.of(spec, model), tp, kind)


def _shape(model: Model, spec: GpuSpec | None, tp: int, kind: str) -> RooflineShape | None:
    """The roofline shape, or None (the old rule) without a spec or a tensor-core peak for the model's
    precision (fp32 models, bf16 on GPUs without it): a measured profile needs neither."""
    if spec is None:
        return None
    try:
        return roofline_shape(model, spec, tp, kind)
    except InputError:
        return None


@dataclass(frozen=True)
class GpuProfile:
    gpu: str
    file: str
    curves: dict[tuple[int, str], Curve]
    folder: str | None = None  # profiles_dir as given; None: bundled or synthesised
    synthesised: bool = False  # made from the roofline, not read from a file (`file` then says so)
    precision: str | None = None  # what the file says it was measured or synthesised in (None: it does not say)
    derived_from: str | None = None  # the file's precision, when its times were scaled to the model's (derived)
    kernel_launch_us: float | None = None  # the host floor the file says its maker measured
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tensor_degrees(self) -> tuple[int, ...]:
        return tuple(sorted({tp for tp, _ in self.curves}))

    def time(self, tp: int, kind: str, mbs: int) -> tuple[float, float]:
        curve = self.curves.get((tp, kind))
        if curve is None:
            raise InputError(self.file, f"no rows for tp={tp} kind={kind}")
        return curve.at(mbs)

    def times_s(self, tp: int, kind: str, mbs_values: tuple[int, ...], layout: Layout = DENSE) -> np.ndarray:
        """(K, 2) forward and backward seconds of one unit for each micro-batch size (memoised: searches ask
        often), on one rank of `layout`: the profiled time (a rank of no context or expert parallelism) times the
        roofline's ratio of the layout's time to it, pass by pass (layout_ratio)."""
        key = (tp, kind, mbs_values, layout)
        if key not in self._memo:
            times = np.array([self.time(tp, kind, b) for b in mbs_values]).reshape(-1, 2)
            self._memo[key] = times if layout == DENSE else times * self.layout_ratio(tp, kind, mbs_values, layout)
        return self._memo[key]

    @property
    def prices_layouts(self) -> bool:
        """Whether every unit has a roofline to price context and expert parallelism on (layout_ratio)."""
        return all(isinstance(curve.shape, RooflineShape) for curve in self.curves.values())

    def layout_ratio(self, tp: int, kind: str, mbs_values: tuple[int, ...], layout: Layout) -> np.ndarray:
        """(K, 2) a unit's time on one rank of `layout` over its time without context or expert parallelism, per
        pass, on this GPU's roofline."""
        shape = self.curves[(tp, kind)].shape if (tp, kind) in self.curves else None
        if not isinstance(shape, RooflineShape):
            raise InputError(self.file, f"tp={tp} kind={kind}: context and expert parallelism are priced on the "
                                        f"roofline, and GPU {self.gpu} has no spec to draw one from: give it a [[gpu]] "
                                        "table in the cluster file")
        return np.array([np.divide(shape(b, layout), shape(b)) for b in mbs_values])

    def step_s(self, tp: int, kind: str, mbs_values: tuple[int, ...]) -> np.ndarray:
        """Forward + backward seconds of one unit for each micro-batch size."""
        times = self.times_s(tp, kind, mbs_values)
        return times[:, 0] + times[:, 1]

    def module_forward_s(self, model: Model, tp: int, kind: str, mbs_values: tuple[int, ...],
                         layout: Layout = DENSE, modules: tuple[str, ...] = ("core_attn",)) -> np.ndarray:
        """Forward seconds of a unit's `modules` (fasop.cost.roofline.RECOMPUTE_MODULES; the attention core by
        default) for each micro-batch size (memoised): the forward times their share of it on the roofline of
        this GPU (their time share). Where the profile has no roofline (a GPU the catalogue lacks, a precision
        without a tensor-core peak), the attention core's share of the FLOPs; the other modules are element-wise
        or small, and only a roofline prices them."""
        key = ("modules", tp, kind, mbs_values, layout, modules)
        if key not in self._memo:
            shape = self.curves[(tp, kind)].shape if (tp, kind) in self.curves else None
            if isinstance(shape, RooflineShape):
                shares = np.array([shape.module_share(b, layout, modules) for b in mbs_values])
            elif set(modules) <= {"core_attn"}:
                shares = np.full(len(mbs_values), attention_core_share(model, kind) if modules else 0.0)
            else:
                raise InputError(self.file, f"tp={tp} kind={kind}: recomputing {', '.join(modules)} is priced on "
                                            f"the roofline, and GPU {self.gpu} has no spec to draw one from: give it "
                                            "a [[gpu]] table in the cluster file")
            self._memo[key] = self.times_s(tp, kind, mbs_values, layout)[:, 0] * shares
        return self._memo[key]

    def layer_times_s(self, model: Model, tp: int, kind: str, mbs_values: tuple[int, ...],
                      layout: Layout = DENSE) -> np.ndarray:
        """(K, 2) times_s of the mean layer of segment `kind`: its dense and its MoE layers' units weighted by
        their counts (one unit for a dense model)."""
        return _mean_layer(model, kind, lambda unit: self.times_s(tp, unit, mbs_values, layout))

    def layer_module_forward_s(self, model: Model, tp: int, kind: str, mbs_values: tuple[int, ...],
                               layout: Layout = DENSE, modules: tuple[str, ...] = ("core_attn",)) -> np.ndarray:
        """module_forward_s of the mean layer of segment `kind`."""
        return _mean_layer(model, kind,
                           lambda unit: self.module_forward_s(model, tp, unit, mbs_values, layout, modules))


def _mean_layer(model: Model, kind: str, of_unit: Callable[[str], np.ndarray]) -> np.ndarray:
    """`of_unit` of the mean layer of segment `kind`: of its dense unit and its MoE unit (moe_kind), weighted by
    the segment's share of MoE layers; only the unit the segment has where it has one kind."""
    share = model.moe_share(kind)
    if not share:
        return of_unit(kind)
    moe = of_unit(moe_kind(kind))
    return moe if share == 1 else (1 - share) * of_unit(kind) + share * moe


def required_kinds(model: Model) -> tuple[str, ...]:
    """The units a profile of `model` times, in pipeline order: each segment's dense layer where it has one, and
    its MoE layer where it has one."""
    kinds = ["embedding"]
    for kind in model.layer_kinds:
        if kind == "decoder":
            kinds += ["decoder_embedding"] if model.is_encoder_decoder else []
        if model.moe_share(kind) < 1:
            kinds.append(kind)
        if model.moe_layers(kind):
            kinds.append(moe_kind(kind))
    return (*kinds, "head")


def identity_line(model_name: str, gpu: str, precision: str | None = None, kernel_launch_us: float | None = None) -> str:
    """The comment line that says which model and GPU a profile was made for, in which precision, and the host's
    time per kernel its maker measured (read back by read_profile)."""
    line = f"{IDENTITY_PREFIX} model={model_name} gpu={gpu}" + (f" precision={precision}" if precision else "")
    return line + (f" kernel_launch_us={kernel_launch_us:.4g}" if kernel_launch_us is not None else "")


def _identity(line: str, where: str) -> dict[str, str]:
    fields = dict(item.partition("=")[::2] for item in line[len(IDENTITY_PREFIX):].split())
    if not {"model", "gpu"} <= set(fields) <= {"model", "gpu", "precision", "kernel_launch_us"} \
            or not all(fields.values()) or fields.get("precision", "bf16") not in PRECISIONS:
        raise InputError(where, f"expected '{identity_line('MODEL', 'GPU', 'PRECISION')} kernel_launch_us=US' "
                                f"(precision one of {', '.join(PRECISIONS)}, and the host's microseconds per "
                                f"kernel, optional), got {line.strip()!r}")
    if "kernel_launch_us" in fields:
        try:
            launch_us = float(fields["kernel_launch_us"])
        except ValueError:
            launch_us = math.nan
        if not 0 <= launch_us <= MAX_KERNEL_LAUNCH_US:  # also refuses NaN
            raise InputError(f"{where}: kernel_launch_us", f"expected microseconds from 0 to "
                                                           f"{MAX_KERNEL_LAUNCH_US:g}, got {fields['kernel_launch_us']!r}")
    return fields


def read_profile(path: Path, model: Model, gpu: str, allow_profile_mismatch: bool = False,
                 spec: GpuSpec | None = None) -> GpuProfile:
    """The profile of `model` on `gpu`; a header line naming another model or GPU is refused unless
    `allow_profile_mismatch`. With `spec`, times at sizes not profiled follow the roofline shape on that GPU."""
    file = str(path)
    text = read_text(path, CSV_LIMIT_BYTES, missing=f"no profile for GPU type {gpu} of model {model.name}")
    made_in: dict[str, str] = {}
    numbered = csv_rows(_data_lines(text, file, {"model": model.name, "gpu": gpu}, allow_profile_mismatch, made_in),
                        file)
    header = numbered[0][1] if numbered else []
    if tuple(header) not in (COLUMNS, COLUMNS + (MEMORY_COLUMN,)):
        raise InputError(file, f"expected the header {','.join(COLUMNS)}[,{MEMORY_COLUMN}], got {','.join(header)}")
    kinds = required_kinds(model)
    rows: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    for number, cells in numbered[1:]:
        tp, kind, mbs, forward, backward = _row(cells, header, f"{file}: line {number}", kinds, model.architecture)
        rows.setdefault((tp, kind), []).append((mbs, forward, backward))
    precision = made_in.get("precision") or model.high_precision  # a file that does not say: the model's
    floor_us = float(made_in["kernel_launch_us"]) if "kernel_launch_us" in made_in else None
    if spec is not None and floor_us is not None:  # the host floor its maker measured
        spec = replace(spec, kernel_launch_us=floor_us)
    if precision == model.precision:
        return GpuProfile(gpu, file, _curves(rows, file, kinds, model, spec), precision=made_in.get("precision"),
                          kernel_launch_us=floor_us)
    if spec is None:
        raise InputError(file, f"measured in {precision}; the model trains in {model.precision}, and GPU {gpu} has no "
                               "spec (clusters/catalogue/gpus.toml) to convert its times with")
    measured = with_precision(model, precision)
    curves = _curves(rows, file, kinds, measured, spec)
    return GpuProfile(gpu, file, {key: _converted(curve, model, spec, *key) for key, curve in curves.items()},
                      precision=precision, derived_from=precision, kernel_launch_us=floor_us)


def _converted(curve: Curve, model: Model, spec: GpuSpec, tp: int, kind: str) -> Curve:
    """A curve measured in another precision, scaled at each profiled size by the roofline's ratio of `model`'s
    precision to the measured one, unit by unit and pass by pass (its GEMMs at their own rate, the rest unchanged:
    fasop.cost.roofline); beyond the profiled sizes it follows `model`'s roofline shape."""
    shape = RooflineShape(model, Rates.of(spec, model), tp, kind)
    assert curve.shape is not None  # read with a spec
    ratio = np.array([shape(int(b)) for b in curve.mbs]) / curve._anchors
    return Curve(curve.mbs, curve.forward_s * ratio[:, 0], curve.backward_s * ratio[:, 1], shape)


def _data_lines(text: str, file: str, wanted: dict[str, str], allow_profile_mismatch: bool,
                made_in: dict[str, str]) -> list[tuple[int, str]]:
    """(line number, text) of the CSV lines, after checking the identity line against the `wanted` model and
    GPU (its fields into `made_in`); comments and blank lines left out."""
    numbered = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(IDENTITY_PREFIX):
            made_for = _identity(line, f"{file}: line {number}")
            made_in.update(made_for)
            for key in ("model", "gpu"):
                if made_for[key] != wanted[key] and not allow_profile_mismatch:
                    raise InputError(f"{file}: line {number}: {key}", f"the profile was made for {key} {made_for[key]}, "
                                     f"not {wanted[key]}; allow the mismatch to use it anyway",
                                     remedy="allow_profile_mismatch")
        elif line.strip() and not line.lstrip().startswith("#"):
            numbered.append((number, line))
    return numbered


def _row(cells: list[str], header: list[str], where: str, kinds: tuple[str, ...],
         architecture: str) -> tuple[int, str, int, float, float]:
    """(tp, kind, mbs, forward_s, backward_s) of one data line, each cell checked."""
    if len(cells) != len(header):
        raise InputError(where, f"expected {len(header)} cells ({','.join(header)}), got {len(cells)}")
    row = dict(zip(header, cells))
    tp, mbs = (_number(row[key], INTEGER, int) for key in ("tp", "mbs"))
    for key, degree in (("tp", tp), ("mbs", mbs)):
        if not 1 <= degree <= MAX_DEGREE:  # also refuses NaN
            raise InputError(f"{where}: {key}", f"expected an integer from 1 to {MAX_DEGREE}, got {row[key]!r}")
    forward, backward = (_number(row[key], DECIMAL, float) for key in ("forward_s", "backward_s"))
    for key, seconds in (("forward_s", forward), ("backward_s", backward)):
        if not MIN_UNIT_TIME_S <= seconds <= MAX_UNIT_TIME_S:
            raise InputError(f"{where}: {key}", f"expected seconds >= {MIN_UNIT_TIME_S:g} and <= {MAX_UNIT_TIME_S:g}, "
                                                f"got {row[key]!r}")
    memory = row.get(MEMORY_COLUMN)
    if memory is not None and not 0 <= _number(memory, INTEGER, int) <= MAX_MEMORY_BYTES:
        raise InputError(f"{where}: {MEMORY_COLUMN}", f"expected bytes from 0 to 2**50, got {memory!r}")
    if row["kind"] not in kinds:
        raise InputError(f"{where}: kind", f"{row['kind']!r} is not one of {', '.join(kinds)} ({architecture} model)")
    return int(tp), row["kind"], int(mbs), forward, backward


def _number(cell: str, pattern: re.Pattern[str], kind: type[int] | type[float]) -> float:
    """The number a cell holds, written as `pattern` says; else NaN, which every range refuses."""
    try:
        return kind(cell) if pattern.fullmatch(cell) else math.nan
    except ValueError:  # more digits than int() converts
        return math.nan


def _curves(rows: dict[tuple[int, str], list[tuple[int, float, float]]], file: str, kinds: tuple[str, ...],
            model: Model, spec: GpuSpec | None) -> dict[tuple[int, str], Curve]:
    """One curve over micro-batch sizes per (tp, kind); every kind present at every tensor degree listed."""
    curves: dict[tuple[int, str], Curve] = {}
    for (tp, kind), entries in rows.items():
        entries.sort()
        sizes = [e[0] for e in entries]
        if len(set(sizes)) != len(sizes):
            raise InputError(file, f"micro-batch size listed twice for tp={tp} kind={kind}")
        table = np.array(entries, dtype=float)
        curves[(tp, kind)] = Curve(table[:, 0], table[:, 1], table[:, 2], _shape(model, spec, tp, kind))
    for tp in sorted({tp for tp, _ in curves}):
        missing = [k for k in kinds if (tp, k) not in curves]
        if missing:
            raise InputError(file, f"tp={tp} has no rows for kind {', '.join(missing)}")
    if not curves:
        raise InputError(file, "no profile rows")
    return curves


def profile_paths(model: Model, gpus, profiles_dir: str | None = None) -> dict[str, Path]:
    """The profile files of `model` to read, by GPU type: every <gpu>.csv of `profiles_dir`, or by default those
    the bundled profiles/<model> holds (the other GPU types get synthesised profiles)."""
    if not profiles_dir:
        folder = bundled.data_dir("profiles") / model.name
        return {gpu: folder / f"{gpu}.csv" for gpu in sorted(set(gpus)) if (folder / f"{gpu}.csv").exists()}
    folder = Path(profiles_dir)
    if not folder.is_dir():
        raise ArgumentError("profiles_dir", "no such folder (expected one <gpu>.csv per GPU type)", profiles_dir)
    return {gpu: folder / f"{gpu}.csv" for gpu in sorted(set(gpus))}


def _measure_command(model: Model, gpu: str, out: str) -> str:
    """The command that measures a profile of `model` on `gpu` into `out`."""
    return f"`fasop profile layers --model {shlex.quote(model.file or model.name)} --gpu {gpu} --out {shlex.quote(out)}`"


def _how_to_profile(model: Model, gpu: str, out: str) -> str:
    return (f"measure one with {_measure_command(model, gpu, out)}, "
            "or estimate one with `fasop profile synth` and the same options")


def load_profiles(model: Model, gpus: list[str], profiles_dir: str | None = None, allow_profile_mismatch: bool = False,
                  specs: dict[str, GpuSpec] | None = None) -> dict[str, GpuProfile]:
    """Profiles of `model` for each GPU type: from `profiles_dir`, which must hold each, or by default from the
    bundled profiles/<model>, a GPU type without one there synthesised from its spec (measured profiles and
    the user's folder always win over the roofline). A GPU type of `specs` (default: the bundled
    clusters/catalogue/gpus.toml) scales its times with its roofline shape. `allow_profile_mismatch`: read a profile made
    for another model or GPU (refused otherwise)."""
    specs = load_gpu_specs() if specs is None else specs
    paths = profile_paths(model, gpus, profiles_dir)
    profiles = {}
    for gpu in sorted(set(gpus)):
        path = paths.get(gpu)
        if path is None:
            profiles[gpu] = synthesised_profile(model, gpu, specs.get(gpu))
            continue
        if not path.exists():
            raise InputError(str(path), f"no profile of model {model.name} for GPU type {gpu}: "
                                        + _how_to_profile(model, gpu, str(path)))
        read = read_profile(path, model, gpu, allow_profile_mismatch, specs.get(gpu))
        profiles[gpu] = replace(read, folder=profiles_dir, _memo={})
    return profiles


def synthesised_profile(model: Model, gpu: str, spec: GpuSpec | None) -> GpuProfile:
    """The profile `fasop profile synth --model MODEL --gpu GPU` writes (at its default tensor degrees that split
    the model, and micro-batch sizes), made in memory: the roofline times themselves, and its shape beyond."""
    where = f"model {model.name}"
    missing = f"no profile for GPU type {gpu}"
    if spec is None:
        raise InputError(where, f"{missing}, and no spec of {gpu} to synthesise one from: add a [[gpu]] table of "
                                f"{gpu} ({GPU_TABLE}'s format) to the cluster file, or measure one with "
                                f"{_measure_command(model, gpu, f'DIR/{gpu}.csv')} into a profile folder that "
                                "holds every GPU type's profile", remedy="profiles_dir")
    try:
        rates = Rates.of(spec, model)
    except InputError as err:  # fp32 models, bf16 on GPUs without it
        raise InputError(where, f"{missing}, and none can be synthesised ({err})") from None
    splits = (model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size)
    sizes = np.array(DEFAULT_DEGREES, dtype=float)
    curves = {}
    for tp in (t for t in DEFAULT_DEGREES if all(value % t == 0 for value in splits)):
        for kind in required_kinds(model):
            shape = RooflineShape(model, rates, tp, kind)
            times = np.array([shape(b) for b in DEFAULT_DEGREES])
            curves[(tp, kind)] = Curve(sizes, times[:, 0], times[:, 1], shape)
    return GpuProfile(gpu, f"{model.name} on {gpu}, synthesised from the roofline", curves, synthesised=True)


def profile_sources(profiles: dict[str, GpuProfile]) -> dict[str, str | list[str]]:
    """The plan fields that say which profiles a plan was made with: `profiles`, the --profiles folder as given,
    and `synthesised_profiles`, the GPU types whose profiles were synthesised; neither for bundled profiles."""
    sources: dict[str, str | list[str]] = {}
    folders = {p.folder for p in profiles.values() if p.folder is not None}
    if len(folders) == 1:  # profiles from several folders (by hand, in Python) name none
        sources["profiles"] = folders.pop()
    synthesised = sorted(gpu for gpu, p in profiles.items() if p.synthesised)
    if synthesised:
        sources["synthesised_profiles"] = synthesised
    return sources
