"""The command line keeps the user's files and numbers safe: an option names an input or an output, never both;
no file is replaced without --force, nor an input with it; a failing command leaves no output behind; every
option is checked where it is parsed, in one line; an option with no effect is refused; CSV cells may be long;
measured runs are read as what their plans are, with step times that keep the arithmetic finite."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import one_line_error

from fasop.cli import main
from fasop.inputs.csvfile import CSV_CELL_LIMIT
from fasop.search.robust import MAX_TRIALS

LONG = 200 * 1024  # above Python's csv field limit of 128 KiB
COLUMNS = "run,model_file,cluster_file,gbs,mbs,tp,dp,pp,placement,layers_per_stage,measured_step_s"
ROWS = ["a,model.toml,cluster.toml,8,1,1,2,1,fast,4,0.061", "b,model.toml,cluster.toml,8,1,1,1,2,fast,2 2,0.052",
        "c,model.toml,cluster.toml,8,1,1,4,1,fast slow,4,0.09"]


def ok(result) -> None:
    assert result.exit_code == 0, (result.output, result.exception)


def measured_csv(tiny_files, rows=ROWS, header=COLUMNS) -> Path:
    path = tiny_files.root / "runs.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- one option, one direction: compare's plans are --plans-out ----------------------------------------------

def test_compare_never_replaces_the_plan_list_the_readme_searched(runner, tiny):
    """search --output plans.json, then compare: --plans is what emit and plot read, so compare has no such
    option, and its --plans-out refuses the search's file without --force."""
    files = tiny()
    plans = files.root / "plans.json"
    ok(runner.invoke(main, ["search", *files.args("--output", str(plans))]))
    searched = plans.read_bytes()
    result = runner.invoke(main, ["compare", *files.args("--plans", str(plans))])
    assert result.exit_code == 2 and "No such option '--plans'" in result.output
    one_line_error(runner.invoke(main, ["compare", *files.args("--plans-out", str(plans))]), "--plans-out",
                   "already exists", "--force")
    assert plans.read_bytes() == searched
    strategies = files.root / "strategies.json"
    ok(runner.invoke(main, ["compare", *files.args("--plans-out", str(strategies))]))
    assert {p["kind"] for p in json.loads(strategies.read_text())} >= {"ddp", "zero3", "3d"}


# -- no file replaced without --force ----------------------------------------------------------------------

WRITERS = {  # command line (after the tiny inputs' options where "{inputs}" stands), the output it writes
    "search --output": (["search", "{inputs}", "--output", "{out}"], "plans.json"),
    "compare --output": (["compare", "{inputs}", "--output", "{out}"], "compare.csv"),
    "compare --plans-out": (["compare", "{inputs}", "--plans-out", "{out}"], "strategies.json"),
    "compare --chart": (["compare", "{inputs}", "--chart", "{out}"], "compare.svg"),
    "pareto --output": (["pareto", "{inputs}", "--output", "{out}"], "front.csv"),
    "pareto --chart": (["pareto", "{inputs}", "--chart", "{out}"], "front.svg"),
    "plot --out": (["plot", "--plan", "{plans}", "--out", "{out}"], "stages.svg"),
    "plot --timeline": (["plot", "--plan", "{plans}", "--timeline", "{out}"], "schedule.svg"),
    "validate --chart": (["validate", "--measured", "{runs}", "--profiles", "{profiles}", "--chart", "{out}"],
                         "validate.svg"),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_an_existing_output_is_replaced_only_with_force(runner, tiny, writer):
    files = tiny()
    plans = files.root / "plans.json"
    ok(runner.invoke(main, ["search", *files.args("--output", str(plans))]))
    command, name = WRITERS[writer]
    out = files.root / name
    out.write_text("mine\n")
    args: list[str] = []
    for item in command:
        if item == "{inputs}":
            args += files.args()
        else:
            args.append(item.format(out=out, plans=plans, runs=measured_csv(files), profiles=files.profiles))
    one_line_error(runner.invoke(main, args), f"{writer.split()[1]} {out}", "already exists", "--force")
    assert out.read_text() == "mine\n"
    ok(runner.invoke(main, [*args, "--force"]))
    assert out.read_bytes() != b"mine\n"


def test_search_emit_folder_with_files_is_replaced_only_with_force(runner, tiny):
    files = tiny()
    run = files.root / "run"
    run.mkdir()
    (run / "sbatch.sh").write_text("mine\n")
    result = runner.invoke(main, ["search", *files.args("--emit", str(run), "--smoke-test")])
    one_line_error(result, f"--emit {run}", "--force")  # the option the user gave, not emit's --out
    assert (run / "sbatch.sh").read_text() == "mine\n"
    ok(runner.invoke(main, ["search", *files.args("--emit", str(run), "--force", "--smoke-test")]))
    assert (run / "sbatch.sh").read_text().startswith("#!")


@pytest.mark.parametrize("rank", ["0", "-3"])
def test_emit_rank_is_checked_where_it_is_parsed(runner, tiny, rank):
    files = tiny()
    plans = files.root / "plans.json"
    ok(runner.invoke(main, ["search", *files.args("--output", str(plans))]))
    result = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--rank", rank, "--out",
                                  str(files.root / "run")])
    one_line_error(result, "--rank", rank)
    assert not (files.root / "run").exists()


