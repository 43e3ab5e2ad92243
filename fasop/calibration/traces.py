"""PyTorch profiler traces of training steps as measurements: what each rank's GPU did in each step.

A trace is the Chrome trace event JSON that torch.profiler writes (`export_chrome_trace`, or
`tensorboard_trace_handler`'s `<worker>.<time>.pt.trace.json`), one per rank. A step is a `ProfilerStep#N` span
(what `profiler.step()` marks); in it, the rank's GPU kernels (events of category `kernel`) are communication when
NCCL runs them (a name with `nccl`: tensor-parallel collectives, pipeline sends and receives, data-parallel
reductions) and compute otherwise, and the GPU is idle where no kernel of either runs. Which pipeline stage a rank
is follows Megatron-LM's rank order, tensor-parallel ranks innermost and pipeline stages outermost: rank r of a
plan with tp x dp ranks per stage is on stage r // (tp dp); `distributedInfo.rank` of the trace says r.

A step's time, from a trace, a CSV or a log, is held to one range (step_seconds); every other time of a trace is
finite and in range too, so that sums and differences of them stay finite.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fasop.errors import InputError
from fasop.files import read_json

TRACE_SUFFIXES = (".pt.trace.json", ".trace.json")  # torch.profiler's names for its Chrome traces
TRACE_LIMIT_BYTES = 2**30  # a trace of a few steps of a large model is hundreds of MB
_STEP = re.compile(r"ProfilerStep#\d+$")
KERNEL_CATEGORIES = ("kernel", "Kernel")  # Kineto's category of GPU kernels (the older spelling too)
# Range of a measured step time: a normal float far from both ends, so that errors relative to it stay finite.
MIN_STEP_S, MAX_STEP_S = 1e-6, 1e6
# Largest timestamp or duration of a trace event (microseconds): 285 years, above any clock Kineto reads, and
# far enough below float's end that a timestamp plus a duration stays finite.
MAX_EVENT_US = 2.0**53
# A measured time as CSV and log cells write it: plain ASCII decimal digits, one point, an exponent (float() would
# also take 1_000 and non-ASCII digits).
_DECIMAL = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", re.ASCII)


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step on one rank: the step's span, the GPU's compute and communication kernels in it (each
    summed, so overlapping streams count twice), and the time no kernel ran."""

    step_s: float
    compute_s: float
    communication_s: float
    idle_s: float


@dataclass(frozen=True)
class RankTrace:
    file: str
    rank: int
    steps: tuple[StepTimes, ...]

    def median(self) -> StepTimes:
        """Each time's median over the steps."""
        return StepTimes(*(statistics.median(getattr(s, name) for s in self.steps)
                           for name in ("step_s", "compute_s", "communication_s", "idle_s")))


def is_trace(path: Path) -> bool:
    return path.name.endswith(TRACE_SUFFIXES)


def step_seconds(value: Any, where: str, key: str, unit_s: float = 1.0) -> float:
    """A measured time in seconds from `value`, a number or a plain decimal (_DECIMAL) in units of `unit_s`
    seconds: finite and in range."""
    plain = (isinstance(value, (int, float)) and not isinstance(value, bool)
             or isinstance(value, str) and _DECIMAL.fullmatch(value) is not None)
    number = float(value) * unit_s if plain else math.nan
    if not MIN_STEP_S <= number <= MAX_STEP_S:  # also refuses NaN, zero and denormals
        raise InputError(f"{where}: {key}", f"expected a positive, finite time from {MIN_STEP_S / unit_s:g} to "
                                            f"{MAX_STEP_S / unit_s:g}, got {value!r}")
    return number


def _number(event: dict, key: str, where: str) -> float:
    value = event.get(key)
    # compared before any conversion: an integer too large for a float is refused, not an OverflowError
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_EVENT_US:
        raise InputError(where, f"event {event.get('name', '?')!r}: expected {key} microseconds >= 0 and <= "
                                f"{MAX_EVENT_US:g}, got {value!r}")
    return float(value)


