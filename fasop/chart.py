"""What every chart shares: a figure drawn headless, written whole (PNG or SVG, by the file suffix) with the same
bytes for the same inputs, every text drawn as written (no mathematics), at most MAX_ROWS rows, titles wrapped
inside the figure, logarithmic axes where values span orders of magnitude, and labels of chart points placed so
that no two overlap.

Labels (at most MAX_LABELS): each label may sit at eight positions around its point (right first, then round the
compass), or, shortened to a number, at the same eight; the figure's renderer measures every text, and one
integer program (scipy's milp, exact and deterministic) picks at most one position per label so that no two
chosen boxes intersect and none leaves the axes, preferring full labels, then labels that cover fewer points,
then the earlier positions. A label shown as a number, or not shown at all, is named with its value in the legend
instead; as the legend's size moves the axes, the placement is solved again with those labels kept as numbers
until no new one is added.

matplotlib is imported only inside these functions, so that the rest of fasop starts without it.
"""

from __future__ import annotations

import io
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from fasop.errors import ArgumentError, InputError
from fasop.files import write_atomically

SUFFIXES = (".png", ".svg")
# Rows (pipeline stages) a chart draws: a figure grows some 0.45 inches a row, so 256 rows make one about 115 inches
# (11,500 pixels) tall, which draws and saves in a few seconds.
MAX_ROWS = 256
T = TypeVar("T")


def figure(width_in: float, height_in: float):
    """A figure not registered with pyplot; the Agg backend is selected unless pyplot is already in use."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), layout="constrained")


def check_out(out_path, argument: str) -> Path:
    path = Path(out_path)
    if path.suffix.lower() not in SUFFIXES:
        raise ArgumentError(argument, "expected a file name ending in .png or .svg", out_path)
    return path


@contextmanager
def as_argument(argument: str, path) -> Iterator[None]:
    """The errors of a file check or write in the block, which name the file, as errors of the argument that
    gave its path (which the command line names by its option)."""
    try:
        yield
    except InputError as err:
        raise ArgumentError(argument, err.problem, path) from None


@contextmanager
def plain_text() -> Iterator[None]:
    """Every text drawn inside (as a decorator: by the function) as written: names from input files may hold `$`,
    which matplotlib would otherwise read as mathematics and draw as something else, or refuse with a traceback;
    fasop's charts draw no mathematics. Tick labels are made as the figure is drawn, so saving it needs this too."""
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False}):
        yield


@plain_text()
def figure_bytes(fig, suffix: str) -> bytes:
    """The chart as PNG or SVG ('.png', '.svg'), without a date or random ids (the same inputs, the same bytes)."""
    import matplotlib

    image = io.BytesIO()
    if suffix.lower() == ".svg":
        with matplotlib.rc_context({"svg.hashsalt": "fasop"}):
            fig.savefig(image, format="svg", metadata={"Date": None})
    else:
        fig.savefig(image, format="png", dpi=100, metadata={"Software": None})
    return image.getvalue()


def save(fig, path: Path, argument: str) -> None:
    """Write the chart whole or not at all."""
    with as_argument(argument, path):
        write_atomically(path, figure_bytes(fig, path.suffix))


# An axis is logarithmic when its largest value is more than LOG_SPAN times its smallest: on a linear axis the
# values under a tenth of the largest share the first tenth of it (some 60 pixels), too little to tell points
# apart or to label them, while a logarithmic axis gives each factor of the span the same room.
LOG_SPAN = 10.0


def fit_title(ax, title: str, fontsize: float) -> None:
    """Set the axes' title in lines that lie inside the figure: the title is centred on the axes, so a line may
    be at most twice as wide as the distance from the axes' centre to the nearer edge of the figure (measured
    once laid out; lines are broken at spaces, or inside a word longer than a line)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = ax.figure
    text = ax.set_title(title, fontsize=fontsize)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    width = text.get_window_extent(renderer).width
    frame = ax.get_window_extent(renderer)
    centre = (frame.x0 + frame.x1) / 2
    room = 2 * min(centre - fig.bbox.x0, fig.bbox.x1 - centre)
    if width > room:  # characters per line from the title's mean character width, with a tenth to spare
        chars = max(8, int(0.9 * len(title) * room / width))
        ax.set_title(textwrap.fill(title, width=chars, break_on_hyphens=False), fontsize=fontsize)


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1 else f"{value:.2g}"


def scale(ax, which: str, values: list[float], money: bool) -> None:
    """A logarithmic scale for values that span more than LOG_SPAN, ticked at 1, 2 and 5 of each power of ten
    (a plain log axis may show a single tick across a span of 11); numbers with thousands separators."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    low, high = min(values), max(values)
    if low > 0 and high > LOG_SPAN * low:
        ax.set_xscale("log") if which == "x" else ax.set_yscale("log")
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(lambda value, _: ("$" if money else "") + _number(value)))


