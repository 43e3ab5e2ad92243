"""Calibration: a few named factors fitted to measured runs so that estimates match the user's hardware.

The factors, each with bounds:

- `compute_time_scale.<gpu>`: a multiplier on every time of that GPU type's profile (1.3: the GPU takes 30%
  longer than profiled, e.g. a profile measured on a faster part, or a synthetic one), and on its optimizer step
  (its node types' memory bandwidth is divided by it). Bounds 0.25 to 4.
- `host_time_scale.<gpu>`: a multiplier on the host's time per kernel (the launch queue of docs/cost-model.md
  section 2.1) in that GPU type's profile: each pass's host and GPU parts are split on its roofline, and the
  host's launches take this many times as long (10: a host ten times slower per kernel than the spec or the
  profile's measured floor). Only for a GPU type whose profile has a roofline (a spec), and fitted only where the
  host matters to some run: where a host HOST_PROBE times as slow would move its estimate by more than the
  fit's scale of noise; elsewhere the runs cannot tell the host's time from the GPU's. Bounds 0.1 to 100, and at
  most MAX_KERNEL_LAUNCH_US per kernel (what a GPU table and a profile take).
- `bandwidth_scale.intra_node` / `bandwidth_scale.inter_node`: the fraction of the cluster file's (already
  derated) bandwidth that transfers inside a node / between nodes achieve; pipeline sends and all-reduces
  alike. Bounds 0.1 to 10. Written as derating: each `[cluster.derating]` field of that link kind is divided
  by it.

The fit is robust least squares (scipy.optimize.least_squares, soft-L1 loss with a 5% scale, so one odd run
cannot drag the factors) on log(estimate / measurement), over the logarithms of the factors. A factor that no
run depends on (no run crosses nodes, say) is not fitted and stays 1. Every evaluation is a full estimate of
each run with scaled profiles, memory bandwidths and derating, so the fit and the estimate cannot drift apart.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fasop import files
from fasop.calibration.measured import MeasuredRun
from fasop.calibration.validate import Setting, mape_pct, predict_step_s
from fasop.errors import ArgumentError, InputError
from fasop.inputs.bandwidth import MAX_BANDWIDTH_BYTES_PER_S, MIN_BANDWIDTH_BYTES_PER_S, bandwidth_bytes_per_s
from fasop.inputs.catalogue import GpuTable, gpu_tables, merged_specs
from fasop.inputs.cluster import Cluster
from fasop.inputs.csvfile import csv_rows
from fasop.inputs.profiles import (
    DEFAULT_DEGREES,
    IDENTITY_PREFIX,
    MAX_KERNEL_LAUNCH_US,
    MAX_UNIT_TIME_S,
    MIN_UNIT_TIME_S,
    GpuProfile,
)
from fasop.inputs.tomlfile import read_toml
from fasop.profile import synth

COMPUTE_BOUNDS = (0.25, 4.0)
HOST_BOUNDS = (0.1, 100.0)
BANDWIDTH_BOUNDS = (0.1, 10.0)
LINK_KINDS = ("intra_node", "inter_node")
LOSS_SCALE = 0.05  # residuals (log ratios) beyond about 5% count linearly, not quadratically
UNUSED_SENSITIVITY = 1e-9  # doubling a factor moves no estimate by more than this (log ratio): not fitted
# The host factor is fitted only where a host HOST_PROBE times as slow per kernel moves some run's estimate by more
# than the fit's own scale of noise (LOSS_SCALE, log ratio): eager PyTorch units measured on one H100 host took 61
# to 64 us per kernel against the catalogue's 5 (validation/profiles/README.md), about 12 times. Where it moves no
# run by more, the runs' times are the GPU's, and their scatter would be fitted as a host.
HOST_PROBE = 10.0


FACTOR_KINDS = {"compute": ("compute_time_scale", COMPUTE_BOUNDS), "host": ("host_time_scale", HOST_BOUNDS),
                "bandwidth": ("bandwidth_scale", BANDWIDTH_BOUNDS)}


@dataclass(frozen=True)
class Factor:
    kind: str  # "compute", "host" or "bandwidth"
    key: str  # a GPU type or a link kind

    @property
    def name(self) -> str:
        return f"{FACTOR_KINDS[self.kind][0]}.{self.key}"

    @property
    def bounds(self) -> tuple[float, float]:
        return FACTOR_KINDS[self.kind][1]


def factors_of(settings: list[Setting]) -> list[Factor]:
    """A compute factor per GPU type, a host factor per GPU type whose profile has a roofline to split the host's
    part from (a spec), a bandwidth factor per link kind."""
    gpus = sorted({g for s in settings for g in s.profiles})
    split = [g for g in gpus if any(c.shape is not None for s in settings if g in s.profiles
                                    for c in s.profiles[g].curves.values())]
    return ([Factor("compute", g) for g in gpus] + [Factor("host", g) for g in split]
            + [Factor("bandwidth", k) for k in LINK_KINDS])


def adjusted_profile(profile: GpuProfile, compute: float, host: float = 1.0) -> GpuProfile:
    """`profile` with its host `host` times as slow per kernel (Curve.host_scaled), then every time x `compute`."""
    curves = {key: c.host_scaled(host).scaled(compute) for key, c in profile.curves.items()}
    return replace(profile, curves=curves, _memo={})


def derated(cluster: Cluster, intra_scale: float, inter_scale: float) -> Cluster:
    """`cluster` whose links achieve `intra_scale` / `inter_scale` times the bandwidth its file gives."""
    d = cluster.derating
    return replace(cluster, derating=replace(
        d, p2p_intra_node=d.p2p_intra_node / intra_scale, collective_intra_node=d.collective_intra_node / intra_scale,
        p2p_inter_node=d.p2p_inter_node / inter_scale, collective_inter_node=d.collective_inter_node / inter_scale))


class Calibration:
    """Measured runs on one cluster, and their estimates as a function of the factors. `setting`: the one setting
    of every run (one model, as `fasop calibrate` fits), or a list of each run's own (runs of several models, or
    with profiles of their own, on one cluster: the factors are per GPU type and link kind, not per model)."""

    def __init__(self, runs: list[MeasuredRun], setting: Setting | list[Setting]):
        self.settings = setting if isinstance(setting, list) else [setting] * len(runs)
        if len(self.settings) != len(runs):
            raise ArgumentError("setting", f"expected one setting per run ({len(runs)}), got {len(self.settings)}")
        if any(s.cluster != self.settings[0].cluster for s in self.settings):
            raise ArgumentError("setting", "expected the runs' settings to share one cluster: the bandwidth factors "
                                           "are the cluster's")
        self.runs, self.setting = runs, self.settings[0]  # `setting`: the first run's (every run's for one model)
        self.factors = factors_of(self.settings)
        self.bounds = {f: self._bounds(f) for f in self.factors}
        self.measured_s = np.array([r.measured_step_s for r in runs])

    def _bounds(self, factor: Factor) -> tuple[float, float]:
        """A factor's bounds, kept so that the calibrated files read: a compute factor's below the longest time a
        profile row holds (MAX_UNIT_TIME_S) for the GPU type's longest profiled time, a host factor's below the
        longest time per kernel a GPU table or profile takes (MAX_KERNEL_LAUNCH_US) for the GPU type's longest host
        time per kernel. A row that the factors take further still (by a fitted host factor, or a file in another
        precision than the times fitted) is refused when the profiles are written (calibrated_profile_text)."""
        low, high = factor.bounds
        curves = [c for s in {id(s): s for s in self.settings}.values() if factor.key in s.profiles
                  for c in s.profiles[factor.key].curves.values()]
        if factor.kind == "compute":
            most = MAX_UNIT_TIME_S / max(max(c.forward_s.max(), c.backward_s.max()) for c in curves)
        elif factor.kind == "host":
            launch_us = max(c.shape.rates.kernel_launch_s * 1e6 for c in curves if c.shape is not None)
            most = MAX_KERNEL_LAUNCH_US / launch_us if launch_us > 0 else high
        else:
            return low, high
        return low, max(low, min(high, float(most)))

    def inputs(self, values: dict[Factor, float], setting: Setting | None = None) -> tuple[Cluster, dict[str, GpuProfile]]:
        """The cluster and profiles of `setting` (the first run's by default) that `values` make: each GPU type's
        profile times and optimizer step scaled by its compute factor, each link kind's bandwidth by its
        bandwidth factor."""
        s = setting or self.setting
        scales = {g: values[Factor("compute", g)] for g in s.profiles}
        cluster = derated(s.cluster, values[Factor("bandwidth", "intra_node")], values[Factor("bandwidth", "inter_node")])
        return cluster.with_memory_time_scales(scales), {
            g: adjusted_profile(p, scales[g], values.get(Factor("host", g), 1.0)) for g, p in s.profiles.items()}

    def predict(self, values: dict[Factor, float], runs: list[int] | None = None) -> np.ndarray:
        made: dict[int, tuple[Cluster, dict[str, GpuProfile]]] = {}  # each setting's scaled inputs, made once
        predicted = []
        for i in range(len(self.runs)) if runs is None else runs:
            s = self.settings[i]
            if id(s) not in made:
                made[id(s)] = self.inputs(values, s)
            cluster, profiles = made[id(s)]
            predicted.append(predict_step_s(self.runs[i], s.model, cluster, profiles))
        return np.array(predicted)

    def unit(self) -> dict[Factor, float]:
        return dict.fromkeys(self.factors, 1.0)

    def exercised(self, runs: list[int] | None = None) -> list[Factor]:
        """The factors the estimate of some run (of `runs`, by default every run) depends on: doubling the factor
        moves it; a host factor, HOST_PROBE times it moves it by more than LOSS_SCALE."""
        base = np.log(self.predict(self.unit(), runs))

        def moves(f: Factor) -> bool:
            probe, threshold = (HOST_PROBE, LOSS_SCALE) if f.kind == "host" else (2.0, UNUSED_SENSITIVITY)
            return bool(np.max(np.abs(np.log(self.predict({**self.unit(), f: probe}, runs)) - base)) > threshold)

        return [f for f in self.factors if moves(f)]

    def fit(self, free: list[Factor], runs: list[int], start: dict[Factor, float] | None = None) -> dict[Factor, float]:
        """Values of the `free` factors (the others 1) that best explain the measured `runs`."""
        from scipy.optimize import least_squares

        measured = np.log(self.measured_s[runs])

        def values(x: np.ndarray) -> dict[Factor, float]:
            return {**self.unit(), **{f: float(math.exp(v)) for f, v in zip(free, x)}}

        def residuals(x: np.ndarray) -> np.ndarray:
            return np.log(self.predict(values(x), runs)) - measured

        x0 = np.log([(start or {}).get(f, 1.0) for f in free])
        low, high = np.log([self.bounds[f][0] for f in free]), np.log([self.bounds[f][1] for f in free])
        result = least_squares(residuals, np.clip(x0, low, high), bounds=(low, high), loss="soft_l1",
                               f_scale=LOSS_SCALE)
        return values(result.x)


@dataclass(frozen=True)
class Outcome:
    values: dict[Factor, float]
    free: list[Factor]
    mape_before_pct: float
    mape_after_pct: float  # fitted on every run, scored on the same runs
    mape_loo_pct: float | None  # each run estimated by a fit on the others; None for a single run
    held_out_ratios: tuple[float, ...] = ()  # measured / that estimate, per run; empty for a single run
    bounds: dict[Factor, tuple[float, float]] = field(default_factory=dict)  # where not Factor.bounds

    def error_band(self, measured: str, date: str) -> dict | None:
        """The `[cluster.error_band]` table of the calibrated file: the band of the runs estimated by fits on the
        others (a fit scored on its own runs would claim a narrower band than new runs will show); None for one run."""
        if not self.held_out_ratios:
            return None
        return {"low": round(min(self.held_out_ratios), 4), "high": round(max(self.held_out_ratios), 4),
                "runs": len(self.held_out_ratios), "source": f"fasop calibrate on {measured}, leave-one-out",
                "date": date}


def calibrate(calibration: Calibration, progress: Callable[[int, int], None] | None = None) -> Outcome:
    """The factors fitted on every run, and the leave-one-out error: one fit per run on the others.
    `progress(done, total)` after each fit."""
    n = len(calibration.runs)
    measured = calibration.measured_s
    before = calibration.predict(calibration.unit())
    free = calibration.exercised()
    everything = list(range(n))
    fits = 1 + n if n > 1 else 1
    values = calibration.fit(free, everything) if free else calibration.unit()
    if progress:
        progress(1, fits)
    after = calibration.predict(values)
    loo: float | None = None
    ratios: tuple[float, ...] = ()
    if n > 1:
        held_out = []
        for i in range(n):
            others = [j for j in everything if j != i]
            fitted = calibration.fit(free, others, start=values) if free else values
            held_out.append(calibration.predict(fitted, [i])[0])
            if progress:
                progress(2 + i, fits)
        loo = mape_pct(np.array(held_out), measured)
        ratios = tuple(float(r) for r in measured / np.array(held_out))
    return Outcome(values, free, mape_pct(before, measured), mape_pct(after, measured), loo, ratios,
                   calibration.bounds)


def factor_lines(outcome: Outcome) -> list[str]:
    """One line per factor: its value and bounds, or why it was not fitted."""
    width = max(len(f.name) for f in outcome.values)
    lines = []
    for f, value in outcome.values.items():
        low, high = outcome.bounds.get(f, f.bounds)
        if f not in outcome.free:
            note = "not fitted: " + ("the GPU's work, not the host's launches, sets every run's time" if f.kind == "host"
                                     else "no run depends on it")
        elif min(abs(math.log(value / low)), abs(math.log(value / high))) < 1e-6:
            note = f"at its bound ({low:g} to {high:g}): the runs would take it further"
        else:
            note = f"bounds {low:g} to {high:g}"
        lines.append(f"{f.name:<{width}}  {value:.4f}  {note}")
    return lines


# -- the written files ---------------------------------------------------------------------------------

def provenance(outcome: Outcome, measured: str, date: str, runs: int, setting: Setting) -> list[str]:
    """Comment lines saying what was fitted, to what, when, and how well."""
    loo = "n/a" if outcome.mape_loo_pct is None else f"{outcome.mape_loo_pct:.2f}%"
    return [f"Calibrated by fasop calibrate on {date} from {runs} measured runs in {measured}",
            f"(model {setting.model.name}, cluster {setting.cluster.name}); input cluster file {setting.cluster_path}.",
            "Fitted factors (docs/formats.md, section Calibration, says what each means):",
            *(f"  {line}" for line in factor_lines(outcome)),
            f"MAPE {outcome.mape_before_pct:.2f}% before, {outcome.mape_after_pct:.2f}% after, {loo} leave-one-out."]


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON escapes are TOML escapes; TOML also wants DEL escaped
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007F")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_tables(path: str, table: dict, lines: list[str]) -> None:
    """`table` as TOML at `path`: its plain values, then its sub-tables and arrays of tables."""
    def is_array_of_tables(v):
        return isinstance(v, list) and v and all(isinstance(e, dict) for e in v)

    for key, value in table.items():
        if not isinstance(value, dict) and not is_array_of_tables(value):
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in table.items():
        sub = f"{path}.{_toml_key(key)}" if path else _toml_key(key)
        if isinstance(value, dict):
            lines += ["", f"[{sub}]"]
            _toml_tables(sub, value, lines)
        elif is_array_of_tables(value):
            for entry in value:
                lines += ["", f"[[{sub}]]"]
                _toml_tables(sub, entry, lines)


# every efficiency of a GPU table, each divided by a fitted compute factor
EFFICIENCY_FIELDS = ("matmul_efficiency", "fp8_matmul_efficiency", "sustained_matmul_efficiency",
                     "sustained_fp8_matmul_efficiency")


def calibrated_gpu_tables(cluster: Cluster, outcome: Outcome, measured: str, date: str) -> tuple[list[dict], list[str]]:
    """A [[gpu]] table for each GPU type with a fitted compute_time_scale or host_time_scale and a spec in the
    catalogue (bundled, then the cluster file's own): every figure of its spec, with its efficiencies, attention
    speeds and memory_bandwidth_gb_per_s divided by the compute scale and its kernel_launch_us times the host scale,
    so that `fasop profile synth` reads the calibrated figures; and a comment line instead for each GPU whose
    efficiency would leave (0, 1] or whose calibrated figures leave a GPU table's range."""
    specs = merged_specs(own=cluster.gpus)
    tables, notes = [], []
    for gpu in sorted({f.key for f in outcome.free if f.kind in ("compute", "host")}):
        compute, host = (outcome.values.get(Factor(kind, gpu), 1.0) for kind in ("compute", "host"))
        if gpu not in specs or compute == host == 1.0:
            continue
        spec = specs[gpu]
        efficiencies = {name: getattr(spec, name) / compute for name in EFFICIENCY_FIELDS if getattr(spec, name) is not None}
        above = [name for name, efficiency in efficiencies.items() if efficiency > 1.0]
        if above:
            notes.append(f"No [[gpu]] table for {spec.name}: {above[0]} {getattr(spec, above[0]):g} ({spec.file}) / "
                         f"compute_time_scale.{gpu} {compute:.4f} = {efficiencies[above[0]]:.4f} is above 1, so the runs "
                         "are faster than its other figures (peak, memory bandwidth, link) allow; check them.")
            continue
        origin = spec.file + (f" ({spec.source})" if spec.source else "")
        table = {name: getattr(spec, name) for name in GpuTable.model_fields}
        table.update(
            **efficiencies, memory_bandwidth_gb_per_s=spec.memory_bandwidth_gb_per_s / compute,
            kernel_launch_us=spec.kernel_launch_us * host,
            attention_tflops=[[d, n, *(speed / compute for speed in speeds)] for d, n, *speeds in spec.attention_tflops],
            source=f"fasop calibrate on {measured}: matmul_efficiency {spec.matmul_efficiency:g} (its FP8 one and "
                   f"its attention speeds alike) and memory_bandwidth_gb_per_s {spec.memory_bandwidth_gb_per_s:g} / "
                   f"compute_time_scale.{gpu} {compute:.6g}, kernel_launch_us {spec.kernel_launch_us:g} x "
                   f"host_time_scale.{gpu} {host:.6g}; the other figures from {origin}",
            date=date)
        # TOML has no null: a figure the spec leaves out stays out
        table = {key: [list(row) for row in value] if isinstance(value, tuple) else value
                 for key, value in table.items() if value not in (None, (), [])}
        try:
            gpu_tables([table], "the calibrated cluster file")
        except InputError as err:
            notes.append(f"No [[gpu]] table for {spec.name}: its calibrated figures are out of a GPU table's range ({err}).")
            continue
        tables.append(table)
    return tables, notes


def calibrate_node_types(node_types: list[dict], cluster: Cluster, outcome: Outcome) -> list[str]:
    """Writes into each [[node_type]] table whose GPU type has a fitted compute_time_scale its memory bandwidth
    (its own, else its GPU's spec's) divided by the scale, so that the optimizer step scales as in the fit; returns
    a comment line for each whose divided bandwidth is out of the range a cluster file takes (the table kept)."""
    specs = merged_specs(own=cluster.gpus)
    notes = []
    for table in node_types:
        factor = Factor("compute", table["gpu"])
        scale = outcome.values.get(factor, 1.0)
        if factor not in outcome.free or scale == 1.0:
            continue
        given = table.get("gpu_memory_bandwidth")
        bandwidth = bandwidth_bytes_per_s(given) if given else specs[table["gpu"]].memory_bytes_per_s
        if not MIN_BANDWIDTH_BYTES_PER_S <= bandwidth / scale <= MAX_BANDWIDTH_BYTES_PER_S:
            notes.append(f"node_type {table['name']} keeps its gpu_memory_bandwidth: {bandwidth / 1e9:g} GB/s / "
                         f"{factor.name} {scale:.4f} is outside 1 kB/s to 1 PB/s, so its optimizer step is not "
                         "calibrated.")
            continue
        table["gpu_memory_bandwidth"] = f"{bandwidth / scale / 1e9!r} GB/s"
    return notes


def calibrated_cluster_text(cluster_path: Path, cluster: Cluster, outcome: Outcome, comments: list[str],
                            measured: str, date: str) -> str:
    """The input cluster file with its derating divided by the fitted bandwidth scales, its node types' memory
    bandwidths divided by the compute scales (calibrate_node_types), calibrated [[gpu]] tables
    (calibrated_gpu_tables) replacing or added to its own, and `comments` on top."""
    raw = read_toml(cluster_path)
    gpus, notes = calibrated_gpu_tables(cluster, outcome, measured, date)
    notes += calibrate_node_types(raw["node_type"], cluster, outcome)
    if gpus:
        replaced = {g["name"] for g in gpus}
        raw["gpu"] = [g for g in raw.get("gpu", []) if g.get("name") not in replaced] + gpus
    calibrated = derated(cluster, outcome.values[Factor("bandwidth", "intra_node")],
                         outcome.values[Factor("bandwidth", "inter_node")]).derating
    head = raw.setdefault("cluster", {})
    head["derating"] = {k: getattr(calibrated, k) for k in type(calibrated).__dataclass_fields__}
    band = outcome.error_band(measured, date)
    if band is not None:
        head["error_band"] = band
    else:
        head.pop("error_band", None)  # a band of other runs, or of the file before this fit, no longer applies
    mark = "(calibrated by fasop calibrate)"
    if mark not in head.get("description", ""):
        head["description"] = f"{head.get('description', '')} {mark}".strip()
    lines = [files.comment_line(line) for line in comments + notes]  # paths: a newline there would start a TOML line
    _toml_tables("", raw, lines)
    return "\n".join(lines) + "\n"


def calibrated_profile_text(setting: Setting, gpu: str, values: dict[Factor, float], comments: list[str]) -> str:
    """The profile file of `gpu` with the fitted compute and host factors applied to every row (adjusted_profile;
    the host factor to its measured floor too, where the identity line carries one), its own comments kept under
    `comments` (a synthesised profile: the file `fasop profile synth` writes of it). A time taken past the longest
    a profile row holds (MAX_UNIT_TIME_S) is an InputError: the file would not read back."""
    profile = setting.profiles[gpu]
    compute, host = values[Factor("compute", gpu)], values.get(Factor("host", gpu), 1.0)
    adjusted = adjusted_profile(profile, compute, host)
    if profile.synthesised:
        spec = merged_specs(own=setting.cluster.gpus)[gpu]
        tps = profile.tensor_degrees
        text = synth.format_profile(synth.synthesize(setting.model, spec, tps, DEFAULT_DEGREES),
                                    synth.header_lines(setting.model, spec, tps, DEFAULT_DEGREES))
    else:
        text = files.read_text(profile.file, files.CSV_LIMIT_BYTES)
    kept = [_host_scaled_identity(line, host) for line in text.splitlines() if line.lstrip().startswith("#")]
    rows = csv_rows(((n, line) for n, line in enumerate(text.splitlines(), start=1)
                     if line.strip() and not line.lstrip().startswith("#")), profile.file)
    header = rows[0][1]
    timed = [header.index("forward_s"), header.index("backward_s")]
    applied = f"profile times x {compute:.6g} (compute_time_scale.{profile.gpu})"
    if host != 1.0:
        applied += f", the host's part of each pass x {host:.6g} (host_time_scale.{profile.gpu}) first"
    out = [files.comment_line(line) for line in comments] + [
        files.comment_line(f"{applied}; scaled from {profile.file}, whose comments follow:")] + kept
    out.append(",".join(header))
    for number, row in rows[1:]:
        unit = (int(row[header.index("tp")]), row[header.index("kind")], int(row[header.index("mbs")]))
        ratios = np.divide(adjusted.time(*unit), profile.time(*unit))
        scaled = {i: format(float(row[i]) * ratio, ".10g") for i, ratio in zip(timed, ratios)}
        for i, seconds in scaled.items():
            if not MIN_UNIT_TIME_S <= float(seconds) <= MAX_UNIT_TIME_S:  # as the profile reader takes it
                raise InputError(f"{profile.file}: line {number}: {header[i]}",
                                 f"{row[i]} s calibrated ({applied}) is {seconds} s; a profile holds seconds >= "
                                 f"{MIN_UNIT_TIME_S:g} and <= {MAX_UNIT_TIME_S:g}, so no calibrated profile of "
                                 f"{profile.gpu} can be written")
        out.append(",".join(scaled.get(i, v) for i, v in enumerate(row)))
    return "\n".join(out) + "\n"


_LAUNCH_FIELD = re.compile(r"(?<=\skernel_launch_us=)\S+")


def _host_scaled_identity(line: str, host: float) -> str:
    """A comment line of a profile; its identity line's measured host floor times `host`."""
    if host == 1.0 or not line.lstrip().startswith(IDENTITY_PREFIX):
        return line
    return _LAUNCH_FIELD.sub(lambda found: format(float(found.group()) * host, ".4g"), line)