def test_profile_layers_never_writes_over_its_model_even_with_force(runner, tiny):
    files = tiny()
    before = files.model.read_bytes()
    result = runner.invoke(main, ["profile", "layers", "--model", str(files.model), "--gpu", "fast", "--device", "cpu",
                                  "--out", str(files.model), "--force"])
    one_line_error(result, f"--out {files.model}", "is an input of this run")
    assert files.model.read_bytes() == before


@pytest.mark.parametrize("command", ["layers", "synth"])
@pytest.mark.parametrize("gpu", ["A10\nrm -rf x", "../A10", "a b", ""])
def test_a_profile_gpu_name_that_no_script_or_file_name_can_hold_is_refused(runner, tiny, command, gpu):
    files = tiny()
    out = files.root / "out.csv"
    result = runner.invoke(main, ["profile", command, "--model", str(files.model), "--gpu", gpu, "--out", str(out)])
    one_line_error(result, "--gpu", "expected a name of 1 to 64")
    assert not out.exists()


# -- a failing command leaves no output behind --------------------------------------------------------------

def test_calibrate_writes_no_cluster_file_when_the_profiles_cannot_be_written(runner, tiny):
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    files = tiny()
    out = files.root / "calibrated.toml"
    result = runner.invoke(main, ["calibrate", "--measured", str(measured_csv(files)), "--profiles",
                                  str(files.profiles), "--out", str(out), "--profiles-out", "/proc/fasop-profiles"])
    assert not out.exists()
    one_line_error(result, "--profiles-out /proc/fasop-profiles")
    assert not [p for p in files.root.iterdir() if p.name.startswith(".")]  # no temporary file either


def test_huge_trials_are_refused_before_the_search_writes_anything(runner, tiny):
    files = tiny()
    out = files.root / "plans.json"
    for trials in (str(10**12), str(MAX_TRIALS + 1), "1e12", "0"):
        result = runner.invoke(main, ["search", *files.args("--output", str(out), "--noise", "0.1", "--trials", trials)])
        one_line_error(result, "--trials", trials)
        assert not out.exists()


@pytest.mark.parametrize("seed", ["-1", str(2**32), "x"])
def test_a_bad_seed_is_one_line(runner, tiny, seed):
    files = tiny()
    out = files.root / "plans.json"
    result = runner.invoke(main, ["search", *files.args("--output", str(out), "--noise", "0.1", "--seed", seed)])
    one_line_error(result, "--seed", seed)
    assert not out.exists()


def test_noise_with_trials_in_range_still_reports(runner, tiny):
    files = tiny()
    result = runner.invoke(main, ["search", *files.args("--noise", "0.1", "--trials", "5", "--seed", "4294967295")])
    ok(result)
    assert "(5 trials, seed 4294967295)" in result.stdout


# -- charts name their own option ---------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["pareto", "compare", "validate"])
def test_a_chart_that_cannot_be_written_names_chart(runner, tiny, command):
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    files = tiny()
    chart = "/proc/fasop-charts/chart.png"
    args = (["validate", "--measured", str(measured_csv(files)), "--profiles", str(files.profiles)]
            if command == "validate" else [command, *files.args()])
    one_line_error(runner.invoke(main, [*args, "--chart", chart]), f"--chart {chart}")


# -- options with no effect are refused ---------------------------------------------------------------------

@pytest.mark.parametrize("args, option", [
    (["search", "{inputs}", "--trials", "50"], "--trials"),
    (["search", "{inputs}", "--seed", "3"], "--seed"),
    (["pareto", "{inputs}", "--x", "time"], "--x"),
    (["validate", "--measured", "{runs}", "--profiles", "{profiles}", "--warmup-iters", "5"], "--warmup-iters"),
    (["calibrate", "--measured", "{runs}", "--profiles", "{profiles}", "--warmup-iters", "5", "--out", "{out}"],
     "--warmup-iters"),
    (["profile", "synth", "--model", "bert", "--gpu", "A100", "--tp", "1", "--link-bandwidth", "100 GB/s", "--out",
      "{out}"], "--link-bandwidth"),
])
def test_an_option_without_effect_is_refused(runner, tiny, args, option):
    files = tiny()
    runs = measured_csv(files)
    expanded: list[str] = []
    for item in args:
        expanded += files.args() if item == "{inputs}" else [item.format(runs=runs, profiles=files.profiles,
                                                                         out=files.root / "c.toml")]
    one_line_error(runner.invoke(main, expanded), option)
    assert not (files.root / "c.toml").exists()


