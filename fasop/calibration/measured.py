"""Measured step times of plans that really ran, for `fasop validate` and `fasop calibrate`.

Two sources: a CSV with the plan columns of a plan file plus `measured_step_s`, or a folder of Megatron-LM
runs, each a `plan.json` (as `fasop emit` writes it) beside the training log(s) of the job, or torch.profiler
traces of its steps, or both. From a log, the step time is the median of Megatron-LM's `elapsed time per
iteration (ms)` reports once the warm-up iterations are over (the first iterations build CUDA graphs, allocate
memory and tune kernels). From the traces (one per rank, fasop.calibration.traces), it is the median profiled
step of the slowest rank, and each pipeline stage's compute, communication and idle time come with it.

A run keeps what its plan is: a 3D plan with its virtual stages, recomputation, sequence parallelism and
overlap, or a data-parallel plan (kind ddp, zero1, zero2 or zero3) with its per-type batch split, which only
a plan.json holds. One plan measured several times is scored once, at the mean of its measurements
(merge_repeats).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fasop.calibration.traces import (
    TRACE_SUFFIXES,
    StepTimes,
    is_trace,
    measured_step_s,
    read_trace,
    stage_medians,
    step_seconds,
)
from fasop.cost.config import RECOMPUTE_METHODS, RECOMPUTE_MODES
from fasop.errors import ArgumentError, InputError
from fasop.files import CSV_LIMIT_BYTES, LOG_LIMIT_BYTES, PLANS_LIMIT_BYTES, beside, read_json, read_text
from fasop.inputs.csvfile import csv_rows
from fasop.plans import DATA_PARALLEL_KINDS, Plan, expand_placement, read_plan
from fasop.runtime import check_plan

WARMUP_ITERS = 3  # iterations of each log whose timings are left out by default
LOG_SUFFIXES = (".out", ".log", ".txt")  # files beside plan.json read as training logs (fasop emit: fasop-<job>.out)
REQUIRED_COLUMNS = ("tp", "dp", "pp", "mbs", "gbs", "placement", "layers_per_stage", "measured_step_s")
SPEC_FIELDS = ("tp", "dp", "pp", "mbs", "gbs", "placement", "layers_per_stage", "distributed_optimizer", "virtual_stages",
               "recompute", "recompute_method", "recompute_num_layers", "recompute_modules", "sequence_parallel",
               "overlap_grad_reduce", "overlap_param_gather")

# Megatron-LM's training_log prints, on the last rank, every --log-interval iterations:
#  [2024-05-01 12:00:03] iteration       10/      50 | consumed samples:          640 | elapsed time per
#  iteration (ms): 1234.5 | learning rate: ... (one line; older versions have no date, some forks print
#  "X/Y" with a running mean after the interval's own figure, which is the one read here)
ELAPSED_MARK = "elapsed time per iteration (ms):"
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/")
_ELAPSED = re.compile(re.escape(ELAPSED_MARK) + r"\s*([^\s|/]*)")


@dataclass(frozen=True)
class MeasuredRun:
    """One plan and the step time measured for it: the plan's fields as its file gives them, checked against
    its model and cluster when it is estimated (fasop.search.spec.plan_spec; None: fasop's default)."""

    label: str  # how reports name the run: "row 3" of a CSV, or the log's path inside the folder
    where: str  # file (and row) for messages
    model: str  # model name or file, as load_model takes it
    cluster: str
    measured_step_s: float
    tp: int
    dp: int
    pp: int
    mbs: int
    gbs: int
    placement: tuple[str, ...]
    layers_per_stage: tuple[int, ...]
    distributed_optimizer: bool = True
    virtual_stages: int = 1
    recompute: str = "none"
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    sequence_parallel: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    kind: str = "3d"
    # data-parallel kinds: the batch split of the plan.json, as fasop.search.dataparallel.plan_row takes it
    batch_split: str | None = None
    samples_per_gpu: tuple[tuple[str, int], ...] = ()
    gpus_per_node: int | None = None
    # per pipeline stage, what torch.profiler traces measured (None for a stage no trace covers); () without traces
    stages: tuple[StepTimes | None, ...] = ()

    @property
    def plan_key(self) -> tuple:
        """What the run measured: every field but its name, place and measurement."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name not in ("label", "where", "measured_step_s"))

    @property
    def spec_fields(self) -> dict[str, Any]:
        """A 3D run's plan as fasop.search.spec.plan_spec takes it."""
        shape = {name: getattr(self, name) for name in SPEC_FIELDS}
        return {name: value for name, value in shape.items() if value is not None}


def _positive_int(value: Any, where: str, key: str) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{where}: {key}", f"expected a positive integer, got {value!r}")
    return value


def _int_list(value: Any, where: str, key: str, minimum: int) -> tuple[int, ...]:
    items = re.split(r"[\s,]+", value.strip()) if isinstance(value, str) else value
    try:
        numbers = tuple(int(v) if isinstance(v, str) and v.isdigit() else v for v in items)
    except TypeError:
        numbers = ()
    if not numbers or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in numbers):
        raise InputError(f"{where}: {key}", f"expected a list of integers >= {minimum}, got {value!r}")
    return tuple(int(v) for v in numbers)  # checked to be ints above


