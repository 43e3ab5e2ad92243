"""fasop validate and fasop calibrate: measured runs read from CSV and Megatron-LM logs, estimates scored
against them, and factors fitted to runs generated from a known ground truth."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import GPU_SPEED, gpu_table, one_line_error, profile_csv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fasop.calibration.calibrate import (
    Calibration,
    Factor,
    Outcome,
    calibrate,
    calibrated_cluster_text,
    calibrated_gpu_tables,
)
from fasop.calibration.measured import median_iteration_s, read_measured
from fasop.calibration.validate import load_settings, predict_step_s
from fasop.cli import main
from fasop.inputs.catalogue import gpu_tables, merged_specs
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.inputs.profiles import load_profiles
from fasop.inputs.tomlfile import tomllib
from fasop.search import estimate

# Slow links, so that transfers take a real share of the tiny model's step time and the fit can see them.
NODES = {
    "fast": {"intra_node_bandwidth": "50 Mbit/s", "inter_node_bandwidth": "20 Mbit/s"},
    "slow": {"intra_node_bandwidth": "25 Mbit/s", "inter_node_bandwidth": "20 Mbit/s"},
}
# The hidden truth: "fast" GPUs take 1.3x their profiled times, links between nodes achieve 0.7x the file's.
HIDDEN = {"fast": 1.3, "slow": 1.0, "intra_node": 1.0, "inter_node": 0.7}
# (tp, dp, pp, mbs, placement, layers per stage): single-node and two-node plans of every shape
PLANS = [
    (1, 2, 1, 1, ["fast"], [4]), (1, 1, 2, 1, ["fast"], [2, 2]), (2, 1, 1, 2, ["fast"], [4]),
    (1, 2, 1, 1, ["slow"], [4]), (1, 1, 2, 2, ["slow"], [2, 2]),
    (1, 1, 4, 1, ["fast", "slow"], [1, 1, 1, 1]), (1, 2, 2, 1, ["fast", "slow"], [2, 2]),
    (2, 1, 2, 1, ["slow", "fast"], [2, 2]), (1, 4, 1, 1, ["fast", "slow"], [4]),
    (2, 2, 1, 2, ["slow", "fast"], [4]), (1, 1, 4, 2, ["slow", "fast"], [1, 2, 1, 0]),
]
NOISE = [0.006, -0.004, 0.002, -0.007, 0.005, -0.001, 0.004, -0.006, 0.003, -0.002, 0.001]  # measurement scatter
COLUMNS = "run,model_file,cluster_file,gbs,mbs,tp,dp,pp,placement,layers_per_stage,measured_step_s"


def scaled_csv(gpu: str, scale: float) -> str:
    """The tiny profile of `gpu` with every time multiplied by `scale`."""
    lines = profile_csv(gpu).splitlines()
    out = lines[:2]
    for line in lines[2:]:
        tp, mbs, kind, forward, backward = line.split(",")
        out.append(f"{tp},{mbs},{kind},{float(forward) * scale!r},{float(backward) * scale!r}")
    return "\n".join(out) + "\n"


def truth_step_s(tiny) -> list[float]:
    """Step times of PLANS on the hidden truth: profiles and derating as they really are, through the plain
    estimate (not the calibration code)."""
    derating = (f"\n[cluster.derating]\np2p_inter_node = {1 / HIDDEN['inter_node']!r}\n"
                f"collective_inter_node = {1 / HIDDEN['inter_node']!r}\n")
    truth = tiny("truth", nodes=NODES, cluster_extra=derating,
                 profiles={g: scaled_csv(g, HIDDEN[g]) for g in GPU_SPEED})
    model, cluster = load_model(str(truth.model)), load_cluster(str(truth.cluster))
    return [estimate(model, cluster, tp=tp, dp=dp, pp=pp, mbs=mbs, placement=placement, layers_per_stage=layers,
                     profiles_dir=str(truth.profiles)).step_time_s
            for tp, dp, pp, mbs, placement, layers in PLANS]


@pytest.fixture
def measured(tiny):
    """(the user's tiny inputs, the CSV of runs measured on the hidden truth)."""
    user = tiny("user", nodes=NODES)
    rows = [COLUMNS]
    for i, ((tp, dp, pp, mbs, placement, layers), step_s) in enumerate(zip(PLANS, truth_step_s(tiny))):
        rows.append(f"r{i},model.toml,cluster.toml,8,{mbs},{tp},{dp},{pp},{' '.join(placement)},"
                    f"{' '.join(map(str, layers))},{step_s * (1 + NOISE[i])!r}")
    path = user.root / "runs.csv"
    path.write_text("\n".join(rows) + "\n")
    return user, path


def calibration_of(user, path) -> Calibration:
    runs = read_measured(path)
    return Calibration(runs, load_settings(runs, str(user.profiles))[0])


# -- calibration on a known ground truth ---------------------------------------------------------------

def test_calibrate_recovers_the_hidden_factors(measured):
    outcome = calibrate(calibration_of(*measured))
    fitted = {f.key: v for f, v in outcome.values.items()}
    for key, truth in HIDDEN.items():
        assert fitted[key] == pytest.approx(truth, rel=0.05), (key, fitted)
    assert outcome.mape_before_pct > 10
    assert outcome.mape_after_pct < 1.0
    assert outcome.mape_loo_pct < 1.5


def test_calibrate_command_writes_files_that_make_validate_agree(measured, runner):
    user, path = measured
    out, profiles_out = user.root / "calibrated.toml", user.root / "calibrated-profiles"
    before = runner.invoke(main, ["validate", "--measured", str(path), "--profiles", str(user.profiles)])
    assert before.exit_code == 0, before.output
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(out), "--profiles-out", str(profiles_out)])
    assert result.exit_code == 0, result.output
    assert re.search(r"compute_time_scale\.fast\s+1\.[23]\d*", result.stdout)
    cluster = load_cluster(str(out))
    assert cluster.derating.p2p_inter_node == pytest.approx(1 / HIDDEN["inter_node"], rel=0.05)
    assert cluster.derating.collective_inter_node == cluster.derating.p2p_inter_node
    text = out.read_text()
    # the fast GPUs' optimizer step is calibrated with their profile; the slow GPUs' 1000 TB/s divided by their
    # scale, just under 1, would be above the 1 PB/s a cluster file takes: kept, and a comment says so
    written, original = cluster.node_types, load_cluster(str(user.cluster)).node_types
    scale = float(re.search(r"compute_time_scale\.fast\s+([\d.]+)", result.stdout).group(1))
    assert written["fast"].gpu_memory_bytes_per_s == pytest.approx(original["fast"].gpu_memory_bytes_per_s / scale,
                                                                   rel=1e-4)
    assert written["slow"] == original["slow"]
    assert re.search(r"^# node_type slow keeps its gpu_memory_bandwidth: .* is outside 1 kB/s to 1 PB/s", text, re.M)
    assert written["fast"] == replace(original["fast"], gpu_memory_bytes_per_s=written["fast"].gpu_memory_bytes_per_s)
    assert text.startswith("# Calibrated by fasop calibrate on ") and str(path) in text
    assert "bandwidth_scale.inter_node" in text
    model = load_model(str(user.model))
    profiles = load_profiles(model, ["fast", "slow"], str(profiles_out))
    original = load_profiles(model, ["fast", "slow"], str(user.profiles))
    ratio = profiles["fast"].time(1, "layer", 1)[0] / original["fast"].time(1, "layer", 1)[0]
    assert ratio == pytest.approx(HIDDEN["fast"], rel=0.05)
    assert "compute_time_scale.fast" in (profiles_out / "fast.csv").read_text()
    after = runner.invoke(main, ["validate", "--measured", str(path), "--cluster", str(out),
                                 "--profiles", str(profiles_out)])
    assert after.exit_code == 0, after.output
    mape = [float(re.search(r"MAPE ([\d.]+)%", r.stdout).group(1)) for r in (before, after)]
    assert mape[0] > 10 and mape[1] < 1.0, mape


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scale=st.floats(0.3, 3.0))
def test_scaling_every_factor_scales_every_estimate(calibration, scale):
    """Step time is homogeneous in the factors: profile times and optimizer steps x c and bandwidths / c give
    times x c (the fixture is only read)."""
    unit = calibration.predict(calibration.unit())
    scaled = calibration.predict({f: scale if f.kind == "compute" else 1 / scale for f in calibration.factors})
    np.testing.assert_allclose(scaled, unit * scale, rtol=1e-9)


