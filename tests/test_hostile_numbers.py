"""Hostile numbers: values inside a field's old range that broke the arithmetic (divisions by zero, steps of
300 digits, casts of NaN, floats cancelling to a negative exposure), digits int() and float() take that a
profile must not, and commands that printed before refusing their input. Each is refused in one line naming
the file or option, the field and what was expected, or answered exactly."""

from __future__ import annotations

import json
import math

import pytest
from conftest import gpu_table, one_line_error, profile_csv

from fasop.cli import main
from fasop.errors import InputError
from fasop.market.choice import choose
from fasop.market.pareto import MAX_LIMIT, MIN_LIMIT, check_limits

# -- the GPU table's least figures ------------------------------------------------------------------------------
TINY_FIGURES = [  # a figure so small that the roofline divided by zero or printed 300 digits, what the line says
    ({"dense_fp16_tflops": 1e-200, "matmul_efficiency": 1e-200}, "dense_fp16_tflops", ">= 0.01"),
    ({"matmul_efficiency": 1e-200}, "matmul_efficiency", ">= 0.01"),
    ({"dense_bf16_tflops": 1e-300}, "dense_bf16_tflops", "0 (none) or a number >= 0.01"),
    ({"memory_bandwidth_gb_per_s": 1e-300}, "memory_bandwidth_gb_per_s", ">= 1"),
    ({"dense_fp8_tflops": 1e-300}, "dense_fp8_tflops", "0 (none) or a number >= 0.01"),
    ({"dense_fp8_tflops": 100.0, "fp8_matmul_efficiency": 1e-300, "compute_capability": "9.0"},
     "fp8_matmul_efficiency", ">= 0.01"),
    ({"allreduce_busbw": [[1024, 1e-300], [2048, 10.0]]}, "allreduce_busbw", "bandwidths >= 1e-06"),
    ({"attention_tflops": [[64, 512, 1e-300, 300, 300], [64, 1024, 300, 400, 300]]}, "attention_tflops",
     "speeds >= 0.01"),
]


@pytest.mark.parametrize("changes, field, expected", TINY_FIGURES, ids=[f[1] for f in TINY_FIGURES])
def test_a_gpu_figure_below_its_least_is_refused_in_one_line(runner, tiny, changes, field, expected):
    files = tiny(cluster_extra=gpu_table("fast", **changes) + gpu_table("slow"))
    result = runner.invoke(main, ["search", *files.args()])
    one_line_error(result, f"{files.cluster}: gpu.fast.{field}", expected)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_gpus_at_the_least_figures_give_finite_steps_at_every_micro_batch_size(runner, tiny, tmp_path):
    least = {"dense_fp16_tflops": 0.01, "dense_bf16_tflops": 0.01, "matmul_efficiency": 0.01,
             "memory_bandwidth_gb_per_s": 1.0}
    files = tiny(cluster_extra=gpu_table("fast", **least) + gpu_table("slow", **least))
    out = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", *files.args(), "--output", str(out)])
    assert result.exit_code == 0, result.output
    plans = json.loads(out.read_text())
    # micro-batch sizes beyond the profiled one follow the roofline of these figures
    assert {p["mbs"] for p in plans} > {1}
    assert all(math.isfinite(p["step_time_s"]) and 0 < p["step_time_s"] < 1e9 for p in plans)


# -- the cluster file's memory margin and node counts -----------------------------------------------------------
@pytest.mark.parametrize("margin", [1e-20, 1e-10, 0.5])
def test_a_memory_margin_below_1_is_refused(runner, tiny, margin):
    files = tiny(cluster={"memory_margin": margin})
    result = runner.invoke(main, ["search", *files.args()])
    one_line_error(result, f"{files.cluster}: cluster.memory_margin", "expected a number >= 1 and <= 100")


def test_node_counts_of_more_gpus_than_a_plan_spans_name_the_file_and_the_count(runner, tiny):
    files = tiny(nodes={"slow": {"count": 1_000_000}})
    result = runner.invoke(main, ["search", *files.args()])
    one_line_error(result, f"{files.cluster}: node_type.slow.count", "at most 262,144 GPUs", "got 2,000,002")


# -- profile rows ---------------------------------------------------------------------------------------------
FIRST_ROW = "1,1,embedding,0.001,0.002"  # line 3 of the fast profile: a comment and the header before it
MALFORMED_CELLS = [  # the row as written, the field refused; int() and float() read each as the original
    ("0_1,1,embedding,0.001,0.002", "tp"),
    ("\u0661,1,embedding,0.001,0.002", "tp"),  # ARABIC-INDIC DIGIT ONE
    ("\uff11,1,embedding,0.001,0.002", "tp"),  # FULLWIDTH DIGIT ONE
    ("1,\uff11,embedding,0.001,0.002", "mbs"),
    ("1,1,embedding,0.00_1,0.002", "forward_s"),
    ("1,1,embedding,0.001,\u0660.\u0660\u0660\u0662", "backward_s"),  # 0.002 in Arabic-Indic digits
    ("1,1,embedding,1e-320,0.002", "forward_s"),  # below a picosecond: the partition's ratios overflow
]


