"""The pipeline schedule of one plan as a Gantt chart: one row per stage, time across; or as a Chrome trace that
Perfetto and chrome://tracing open, to lay beside a measured torch.profiler trace (write_trace).

Forwards, backwards, recomputed forwards, blocking sends and idle time each have their own colour (and hatch,
for readers of a grey print); rows name their stage, GPU type and layers; bars wide enough carry their micro-batch
(and model chunk, when interleaved).
The times come from fasop.cost.schedule.op_times, fed a plan file's per-stage (interleaved: per-chunk) times;
matplotlib is imported only when a chart is drawn.

A chart draws at most MAX_OPERATIONS forwards and backwards (2 x stages x model chunks x micro-batches): its
10 inches at 100 dpi are 1000 pixels, so a row of 2048 of them (1024 micro-batches, or 256 of 4 model chunks)
already leaves each half a pixel, and the limit is 16 such rows, the plain schedules of up to 16 stages over
the 1024 micro-batches fasop plot allows. A chart also draws at most MAX_ROWS stages (fasop.chart). A larger plan
is refused in one line, before its schedule is computed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fasop.chart import MAX_ROWS, as_argument, check_out, figure, fit_title, plain_text, save
from fasop.cost.schedule import OpTimes, interleaving_error, op_times
from fasop.errors import ArgumentError, InputError
from fasop.files import check_outputs, write_atomically
from fasop.plans import Plan
from fasop.plot import MAX_SECONDS

# (label, face colour, hatch) of each kind of segment, in legend order
STYLE = {
    "forward": ("forward", "#4c72b0", None),
    "recompute": ("recomputed forward", "#8172b3", "//"),
    "backward": ("backward", "#dd8452", None),
    "send": ("send (blocking)", "#8c8c8c", "xx"),
    "idle": ("idle", "#f2f2f2", ".."),
}
ROW_HEIGHT = 0.8
MAX_OPERATIONS = 2**15  # forwards and backwards a chart draws (module docstring)
LABEL_FONT_SIZE = 6
LABEL_PAD_PX = 3  # room on either side of a micro-batch number inside its bar
MIN_EDGED_PX = 4  # bars are drawn without edges when the narrowest is narrower (timeline_chart)


def _seconds(value: float | None, where: str, top: float) -> float:
    if value is None or not 0 <= value <= top:
        raise InputError(where, f"expected seconds from 0 to {top:g}, got {value!r} (plan files of fasop search "
                                "hold the per-stage (and, interleaved, per-chunk) times the schedule needs)")
    return float(value)


def check_drawable(stages: int, virtual_stages: int, num_microbatches: int, where: str) -> None:
    """Refuse, in one line, a schedule of more than MAX_ROWS stages or MAX_OPERATIONS forwards and backwards."""
    if stages > MAX_ROWS:
        raise InputError(where, f"{stages:,} stages: a timeline draws at most {MAX_ROWS}")
    operations = 2 * stages * virtual_stages * num_microbatches
    if operations > MAX_OPERATIONS:
        raise InputError(where, f"{stages} stages x {virtual_stages} model chunks x {num_microbatches} micro-batches "
                                f"make {operations} forwards and backwards; a timeline draws at most {MAX_OPERATIONS}")


def plan_op_times(plan: Plan, where: str) -> OpTimes:
    """The exact schedule of a plan from the times its plan file holds: each stage's forward, recomputed forward
    and backward per micro-batch (interleaved: each model chunk's) and its sends (interleaved: also the last
    stage's send to the first). Its makespan is the plan's pipeline_time_s."""
    stages = plan.stages or []
    v, m = plan.virtual_stages or 1, int(plan.num_microbatches or 1)
    check_drawable(len(stages), v, m, where)
    interleaving = interleaving_error(len(stages), v, m)
    if interleaving:
        raise InputError(f"{where}: virtual_stages", f"Megatron-LM runs no schedule of {v} model chunks here: "
                                                     f"{interleaving}")
    sends = [_seconds(s.send_s, f"{where}: stages[{i}].send_s", MAX_SECONDS) for i, s in enumerate(stages[:-1])]
    wrap = None if v == 1 else _seconds(plan.wrap_send_s, f"{where}: wrap_send_s", MAX_SECONDS)
    chunks: list[list[tuple[float, ...]]] = []  # per stage, per chunk: (forward, recomputed forward, backward)
    for i, s in enumerate(stages):
        if v == 1:
            forward = _seconds(s.forward_s, f"{where}: stages[{i}].forward_s", s.compute_s)
            recompute = _seconds(s.recompute_s or 0.0, f"{where}: stages[{i}].recompute_s", s.compute_s - forward)
            chunks.append([(forward, recompute, s.compute_s - forward - recompute)])
        elif s.chunks is None or len(s.chunks) != v:
            raise InputError(f"{where}: stages[{i}].chunks",
                             f"expected the times of {v} model chunks, got {0 if s.chunks is None else len(s.chunks)}")
        else:
            chunks.append([tuple(_seconds(getattr(c, key), f"{where}: stages[{i}].chunks[{j}].{key}", MAX_SECONDS)
                                 for key in ("forward_s", "recompute_s", "backward_s")) for j, c in enumerate(s.chunks)])
    forward_s, recompute_s, backward_s = (np.array([[[c[part] for c in stage] for stage in chunks]]) for part in range(3))
    return op_times(forward_s, backward_s, np.array([sends], dtype=float), m,
                    virtual_stages=v, wrap_send_s=wrap, recompute_s=recompute_s)


def timeline_title(plan: Plan, times: OpTimes) -> str:
    """'plan 1: tp=1 dp=2 pp=4 mbs=1 vp=2, 64 micro-batches, pipeline 1.02 s'; a stage-group plan names its
    micro-batch across the data-parallel ranks, each stage's degrees being in its row's name (fasop.plot)."""
    v = plan.virtual_stages or 1
    shape = (f"stage groups, pp={plan.pp}, micro-batch {plan.mbs * plan.dp} across each stage's dp"
             if plan.is_stage_groups else
             f"tp={plan.tp} dp={plan.dp} pp={plan.pp} mbs={plan.mbs}" + (f" vp={v}" if v > 1 else ""))
    return (f"plan {plan.rank}: {shape}, {plan.num_microbatches} micro-batches, "
            f"pipeline {float(times.makespan_s[0]):.4g} s")


def _segments(times: OpTimes, plan: int) -> dict[str, list[tuple[int, float, float, int]]]:
    """(stage, start, end, operation) of every non-empty segment of each kind."""
    prog = times.program
    start, redo_end = times.start_s[plan], times.recompute_end_s[plan]
    compute_end, end = times.compute_end_s[plan], times.end_s[plan]
    found: dict[str, list] = {kind: [] for kind in STYLE}
    for i in range(prog.ops):
        stage = int(prog.stage[i])
        parts = [("recompute", start[i], redo_end[i]),
                 ("backward" if prog.backward[i] else "forward", redo_end[i], compute_end[i]),
                 ("send", compute_end[i], end[i])]
        for kind, a, b in parts:
            if b > a:
                found[kind].append((stage, float(a), float(b), i))
    makespan = float(times.makespan_s[plan])
    for stage in range(prog.stages):
        ops = np.flatnonzero(prog.stage == stage)  # in program order, so in time order
        edges = [0.0, *np.column_stack([start[ops], end[ops]]).ravel(), makespan]
        for a, b in zip(edges[::2], edges[1::2]):
            if b > a:
                found["idle"].append((stage, a, b, -1))
    return found


def _drawn(found: dict[str, list[tuple[int, float, float, int]]]) -> dict[str, dict]:
    """How many segments of each kind, and their total seconds."""
    return {kind: {"segments": len(segments), "seconds": sum(b - a for _, a, b, _ in segments)}
            for kind, segments in found.items()}


def plot_timeline(times: OpTimes, out_path: str | os.PathLike, *, plan: int = 0, title: str | None = None,
                  stage_names: Sequence[str] = (), inputs: Iterable[str | os.PathLike] = (),
                  argument: str = "out_path") -> dict[str, dict]:
    """Draw timeline_chart to out_path (.png or .svg), refusing to write over any of `inputs`; `argument` names
    the chart file in errors. Returns, for each kind of segment, how many were drawn and their total seconds."""
    path = check_out(out_path, argument)
    with as_argument(argument, out_path):
        check_outputs([(path, argument)], inputs)
    fig, drawn = timeline_chart(times, plan=plan, title=title, stage_names=stage_names)
    save(fig, path, argument)
    return drawn


@plain_text()
def timeline_chart(times: OpTimes, *, plan: int = 0, title: str | None = None, stage_names: Sequence[str] = ()):
    """The schedule of plan `plan` of `times`, one row per stage named by `stage_names` ('stage 0 · A100 · layers
    1-4', fasop.plot.stage_names; 'stage k' without them). Returns the figure and what plot_timeline returns.

    Many micro-batches make thin bars: a bar carries its micro-batch number only where the number fits inside it
    (measured at the chart's size), and when the narrowest forward or backward is under MIN_EDGED_PX the bars are
    drawn without edges or hatching, so that a run of forwards or backwards reads as one block of colour rather
    than as stripes."""
    prog = times.program
    check_drawable(prog.stages, prog.virtual_stages, prog.num_microbatches, "times")
    found = _segments(times, plan)
    makespan = float(times.makespan_s[plan])
    names = [stage_names[s] if s < len(stage_names) else f"stage {s}" for s in range(prog.stages)]

    fig = figure(10.0, 1.4 + 0.45 * prog.stages)
    ax = fig.add_subplot()
    ax.set_xlim(0, makespan)
    ax.set_ylim(prog.stages - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(prog.stages), names, fontsize=8)
    ax.set_xlabel("time in the step (s)")
    interleaved = ""
    if prog.virtual_stages > 1:
        interleaved = f", {prog.virtual_stages} chunks per stage (labels: micro-batch.chunk)"
    fig.legend(*_legend_keys(found), loc="outside lower center", ncols=len(STYLE), fontsize=8, frameon=False)
    fit_title(ax, title or f"1F1B schedule: {prog.num_microbatches} micro-batches{interleaved}, "
                           f"pipeline time {makespan:.4g} s", 10)
    fig.draw_without_rendering()  # the layout: how many pixels a second is
    px_per_s = ax.get_window_extent().width / makespan
    narrowest = min((b - a for kind in ("forward", "backward") for _, a, b, _ in found[kind]), default=makespan)
    for kind, (_, color, hatch) in STYLE.items():
        rows: dict[int, list[tuple[float, float]]] = {}
        for stage, a, b, _ in found[kind]:
            rows.setdefault(stage, []).append((a, b - a))
        narrow = narrowest * px_per_s < MIN_EDGED_PX
        edge = "none" if narrow else "#555555" if hatch is not None else "white"
        hatch = None if narrow else hatch
        for stage, bars in sorted(rows.items()):
            ax.broken_barh(bars, (stage - ROW_HEIGHT / 2, ROW_HEIGHT), facecolors=color, hatch=hatch,
                           edgecolor=edge, linewidth=0.4)
    _number_bars(fig, ax, prog, found, px_per_s)
    return fig, _drawn(found)


def _legend_keys(found: dict[str, list]) -> tuple[list, list[str]]:
    """A key for each kind of segment drawn, in STYLE's order."""
    from matplotlib.patches import Patch

    kinds = [kind for kind in STYLE if found[kind]]
    return ([Patch(facecolor=STYLE[k][1], hatch=STYLE[k][2], edgecolor="#555555", linewidth=0.4) for k in kinds],
            [STYLE[k][0] for k in kinds])


def _number_bars(fig, ax, prog, found: dict[str, list], px_per_s: float) -> None:
    """Each forward and backward's micro-batch (.chunk, interleaved) inside its bar, where it fits."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.font_manager import FontProperties

    renderer = FigureCanvasAgg(fig).get_renderer()
    font = FontProperties(size=LABEL_FONT_SIZE)
    widths: dict[str, float] = {}
    for kind in ("forward", "backward"):
        for stage, a, b, i in found[kind]:
            text = str(prog.microbatch[i]) + (f".{prog.chunk[i]}" if prog.virtual_stages > 1 else "")
            if text not in widths:
                widths[text] = renderer.get_text_width_height_descent(text, font, ismath=False)[0]
            if (b - a) * px_per_s >= widths[text] + LABEL_PAD_PX:
                ax.text((a + b) / 2, stage, text, ha="center", va="center", fontsize=LABEL_FONT_SIZE, color="white")


def write_trace(times: OpTimes, out_path: str | os.PathLike, *, plan: int = 0, stage_names: Sequence[str] = (),
                inputs: Iterable[str | os.PathLike] = (), argument: str = "out_path") -> dict[str, dict]:
    """Write the schedule of plan `plan` of `times` to out_path (.json) in the Chrome trace event format: one
    thread per stage (named by `stage_names`), one complete event per forward, recomputed forward, backward and
    blocking send, times in microseconds from the step's start; idle time is what lies between them. Returns
    what plot_timeline returns."""
    path = Path(out_path)
    if path.suffix.lower() != ".json":
        raise ArgumentError(argument, "expected a trace file name ending in .json", out_path)
    with as_argument(argument, out_path):
        check_outputs([(path, argument)], inputs)
    prog = times.program
    check_drawable(prog.stages, prog.virtual_stages, prog.num_microbatches, "times")
    found = _segments(times, plan)
    events: list[dict] = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
                           "args": {"name": stage_names[stage] if stage < len(stage_names) else f"stage {stage}"}}
                          for stage in range(prog.stages)]
    for kind in ("forward", "recompute", "backward", "send"):
        for stage, a, b, i in found[kind]:
            chunk = f" chunk {prog.chunk[i]}" if prog.virtual_stages > 1 else ""
            events.append({"name": f"{STYLE[kind][0]} {prog.microbatch[i]}{chunk}", "cat": kind, "ph": "X", "pid": 0,
                           "tid": stage, "ts": a * 1e6, "dur": (b - a) * 1e6})
    events.sort(key=lambda event: (event["ph"] != "M", event.get("ts", 0.0), event["tid"]))
    text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=0, allow_nan=False) + "\n"
    with as_argument(argument, out_path):
        write_atomically(path, text, str(path))
    return _drawn(found)