@pytest.mark.parametrize("scale", [0.8, 1.3])
def test_compute_time_scale_scales_its_gpus_optimizer_step(calibration, scale):
    """The optimizer step is the GPU's work: compute_time_scale.fast divides the fast nodes' memory bandwidth, so
    a plan on them spends `scale` times as long on it; a plan on the slow nodes keeps its step."""
    model = calibration.setting.model

    def optimizer_s(values, node_type):
        cluster, profiles = calibration.inputs(values)
        return estimate(model, cluster, tp=1, dp=2, pp=1, mbs=1, placement=[node_type], layers_per_stage=[4],
                        profiles=profiles).optimizer_s

    unit, scaled = calibration.unit(), {**calibration.unit(), Factor("compute", "fast"): scale}
    assert optimizer_s(unit, "fast") > 0
    assert optimizer_s(scaled, "fast") == pytest.approx(scale * optimizer_s(unit, "fast"), rel=1e-12)
    assert optimizer_s(scaled, "slow") == optimizer_s(unit, "slow")


def test_the_calibrated_files_estimate_what_the_fit_predicts(measured, runner):
    """The calibrated cluster file and profiles give every run the step time the fit predicts, optimizer step
    included: on memory slow enough that the step takes a real share of a run."""
    user, path = measured
    user.cluster.write_text(user.cluster.read_text().replace('"1000 TB/s"', '"200 MB/s"'))
    out, profiles_out = user.root / "calibrated.toml", user.root / "calibrated-profiles"
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(out), "--profiles-out", str(profiles_out)])
    assert result.exit_code == 0, result.output
    calibration = calibration_of(user, path)
    values = calibrate(calibration).values
    model, cluster = calibration.setting.model, load_cluster(str(out))
    profiles = load_profiles(model, ["fast", "slow"], str(profiles_out))
    for gpu in ("fast", "slow"):
        assert cluster.node_types[gpu].gpu_memory_bytes_per_s == pytest.approx(2e8 / values[Factor("compute", gpu)],
                                                                              rel=1e-15)
    fitted = calibration.predict(values)
    np.testing.assert_allclose([predict_step_s(run, model, cluster, profiles) for run in calibration.runs], fitted,
                               rtol=1e-9)
    plan = estimate(model, cluster, tp=1, dp=2, pp=1, mbs=1, placement=["fast"], layers_per_stage=[4], profiles=profiles)
    assert plan.optimizer_s > 0.01 * plan.step_time_s


@pytest.fixture
def calibration(measured):
    return calibration_of(*measured)


def test_a_factor_no_run_depends_on_is_not_fitted(measured, runner):
    user, path = measured
    lines = path.read_text().splitlines()
    single_node = [lines[0]] + [line for line in lines[1:] if line.split(",")[8] in ("fast", "slow")]
    path.write_text("\n".join(single_node) + "\n")
    outcome = calibrate(calibration_of(user, path))
    inter = Factor("bandwidth", "inter_node")
    assert inter not in outcome.free and outcome.values[inter] == 1.0
    assert outcome.values[Factor("compute", "fast")] == pytest.approx(HIDDEN["fast"], rel=0.05)


# -- validate -----------------------------------------------------------------------------------------