def _covered_us(intervals: np.ndarray, points: np.ndarray, union: bool = False) -> np.ndarray:
    """For each of `points`, the microseconds before it that the (start, end) rows of `intervals` cover: their
    lengths summed (overlaps counted as often as they overlap), or with `union` their union's. A span's share of
    the intervals is this at its end less this at its start: O((n + points) log n) for all spans, where clipping
    each interval to each span would take O(n points)."""
    if not len(intervals):
        return np.zeros(len(points))
    edges = intervals.T.ravel()  # every start, then every end
    order = np.argsort(edges)
    edges = edges[order]
    depth = np.cumsum(np.where(order < len(intervals), 1, -1))  # intervals running after each edge
    if union:
        depth = np.minimum(depth, 1)
    covered = np.concatenate(([0.0], np.cumsum(depth[:-1] * np.diff(edges))))  # up to each edge
    last = np.searchsorted(edges, points, side="right") - 1  # the last edge at or before each point
    at = np.maximum(last, 0)
    return np.where(last < 0, 0.0, covered[at] + depth[at] * (points - edges[at]))


def read_trace(path: Path) -> RankTrace:
    """The steps of one rank's trace."""
    where = str(path)
    found = read_json(path, TRACE_LIMIT_BYTES, "a Chrome trace of torch.profiler with a traceEvents list")
    events = found.get("traceEvents") if isinstance(found, dict) else None
    if not isinstance(events, list):
        raise InputError(where, "expected a JSON object with a traceEvents list (torch.profiler's Chrome trace)")
    info = found.get("distributedInfo") or {}
    rank = info.get("rank", 0) if isinstance(info, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**24:
        raise InputError(f"{where}: distributedInfo.rank", f"expected an integer rank >= 0, got {rank!r}")
    steps, kernels = [], []
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        name = event.get("name")
        if isinstance(name, str) and _STEP.match(name) and event.get("cat") == "user_annotation":
            start, dur = _number(event, "ts", where), _number(event, "dur", where)
            steps.append((start, start + dur, step_seconds(dur, f"{where}: event {name!r}", "dur (microseconds)",
                                                           unit_s=1e-6)))
        elif event.get("cat") in KERNEL_CATEGORIES:
            start = _number(event, "ts", where)
            kernels.append((start, start + _number(event, "dur", where), "nccl" in str(name).lower()))
    if not steps:
        raise InputError(where, "no ProfilerStep#N spans: record the steps with torch.profiler's schedule and call "
                                "profiler.step() after each")
    if not kernels:
        raise InputError(where, "no GPU kernels (events of category 'kernel'): profile with "
                                "activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]")
    kernel_array = np.array([(a, b) for a, b, _ in kernels])
    nccl = np.array([c for _, _, c in kernels])
    steps.sort()
    spans = np.array([(start, end) for start, end, _ in steps]).ravel()

    def in_steps_s(intervals: np.ndarray, union: bool = False) -> np.ndarray:
        covered = _covered_us(intervals, spans, union).reshape(-1, 2)
        return (covered[:, 1] - covered[:, 0]) * 1e-6

    compute, communication = in_steps_s(kernel_array[~nccl]), in_steps_s(kernel_array[nccl])
    busy = in_steps_s(kernel_array, union=True)
    return RankTrace(where, rank, tuple(StepTimes(step_s, float(c), float(n), max(step_s - float(b), 0.0))
                                        for (_, _, step_s), c, n, b in zip(steps, compute, communication, busy)))


def stage_of(rank: int, tp: int, dp: int, pp: int, where: str) -> int:
    """The pipeline stage of `rank` in Megatron-LM's order (tensor-parallel innermost, pipeline outermost)."""
    if rank >= tp * dp * pp:
        raise InputError(where, f"rank {rank} is beyond the plan's {tp * dp * pp} GPUs")
    return rank // (tp * dp)


def stage_medians(traces: list[RankTrace], tp: int, dp: int, pp: int) -> list[StepTimes | None]:
    """Per pipeline stage, the median step of its slowest traced rank (the one with the least idle time: the
    stage's pace), None for a stage no trace covers."""
    by_stage: list[StepTimes | None] = [None] * pp
    for trace in traces:
        stage = stage_of(trace.rank, tp, dp, pp, trace.file)
        median = trace.median()
        held = by_stage[stage]
        if held is None or median.compute_s + median.communication_s > held.compute_s + held.communication_s:
            by_stage[stage] = median
    return by_stage


def measured_step_s(traces: list[RankTrace]) -> float:
    """The step time the traces measured: the median over steps, on the rank whose steps were longest."""
    return max(trace.median().step_s for trace in traces)
