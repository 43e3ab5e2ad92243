"""Front files: what `fasop pareto --output` writes (one row per composition, CSV) and `fasop plot` reads."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fasop.errors import InputError
from fasop.files import PLANS_LIMIT_BYTES, check_finite, read_text, write_atomically
from fasop.inputs.cluster import MAX_GPU_MEMORY_GIB, MAX_NODES_PER_TYPE
from fasop.inputs.csvfile import csv_rows
from fasop.inputs.names import NAME, NAME_RULE
from fasop.inputs.profiles import DECIMAL, INTEGER, _number
from fasop.plans import CSV_LIST_SEPARATOR, MAX_PLAN_INT

NODES_PREFIX = "nodes_"
# Columns of a front file, in order; the per-type node counts (nodes_<type>) come first, after the inputs.
HEAD_COLUMNS = ("model", "cluster", "gbs")
TAIL_COLUMNS = (
    "gpus", "feasible", "on_front", "mbs", "tp", "dp", "pp", "num_microbatches", "placement", "layers_per_stage",
    "step_time_s", "throughput_samples_per_s", "cost_per_hour_usd", "cost_per_step_usd", "train_steps",
    "train_hours", "train_cost_usd", "peak_memory_gib", "plans_evaluated", "out_of_memory", "note",
)
# Columns of the points `fasop pareto --rent` finds, stage-group plans (each stage's tp and dp, the integer
# program's gap), after the others in a file that holds any.
PROGRAM_COLUMNS = ("kind", "stage_tp", "stage_dp", "placement_search", "optimality_gap")
# A sweep in several precisions (--precision bf16,fp8): each composition's best plan's precision, last.
PRECISION_COLUMNS = ("precision",)
# What `read_front_csv` insists on (the rest are informative).
REQUIRED_COLUMNS = (
    "gpus", "feasible", "on_front", "mbs", "tp", "dp", "pp", "placement", "layers_per_stage", "step_time_s",
    "throughput_samples_per_s", "cost_per_hour_usd", "train_hours", "train_cost_usd",
)
COLUMNS = {*HEAD_COLUMNS, *TAIL_COLUMNS, *PROGRAM_COLUMNS, *PRECISION_COLUMNS}  # and nodes_<type>


class Bounds(NamedTuple):
    """The range of a number of a front file: from `low` (itself allowed only if `low_allowed`) to `high`."""

    low: float
    high: float
    integer: bool = True
    low_allowed: bool = True

    def expected(self) -> str:
        if self.integer:
            return f"an integer from {self.low} to {self.high:,}"
        # every digit of `high`: 2^53 rounded to 9.0072e+15 would name a bound it is not
        return f"a number {'>=' if self.low_allowed else '>'} {self.low:g} and <= {self.high:,.16g}"


# The ranges of the numbers (docs/pareto.md): counts and degrees as a plan file bounds them, node counts as a cluster
# file does; times, throughput and dollars up to 2^53 too, dollars from 0 (a cluster file's nodes may cost nothing);
# the memory of a cluster file's GPU; the integer program's gap, relative to a time whose bound is never negative.
COUNT, TALLY = Bounds(1, MAX_PLAN_INT), Bounds(0, MAX_PLAN_INT)
NODE_COUNT = Bounds(0, MAX_NODES_PER_TYPE)
FIGURE, DOLLARS = Bounds(0, MAX_PLAN_INT, False, False), Bounds(0, MAX_PLAN_INT, False)
NUMBER_COLUMNS = {
    "gbs": COUNT, "gpus": COUNT, "mbs": COUNT, "tp": COUNT, "dp": COUNT, "pp": COUNT, "num_microbatches": COUNT,
    "train_steps": COUNT, "plans_evaluated": TALLY, "out_of_memory": TALLY,
    "step_time_s": FIGURE, "throughput_samples_per_s": FIGURE, "train_hours": FIGURE,
    "cost_per_hour_usd": DOLLARS, "cost_per_step_usd": DOLLARS, "train_cost_usd": DOLLARS,
    "peak_memory_gib": Bounds(0, MAX_GPU_MEMORY_GIB, False, False), "optimality_gap": Bounds(0, 1, False),
}
INT_COLUMNS = {column for column, bounds in NUMBER_COLUMNS.items() if bounds.integer}
BOOL_COLUMNS = {"feasible", "on_front"}
# Lists of node-type names (None) or of integers, separated by spaces
LIST_COLUMNS = {"placement": None, "layers_per_stage": TALLY, "stage_tp": COUNT, "stage_dp": COUNT}
# Names (fasop.inputs.names): model and cluster always, the others where given (not for a point without a plan,
# or of a sweep in one precision)
NAME_COLUMNS = {"model", "cluster", "kind", "placement_search", "precision"}
SHOWN_CHARS = 32  # of a refused value quoted in an error: a cell may hold megabytes


def columns_of(records: list[dict]) -> list[str]:
    types = [key for key in records[0] if key.startswith(NODES_PREFIX)] if records else []
    program = PROGRAM_COLUMNS if any(key in record for record in records for key in PROGRAM_COLUMNS) else ()
    precision = PRECISION_COLUMNS if any("precision" in record for record in records) else ()
    return [*HEAD_COLUMNS, *types, *TAIL_COLUMNS, *program, *precision]


def _format(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return CSV_LIST_SEPARATOR.join(map(str, value))
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float
    if isinstance(value, (np.floating, np.integer)):
        return _format(value.item())
    return str(value)


def front_as_csv(records: list[dict]) -> str:
    """The records as CSV text: one row per composition, lists joined with spaces, booleans true/false,
    floats in the shortest form that reads back exactly, empty cells for the plan of an infeasible row."""
    if not records:
        raise InputError("front", "no compositions to write")
    check_finite(records, "front")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    columns = columns_of(records)
    writer.writerow(columns)
    for record in records:
        writer.writerow([_format(record.get(key)) for key in columns])
    return out.getvalue()


def write_front_csv(records: list[dict], path) -> None:
    """Write the front file whole or not at all."""
    write_atomically(Path(path), front_as_csv(records))


def _shown(text: str) -> str:
    return repr(text) if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]!r}... ({len(text):,} characters)"


def _bounded(text: str, bounds: Bounds, where: str) -> float:
    """The number `text` writes in ASCII digits (no sign, `_` or spaces), within `bounds`."""
    number = _number(text, INTEGER if bounds.integer else DECIMAL, int if bounds.integer else float)
    if not (bounds.low <= number if bounds.low_allowed else bounds.low < number) or not number <= bounds.high:
        raise InputError(where, f"expected {bounds.expected()}, got {_shown(text)}")  # NaN, text not so written, too
    return number


def _name(text: str, where: str) -> str:
    if not NAME.fullmatch(text):
        raise InputError(where, f"expected {NAME_RULE}, got {_shown(text)}")
    return text


def _parse(value: str, column: str, where: str):
    at = f"{where}: column {column}"
    if column == "note":  # fasop writes one line there, shown as it is in the table and the report
        if not value.isprintable():
            raise InputError(at, f"expected one line of printable text, got {_shown(value)}")
        return value
    if column in NAME_COLUMNS:
        return value if value == "" and column not in HEAD_COLUMNS else _name(value, at)
    if column.startswith(NODES_PREFIX):  # every row is a composition
        return _bounded(value, NODE_COUNT, at)
    if value == "":
        return None
    if column in BOOL_COLUMNS:
        if value.lower() not in ("true", "false"):
            raise InputError(at, f"expected true or false, got {_shown(value)}")
        return value.lower() == "true"
    if column in LIST_COLUMNS:
        bounds = LIST_COLUMNS[column]
        return [_name(item, f"{at}: item {index}") if bounds is None else _bounded(item, bounds, f"{at}: item {index}")
                for index, item in enumerate(value.split(CSV_LIST_SEPARATOR), start=1)]
    return _bounded(value, NUMBER_COLUMNS[column], at)


def _check_header(header: list[str], where: str) -> None:
    """Only the columns fasop pareto writes (csv_rows refuses one named twice), each node type's named by the rule."""
    for column in header:
        if column.startswith(NODES_PREFIX) and not NAME.fullmatch(column[len(NODES_PREFIX):]):
            raise InputError(where, f"column {_shown(column)}: expected {NODES_PREFIX}<type>, <type> {NAME_RULE}")
        if not column.startswith(NODES_PREFIX) and column not in COLUMNS:
            raise InputError(where, f"unknown column {_shown(column)}: expected only the columns fasop pareto writes "
                                    "(docs/pareto.md)")