def test_validate_scores_match_a_hand_computation(measured, runner):
    user, path = measured
    chart = user.root / "chart.png"
    result = runner.invoke(main, ["validate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--chart", str(chart)])
    assert result.exit_code == 0, result.output
    model, cluster = load_model(str(user.model)), load_cluster(str(user.cluster))
    predicted = np.array([estimate(model, cluster, tp=tp, dp=dp, pp=pp, mbs=mbs, placement=pl, layers_per_stage=la,
                                   profiles_dir=str(user.profiles)).step_time_s
                          for tp, dp, pp, mbs, pl, la in PLANS])
    measured_s = np.array([float(line.split(",")[-1]) for line in path.read_text().splitlines()[1:]])
    mape = 100 * np.mean(np.abs(predicted - measured_s) / measured_s)
    assert f"MAPE {mape:.1f}% over {len(PLANS)} runs" in result.stdout
    # Spearman without ties: 1 - 6 sum(d^2) / (n (n^2 - 1)) over the rank differences
    d = np.argsort(np.argsort(predicted)) - np.argsort(np.argsort(measured_s))
    n = len(PLANS)
    assert f"Spearman rank correlation {1 - 6 * np.sum(d ** 2) / (n * (n * n - 1)):.3f}" in result.stdout
    first, fastest = int(np.argmin(predicted)), int(np.argmin(measured_s))
    verdict = "yes" if first == fastest else f"no: r{fastest} was"
    assert f"fasop's first plan, r{first}, was the fastest measured: {verdict}" in result.stdout
    for i in range(n):
        assert re.search(rf"^r{i}\s+{predicted[i]:.4f}\s+{measured_s[i]:.4f}\s", result.stdout, re.M)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- Megatron-LM logs ---------------------------------------------------------------------------------

