"""Hostile input to fasop validate and fasop calibrate: times out of range from profiler traces and CSV cells,
run names that would drive a terminal, columns named twice, outputs that clash, calibrated profiles that would not
read back, and traces large enough that per-step work must not grow with every kernel. Each is refused in one
line with exit code 2 and nothing written, or bounded."""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error
from test_traces import kernel, step, trace
from test_validate_calibrate import COLUMNS, LOG, NODES, scaled_csv, write_run

from fasop.calibration.calibrate import Calibration, Factor, calibrated_profile_text
from fasop.calibration.measured import read_measured
from fasop.calibration.traces import read_trace
from fasop.calibration.validate import load_settings
from fasop.cli import main
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.csvfile import csv_rows
from fasop.inputs.model import load_model
from fasop.inputs.profiles import MAX_UNIT_TIME_S
from fasop.search import estimate

PLANS = [(1, 2), (2, 1)]  # (tp, dp) of one-node plans on the "fast" node, every layer on one stage


def runs_csv(user, step_s: list[str], header: str = COLUMNS, extra: str = "") -> str:
    """A measured CSV of PLANS beside `user`'s files: measured_step_s cells as given, `extra` cells after them."""
    rows = [header] + [f"r{i},model.toml,cluster.toml,8,1,{tp},{dp},1,fast,4,{cell}{extra}"
                       for i, ((tp, dp), cell) in enumerate(zip(PLANS, step_s))]
    path = user.root / "runs.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def validate(runner, user, measured: str, *extra: str):
    return runner.invoke(main, ["validate", "--measured", measured, "--profiles", str(user.profiles), *extra])


# -- 1. a calibrated profile reads back ------------------------------------------------------------------------

@pytest.fixture
def slow_units(tiny):
    """(the user's inputs, whose "fast" layers take up to 1000 s, and runs measured 5 times as slow as estimated)."""
    user = tiny("user", profiles={"fast": scaled_csv("fast", 1e5)})
    model, cluster = load_model(str(user.model)), load_cluster(str(user.cluster))
    step_s = [estimate(model, cluster, tp=tp, dp=dp, pp=1, mbs=1, placement=["fast"], layers_per_stage=[4],
                       profiles_dir=str(user.profiles)).step_time_s for tp, dp in PLANS]
    return user, runs_csv(user, [repr(5 * s) for s in step_s])


def test_the_compute_factor_stops_where_a_profile_row_would_pass_an_hour(slow_units, runner):
    """The longest "fast" row is 1000 s: the compute factor stops at 3.6, says it is at its bound, and the written
    profiles read back."""
    user, measured = slow_units
    out, profiles_out = user.root / "c.toml", user.root / "calibrated"
    result = runner.invoke(main, ["calibrate", "--measured", measured, "--profiles", str(user.profiles),
                                  "--out", str(out), "--profiles-out", str(profiles_out)])
    assert result.exit_code == 0, result.output
    assert re.search(r"^compute_time_scale\.fast\s+3\.6000\s+at its bound \(0\.25 to 3\.6\)", result.stdout, re.M)
    times = [float(cell) for line in (profiles_out / "fast.csv").read_text().splitlines()[1:]
             if line[0].isdigit() for cell in line.split(",")[3:5]]
    assert max(times) == pytest.approx(MAX_UNIT_TIME_S)
    reread = runner.invoke(main, ["validate", "--measured", measured, "--profiles", str(profiles_out)])
    assert reread.exit_code == 0, reread.output


def test_a_calibrated_row_past_an_hour_is_refused(slow_units):
    """Where the factors still take a row past an hour (a fitted host factor), no profile text is made."""
    user, measured = slow_units
    runs = read_measured(Path(measured))
    calibration = Calibration(runs, load_settings(runs, str(user.profiles))[0])
    assert calibration.bounds[Factor("compute", "fast")] == pytest.approx((0.25, 3.6))
    values = {**calibration.unit(), Factor("compute", "fast"): 4.0}
    with pytest.raises(InputError, match=r"fast\.csv: line 4: backward_s: 1000(\.0)? s calibrated .* is 4000 s; a "
                                         r"profile holds seconds >= 1e-12 and <= 3600"):
        calibrated_profile_text(calibration.setting, "fast", values, [])


# -- 2. outputs that clash -----------------------------------------------------------------------------------