def test_plot_rank_is_checked_where_it_is_parsed(runner, tiny):
    files = tiny()
    result = runner.invoke(main, ["plot", "--plan", str(files.root / "absent.json"), "--rank", "0",
                                  "--out", str(files.root / "c.png")])
    one_line_error(result, "--rank", "0")


# -- long CSV cells -------------------------------------------------------------------------------------------

def test_validate_reads_a_long_cell(runner, tiny):
    files = tiny()
    runs = measured_csv(files, [f"{row},{'x' * LONG}" for row in ROWS], COLUMNS + ",notes")
    ok(runner.invoke(main, ["validate", "--measured", str(runs), "--profiles", str(files.profiles)]))


def test_search_reads_a_profile_with_a_long_cell(runner, tiny):
    files = tiny()
    profile = files.profiles / "fast.csv"
    lines = profile.read_text().splitlines()
    tp, mbs, kind, forward, backward = lines[2].split(",")
    lines[2] = ",".join([tp, mbs, kind, forward + "0" * LONG, backward])  # the same number, padded
    profile.write_text("\n".join(lines) + "\n")
    ok(runner.invoke(main, ["search", *files.args()]))


def front_file(runner, files) -> Path:
    front = files.root / "front.csv"
    ok(runner.invoke(main, ["pareto", *files.args("--output", str(front))]))
    return front


def test_plot_reads_a_front_file_with_a_long_note(runner, tiny):
    files = tiny()
    front = front_file(runner, files)
    lines = front.read_text().splitlines()
    lines[1] = lines[1] + "x" * LONG  # the note is the last column
    front.write_text("\n".join(lines) + "\n")
    ok(runner.invoke(main, ["plot", str(front), "--out", str(files.root / "front.svg")]))


def test_a_cell_beyond_the_limit_is_one_line(runner, tiny):
    files = tiny()
    front = front_file(runner, files)
    lines = front.read_text().splitlines()
    lines[2] = lines[2] + "x" * (CSV_CELL_LIMIT + 1)
    front.write_text("\n".join(lines) + "\n")
    chart = files.root / "front.svg"
    one_line_error(runner.invoke(main, ["plot", str(front), "--out", str(chart)]), f"{front}: line 3",
                   "a cell longer than 16,777,216 characters")
    assert not chart.exists()


# -- measured step times --------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", ["5e-324", "0", "1e-300", "1e300", "-0.5"])
def test_measured_times_keep_the_arithmetic_finite(runner, tiny, step):
    files = tiny()
    runs = measured_csv(files, [ROWS[0], ROWS[1].rsplit(",", 1)[0] + f",{step}", ROWS[2]])
    one_line_error(runner.invoke(main, ["validate", "--measured", str(runs), "--profiles", str(files.profiles)]),
                   f"{runs}: line 3: measured_step_s", "from 1e-06 to 1e+06", repr(step))


def megatron_log(elapsed_ms: list[str]) -> str:
    return "".join(f" iteration {i:8d}/      50 | consumed samples: {i * 8:12d} | elapsed time per iteration (ms): "
                   f"{ms} | learning rate: 1.0E-04 |\n" for i, ms in enumerate(elapsed_ms, start=1))


def write_run(folder: Path, plan: dict, log: str) -> None:
    folder.mkdir(parents=True)
    (folder / "plan.json").write_text(json.dumps(plan))
    (folder / "fasop-1.out").write_text(log)


@pytest.mark.parametrize("elapsed", ["1e-320", "0", "1e300"])
def test_a_log_time_out_of_range_is_one_line(runner, tiny, elapsed):
    files = tiny()
    plan = {"model_file": str(files.model), "cluster_file": str(files.cluster), "gbs": 8, "mbs": 1, "tp": 1, "dp": 2,
            "pp": 1, "placement": ["fast"], "layers_per_stage": [4]}
    write_run(files.root / "runs" / "a", plan, megatron_log(["900", "800", "700", elapsed, "700"]))
    result = runner.invoke(main, ["validate", "--measured", str(files.root / "runs"), "--profiles", str(files.profiles)])
    one_line_error(result, "fasop-1.out: line 4: elapsed time per iteration (ms)", "from 0.001 to 1e+09")