def megatron_line(iteration: int, elapsed_ms: str, total: int = 50, stamp: bool = True) -> str:
    """One report as Megatron-LM's training_log prints it (megatron/training/training.py)."""
    head = f" [2024-05-01 12:00:{iteration:02d}]" if stamp else ""
    return (f"{head} iteration {iteration:8d}/{total:8d} | consumed samples: {iteration * 8:12d} | elapsed time per "
            f"iteration (ms): {elapsed_ms} | learning rate: 1.500000E-04 | global batch size:     8 | lm loss: "
            f"1.046713E+01 | loss scale: 4294967296.0 | grad norm: 12.345 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


LOG = "\n".join([
    "using world size: 4, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 1",
    "[after training is done] datetime: 2024-05-01 12:00:00",  # not a report
    megatron_line(1, "9876.5"),  # warm-up: allocation, kernel tuning
    megatron_line(2, "1400.0"),
    megatron_line(3, "1300.0"),
    megatron_line(4, "1234.5"),
    " [Rank 3] (after 4 iterations) memory (MB) | allocated: 1234.5 | max allocated: 2345.6",
    megatron_line(5, "1250.0"),
    megatron_line(6, "1240.0"),
    megatron_line(7, "5000.0"),  # a slow outlier: the median ignores it
]) + "\n"


def test_megatron_log_median_after_warmup(tmp_path):
    log = tmp_path / "fasop-1234.out"
    log.write_text(LOG)
    assert median_iteration_s(log) == pytest.approx(1.245)  # median of 1234.5, 1250, 1240, 5000 ms
    assert median_iteration_s(log, warmup_iters=0) == pytest.approx(1.3)  # the warm-up report counts too
    assert median_iteration_s(log, warmup_iters=5) == pytest.approx(3.12)  # 1240 and 5000


def test_megatron_log_intervals_of_ten_without_dates(tmp_path):
    # fasop emit asks for --log-interval 10: each report averages ten iterations, the first holds the warm-up
    log = tmp_path / "train.log"
    log.write_text("\n".join(megatron_line(i, ms, stamp=False)
                             for i, ms in ((10, "2500.0"), (20, "1200.0"), (30, "1100.0"), (40, "1000.0"))) + "\n")
    assert median_iteration_s(log) == pytest.approx(1.1)
    assert median_iteration_s(log, warmup_iters=10) == pytest.approx(1.1)
    assert median_iteration_s(log, warmup_iters=11) == pytest.approx(1.05)


def write_run(folder: Path, tiny_user, log_text: str, **plan_overrides) -> None:
    folder.mkdir(parents=True)
    plan = {"rank": 1, "model_file": str(tiny_user.model), "cluster_file": str(tiny_user.cluster), "gbs": 8,
            "mbs": 1, "tp": 1, "dp": 2, "pp": 1, "placement": ["fast"], "layers_per_stage": [4],
            "distributed_optimizer": True, **plan_overrides}
    (folder / "plan.json").write_text(json.dumps(plan, indent=2))
    (folder / "fasop-77.out").write_text(log_text)
    (folder / "fasop-77.err").write_text("W0501 12:00:00 torch warnings\n")


def test_validate_reads_run_folders(tiny, runner):
    user = tiny("user", nodes=NODES)
    logs = user.root / "logs"
    write_run(logs / "a", user, LOG)
    write_run(logs / "b", user, LOG.replace("1234.5", "900.0").replace("1250.0", "910.0").replace("1240.0", "905.0"),
              pp=2, dp=1, layers_per_stage=[2, 2])
    result = runner.invoke(main, ["validate", "--measured", str(logs), "--profiles", str(user.profiles)])
    assert result.exit_code == 0, result.output
    assert re.search(r"^a/fasop-77\.out\s+\d+\.\d{4}\s+1\.2450\s", result.stdout, re.M)
    assert re.search(r"^b/fasop-77\.out\s+\d+\.\d{4}\s+0\.9075\s", result.stdout, re.M)
    assert "MAPE" in result.stdout and "Spearman rank correlation n/a" in result.stdout


# -- bad input: one line, exit code 2 -----------------------------------------------------------------

@pytest.mark.parametrize("edit, fragments", [
    (lambda rows: [rows[0].replace(",measured_step_s", "")] + [r.rsplit(",", 1)[0] for r in rows[1:]],
     ["missing column(s) measured_step_s"]),
    (lambda rows: rows[:2] + [rows[2].rsplit(",", 1)[0] + ",fast"], ["line 3: measured_step_s", "positive, finite"]),
    (lambda rows: rows[:2] + [rows[2].rsplit(",", 1)[0] + ",nan"], ["line 3: measured_step_s"]),
    (lambda rows: rows[:2] + [rows[2].rsplit(",", 1)[0] + ",-1.5"], ["line 3: measured_step_s"]),
    (lambda rows: rows[:2] + [rows[2].replace(",8,", ",8.5,", 1)], ["line 3: gbs", "positive integer"]),
    (lambda rows: rows[:2] + [rows[2] + ",extra"], ["line 3", "fields like the header"]),
    (lambda rows: rows[:1], ["no rows under the header"]),
    (lambda rows: [], ["no header and no rows"]),
    (lambda rows: [rows[0], rows[1].replace(",fast,4,", ",fast,3,")],
     ["line 2", "cannot be estimated", "layers_per_stage: expected 1"]),
    (lambda rows: rows[:2] + [rows[2].replace("cluster.toml", "nowhere/cluster.toml")], ["line 3", "nowhere"]),
])
def test_malformed_csv_is_one_line(measured, runner, edit, fragments):
    user, path = measured
    path.write_text("\n".join(edit(path.read_text().splitlines())) + "\n")
    result = runner.invoke(main, ["validate", "--measured", str(path), "--profiles", str(user.profiles)])
    one_line_error(result, *fragments)


@pytest.mark.parametrize("log, plan, fragments", [
    (LOG.replace("(ms): 1300.0", "(ms): fast"), None, ["line 5", "elapsed time per iteration (ms)"]),
    (LOG.replace("(ms): 1300.0", "(ms): inf"), None, ["line 5", "positive, finite"]),
    (megatron_line(1, "900.0") + "\n" + megatron_line(2, "800.0") + "\n", None, ["warm-up iterations"]),
    (LOG + megatron_line(3, "1000.0") + "\n", None, ["iteration 3 follows iteration 7"]),
    ("no reports here\n", None, ["no training log", "beside plan.json"]),
    (LOG, "{not json", ["plan.json", "not JSON"]),
    (LOG, json.dumps({"tp": 1}), ["plan.json: gbs", "missing"]),
    (LOG, json.dumps({"model": "m", "cluster": "c", "gbs": 8, "mbs": 1, "tp": "1", "dp": 2, "pp": 1,
                      "placement": ["fast"], "layers_per_stage": [4]}), ["plan.json: tp"]),
    (LOG, json.dumps({"model": "m", "cluster": "c", "gbs": 8, "mbs": 1, "tp": 1, "dp": 2, "pp": 1,
                      "placement": ["fast"], "layers_per_stage": [4], "step_time": 1.0}), ["plan.json: step_time"]),
    (LOG, json.dumps({"gbs": 8, "mbs": 1, "tp": 1, "dp": 2, "pp": 1, "placement": ["fast"],
                      "layers_per_stage": [4]}), ["names no model_file"]),
])
def test_malformed_logs_are_one_line(tiny, runner, log, plan, fragments):
    user = tiny("user", nodes=NODES)
    write_run(user.root / "logs" / "a", user, log)
    if plan is not None:
        (user.root / "logs" / "a" / "plan.json").write_text(plan)
    result = runner.invoke(main, ["validate", "--measured", str(user.root / "logs"), "--profiles", str(user.profiles)])
    one_line_error(result, *fragments)


def test_bad_options_are_one_line(measured, runner):
    user, path = measured
    one_line_error(runner.invoke(main, ["validate", "--measured", str(user.root / "absent.csv")]), "no such file")
    one_line_error(runner.invoke(main, ["validate", "--measured", str(user.root)]), "no plan.json")
    one_line_error(runner.invoke(main, ["validate", "--measured", str(path), "--chart", str(user.root / "c.pdf")]),
                   "--chart", ".png or .svg")
    one_line_error(runner.invoke(main, ["calibrate", "--measured", str(path), "--out", str(user.root / "c.json")]),
                   "--out", ".toml")


# -- calibrate never writes over its inputs ---------------------------------------------------------------

def test_calibrate_never_overwrites_an_input(measured, runner):
    user, path = measured
    inputs = [user.cluster, path, user.model, *user.profiles.iterdir()]
    before = {p: p.read_bytes() for p in inputs}
    alias = user.root / "profiles" / ".." / "cluster.toml"  # the same file by another name
    for out, more in ((user.cluster, []), (alias, []), (user.root / "new.toml", ["--profiles-out", str(user.profiles)])):
        result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                      "--out", str(out), "--force", *more])
        one_line_error(result, "is an input of this run")
    assert {p: p.read_bytes() for p in inputs} == before
    assert not (user.root / "new.toml").exists()
    existing = user.root / "existing.toml"
    existing.write_text("# mine\n")
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(existing)])
    one_line_error(result, "already exists")
    assert existing.read_text() == "# mine\n"


def test_calibrate_fits_one_cluster(measured, tiny, runner):
    user, path = measured
    other = tiny("other", nodes=NODES)
    rows = path.read_text().splitlines()
    rows[2] = rows[2].replace("cluster.toml", str(other.cluster))
    path.write_text("\n".join(rows) + "\n")
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(user.root / "c.toml")])
    one_line_error(result, "one model on one cluster")