LABEL_GID = "label-"  # gid of every placed label: label-<index>, label-<index>-number
# (x, y) direction of each position from the point, with the text's alignment there; right of the point first
POSITIONS = ((1, 0, "left", "center"), (1, -1, "left", "top"), (1, 1, "left", "bottom"), (0, 1, "center", "bottom"),
             (0, -1, "center", "top"), (-1, 0, "right", "center"), (-1, 1, "right", "bottom"),
             (-1, -1, "right", "top"))
GAP_PX = 2.0  # clearance kept between two labels and between a label and the axes' edge
FULL_SCORE, NUMBER_SCORE, COVER_PENALTY = 100.0, 30.0, 5.0  # a full label beats a number even over a few points
# Labels of one chart: as many as its legend can name beside its 5.4 inches where none has room; the integer
# program's work grows steeply with them.
MAX_LABELS = 40
# Seconds the integer programs of one chart take at most, together: far beyond what MAX_LABELS labels take but in
# crowds built to be hard, so that the placement is the exact optimum, the same every run. Out of time, no label is
# drawn and each is named in the legend instead, whatever the program had found by then.
LABEL_TIME_LIMIT_S = 10.0


@dataclass(frozen=True)
class Label:
    """A text for the point (x, y) in data coordinates; `value` names the point where the text is not drawn."""

    x: float
    y: float
    text: str
    value: str
    radius_pt: float = 4.0  # how far from the point the text starts: the marker's radius and a little
    color: str = "#333333"
    fontsize: float = 7.0
    weight: str = "normal"


