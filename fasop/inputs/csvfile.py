"""Reading CSV input files: rows with their line numbers, cells as long as CSV_CELL_LIMIT, every error one line
naming the file and the line."""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Iterable

from fasop.errors import InputError
from fasop.files import CSV_LIMIT_BYTES

# Longest cell of any CSV fasop reads (docs/formats.md): a profile or measured-runs file may be this long whole,
# and a front file's placement of a large composition can outgrow Python's own default of 128 KiB.
CSV_CELL_LIMIT = CSV_LIMIT_BYTES


def csv_rows(lines: Iterable[tuple[int, str]], file: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of each row of `lines`, given as (line number, text) pairs; a row whose quoted cell
    spans several lines takes the number of its first. A cell longer than CSV_CELL_LIMIT characters, text that is
    not CSV, or a first row (the header of every CSV fasop reads) naming a column twice is an InputError naming
    the file and the line."""
    numbered = list(lines)
    reader = csv.reader(text for _, text in numbered)
    rows: list[tuple[int, list[str]]] = []
    # csv's limit is process-wide: set for this read only, so that other readers in the process keep theirs
    previous = csv.field_size_limit(CSV_CELL_LIMIT)
    try:
        start = 0  # lines read before the row
        for cells in reader:
            if cells:  # a blank line is no row
                rows.append((numbered[start][0], cells))
            start = reader.line_num
    except csv.Error as err:
        where = f"{file}: line {numbered[max(reader.line_num, 1) - 1][0]}"
        if "field larger than field limit" in str(err):
            raise InputError(where, f"a cell longer than {CSV_CELL_LIMIT:,} characters, the most fasop reads "
                                    "in one cell") from None
        raise InputError(where, f"not CSV ({err})") from None
    finally:
        csv.field_size_limit(previous)
    if rows:  # a reader of a row as a dict would keep only the last of two cells of one column
        number, header = rows[0]
        twice = [name for name, count in Counter(header).items() if count > 1]
        if twice:
            raise InputError(f"{file}: line {number}", f"column {twice[0]!r} named twice in the header; expected each "
                                                       "column once")
    return rows