def test_calibrated_cluster_keeps_every_other_field(measured):
    """The written cluster is the input with only derating, description, the error band and the memory bandwidth
    of the GPU type calibrated above 1 changed, launch table included."""
    user, path = measured
    user.cluster.write_text(user.cluster.read_text() + '\n[launch]\npartition = { fast = "hgx", slow = "gpu 2" }\n'
                            'extra_flags = ["--log-interval", "1"]\njob_name = "tab\\there \\u00e9"\n'
                            "[cluster.derating]\np2p_intra_node = 3.5\n")
    calibration = calibration_of(user, path)
    outcome = calibrate(calibration)
    text = calibrated_cluster_text(user.cluster, calibration.setting.cluster, outcome, ["first", "second"],
                                   str(path), "2026-02-03")
    written, original = tomllib.loads(text), tomllib.loads(user.cluster.read_text())
    intra = outcome.values[Factor("bandwidth", "intra_node")]
    inter = outcome.values[Factor("bandwidth", "inter_node")]
    assert written["cluster"]["derating"] == {"p2p_intra_node": 3.5 / intra, "p2p_inter_node": 1 / inter,
                                              "collective_intra_node": 1 / intra, "collective_inter_node": 1 / inter}
    fast = outcome.values[Factor("compute", "fast")]
    assert [t["gpu_memory_bandwidth"] for t in written["node_type"]] == [f"{1e15 / fast / 1e9!r} GB/s", "1000 TB/s"]
    assert written["cluster"].pop("error_band") == outcome.error_band(str(path), "2026-02-03")
    for table in (written, original):
        del table["cluster"]["derating"], table["cluster"]["description"], table["node_type"][0]["gpu_memory_bandwidth"]
    assert written == original
    assert text.startswith("# first\n# second\n")


# -- the calibrated efficiency in the written cluster's [[gpu]] tables -----------------------------------

# slow matmuls, fast memory: profile synth's roofline puts the tiny model's matmuls on the compute side
FAST_GPU = ('\n[[gpu]]\nname = "fast"\ndense_fp16_tflops = 1.0\ndense_bf16_tflops = 0.0\nmemory_gib = 24.0\n'
            'memory_bandwidth_gb_per_s = 90000.0\nintra_node_link = "25 GB/s"\nmatmul_efficiency = 0.9\n'
            'kernel_launch_us = 0.0\nsource = "my datasheet"\ndate = "2026-01-01"\n')  # no launches: compute-bound


def test_calibrated_cluster_carries_the_fitted_efficiency_for_profile_synth(measured, runner):
    user, path = measured
    user.cluster.write_text(user.cluster.read_text() + FAST_GPU)
    out = user.root / "calibrated.toml"
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    scale = float(re.search(r"compute_time_scale\.fast\s+([\d.]+)", result.stdout).group(1))
    written = load_cluster(str(out)).gpus  # through the cluster loader and the catalogue's checks
    assert set(written) == {"fast"}  # "slow" is in no catalogue
    fast = written["fast"]
    assert fast.matmul_efficiency == pytest.approx(0.9 / HIDDEN["fast"], rel=0.05)
    assert fast.matmul_efficiency == pytest.approx(0.9 / scale, rel=1e-4)
    assert fast.memory_bandwidth_gb_per_s == pytest.approx(90000.0 * fast.matmul_efficiency / 0.9, rel=1e-12)
    assert (fast.dense_fp16_tflops, fast.memory_gib, fast.intra_node_link) == (1.0, 24.0, "25 GB/s")
    assert fast.kernel_launch_us == 0.0  # carried over, not the default
    assert "fasop calibrate" in fast.source and str(path) in fast.source and "my datasheet" in fast.source
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", fast.date)
    # profile synth with the calibrated cluster uses the calibrated efficiency and memory bandwidth: with no
    # kernel launches and no tensor parallelism, every time is the uncalibrated one times the scale
    synthesised = []
    for name, options in (("calibrated", ["--cluster", str(out)]), ("uncalibrated", ["--cluster", str(user.cluster)])):
        target = user.root / f"{name}.csv"
        result = runner.invoke(main, ["profile", "synth", "--model", str(user.model), "--gpu", "fast", "--tp", "1",
                                      "--mbs", "1", "--out", str(target), *options])
        assert result.exit_code == 0, result.output
        synthesised.append({tuple(row[:3]): [float(t) for t in row[3:]] for row in
                            (line.split(",") for line in target.read_text().splitlines() if line[:1].isdigit())})
    calibrated, uncalibrated = synthesised
    assert calibrated.keys() == uncalibrated.keys()
    for unit, times in calibrated.items():
        assert np.array(times) == pytest.approx(np.array(uncalibrated[unit]) * 0.9 / fast.matmul_efficiency, rel=1e-9)


def test_an_efficiency_above_one_is_a_comment_not_a_gpu_table(measured):
    user, path = measured
    user.cluster.write_text(user.cluster.read_text() + FAST_GPU)
    calibration = calibration_of(user, path)
    outcome = calibrate(calibration)
    faster = replace(outcome, values={**outcome.values, Factor("compute", "fast"): 0.8})  # 0.9 / 0.8 > 1
    text = calibrated_cluster_text(user.cluster, calibration.setting.cluster, faster, ["head"], "runs.csv",
                                   "2026-02-03")
    assert re.search(r"^# No \[\[gpu\]\] table for fast: .* 1\.1250 is above 1", text, re.M)
    assert tomllib.loads(text)["gpu"] == tomllib.loads(user.cluster.read_text())["gpu"]  # the input's, unchanged
    written = user.root / "written.toml"
    written.write_text(text)
    assert load_cluster(str(written)).gpus["fast"].matmul_efficiency == 0.9


# -- the calibrated error band --------------------------------------------------------------------------