def read_front_csv(path) -> list[dict]:
    """The records of a front file written by `write_front_csv` (`fasop pareto --output`), every cell checked."""
    file = str(path)
    text = read_text(path, PLANS_LIMIT_BYTES, missing="no such file")
    rows = csv_rows(enumerate(io.StringIO(text, newline=""), start=1), file)
    header = rows[0][1] if rows else []
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if not any(h.startswith(NODES_PREFIX) for h in header):
        missing.insert(0, f"{NODES_PREFIX}<type>")
    if missing:
        raise InputError(file, f"not a fasop front file (as fasop pareto writes them): missing column "
                               f"{', '.join(missing)}")
    _check_header(header, f"{file}: line {rows[0][0]}")
    records = []
    for number, cells in rows[1:]:
        where = f"{file}: line {number}"
        if len(cells) != len(header):
            raise InputError(where, f"expected {len(header)} cells, got {len(cells)}")
        record = {column: _parse(value, column, where) for column, value in zip(header, cells)}
        if record["feasible"] is None or record["on_front"] is None:
            raise InputError(where, "columns feasible and on_front need true or false")
        if record["feasible"]:
            blank = [c for c in REQUIRED_COLUMNS if record[c] is None]
            if blank:
                raise InputError(where, f"a feasible composition needs a value in column {', '.join(blank)}")
        records.append(record)
    if not records:
        raise InputError(file, "a front file with no compositions")
    return records