@pytest.mark.parametrize("row, field", MALFORMED_CELLS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(MALFORMED_CELLS)])
def test_a_profile_cell_that_is_not_a_plain_ascii_number_in_range_is_refused(runner, tiny, row, field):
    text = profile_csv("fast")
    assert FIRST_ROW in text
    files = tiny(profiles={"fast": text.replace(FIRST_ROW, row)})
    result = runner.invoke(main, ["search", *files.args()])
    one_line_error(result, f"{files.profiles / 'fast.csv'}: line 3: {field}")


def test_a_peak_memory_cell_of_more_digits_than_int_reads_is_refused(runner, tiny):
    lines = profile_csv("fast").splitlines()
    header = lines.index("tp,mbs,kind,forward_s,backward_s")
    rows = [line + ",0" if i > header else line for i, line in enumerate(lines)]
    rows[header] += ",peak_memory_bytes"
    rows[header + 1] = rows[header + 1][:-1] + "9" * 5000
    files = tiny(profiles={"fast": "\n".join(rows) + "\n"})
    result = runner.invoke(main, ["search", *files.args()])
    one_line_error(result, f"{files.profiles / 'fast.csv'}: line 3: peak_memory_bytes", "from 0 to 2**50")


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_profile_times_of_a_nanosecond_give_a_plan(runner, tiny):
    fast = "\n".join(line if line[0] in "#t" else ",".join(line.split(",")[:3] + ["1e-09", "1e-09"])
                     for line in profile_csv("fast").splitlines()) + "\n"
    files = tiny(profiles={"fast": fast})
    assert runner.invoke(main, ["search", *files.args()]).exit_code == 0


# -- the exact step's data-parallel exposure --------------------------------------------------------------------
def _estimate(runner, gbs: int) -> dict:
    result = runner.invoke(main, ["estimate", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10", "--gbs", str(gbs),
                                  "--tp", "1", "--dp", "4", "--pp", "4", "--mbs", "1", "--placement", "A100,A10*3",
                                  "--layers", "16,11,11,10", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_exposed_data_parallel_time_is_exact_at_the_largest_batch(runner):
    small, huge = _estimate(runner, 64), _estimate(runner, 2**52)
    assert huge["step_time_s"] > 1e13  # steps this long once cancelled the exposure to a negative number
    # the exposure after the last backward does not depend on the number of micro-batches before it
    assert small["dp_exposed_s"] > 0
    assert huge["dp_exposed_s"] == pytest.approx(small["dp_exposed_s"], rel=1e-12)


# -- block recomputation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp, layers, count", [(2, "2,2", str(2**63)), (2, "2,2", "99999999999999999999"),
                                               (1, "4", "5")])
def test_a_block_recompute_count_above_the_models_layers_is_refused(runner, tiny, pp, layers, count):
    files = tiny()
    placement = "fast,slow" if pp == 2 else "fast"
    result = runner.invoke(main, ["estimate", *files.args(), "--tp", "1", "--dp", "2", "--pp", str(pp), "--mbs", "1",
                                  "--placement", placement, "--layers", layers, "--recompute", "full",
                                  "--recompute-method", "block", "--recompute-num-layers", count])
    one_line_error(result, "--recompute", "layer count from 1 to the model's 4 layers", f"got {count}")


# -- fasop pareto's limits and run length, checked before any line ------------------------------------------------
@pytest.mark.parametrize("args, option", [
    (["--budget", "1e300", "--train-steps", "10"], "--budget"),
    (["--budget", "0.001", "--train-steps", "10"], "--budget"),
    (["--deadline", "1e-300", "--train-steps", "10"], "--deadline"),
    (["--deadline", "1e300", "--train-steps", "10"], "--deadline"),
    (["--train-tokens", "1e-300"], "--train-tokens"),
    (["--gbs", "-5"], "--gbs"),
])
def test_pareto_refuses_its_numbers_before_printing_anything(runner, tiny, args, option):
    files = tiny()
    result = runner.invoke(main, ["pareto", *files.args(), *args])
    one_line_error(result, option)
    assert result.stdout == ""


def test_pareto_rent_refuses_quotas_of_too_many_gpus_before_printing_anything(runner, tiny):
    files = tiny(nodes={"slow": {"count": 1_000_000}})
    result = runner.invoke(main, ["pareto", *files.args(), "--rent", "--train-steps", "10"])
    one_line_error(result, f"{files.cluster}: node_type.slow.count")
    assert result.stdout == ""


@pytest.mark.parametrize("limits", [{"budget_usd": 1e300}, {"budget_usd": 0.001}, {"deadline_hours": 1e-300},
                                    {"deadline_hours": MAX_LIMIT * 2}])
def test_a_limit_out_of_its_range_is_refused_by_the_library(limits):
    with pytest.raises(InputError, match=f"from {MIN_LIMIT:g} to"):
        check_limits(**limits)
    with pytest.raises(InputError, match=next(iter(limits))):
        choose([], **limits)


def test_the_limits_at_their_ends_are_taken():
    check_limits(budget_usd=MIN_LIMIT, deadline_hours=MAX_LIMIT)
    check_limits(budget_usd=MAX_LIMIT, deadline_hours=MIN_LIMIT)