def test_calibrate_writes_the_leave_one_out_band_and_answers_on_its_file_carry_it(measured, runner):
    """The band of a calibrated file is measured / estimate of each run by a fit on the other runs (recomputed
    here fit by fit), and search, estimate and the budget choice on that file use it instead of the published
    runs' band."""
    user, path = measured
    out = user.root / "calibrated.toml"
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    calibration = calibration_of(user, path)
    free = calibration.exercised()
    everything = list(range(len(calibration.runs)))
    start = calibration.fit(free, everything)
    ratios = [calibration.measured_s[i] / calibration.predict(
        calibration.fit(free, [j for j in everything if j != i], start=start), [i])[0] for i in everything]
    band = load_cluster(str(out)).error_band
    assert band is not None and band.runs == len(PLANS)
    assert (band.low, band.high) == (pytest.approx(min(ratios), abs=1e-4), pytest.approx(max(ratios), abs=1e-4))
    assert 0.97 < band.low <= band.high < 1.03  # the runs' own scatter, not the published runs' 1.08-1.30
    assert f"error band: the runs took {band.low:.2f}-{band.high:.2f}x" in result.stdout
    described = f"measured runs took {band.low:.2f}-{band.high:.2f}x the estimate (fasop calibrate on {path}"
    searched = runner.invoke(main, ["search", "--model", str(user.model), "--cluster", str(out),
                                    "--profiles", str(user.profiles), "--top", "1"])
    estimated = runner.invoke(main, ["estimate", "--model", str(user.model), "--cluster", str(out),
                                     "--profiles", str(user.profiles), "--tp", "1", "--dp", "2", "--pp", "1",
                                     "--mbs", "1", "--placement", "fast", "--layers", "4"])
    for answer in (searched, estimated):
        assert answer.exit_code == 0, answer.output
        assert described in answer.stdout and "docs/validation.md" not in answer.stdout
    from fasop.market.choice import choose

    record = {"feasible": True, "train_hours": 10.0, "train_cost_usd": 100.0, "nodes_fast": 1, "tp": 1, "dp": 2,
              "pp": 1, "mbs": 1}
    chosen, message = choose([record], deadline_hours=10.0 * max(1.0, band.high) * 1.001, band=band)
    assert chosen is record and f"with a {max(0.0, band.high - 1):.0%} margin (the slow end of the error band, " \
                                f"fasop calibrate on {path}" in message
    assert choose([record], deadline_hours=10.0 * 1.2, band=None)[0] is None  # the published band's 30% misses


def test_one_run_leaves_no_band_and_a_bad_band_is_one_line(measured, runner, tiny):
    user, path = measured
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2]) + "\n")
    out = user.root / "calibrated.toml"
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "keep the published runs' band" in result.stdout
    assert load_cluster(str(out)).error_band is None and "error_band" not in out.read_text()
    bad = tiny("bad", cluster_extra="")
    text = bad.cluster.read_text().replace("[[node_type]]", "[cluster.error_band]\nlow = 1.2\nhigh = 1.1\nruns = 3\n"
                                           "source = \"mine\"\n\n[[node_type]]", 1)
    bad.cluster.write_text(text)
    refused = runner.invoke(main, ["search", "--model", str(bad.model), "--cluster", str(bad.cluster),
                                   "--profiles", str(bad.profiles)])
    one_line_error(refused, "cluster.error_band.low", "expected at most high (1.1)")


# -- the host's time per kernel -------------------------------------------------------------------------

# A layer large enough that the GPU's work outlasts the host's launches at larger micro-batches and not at the
# smallest: the runs then tell the host's time from the GPU's.
HOST_MODEL = {"hidden_size": 1024, "num_attention_heads": 8, "seq_length": 512, "vocab_size": 4096,
              "global_batch_size": 32}
