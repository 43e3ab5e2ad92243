"""Estimates against measurements: each measured run's plan is estimated afresh (as `fasop estimate` does)
from its model, cluster and profiles, and the estimates are scored against the measured step times."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fasop.calibration.measured import MeasuredRun
from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.cluster import Cluster, load_cluster
from fasop.inputs.model import Model, load_model
from fasop.inputs.profiles import GpuProfile, load_profiles


@dataclass(frozen=True)
class Setting:
    """What a run is estimated with, and the files that hold it."""

    model: Model
    cluster: Cluster
    profiles: dict[str, GpuProfile]
    files: tuple[Path, Path]  # the model file and the cluster file

    @property
    def cluster_path(self) -> Path:
        return self.files[1]

    @property
    def input_paths(self) -> list[Path]:
        return [*self.files] + [Path(p.file) for p in self.profiles.values() if not p.synthesised]


def load_settings(runs: list[MeasuredRun], profiles_dir: str | None) -> list[Setting]:
    """The setting of each run; runs naming the same model and cluster share one."""
    cache: dict[tuple[str, str], Setting] = {}
    result = []
    for run in runs:
        key = (run.model, run.cluster)
        if key not in cache:
            try:
                model, cluster = load_model(run.model), load_cluster(run.cluster)
                gpus = sorted({t.gpu for t in cluster.node_types.values()})
                profiles = load_profiles(model, gpus, profiles_dir, specs=merged_specs(own=cluster.gpus))
            except InputError as err:
                raise InputError(run.where, str(err)) from None
            files = (bundled.locate("models", run.model, ".toml", "--model")[0],
                     bundled.locate("clusters", run.cluster, ".toml", "--cluster")[0])
            cache[key] = Setting(model, cluster, profiles, files)
        result.append(cache[key])
    return result


def predict_step_s(run: MeasuredRun, model: Model, cluster: Cluster, profiles: dict[str, GpuProfile]) -> float:
    """The estimated step time of the run's plan, estimated as what it is: a 3D plan or a data-parallel one."""
    step_s = predict_plan(run, model, cluster, profiles).step_time_s
    assert step_s is not None  # an estimate states every figure
    return step_s


def predict_plan(run: MeasuredRun, model: Model, cluster: Cluster, profiles: dict[str, GpuProfile]) -> Any:
    """The run's plan estimated afresh (a Plan, or a data-parallel plan row)."""
    from fasop.search import estimate  # the search modules load only when a plan is estimated
    from fasop.search.dataparallel import NoPlan, plan_row

    try:
        if run.kind != "3d":
            _check_whole_cluster(run, cluster)
            plan = plan_row(model, cluster, profiles, run.kind, run.gbs, run.batch_split == "even",
                            dict(run.samples_per_gpu), overlap=run.overlap_grad_reduce is not False,
                            recompute=run.recompute)
        else:
            plan = estimate(model, cluster, profiles=profiles, **run.spec_fields)
    except (InputError, NoPlan) as err:
        raise InputError(run.where, f"cannot be estimated with model {model.name} and cluster {cluster.name} ({err})") from None
    return plan


def predict_runs(runs: list[MeasuredRun], settings: list[Setting],
                 progress: Callable[[int, int], None] | None = None) -> list[Any]:
    """predict_plan of each run with its setting, `progress(done, total)` after each."""
    predicted = []
    for done, (run, setting) in enumerate(zip(runs, settings), start=1):
        predicted.append(predict_plan(run, setting.model, setting.cluster, setting.profiles))
        if progress:
            progress(done, len(runs))
    return predicted


def _check_whole_cluster(run: MeasuredRun, cluster: Cluster) -> None:
    """A data-parallel plan trains on every GPU of its cluster (fasop.search.dataparallel)."""
    have = Counter({name: t.count for name, t in cluster.node_types.items()})
    if Counter(run.placement) != have or run.gpus_per_node != cluster.gpus_per_node:
        raise InputError("placement", f"a {run.kind} plan uses every node of its cluster; cluster {cluster.name} has "
                                      f"{dict(have)} nodes of {cluster.gpus_per_node} GPUs")


