"""PyTorch profiler traces of training steps as measurements: what each rank's GPU did in each step.

A trace is the Chrome trace event JSON that torch.profiler writes (`export_chrome_trace`, or
`tensorboard_trace_handler`'s `<worker>.<time>.pt.trace.json`), one per rank. A step is a `ProfilerStep#N` span
(what `profiler.step()` marks); in it, the rank's GPU kernels (events of category `kernel`) are communication when
NCCL runs them (a name with `nccl`: tensor-parallel collectives, pipeline sends and receives, data-parallel
reductions) and compute otherwise, and the GPU is idle where no kernel of either runs. Which pipeline stage a rank
is follows Megatron-LM's rank order, tensor-parallel ranks innermost and pipeline stages outermost: rank r of a
plan with tp x dp ranks per stage is on stage r // (tp dp); `distributedInfo.rank` of the trace says r.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fasop.errors import InputError
from fasop.files import read_json

TRACE_SUFFIXES = (".pt.trace.json", ".trace.json")  # torch.profiler's names for its Chrome traces
TRACE_LIMIT_BYTES = 2**30  # a trace of a few steps of a large model is hundreds of MB
_STEP = re.compile(r"ProfilerStep#\d+$")
KERNEL_CATEGORIES = ("kernel", "Kernel")  # Kineto's category of GPU kernels (the older spelling too)


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


def _number(event: dict, key: str, where: str) -> float:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(where, f"event {event.get('name', '?')!r}: expected {key} microseconds >= 0, got {value!r}")
    return float(value)


def _busy_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) microsecond intervals."""
    covered, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered * 1e-6


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
            start = _number(event, "ts", where)
            steps.append((start, start + _number(event, "dur", where)))
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
    measured = []
    for start, end in sorted(steps):
        clipped = np.clip(kernel_array, start, end)
        inside = clipped[:, 1] > clipped[:, 0]
        lengths = (clipped[:, 1] - clipped[:, 0]) * 1e-6
        step_s = (end - start) * 1e-6
        busy = _busy_s([tuple(row) for row in clipped[inside]])
        measured.append(StepTimes(step_s, float(lengths[inside & ~nccl].sum()), float(lengths[inside & nccl].sum()),
                                  max(step_s - busy, 0.0)))
    return RankTrace(where, rank, tuple(measured))


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