# The user's spec launches a kernel in 5 us; the truth's "fast" host takes 40 (eight times as long), its GPU as
# specified; the "slow" GPU is as specified.
HOST_TRUTH = {"fast": 8.0, "slow": 1.0}
HOST_PLANS = [(tp, 2 // tp, 1, mbs, [gpu], [4]) for gpu in ("fast", "slow") for tp in (1, 2) for mbs in (1, 2, 4, 16)]


def host_gpu_tables(launch_us: dict[str, float]) -> str:
    return "".join(gpu_table(gpu, dense_bf16_tflops=50.0, kernel_launch_us=launch_us[gpu]) for gpu in GPU_SPEED)


@pytest.fixture
def host_measured(tiny):
    """(the user's inputs, runs measured where the fast GPUs' host takes HOST_TRUTH times as long per kernel):
    profiles synthesised from each cluster's own spec, through the plain estimate."""
    truth = tiny("host-truth", model=HOST_MODEL, cluster_extra=host_gpu_tables({g: 5.0 * f for g, f in HOST_TRUTH.items()}))
    user = tiny("host-user", model=HOST_MODEL, cluster_extra=host_gpu_tables(dict.fromkeys(GPU_SPEED, 5.0)))
    model, cluster = load_model(str(truth.model)), load_cluster(str(truth.cluster))
    rows = [COLUMNS]
    for i, (tp, dp, pp, mbs, placement, layers) in enumerate(HOST_PLANS):
        step_s = estimate(model, cluster, tp=tp, dp=dp, pp=pp, mbs=mbs, placement=placement, layers_per_stage=layers,
                          gbs=32).step_time_s
        rows.append(f"r{i},model.toml,cluster.toml,32,{mbs},{tp},{dp},{pp},{placement[0]},{layers[0]},{step_s!r}")
    path = user.root / "runs.csv"
    path.write_text("\n".join(rows) + "\n")
    return user, path


def host_calibration(user, path) -> Calibration:
    runs = read_measured(path)
    return Calibration(runs, load_settings(runs, None)[0])


def test_calibrate_recovers_the_hosts_time_per_kernel(host_measured):
    calibration = host_calibration(*host_measured)
    assert all(p.synthesised for p in calibration.setting.profiles.values())
    outcome = calibrate(calibration)
    assert Factor("host", "fast") in outcome.free
    assert outcome.values[Factor("host", "fast")] == pytest.approx(HOST_TRUTH["fast"], rel=0.02)
    for gpu in GPU_SPEED:
        assert outcome.values[Factor("compute", gpu)] == pytest.approx(1.0, rel=0.02)
    if Factor("host", "slow") in outcome.free:
        assert outcome.values[Factor("host", "slow")] == pytest.approx(1.0, rel=0.05)
    assert outcome.mape_before_pct > 5
    assert outcome.mape_after_pct < 0.5 and outcome.mape_loo_pct < 1.0
    # a compute factor alone cannot say it: the host's share differs between micro-batch sizes
    compute_only = calibration.fit([Factor("compute", "fast"), Factor("compute", "slow")],
                                   list(range(len(calibration.runs))))
    fast = [i for i, plan in enumerate(HOST_PLANS) if plan[4] == ["fast"]]
    errors = np.abs(calibration.predict(compute_only, fast) / calibration.measured_s[fast] - 1)
    assert errors.max() > 0.05


def test_host_time_scale_is_the_launch_queue_of_a_slower_host(host_measured):
    """A host factor on a synthesised profile gives the times of a spec launching kernels that many times as
    slowly, at the profiled micro-batch sizes and between and beyond them; with a compute factor, times x it."""
    user, path = host_measured
    calibration = host_calibration(user, path)
    slower = tiny_profiles(user, {"fast": 5.0 * 3.0, "slow": 5.0})["fast"]
    values = {**calibration.unit(), Factor("host", "fast"): 3.0, Factor("compute", "fast"): 1.5}
    _, profiles = calibration.inputs(values)
    for tp, kind in slower.curves:
        for mbs in (1, 3, 8, 100):
            expected = np.array(slower.time(tp, kind, mbs)) * 1.5
            assert np.array(profiles["fast"].time(tp, kind, mbs)) == pytest.approx(expected, rel=1e-9), (tp, kind, mbs)


def tiny_profiles(user, launch_us: dict[str, float]):
    """Profiles synthesised for the user's model from specs launching kernels in `launch_us`."""
    text = user.cluster.read_text().split("\n[[gpu]]")[0] + "\n" + host_gpu_tables(launch_us)
    other = user.root / "other-cluster.toml"
    other.write_text(text)
    cluster = load_cluster(str(other))
    return load_profiles(load_model(str(user.model)), sorted(GPU_SPEED), specs=merged_specs(own=cluster.gpus))


def test_calibrated_files_carry_the_host_factor(host_measured, runner):
    """The calibrated cluster's [[gpu]] table launches kernels host_time_scale times as slowly, every other figure
    kept; the calibrated profiles give each run the estimate the fit predicts."""
    user, path = host_measured
    out, profiles_out = user.root / "calibrated.toml", user.root / "calibrated-profiles"
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--out", str(out),
                                  "--profiles-out", str(profiles_out)])
    assert result.exit_code == 0, result.output
    host = float(re.search(r"host_time_scale\.fast\s+([\d.]+)", result.stdout).group(1))
    assert host == pytest.approx(HOST_TRUTH["fast"], rel=0.02)
    written = load_cluster(str(out)).gpus["fast"]
    original = load_cluster(str(user.cluster)).gpus["fast"]
    assert written.kernel_launch_us == pytest.approx(5.0 * host, rel=1e-4)
    compute = float(re.search(r"compute_time_scale\.fast\s+([\d.]+)", result.stdout).group(1))
    assert written.matmul_efficiency == pytest.approx(original.matmul_efficiency / compute, rel=1e-4)
    assert written.dense_bf16_tflops == original.dense_bf16_tflops and written.memory_gib == original.memory_gib
    assert "host_time_scale.fast" in written.source
    calibration = host_calibration(user, path)
    values = calibrate(calibration).values
    model = calibration.setting.model
    profiles = load_profiles(model, sorted(GPU_SPEED), str(profiles_out), specs=merged_specs(own=load_cluster(str(out)).gpus))
    assert "host_time_scale.fast" in (profiles_out / "fast.csv").read_text()
    np.testing.assert_allclose([predict_step_s(run, model, load_cluster(str(out)), profiles) for run in calibration.runs],
                               calibration.predict(values), rtol=1e-6)
    after = runner.invoke(main, ["validate", "--measured", str(path), "--cluster", str(out)])
    assert after.exit_code == 0, after.output
    assert float(re.search(r"MAPE ([\d.]+)%", after.stdout).group(1)) < 0.5


def test_a_host_that_never_sets_the_pace_is_not_fitted(measured, runner):
    """Profiles without a spec have no host part to scale, and a spec whose launches are hidden behind the GPU's
    work at ten times their time leaves the host factor unfitted."""
    user, path = measured
    calibration = calibration_of(user, path)
    assert all(f.kind != "host" for f in calibration.factors)
    user.cluster.write_text(user.cluster.read_text() + FAST_GPU)
    with_spec = calibration_of(user, path)
    assert Factor("host", "fast") in with_spec.factors and Factor("host", "fast") not in with_spec.exercised()
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(user.profiles),
                                  "--out", str(user.root / "calibrated.toml")])
    assert result.exit_code == 0, result.output
    assert re.search(r"host_time_scale\.fast\s+1\.0000\s+not fitted: the GPU's work, not the host's launches", result.stdout)