def mape_pct(predicted_s: np.ndarray, measured_s: np.ndarray) -> float:
    """Mean absolute percentage error of the estimates, relative to the measurements."""
    return float(100.0 * np.mean(np.abs(predicted_s - measured_s) / measured_s))


@dataclass(frozen=True)
class Comparison:
    labels: list[str]
    predicted_s: np.ndarray
    measured_s: np.ndarray
    mape_pct: float
    spearman: float | None  # rank correlation of estimates and measurements; None for fewer than 3 runs or ties all round
    first: int  # the run fasop ranks first (lowest estimate; the first listed among equals)
    fastest: int  # the run measured fastest

    @property
    def first_is_fastest(self) -> bool:
        return bool(self.measured_s[self.first] == self.measured_s[self.fastest])


def compare(runs: list[MeasuredRun], predicted_s: list[float]) -> Comparison:
    from scipy.stats import spearmanr

    predicted, measured = np.array(predicted_s, dtype=float), np.array([r.measured_step_s for r in runs])
    rho = None
    # scipy warns of, and returns NaN for, a constant input: no correlation to state then
    if len(runs) >= 3 and np.ptp(predicted) > 0 and np.ptp(measured) > 0:
        value = float(spearmanr(predicted, measured).statistic)
        rho = value if math.isfinite(value) else None
    return Comparison([r.label for r in runs], predicted, measured, mape_pct(predicted, measured), rho,
                      int(np.argmin(predicted)), int(np.argmin(measured)))


def format_comparison(c: Comparison) -> str:
    """One line per run (estimate, measurement, error), then the scores."""
    width = max(len("run"), *(len(label) for label in c.labels))
    lines = [f"{'run':<{width}}  {'estimated s':>11}  {'measured s':>10}  {'error':>7}"]
    for label, p, m in zip(c.labels, c.predicted_s, c.measured_s):
        lines.append(f"{label:<{width}}  {p:>11.4f}  {m:>10.4f}  {100 * (p - m) / m:>+6.1f}%")
    rho = "n/a (needs 3 runs and some spread)" if c.spearman is None else f"{c.spearman:.3f}"
    lines.append(f"MAPE {c.mape_pct:.1f}% over {len(c.labels)} runs; Spearman rank correlation {rho}")
    verdict = "yes" if c.first_is_fastest else f"no: {c.labels[c.fastest]} was ({c.measured_s[c.fastest]:.4f} s)"
    lines.append(f"fasop's first plan, {c.labels[c.first]}, was the fastest measured: {verdict}")
    return "\n".join(lines)


def format_stages(run: MeasuredRun, estimated: dict[str, list[float]]) -> str:
    """A traced run's pipeline stages: the compute, communication and idle seconds per step its traces measured
    (fasop.calibration.traces) beside the estimate's, `estimated` as fasop.plot.stage_times gives them (compute
    holds the tensor-parallel collectives, as profiles do, so the estimate's communication is the pipeline sends
    and the data-parallel reduction, and a trace's the tensor-parallel collectives too)."""
    lines = [f"{run.label}: seconds per step, measured (traces) / estimated",
             f"{'stage':>5}  {'compute':>17}  {'communication':>17}  {'idle':>17}"]
    for stage, measured in enumerate(run.stages):
        guess = (estimated["compute"][stage], estimated["p2p"][stage] + estimated["dp all-reduce"][stage],
                 estimated["idle"][stage])
        seen = ("-", "-", "-") if measured is None else \
            tuple(f"{v:.4f}" for v in (measured.compute_s, measured.communication_s, measured.idle_s))
        lines.append(f"{stage:>5}  " + "  ".join(f"{m:>8} / {g:<6.4f}" for m, g in zip(seen, guess)))
    return "\n".join(lines)