@pytest.mark.parametrize("folder", ["x.toml", "x.toml/profiles", "profiles/../x.toml"])
def test_a_profiles_folder_at_or_inside_the_cluster_file_is_refused_first(tiny, runner, folder):
    user = tiny("user", nodes=NODES)
    measured = runs_csv(user, ["0.75", "0.8"])
    before = sorted(user.root.rglob("*"))
    result = runner.invoke(main, ["calibrate", "--measured", measured, "--profiles", str(user.profiles),
                                  "--out", str(user.root / "x.toml"), "--profiles-out", str(user.root / folder)])
    one_line_error(result, "--profiles-out", "is --out", "x.toml")
    assert result.stdout == ""  # refused before any fit
    assert sorted(user.root.rglob("*")) == before


# -- 3. times read from traces ------------------------------------------------------------------------------

@pytest.mark.parametrize("events, fragments", [
    ([step(1, 0, 0)], ["'ProfilerStep#1'", "dur (microseconds)", "from 1 to 1e+12"]),
    ([step(1, 0, 1e-3)], ["'ProfilerStep#1'", "dur (microseconds)", "got 0.001"]),
    ([step(1, 0, 1e300)], ["'ProfilerStep#1'", "dur"]),
    ([step(1, 1.7e308, 1.7e308)], ["'ProfilerStep#1'", "ts microseconds >= 0 and <="]),
    ([step(1, 0, 10**400)], ["'ProfilerStep#1'", "dur"]),
    ([step(1, 0, 1000), kernel("k", 1.7e308, 10)], ["'k'", "ts microseconds"]),
    ([step(1, 0, 1000), kernel("k", 0, 10**400)], ["'k'", "dur microseconds"]),
])
def test_trace_times_out_of_range_are_one_line(tiny, runner, events, fragments):
    """A step of no time, or of a thousandth of a microsecond, made the measured step infinite in validate and
    crashed calibrate; a timestamp near float's end made a step end at infinity."""
    user = tiny("user", nodes=NODES)
    logs = user.root / "logs"
    write_run(logs / "a", user, "no reports here\n", pp=2, dp=1, layers_per_stage=[2, 2])
    (logs / "a" / "w.pt.trace.json").write_text(json.dumps({"traceEvents": [*events, kernel("k0", 0, 10)]}))
    one_line_error(validate(runner, user, str(logs)), "w.pt.trace.json", *fragments)
    out = user.root / "c.toml"
    one_line_error(runner.invoke(main, ["calibrate", "--measured", str(logs), "--profiles", str(user.profiles),
                                        "--out", str(out)]), "w.pt.trace.json", *fragments)
    assert not out.exists()


# -- 4. trace reading in O((steps + kernels) log) ------------------------------------------------------------

def straightforward(events: list[dict]) -> list[tuple[float, float, float, float]]:
    """Each step's (step, compute, communication, idle) seconds: every kernel clipped to the step, summed, and
    the union of the clipped kernels merged by hand."""
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "user_annotation")
    kernels = [(e["ts"], e["ts"] + e["dur"], "nccl" in e["name"]) for e in events if e["cat"] == "kernel"]
    measured = []
    for start, end in steps:
        clipped = [(max(a, start), min(b, end), nccl) for a, b, nccl in kernels if min(b, end) > max(a, start)]
        busy, reach = 0.0, start
        for a, b, _ in sorted(clipped):
            busy += max(b - max(a, reach), 0.0)
            reach = max(reach, b)
        measured.append(((end - start) * 1e-6, sum(b - a for a, b, nccl in clipped if not nccl) * 1e-6,
                         sum(b - a for a, b, nccl in clipped if nccl) * 1e-6, (end - start - busy) * 1e-6))
    return measured


@pytest.mark.parametrize("seed", range(5))
def test_trace_steps_match_clipping_every_kernel_to_every_step(tmp_path, seed):
    """Random steps (overlapping ones too) and kernels (crossing steps, starting together, of no time, NCCL or
    not), with integer times so that both ways add exactly."""
    rng = random.Random(seed)
    events = [step(i, rng.randrange(0, 5000), rng.randrange(1, 800)) for i in range(rng.randrange(1, 12))]
    events += [kernel(rng.choice(["gemm", "ncclKernel_AllReduce"]), rng.randrange(0, 5000) // 7 * 7,
                      rng.choice([0, rng.randrange(1, 300), rng.randrange(1, 3000)])) for _ in range(rng.randrange(1, 40))]
    path = tmp_path / "w.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = [(s.step_s, s.compute_s, s.communication_s, s.idle_s) for s in read_trace(path).steps]
    assert np.array(got) == pytest.approx(np.array(straightforward(events)), abs=1e-12)