def test_a_calibrated_gpu_table_keeps_every_figure_it_does_not_calibrate():
    """A catalogue GPU's calibrated [[gpu]] table: its SM count, NCCL curve, FP8 and NVLink figures as the
    catalogue's; its efficiencies and attention speeds over the compute scale, its launches times the host scale;
    and it reads back through the catalogue's own checks."""
    cluster = load_cluster("h100-a100-a10g")
    values = {Factor("compute", "H100"): 1.25, Factor("host", "H100"): 2.0, Factor("compute", "A100-80GB"): 1.0}
    outcome = Outcome(values, list(values), 10.0, 1.0, None)
    tables, notes = calibrated_gpu_tables(cluster, outcome, "runs.csv", "2026-02-03")
    assert notes == [] and [t["name"] for t in tables] == ["H100"]  # the A100's factors are 1: no table
    written = gpu_tables(tables, "calibrated.toml")["H100"]
    spec = merged_specs()["H100"]
    assert written.matmul_efficiency == pytest.approx(spec.matmul_efficiency / 1.25, rel=1e-12)
    assert written.fp8_matmul_efficiency == pytest.approx(spec.fp8_matmul_efficiency / 1.25, rel=1e-12)
    assert written.sustained_matmul_efficiency == pytest.approx(spec.sustained_matmul_efficiency / 1.25, rel=1e-12)
    assert written.sustained_fp8_matmul_efficiency == pytest.approx(spec.sustained_fp8_matmul_efficiency / 1.25,
                                                                    rel=1e-12)
    assert written.memory_bandwidth_gb_per_s == pytest.approx(spec.memory_bandwidth_gb_per_s / 1.25, rel=1e-12)
    assert written.kernel_launch_us == pytest.approx(spec.kernel_launch_us * 2.0, rel=1e-12)
    np.testing.assert_allclose(np.array(written.attention_tflops)[:, 2:], np.array(spec.attention_tflops)[:, 2:] / 1.25)
    np.testing.assert_array_equal(np.array(written.attention_tflops)[:, :2], np.array(spec.attention_tflops)[:, :2])
    changed = {"matmul_efficiency", "fp8_matmul_efficiency", "sustained_matmul_efficiency",
               "sustained_fp8_matmul_efficiency", "memory_bandwidth_gb_per_s", "kernel_launch_us", "attention_tflops",
               "source", "date", "file"}
    assert replace(written, **{f: getattr(spec, f) for f in changed}) == spec
    assert spec.sm_count and spec.allreduce_busbw and spec.dense_fp8_tflops  # figures a table without them would lose


def test_calibrated_figures_out_of_a_gpu_tables_range_are_a_comment(measured):
    """A calibrated memory bandwidth above the 100,000 GB/s a [[gpu]] table takes: a comment says so, no table."""
    user, path = measured
    user.cluster.write_text(user.cluster.read_text() + FAST_GPU.replace("matmul_efficiency = 0.9",
                                                                        "matmul_efficiency = 0.5"))
    calibration = calibration_of(user, path)
    fitted = calibrate(calibration)
    outcome = replace(fitted, values={**fitted.values, Factor("compute", "fast"): 0.8})
    tables, notes = calibrated_gpu_tables(calibration.setting.cluster, outcome, "runs.csv", "2026-02-03")
    assert tables == [] and len(notes) == 1
    assert notes[0].startswith("No [[gpu]] table for fast: its calibrated figures are out of a GPU table's range")
    assert "memory_bandwidth_gb_per_s" in notes[0]


def test_the_host_factor_keeps_the_host_below_a_millisecond_per_kernel(host_measured):
    """Its upper bound is the smaller of 100 and the 1,000 us per kernel a GPU table or a profile takes, over the
    GPU type's time per kernel, so that the calibrated files read back."""
    user, path = host_measured
    assert host_calibration(user, path).bounds[Factor("host", "fast")] == (0.1, 100.0)  # 5 us: 200 would do
    user.cluster.write_text(user.cluster.read_text().replace("kernel_launch_us = 5.0", "kernel_launch_us = 40.0"))
    calibration = host_calibration(user, path)
    assert calibration.bounds[Factor("host", "fast")] == (0.1, 25.0)
    assert calibration.bounds[Factor("compute", "fast")] == Factor("compute", "fast").bounds
    outcome = calibrate(calibration)
    assert outcome.values[Factor("host", "fast")] == pytest.approx(1.0, rel=0.02)  # the truth's 40 us
    assert outcome.bounds == calibration.bounds


def test_a_measured_profiles_floor_is_calibrated_with_its_times(host_measured, runner):
    """A profile carrying its measured host floor (`kernel_launch_us=` on its identity line): --profiles-out writes
    the floor times host_time_scale beside the times, and the written profiles with the calibrated cluster give
    every run the estimate the fit predicts."""
    user, path = host_measured
    measured_dir = user.root / "measured"
    measured_dir.mkdir()
    for gpu in GPU_SPEED:
        target = measured_dir / f"{gpu}.csv"
        made = runner.invoke(main, ["profile", "synth", "--model", str(user.model), "--gpu", gpu, "--tp", "1,2",
                                    "--mbs", "1,2,4,16", "--cluster", str(user.cluster), "--out", str(target)])
        assert made.exit_code == 0, made.output
        text = re.sub(r"^(# fasop-profile: .*)$", r"\1 kernel_launch_us=5", target.read_text(), count=1, flags=re.M)
        target.write_text(text)
    out, profiles_out = user.root / "calibrated.toml", user.root / "calibrated-profiles"
    result = runner.invoke(main, ["calibrate", "--measured", str(path), "--profiles", str(measured_dir),
                                  "--out", str(out), "--profiles-out", str(profiles_out)])
    assert result.exit_code == 0, result.output
    host = float(re.search(r"host_time_scale\.fast\s+([\d.]+)", result.stdout).group(1))
    assert host == pytest.approx(HOST_TRUTH["fast"], rel=0.02)
    identity = next(line for line in (profiles_out / "fast.csv").read_text().splitlines()
                    if line.startswith("# fasop-profile:"))
    assert float(re.search(r"kernel_launch_us=(\S+)", identity).group(1)) == pytest.approx(5 * host, rel=1e-3)
    runs = read_measured(path)
    calibration = Calibration(runs, load_settings(runs, str(measured_dir))[0])
    assert not any(p.synthesised for p in calibration.setting.profiles.values())
    model, cluster = calibration.setting.model, load_cluster(str(out))
    profiles = load_profiles(model, sorted(GPU_SPEED), str(profiles_out), specs=merged_specs(own=cluster.gpus))
    assert profiles["fast"].kernel_launch_us == pytest.approx(5 * host, rel=1e-3)
    np.testing.assert_allclose([predict_step_s(run, model, cluster, profiles) for run in runs],
                               calibration.predict(calibrate(calibration).values), rtol=1e-6)