def test_one_plan_measured_thrice_is_scored_once_at_the_mean(runner, tiny):
    files = tiny()
    again = [ROWS[0].replace("a,", f"{name},", 1).replace(",0.061", f",{step}") for name, step in
             (("a2", "0.062"), ("a3", "0.066"))]
    runs = measured_csv(files, [ROWS[0], *again, ROWS[1], ROWS[2]])
    result = runner.invoke(main, ["validate", "--measured", str(runs), "--profiles", str(files.profiles)])
    ok(result)
    notes = result.stderr.strip().splitlines()
    assert len(notes) == 1 and notes[0].startswith("note: 1 plan(s) measured more than once (a, a2, a3)")
    assert re.search(r"^a \(mean of 3\)\s+\d\.\d{4}\s+0\.0630\s", result.stdout, re.M)
    assert "over 3 runs" in result.stdout and "a2" not in result.stdout


def test_only_repeats_of_one_plan_give_no_correlation(runner, tiny):
    files = tiny()
    runs = measured_csv(files, [ROWS[0].replace("a,", f"{name},", 1) for name in "xyz"])
    result = runner.invoke(main, ["validate", "--measured", str(runs), "--profiles", str(files.profiles)])
    ok(result)
    assert "MAPE" in result.stdout and "Spearman rank correlation n/a" in result.stdout


def test_equal_measurements_of_different_plans_give_no_correlation(runner, tiny):
    files = tiny()
    runs = measured_csv(files, [row.rsplit(",", 1)[0] + ",0.07" for row in ROWS])
    result = runner.invoke(main, ["validate", "--measured", str(runs), "--profiles", str(files.profiles)])
    ok(result)
    assert "Spearman rank correlation n/a" in result.stdout and result.stderr == ""


# -- a run is estimated as what its plan is -----------------------------------------------------------------

def estimated_s(stdout: str, label: str) -> float:
    return float(re.search(rf"^{re.escape(label)}\s+(\d+\.\d+)\s", stdout, re.M).group(1))


def test_a_zero3_run_folder_is_estimated_as_zero3(runner, tiny):
    files = tiny()
    strategies = files.root / "strategies.json"
    ok(runner.invoke(main, ["compare", *files.args("--plans-out", str(strategies))]))
    zero3 = next(p for p in json.loads(strategies.read_text()) if p["kind"] == "zero3")
    step_ms = f"{zero3['step_time_s'] * 1e3:.6f}"
    write_run(files.root / "runs" / "zero3", zero3, megatron_log([step_ms] * 6))
    result = runner.invoke(main, ["validate", "--measured", str(files.root / "runs"), "--profiles", str(files.profiles)])
    ok(result)
    assert estimated_s(result.stdout, "zero3/fasop-1.out") == pytest.approx(zero3["step_time_s"], abs=1e-4)
    assert "MAPE 0.0%" in result.stdout


def test_a_data_parallel_row_of_a_csv_is_refused(runner, tiny):
    files = tiny()
    runs = measured_csv(files, [ROWS[0] + ",zero3"], COLUMNS + ",kind")
    one_line_error(runner.invoke(main, ["validate", "--measured", str(runs), "--profiles", str(files.profiles)]),
                   f"{runs}: line 2: kind", "plan.json")


def test_a_recomputing_interleaved_run_folder_is_estimated_with_its_recomputation(runner, tiny):
    files = tiny(model={"num_layers": 8})
    result = runner.invoke(main, ["estimate", *files.args("--tp", "1", "--dp", "1", "--pp", "2", "--mbs", "1",
                                                          "--placement", "fast", "--layers", "4,4",
                                                          "--virtual-stages", "2", "--recompute", "full", "--json")])
    ok(result)
    plan = json.loads(result.stdout)
    assert plan["recompute"] == "full" and plan["virtual_stages"] == 2
    step_ms = f"{plan['step_time_s'] * 1e3:.6f}"
    write_run(files.root / "runs" / "full", plan, megatron_log([step_ms] * 6))
    result = runner.invoke(main, ["validate", "--measured", str(files.root / "runs"), "--profiles", str(files.profiles)])
    ok(result)
    assert estimated_s(result.stdout, "full/fasop-1.out") == pytest.approx(plan["step_time_s"], abs=1e-4)


# -- the corpus: nothing written, nothing left over -----------------------------------------------------------

def test_a_refused_validate_leaves_the_measured_folder_as_it_was(runner, tiny):
    files = tiny()
    runs = measured_csv(files, [ROWS[0], ROWS[1].rsplit(",", 1)[0] + ",5e-324"])
    before = snapshot(files.root)
    result = runner.invoke(main, ["validate", "--measured", str(runs), "--profiles", str(files.profiles),
                                  "--chart", str(files.root / "chart.png")])
    assert result.exit_code == 2
    assert snapshot(files.root) == before
