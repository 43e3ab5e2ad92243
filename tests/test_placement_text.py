"""Placements written in run-length form (`A100,A10*3`, as every output of fasop writes them) are read back
wherever a placement is read: fasop.plans.expand_placement, `fasop estimate --placement`, measured-runs CSVs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from test_cli_search import assert_input_error

from fasop.calibration.measured import read_runs_csv
from fasop.cli import main
from fasop.errors import InputError
from fasop.plans import MAX_PLACEMENT_NODES, compress_placement, expand_placement

NAMES = ["A10", "A100", "H100", "a-b.c+d_1", "9"]  # valid names, some the prefix of another
README_PLAN = ["estimate", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", "--tp", "1", "--dp", "4", "--pp", "4",
               "--mbs", "8", "--layers", "13,5,5,1"]


@given(st.lists(st.sampled_from(NAMES), min_size=1, max_size=40))
def test_compressed_placements_expand_back(placement):
    assert expand_placement(compress_placement(placement), "placement") == placement


@pytest.mark.parametrize("text, placement", [
    ("A10*7,A100", ["A10"] * 7 + ["A100"]),
    (" A100 , A10 * 2 ", ["A100", "A10", "A10"]),
    ("H100", ["H100"]),
    ("H100*1", ["H100"]),
    ("A10*007", ["A10"] * 7),
    ("A10,A10*2,A10", ["A10"] * 4),
    (f"A10*{MAX_PLACEMENT_NODES - 1},A100", ["A10"] * (MAX_PLACEMENT_NODES - 1) + ["A100"]),
])
def test_placement_texts(text, placement):
    assert expand_placement(text, "placement") == placement


@pytest.mark.parametrize("text, named", [
    ("", "item 1 is empty"),
    ("A10,,A100", "item 2 is empty"),
    ("A10, ", "item 2 is empty"),
    ("A10*0", "item 1 ('A10*0'): expected a positive integer after '*', got '0'"),
    ("A100,A10*-1", "item 2 ('A10*-1'): expected a positive integer"),
    ("A10*1.5", "item 1 ('A10*1.5'): expected a positive integer"),
    ("A10*x", "item 1 ('A10*x'): expected a positive integer"),
    ("A10*", "item 1 ('A10*'): expected a positive integer after '*', got ''"),
    ("A10*2*3", "item 1 ('A10*2*3'): expected a positive integer"),
    ("A10*\u0663", "expected a positive integer"),  # an Arabic-Indic 3: a digit to int(), not to a placement
    ("*3", "item 1 ('*3'): expected NAME or NAME*N, where NAME is a name of 1 to 64"),
    ("A 10", "item 1 ('A 10'): expected NAME or NAME*N"),
    ("A100,-A10", "item 2 ('-A10'): expected NAME"),
    (f"A10*{MAX_PLACEMENT_NODES},A100", f"item 2 ('A100'): more than {MAX_PLACEMENT_NODES:,} nodes in all"),
    ("A10*" + "9" * 5000, f"item 1 ('A10*{'9' * 5000}'): more than {MAX_PLACEMENT_NODES:,} nodes"),
])
def test_bad_placement_texts_are_one_line_naming_the_item(text, named):
    with pytest.raises(InputError) as caught:
        expand_placement(text, "plans.csv: line 2: placement")
    message = str(caught.value)
    assert message.startswith("plans.csv: line 2: placement: ") and "\n" not in message
    assert named in message


def test_estimate_reads_the_placement_as_its_output_writes_it(runner):
    expanded, compressed = (runner.invoke(main, [*README_PLAN, "--placement", placement])
                            for placement in ("A100,A10,A10,A10", "A100,A10*3"))
    assert expanded.exit_code == compressed.exit_code == 0, expanded.output + compressed.output
    assert "placement A100,A10*3," in expanded.stdout
    assert compressed.stdout == expanded.stdout and compressed.stderr == expanded.stderr == ""


def test_estimate_refuses_a_bad_placement_in_one_line(runner: CliRunner):
    assert_input_error(runner.invoke(main, [*README_PLAN, "--placement", "A100,A10*0"]), "--placement", "A10*0")


def test_measured_runs_read_run_length_placements(tmp_path):
    measured = tmp_path / "measured.csv"
    measured.write_text("tp,dp,pp,mbs,gbs,placement,layers_per_stage,measured_step_s\n"
                        "1,4,4,8,64,A10*3 A100,5 5 5 9,1.5\n"
                        "1,4,4,8,64,A10 A10 A10 A100,5 5 5 9,1.5\n"
                        '1,4,4,8,64,"A10*2, A10,A100",5 5 5 9,1.5\n')
    runs = read_runs_csv(measured, model="bert", cluster="fasop-1xA100-3xA10")
    assert [run.placement for run in runs] == [("A10", "A10", "A10", "A100")] * 3
    measured.write_text("tp,dp,pp,mbs,gbs,placement,layers_per_stage,measured_step_s\n"
                        "1,4,4,8,64,A10*0 A100,5 5 5 9,1.5\n")
    with pytest.raises(InputError, match=r"measured\.csv: line 2: placement: item 1 \('A10\*0'\)"):
        read_runs_csv(measured, model="bert", cluster="fasop-1xA100-3xA10")