def _placement(value: Any, where: str) -> tuple[str, ...]:
    """A placement: a plan.json's list of names, or a CSV cell of NAME or NAME*N items separated by spaces (as
    plan CSVs write them) or commas."""
    if isinstance(value, str):
        return tuple(expand_placement(",".join(re.split(r"[\s,]+", value.strip())), f"{where}: placement"))
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise InputError(f"{where}: placement", f"expected node-type names, got {value!r}")
    return tuple(value)


def _names(value: Any, where: str, key: str) -> tuple[str, ...]:
    """A list of names: a plan.json's list, or a CSV cell of names separated by spaces (as plan CSVs write
    lists) or commas; what the names may be is the plan's check (fasop.search.spec.plan_spec)."""
    items = re.split(r"[\s,]+", value.strip()) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v for v in items):
        raise InputError(f"{where}: {key}", f"expected a list of names, got {value!r}")
    return tuple(items)


def _flag(value: Any, where: str, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise InputError(f"{where}: {key}", f"expected true or false, got {value!r}")


def _optional(plan: dict, key: str) -> Any:
    """A field a plan may leave out (a CSV leaves its cell empty); None when it does."""
    value = plan.get(key)
    return None if value is None or (isinstance(value, str) and not value.strip()) else value


def _choice(value: Any, where: str, key: str, choices: tuple[str, ...]) -> str:
    text = str(value).strip()
    if text not in choices:
        raise InputError(f"{where}: {key}", f"expected one of {', '.join(choices)}, got {value!r}")
    return text


def run_from_plan(plan: dict, measured_step_s: float, label: str, where: str, base: Path,
                  model: str | None, cluster: str | None, split: Plan | None = None) -> MeasuredRun:
    """A run from the plan fields of `plan` (a CSV row or a plan.json); `model` / `cluster` override it.
    `split`: the checked plan.json of a data-parallel plan, which holds its batch split."""
    refs = {}
    for kind, override in (("model", model), ("cluster", cluster)):
        value = plan.get(f"{kind}_file") or plan.get(kind)
        if override is None and not (isinstance(value, str) and value.strip()):
            raise ArgumentError(kind, f"{where} names no {kind}_file or {kind}")
        refs[kind] = override or beside(str(value).strip(), base)
    missing = [key for key in REQUIRED_COLUMNS if key != "measured_step_s" and key not in plan]
    if missing:
        raise InputError(where, f"lacks {', '.join(missing)}")
    tp = _positive_int(plan["tp"], where, "tp")
    kind = _choice(_optional(plan, "kind") or "3d", where, "kind", ("3d", *DATA_PARALLEL_KINDS))
    dataparallel: dict[str, Any] = {}
    if kind in DATA_PARALLEL_KINDS:
        if split is None:
            raise InputError(f"{where}: kind", f"a {kind} plan's batch split is in its plan.json, not in a CSV: "
                                               "measure it from its run folder")
        check_plan(split, where)
        dataparallel = {"batch_split": split.batch_split, "gpus_per_node": split.gpus_per_node,
                        "samples_per_gpu": tuple((t.node_type, t.samples_per_gpu) for t in split.per_type or [])}
    method, layers = _optional(plan, "recompute_method"), _optional(plan, "recompute_num_layers")
    modules = _optional(plan, "recompute_modules")
    def flag(key: str) -> bool | None:
        return None if (value := _optional(plan, key)) is None else _flag(value, where, key)

    return MeasuredRun(
        label=label, where=where, model=refs["model"], cluster=refs["cluster"],
        tp=tp, dp=_positive_int(plan["dp"], where, "dp"),
        pp=_positive_int(plan["pp"], where, "pp"), mbs=_positive_int(plan["mbs"], where, "mbs"),
        gbs=_positive_int(plan["gbs"], where, "gbs"),
        placement=_placement(plan["placement"], where),
        layers_per_stage=_int_list(plan["layers_per_stage"], where, "layers_per_stage", 0),
        distributed_optimizer=_flag(plan.get("distributed_optimizer", True), where, "distributed_optimizer"),
        measured_step_s=measured_step_s,
        virtual_stages=_positive_int(_optional(plan, "virtual_stages") or 1, where, "virtual_stages"),
        recompute=_choice(_optional(plan, "recompute") or "none", where, "recompute", RECOMPUTE_MODES),
        recompute_method=None if method is None else _choice(method, where, "recompute_method", RECOMPUTE_METHODS),
        recompute_num_layers=None if layers is None else _positive_int(layers, where, "recompute_num_layers"),
        recompute_modules=None if modules is None else _names(modules, where, "recompute_modules"),
        sequence_parallel=flag("sequence_parallel"), overlap_grad_reduce=flag("overlap_grad_reduce"),
        overlap_param_gather=flag("overlap_param_gather"), kind=kind, **dataparallel,
    )


def read_runs_csv(path: Path, model: str | None = None, cluster: str | None = None) -> list[MeasuredRun]:
    """Runs of a CSV: one row per run, plan columns (as `fasop search --output plans.csv` writes them) and
    `measured_step_s`; an optional `run` column names the rows. Lines starting with `#` are comments."""
    file = str(path)
    numbered = csv_rows(((n, line) for n, line in enumerate(read_text(path, CSV_LIMIT_BYTES).splitlines(), start=1)
                         if line.strip() and not line.lstrip().startswith("#")), file)
    if not numbered:
        raise InputError(file, "no header and no rows (expected a CSV with measured_step_s and plan columns)")
    header = numbered[0][1]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise InputError(file, f"missing column(s) {', '.join(missing)} (header: {','.join(header)})")
    runs = []
    for number, cells in numbered[1:]:
        where = f"{file}: line {number}"
        if len(cells) != len(header):
            raise InputError(where, f"expected {len(header)} fields like the header, got {len(cells)}")
        row = dict(zip(header, cells))
        label = row.get("run") or f"line {number}"
        if not label.isprintable():  # reports print it on a terminal and charts write it into SVG
            raise InputError(f"{where}: run", f"expected a name of printable characters, got {label!r}")
        step_s = step_seconds(row["measured_step_s"], where, "measured_step_s")
        runs.append(run_from_plan(row, step_s, label, where, path.parent, model, cluster))
    if not runs:
        raise InputError(str(path), "no rows under the header")
    return runs


def median_iteration_s(path: Path, warmup_iters: int = WARMUP_ITERS) -> float | None:
    """Median seconds per iteration of a Megatron-LM log, leaving out every report whose interval holds
    one of the first `warmup_iters` iterations of the log; None when the file holds no report.

    A report at iteration i covers the iterations after the previous report; the first report's interval
    is taken to be as long as the one after it (or to start at iteration 0 when it is the only one), so
    that a log resumed from a checkpoint counts its warm-up from where it resumed.
    """
    reports: list[tuple[int, float]] = []
    for number, line in enumerate(read_text(path, LOG_LIMIT_BYTES).splitlines(), start=1):
        if ELAPSED_MARK not in line:
            continue
        where = f"{path}: line {number}"
        iteration, elapsed = _ITERATION.search(line), _ELAPSED.search(line)
        if iteration is None or elapsed is None:  # elapsed matches any line holding ELAPSED_MARK
            raise InputError(where, f"expected 'iteration N/ M |' before '{ELAPSED_MARK}'")
        step_s = step_seconds(elapsed.group(1), where, "elapsed time per iteration (ms)", unit_s=1e-3)
        if reports and int(iteration.group(1)) <= reports[-1][0]:
            raise InputError(where, f"iteration {iteration.group(1)} follows iteration {reports[-1][0]}: "
                                    "expected one training run per log file")
        reports.append((int(iteration.group(1)), step_s))
    if not reports:
        return None
    first = reports[0][0]
    interval = reports[1][0] - first if len(reports) > 1 else first
    start = max(first - interval, 0)
    starts = [start] + [i for i, _ in reports[:-1]]
    kept = [s for (_, s), begin in zip(reports, starts) if begin >= start + warmup_iters]
    if not kept:
        raise InputError(str(path), f"every iteration report (last: iteration {reports[-1][0]}) falls within the "
                                    f"first {warmup_iters} warm-up iterations; run longer or lower the warm-up")
    return statistics.median(kept)


def _load_plan_json(path: Path) -> Plan:
    """The plan of a plan.json, checked against the plan schema (fasop.plans.Plan)."""
    return read_plan(read_json(path, PLANS_LIMIT_BYTES, "the plan object that fasop emit writes"), str(path))


def read_runs_logs(folder: Path, warmup_iters: int = WARMUP_ITERS, model: str | None = None,
                   cluster: str | None = None) -> list[MeasuredRun]:
    """One run per training log (*.out, *.log, *.txt with iteration reports) beside each plan.json under
    `folder`, in path order, and one for the torch.profiler traces beside it, if any."""
    runs = []
    plans = sorted(folder.rglob("plan.json"))
    if not plans:
        raise InputError(str(folder), "no plan.json in this folder or below (expected the run folders fasop emit "
                                      "writes, with the training logs beside plan.json)")
    for plan_path in plans:
        plan = _load_plan_json(plan_path)
        record = plan.record()
        beside_plan = sorted(p for p in plan_path.parent.iterdir() if p.is_file())
        found = 0
        for log in (p for p in beside_plan if p.suffix in LOG_SUFFIXES):
            step_s = median_iteration_s(log, warmup_iters)
            if step_s is None:
                continue
            found += 1
            label = str(log.relative_to(folder))
            runs.append(run_from_plan(record, step_s, label, str(plan_path), plan_path.parent, model, cluster,
                                      plan))
        traces = [read_trace(p) for p in beside_plan if is_trace(p)]
        if traces:
            found += 1
            run = run_from_plan(record, measured_step_s(traces), f"{plan_path.parent.relative_to(folder)} (traces)",
                                str(plan_path), plan_path.parent, model, cluster, plan)
            runs.append(replace(run, stages=tuple(stage_medians(traces, run.tp, run.dp, run.pp))))
        if not found:
            raise InputError(str(plan_path.parent), f"no training log ({', '.join(LOG_SUFFIXES)}) with "
                                                    f"'{ELAPSED_MARK}' reports and no torch.profiler trace "
                                                    f"({', '.join(TRACE_SUFFIXES)}) beside plan.json")
    return runs


def read_measured(path: Path, warmup_iters: int = WARMUP_ITERS, model: str | None = None,
                  cluster: str | None = None) -> list[MeasuredRun]:
    """Runs of a CSV file or of a folder of Megatron-LM runs (see the module docstring)."""
    if path.is_dir():
        return read_runs_logs(path, warmup_iters, model, cluster)
    if not path.exists():
        raise ArgumentError("measured", "no such file or folder", path)
    return read_runs_csv(path, model, cluster)


def merge_repeats(runs: list[MeasuredRun]) -> tuple[list[MeasuredRun], str | None]:
    """One run per plan, at the mean of the step times measured for it, and a note naming the repeats (None
    without any). Counted apart, the repeats of one plan would weigh it more in a fit, stay in the fit that
    leaves it out, and tie with one another in the rank correlation."""
    groups: dict[tuple, list[MeasuredRun]] = {}
    for run in runs:
        groups.setdefault(run.plan_key, []).append(run)
    repeated = [group for group in groups.values() if len(group) > 1]
    if not repeated:
        return runs, None
    merged = [group[0] if len(group) == 1 else
              replace(group[0], label=f"{group[0].label} (mean of {len(group)})",
                      measured_step_s=statistics.fmean(r.measured_step_s for r in group),
                      stages=next((r.stages for r in group if r.stages), ()))  # what traces measured stays
              for group in groups.values()]
    named = "; ".join(", ".join(r.label for r in group) for group in repeated[:3])
    more = f" and {len(repeated) - 3} more" if len(repeated) > 3 else ""
    return merged, (f"note: {len(repeated)} plan(s) measured more than once ({named}{more}): each is scored once, "
                    "at the mean of its measured step times")


def input_files(path: Path) -> list[Path]:
    """Every file a measured source consists of (never to be written over)."""
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file()]
    return [path]

