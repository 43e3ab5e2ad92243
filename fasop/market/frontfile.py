"""Front files: what `fasop pareto --output` writes (one row per composition, CSV) and `fasop plot` reads."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from fasop.errors import InputError
from fasop.files import PLANS_LIMIT_BYTES, check_finite, read_text, write_atomically
from fasop.inputs.csvfile import csv_rows
from fasop.plans import CSV_LIST_SEPARATOR

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
INT_COLUMNS = {"gbs", "gpus", "mbs", "tp", "dp", "pp", "num_microbatches", "train_steps", "plans_evaluated",
               "out_of_memory"}
BOOL_COLUMNS = {"feasible", "on_front"}
LIST_COLUMNS = {"placement": str, "layers_per_stage": int, "stage_tp": int, "stage_dp": int}
TEXT_COLUMNS = {"model", "cluster", "note", "kind", "placement_search", "precision"}


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


def _parse(value: str, column: str, where: str):
    known = column.startswith(NODES_PREFIX) or column in (*HEAD_COLUMNS, *TAIL_COLUMNS, *PROGRAM_COLUMNS)
    if column in TEXT_COLUMNS or not known:  # columns added by hand are kept as text
        return value
    if value == "":
        return None
    try:
        if column.startswith(NODES_PREFIX) or column in INT_COLUMNS:
            return int(value)
        if column in BOOL_COLUMNS:
            if value.lower() not in ("true", "false"):
                raise ValueError
            return value.lower() == "true"
        if column in LIST_COLUMNS:
            return [LIST_COLUMNS[column](v) for v in value.split(CSV_LIST_SEPARATOR)]
        number = float(value)
    except ValueError:
        raise InputError(where, f"column {column}: unexpected value {value!r}") from None
    if not math.isfinite(number):
        raise InputError(where, f"column {column}: expected a finite number, got {value!r}")
    return number


def read_front_csv(path) -> list[dict]:
    """The records of a front file written by `write_front_csv` (`fasop pareto --output`)."""
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
    records = []
    for number, cells in rows[1:]:
        where = f"{file}: line {number}"
        if len(cells) != len(header):
            raise InputError(where, f"expected {len(header)} cells")
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