def test_the_hand_worked_trace_matches_the_straightforward_way(tmp_path):
    path = tmp_path / "w.pt.trace.json"
    path.write_text(json.dumps(trace(0)))
    got = [(s.step_s, s.compute_s, s.communication_s, s.idle_s) for s in read_trace(path).steps]
    assert np.array(got) == pytest.approx(np.array(straightforward(trace(0)["traceEvents"])), abs=1e-12)


def test_a_trace_whose_kernels_span_every_step_reads_in_seconds(tmp_path):
    """5,000 steps, each inside all of 5,000 kernels: clipping every kernel to every step and merging the clipped
    ones in Python took 15 seconds or more (over two minutes for 20,000 steps and kernels)."""
    n = 5_000
    events = [step(i, 100 * i, 100) for i in range(n)] + [kernel("nccl" if i % 2 else "gemm", 0, 100 * n)
                                                           for i in range(n)]
    path = tmp_path / "w.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    started = time.monotonic()
    found = read_trace(path)
    assert time.monotonic() - started < 5
    assert len(found.steps) == n
    assert astuple(found.median()) == pytest.approx((1e-4, n / 2 * 1e-4, n / 2 * 1e-4, 0.0))


# -- 5. run names ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["\x1b]0;pwn\x07\x1b[2J", "tab\there", "del\x7f"])
def test_a_run_name_of_control_characters_is_refused(tiny, runner, name):
    user = tiny("user", nodes=NODES)
    measured = runs_csv(user, ["0.75", "0.8"])
    path = user.root / "runs.csv"
    path.write_text(path.read_text().replace("r1,", f'"{name}",'))
    chart = user.root / "c.svg"
    result = validate(runner, user, measured, "--chart", str(chart))
    line = one_line_error(result, "runs.csv: line 3: run", "printable", repr(name))
    assert line.isprintable()
    assert not chart.exists()


# -- 6. columns named twice ---------------------------------------------------------------------------------

@pytest.mark.parametrize("column", ["measured_step_s", "run"])
def test_a_column_named_twice_is_refused(tiny, runner, column):
    """measured_step_s twice (0.75, then 999) used to take 999; run twice, the last."""
    user = tiny("user", nodes=NODES)
    measured = runs_csv(user, ["0.75", "0.8"], header=f"{COLUMNS},{column}", extra=",999")
    one_line_error(validate(runner, user, measured), "runs.csv: line 1", f"column '{column}' named twice")


def test_every_csv_reader_refuses_a_column_named_twice(tiny, runner):
    with pytest.raises(InputError, match=r"^f\.csv: line 3: column 'a' named twice"):
        csv_rows([(3, "a,b,a"), (4, "1,2,3")], "f.csv")
    assert csv_rows([(3, "a,b,c"), (4, "1,2,3")], "f.csv") == [(3, ["a", "b", "c"]), (4, ["1", "2", "3"])]
    comment, header, *rows = scaled_csv("fast", 1.0).splitlines()
    profile = "\n".join([comment, f"{header},tp", *(f"{row},1" for row in rows)]) + "\n"
    user = tiny("user", nodes=NODES, profiles={"fast": profile})
    one_line_error(validate(runner, user, runs_csv(user, ["0.75", "0.8"])), "fast.csv: line 2", "column 'tp'")


# -- 7. only plain decimal numbers as measured times -------------------------------------------------------------

@pytest.mark.parametrize("cell", ["0_8", "1_0.5", "\u0660.\u0667\u0665", "\uff10.75", "0x1p-1", "nan", "infinity"])
def test_a_measured_time_is_a_plain_decimal(tiny, runner, cell):
    user = tiny("user", nodes=NODES)
    one_line_error(validate(runner, user, runs_csv(user, ["0.75", cell])), "runs.csv: line 3: measured_step_s",
                   "positive, finite time")


def test_plain_decimals_of_every_form_read(tiny):
    user = tiny("user", nodes=NODES)
    runs = read_measured(Path(runs_csv(user, [" 7.5e-1", ".8"])))
    assert [r.measured_step_s for r in runs] == [0.75, 0.8]
    runs = read_measured(Path(runs_csv(user, ["75.E-2", "8e-1 "])))
    assert [r.measured_step_s for r in runs] == [0.75, 0.8]


def test_a_log_time_with_underscores_is_refused(tiny, runner):
    user = tiny("user", nodes=NODES)
    write_run(user.root / "logs" / "a", user, LOG.replace("(ms): 1300.0", "(ms): 1_300.0"))
    one_line_error(validate(runner, user, str(user.root / "logs")), "fasop-77.out: line 5",
                   "elapsed time per iteration (ms)", "'1_300.0'")