def spread(items: Sequence[T], count: int) -> list[T]:
    """At most `count` (2 or more) of `items`, evenly spaced from the first to the last."""
    if len(items) <= count:
        return list(items)
    return [items[i * (len(items) - 1) // (count - 1)] for i in range(count)]


def _box(anchor: np.ndarray, size: tuple[float, float], position: tuple, distance_px: float) -> np.ndarray:
    """[x0, y0, x1, y1] in pixels of a text of `size` at `position` around `anchor`."""
    dx, dy, ha, va = position
    x, y = anchor[0] + dx * distance_px, anchor[1] + dy * distance_px
    width, height = size
    x0 = {"left": x, "center": x - width / 2, "right": x - width}[ha]
    y0 = {"bottom": y, "center": y - height / 2, "top": y - height}[va]
    return np.array([x0, y0, x0 + width, y0 + height])


def _measure(fig, renderer, text: str, label: Label) -> tuple[float, float]:
    probe = fig.text(0, 0, text, fontsize=label.fontsize, fontweight=label.weight)
    extent = probe.get_window_extent(renderer)
    probe.remove()
    return float(extent.width), float(extent.height)


def _candidates(fig, ax, renderer, labels: Sequence[Label], numbered: set[int], points_px: np.ndarray):
    """(label, is_number, position index, box, points covered) of every position inside the axes."""
    frame = ax.get_window_extent(renderer)
    found = []
    for index, label in enumerate(labels):
        anchor = ax.transData.transform((label.x, label.y))
        distance_px = label.radius_pt * fig.dpi / 72
        for is_number in (False, True):
            if not is_number and index in numbered:
                continue
            size = _measure(fig, renderer, str(index + 1) if is_number else label.text, label)
            for position_index, position in enumerate(POSITIONS):
                box = _box(anchor, size, position, distance_px)
                if (box[0] < frame.x0 + GAP_PX or box[1] < frame.y0 + GAP_PX or box[2] > frame.x1 - GAP_PX
                        or box[3] > frame.y1 - GAP_PX):
                    continue
                inside = ((points_px[:, 0] >= box[0]) & (points_px[:, 0] <= box[2]) & (points_px[:, 1] >= box[1])
                          & (points_px[:, 1] <= box[3]))
                found.append((index, is_number, position_index, box, int(inside.sum())))
    return found


def _meeting(boxes: np.ndarray, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (a, b), a < b in lexical order, of boxes of different labels closer than GAP_PX: a sweep along x
    meets each box only with those that start before it ends, so work and memory grow with the pairs found."""
    order = np.argsort(boxes[:, 0], kind="stable")
    ends = np.searchsorted(boxes[order, 0], boxes[order, 2] + GAP_PX, side="left")
    pairs = []
    for i, end in enumerate(ends):
        a, others = order[i], order[i + 1:end]
        near = others[(boxes[others, 1] < boxes[a, 3] + GAP_PX) & (boxes[a, 1] < boxes[others, 3] + GAP_PX)
                      & (owner[others] != owner[a])]
        pairs += [(min(a, b), max(a, b)) for b in near.tolist()]
    first, second = np.array(sorted(pairs), dtype=int).reshape(-1, 2).T
    return first, second


def _choose(found: list, count: int, seconds: float) -> list[int]:
    """Indices into `found` of the chosen positions: the integer program of the module docstring, or none when it
    takes more than `seconds`."""
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_matrix

    if not found or seconds <= 0:
        return []
    boxes = np.array([box for _, _, _, box, _ in found])
    owner = np.array([label for label, _, _, _, _ in found])
    score = np.array([(NUMBER_SCORE if is_number else FULL_SCORE) - COVER_PENALTY * min(covered, 10) - 0.1 * position
                      for _, is_number, position, _, covered in found])
    a, b = _meeting(boxes, owner)
    rows = np.concatenate([owner, count + np.arange(len(a)), count + np.arange(len(a))])
    cols = np.concatenate([np.arange(len(found)), a, b])
    matrix = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(count + len(a), len(found)))
    result = milp(-score, integrality=np.ones(len(found)), bounds=(0, 1),
                  constraints=LinearConstraint(matrix, -np.inf, 1), options={"time_limit": seconds})
    if result.status != 0:  # out of time: its best so far depends on the machine's speed
        return []
    return [int(i) for i in np.flatnonzero(np.round(result.x) == 1)]


def place_labels(fig, ax, labels: Sequence[Label], points: np.ndarray,
                 legend: Callable[[list[str]], None]) -> dict[str, int]:
    """Draw `labels` (at most MAX_LABELS) on `ax` without overlap (module docstring), avoiding the points (data
    coordinates, n x 2) where it can; `legend(entries)` draws the figure's legend with the entries of the labels
    not drawn in full. Returns how many labels were drawn in full, as numbers, and not at all."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if len(labels) > MAX_LABELS:
        raise ArgumentError("labels", f"{len(labels)} labels: a chart places at most {MAX_LABELS}")

    renderer = FigureCanvasAgg(fig).get_renderer()
    numbered: set[int] = set()
    deadline = time.monotonic() + LABEL_TIME_LIMIT_S
    while True:
        legend([f"{i + 1}: {' '.join(labels[i].text.split())} ({labels[i].value})" for i in sorted(numbered)])
        fig.draw_without_rendering()  # the layout, with this legend
        points_px = ax.transData.transform(points) if len(points) else np.zeros((0, 2))
        found = _candidates(fig, ax, renderer, labels, numbered, points_px)
        chosen = [found[i] for i in _choose(found, len(labels), deadline - time.monotonic())]
        full = {label for label, is_number, _, _, _ in chosen if not is_number}
        if set(range(len(labels))) - full <= numbered:
            break
        numbered |= set(range(len(labels))) - full
    for label_index, is_number, position_index, _, _ in chosen:
        label = labels[label_index]
        dx, dy, ha, va = POSITIONS[position_index]
        ax.annotate(str(label_index + 1) if is_number else label.text, (label.x, label.y),
                    xytext=(dx * label.radius_pt, dy * label.radius_pt), textcoords="offset points", ha=ha, va=va,
                    fontsize=label.fontsize, fontweight=label.weight, color=label.color,
                    gid=f"{LABEL_GID}{label_index}" + ("-number" if is_number else ""))
    shown_as_number = len(chosen) - len(full)
    return {"full": len(full), "number": shown_as_number, "none": len(labels) - len(chosen)}
