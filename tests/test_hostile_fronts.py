"""Front files written by hand or by an adversary: every cell is parsed strictly and held to its range, the header
holds only the columns fasop pareto writes, and `fasop plot` refuses each in one line that names the file, the
line and the column, quotes at most a short prefix of the value, and leaves no chart behind."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from conftest import one_line_error

from fasop.cli import main
from fasop.inputs.names import NAME_RULE
from fasop.market.frontfile import read_front_csv

# The README's pareto example (gpt2-xl on fasop-pareto); its first rows are enough for every check here.
FRONT = Path(__file__).parent / "data" / "front-gpt2-xl-fasop-pareto.csv"
ROWS = 4


def front_rows() -> list[list[str]]:
    """The header and the first ROWS rows of FRONT; row 1 is line 2, a feasible composition of 1 A10 node."""
    return list(csv.reader(io.StringIO(FRONT.read_text())))[:ROWS + 1]


def written(rows: list[list[str]], path: Path) -> Path:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    path.write_text(out.getvalue())
    return path


def with_cell(tmp_path: Path, column: str, value: str) -> Path:
    """FRONT's first rows with `column` of line 2 set to `value`."""
    rows = front_rows()
    rows[1][rows[0].index(column)] = value
    return written(rows, tmp_path / "front.csv")


def plot(runner, front: Path, *more: str):
    return runner.invoke(main, ["plot", str(front), "--out", str(front.with_name("chart.png")), *more])


COUNT = "expected an integer from 1 to 9,007,199,254,740,992"
NODES = "expected an integer from 0 to 1,000,000"
NAME = f"expected {NAME_RULE}"


@pytest.mark.parametrize("column,value,problem", [
    ("train_cost_usd", "-1", "expected a number >= 0 and <= 9,007,199,254,740,992, got '-1'"),
    ("train_cost_usd", "1e300", "got '1e300'"),
    ("throughput_samples_per_s", "0", "expected a number > 0 and <= 9,007,199,254,740,992, got '0'"),
    ("throughput_samples_per_s", " 1e3 ", "got ' 1e3 '"),
    ("step_time_s", "inf", "expected a number > 0 and <= 9,007,199,254,740,992, got 'inf'"),
    ("peak_memory_gib", "-5", "expected a number > 0 and <= 65,536, got '-5'"),
    ("gbs", "0", f"{COUNT}, got '0'"),
    ("tp", "-1", f"{COUNT}, got '-1'"),
    ("tp", str(2**70), f"got '{2**70}'"),
    ("tp", "2.0", f"{COUNT}, got '2.0'"),
    ("nodes_A10", "-3", f"{NODES}, got '-3'"),
    ("nodes_A10", "9" * 26, f"{NODES}, got '{'9' * 26}'"),
    ("nodes_A10", "", f"{NODES}, got ''"),
    ("gpus", str(10**40), f"{COUNT}, got '{'1' + '0' * 31}'... (41 characters)"),
    ("gpus", "1_6", f"{COUNT}, got '1_6'"),
    ("gpus", "\u0661\u0662\u0663", f"{COUNT}, got '\u0661\u0662\u0663'"),  # Arabic-Indic digits, 123
    ("layers_per_stage", "48 -1", "item 2: expected an integer from 0 to 9,007,199,254,740,992, got '-1'"),
    ("placement", "A10 A$10", f"item 2: {NAME}"),
    ("model", "gpt2\x00xl", f"{NAME}, got 'gpt2\\x00xl'"),
    ("model", "gpt2\nxl,evil", f"{NAME}, got 'gpt2\\nxl,evil'"),
    ("cluster", "", f"{NAME}, got ''"),
    ("note", "two\nlines", "expected one line of printable text, got 'two\\nlines'"),
])
def test_a_cell_out_of_range_or_loosely_written_is_refused(runner, tmp_path, column, value, problem):
    front = with_cell(tmp_path, column, value)
    one_line_error(plot(runner, front), f"{front}: line 2: column {column}: ", problem)
    assert not front.with_name("chart.png").exists()


@pytest.mark.parametrize("rename,problem", [
    ({"note": "remark"}, "unknown column 'remark'"),
    ({"nodes_A10": "nodes_A 10"}, "column 'nodes_A 10': expected nodes_<type>"),
    ({"note": "gpus"}, "column 'gpus' named twice"),
])
def test_a_column_fasop_does_not_write_is_refused(runner, tmp_path, rename, problem):
    rows = front_rows()
    rows[0] = [rename.get(column, column) for column in rows[0]]
    front = written(rows, tmp_path / "front.csv")
    one_line_error(plot(runner, front), f"{front}: line 1: ", problem)
    assert not front.with_name("chart.png").exists()


def test_the_ranges_take_their_bounds(tmp_path):
    rows = front_rows()
    for column, value in (("nodes_A100", "0"), ("nodes_A10", "1000000"), ("train_cost_usd", "0"),
                          ("cost_per_hour_usd", "0.0"), ("peak_memory_gib", "65536"), ("step_time_s", "9007199254740992"),
                          ("tp", str(2**53)), ("train_hours", "1.25E-2"), ("throughput_samples_per_s", ".5")):
        rows[1][rows[0].index(column)] = value
    record = read_front_csv(written(rows, tmp_path / "front.csv"))[0]
    assert (record["nodes_A10"], record["tp"], record["train_hours"], record["throughput_samples_per_s"]) == (
        1_000_000, 2**53, 0.0125, 0.5)


def test_a_byte_order_mark_is_read_as_a_spreadsheet_wrote_it(tmp_path):
    """A front saved by a spreadsheet program starts with a UTF-8 byte-order mark: it is not part of the header."""
    plain = written(front_rows(), tmp_path / "front.csv")
    marked = tmp_path / "marked.csv"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert read_front_csv(marked) == read_front_csv(plain)


def test_the_margin_comes_from_the_fronts_own_cluster_only(runner, tmp_path):
    front = written(front_rows(), tmp_path / "front.csv")
    result = plot(runner, front, "--budget", "3000", "--cluster", "fasop-1xA100-3xA10")
    one_line_error(result, "--cluster fasop-1xA100-3xA10", f"{front} was made for cluster fasop-pareto")
    assert not front.with_name("chart.png").exists()
    result = plot(runner, front, "--budget", "3000", "--cluster", "fasop-pareto")
    assert result.exit_code == 0, result.output
    assert "fastest within the budget of $3,000.00" in result.stdout


def test_a_front_without_a_plan_that_fits_names_its_file(runner, tmp_path):
    rows = front_rows()
    at = rows[0].index("feasible")
    for row in rows[1:]:
        row[at:at + 2] = ["false", "false"]
    front = written(rows, tmp_path / "front.csv")
    one_line_error(plot(runner, front), f"{front}: no composition has a plan that fits in memory")


def test_a_long_value_is_quoted_by_its_first_characters_and_its_length(runner, tmp_path):
    front = with_cell(tmp_path, "train_cost_usd", "9" * 5000)
    line = one_line_error(plot(runner, front), f"{front}: line 2: column train_cost_usd", "(5,000 characters)")
    assert len(line) < 300 and "9" * 100 not in line
