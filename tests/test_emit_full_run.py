"""fasop emit's full runs: iterations from the plan, data and tokenizer required, the [training] table,
checkpoints and the stop before each job's time limit, requeueing, CPUs per task and network settings."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_emit import (
    SMOKE,
    flag_values,
    fresh_plan,
    launchable,
    megatron_args,
    one_line_error,
    runner,
    sbatch_components,
    write_cluster,
    write_plans,
)

from fasop.cli import main
from fasop.cli.emit import emit
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.errorband import ErrorBand, bundled_band
from fasop.inputs.model import load_model
from fasop.launch.options import LaunchOptions
from fasop.launch.resume import exit_duration_min, run_notes, save_interval, time_limit_s, train_iters
from fasop.launch.write import render_plan

DATA = dict(data_path="/data/text_document", tokenizer_type="GPT2BPETokenizer", vocab_file="/data/vocab.json",
            merge_file="/data/merges.txt")
FULL = LaunchOptions(**DATA, training={"lr": "2e-4"})
NETWORK = {"big": 'network = { fabric = "infiniband", ib_hca = "mlx5_0:1,mlx5_1:1", socket_ifname = "ib0" }',
           "small": 'network = { fabric = "ethernet", socket_ifname = "=eth0" }\ncpus_per_node = 48'}


@pytest.fixture
def gpt2():
    return load_model("gpt2-xl")


@pytest.fixture
def cluster(tmp_path):
    return load_cluster(str(write_cluster(tmp_path)))


def args_of(files) -> dict[str, list[str]]:
    return flag_values(megatron_args(files["run_inter.sh"]))


def test_a_full_run_trains_for_the_plans_steps_and_checkpoints(gpt2, cluster):
    plan = launchable(train_steps=23842, step_time_s=2.5)
    options = LaunchOptions(**DATA, training={"lr": "2e-4"}, time_limit="3-00:00:00", stop_margin_s=900)
    files = render_plan(plan, gpt2, cluster, options)
    args = args_of(files)
    assert args["--train-iters"] == args["--lr-decay-iters"] == ["23842"]
    assert args["--save"] == args["--load"] == ["checkpoints"]
    assert args["--save-interval"] == ["1440"]  # an hour of 2.5 s steps
    assert args["--exit-signal-handler"] == []
    assert "--exit-duration-in-mins" not in args  # only where sbatch.sh sets it: other launchers have no limit
    assert f"export FASOP_EXIT_DURATION_MIN={3 * 24 * 60 - 15} " in files["sbatch.sh"]
    assert 'TRAINING_ARGS+=(--exit-duration-in-mins "$FASOP_EXIT_DURATION_MIN")' in files["run_inter.sh"]
    assert args["--data-path"] == ["/data/text_document"] and "--mock-data" not in args
    assert args["--lr"] == ["0.0002"]
    first = sbatch_components(files["sbatch.sh"])[0]
    assert {"--requeue", "--open-mode=append", "--signal=B:USR1@450"} <= set(first)
    assert not any("--requeue" in line for component in sbatch_components(files["sbatch.sh"])[1:] for line in component)
    assert "TRAIN_ITERS=23842" in files["sbatch.sh"] and "CHECKPOINT_DIR=checkpoints" in files["sbatch.sh"]
    assert "# Full run: 23842 iterations, a checkpoint every 1440 in checkpoints." in files["sbatch.sh"]


def test_the_time_limit_warning_counts_the_jobs(gpt2, cluster):
    # 75.8 hours against 3 days less 10 minutes: two jobs
    plan = launchable(train_steps=23842, step_time_s=75.8 * 3600 / 23842)
    options = LaunchOptions(**DATA, training={"lr": "2e-4"}, time_limit="3-00:00:00")
    band = ErrorBand(1.0, 1.3, 2, "two runs")
    notes = run_notes(plan, options, band)
    per_job_h = (3 * 24 * 60 - 10) / 60
    assert notes[1].startswith("warning: the estimated run of 75.8 h (98.5 h at the error band's slow end (1.30x)) "
                               "exceeds the time limit 3-00:00:00: it takes "
                               f"{math.ceil(75.8 / per_job_h)} jobs (2 at the band's slow end) of {per_job_h:.2f} h")
    assert "# Warning: the estimated run of 75.8 h" in render_plan(plan, gpt2, cluster, options)["sbatch.sh"]
    assert len(run_notes(launchable(train_steps=10, step_time_s=1.0), options, band)) == 1  # fits: no warning
    # 60 h fits one job, but not at the band's slow end (78 h): warned, with one job at the estimate
    close = run_notes(launchable(train_steps=23842, step_time_s=60 * 3600 / 23842), options, band)
    assert close[1].startswith("warning: the estimated run of 60.0 h fits the time limit 3-00:00:00 but not at 78.0 h at "
                               f"the error band's slow end (1.30x): it may take 2 jobs of {per_job_h:.2f} h")


@pytest.mark.parametrize("text, seconds", [("90", 5400), ("5:30", 330), ("01:30:00", 5400), ("2-0", 172800),
                                           ("1-12", 129600), ("1-12:30", 131400), ("3-00:00:00", 259200)])
def test_slurm_times(text, seconds):
    assert time_limit_s(text) == seconds


@given(st.integers(0, 30), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59))
def test_every_slurm_time_form_reads_the_same(days, hours, minutes, seconds):
    total = days * 86400 + hours * 3600 + minutes * 60 + seconds
    assert time_limit_s(f"{days}-{hours}:{minutes:02d}:{seconds:02d}") == total
    assert time_limit_s(f"{days * 24 + hours}:{minutes}:{seconds}") == total
    assert time_limit_s(f"{days}-{hours}") == days * 86400 + hours * 3600


def test_save_interval_and_exit_duration():
    plan = launchable(step_time_s=7.0)
    assert save_interval(plan, LaunchOptions(), 100000) == 514  # floor(3600 / 7)
    assert save_interval(plan, LaunchOptions(), 300) == 300  # never beyond the run
    assert save_interval(plan, LaunchOptions(save_interval=25), 300) == 25
    with pytest.raises(InputError, match="^save_interval: needed"):
        save_interval(launchable(step_time_s=None), LaunchOptions(), 300)
    assert exit_duration_min(LaunchOptions(time_limit="01:00:00")) == 50
    assert exit_duration_min(LaunchOptions(time_limit="10", stop_margin_s=120)) == 8
    with pytest.raises(InputError, match="^time_limit=10: leaves no whole minute"):
        exit_duration_min(LaunchOptions(time_limit="10"))


def test_iterations_come_from_the_plan_or_a_smoke_test():
    assert train_iters(launchable(train_steps=1234), LaunchOptions()) == 1234
    assert train_iters(launchable(train_steps=1234), LaunchOptions(train_iters=7)) == 7
    assert train_iters(launchable(), SMOKE) == 50
    with pytest.raises(InputError, match="^train_iters: a full run needs its length"):
        train_iters(launchable(), LaunchOptions())


def test_a_smoke_test_says_so_and_keeps_no_checkpoints(gpt2, cluster):
    files = render_plan(launchable(train_steps=1000), gpt2, cluster, SMOKE)
    args = args_of(files)
    assert args["--train-iters"] == ["50"] and "--mock-data" in args
    assert "--save" not in args and "FASOP_EXIT_DURATION_MIN=" not in files["sbatch.sh"]
    assert "# Smoke test: 50 iterations on mock data, no checkpoints; not the whole training." in files["sbatch.sh"]
    assert "--requeue" not in files["sbatch.sh"] and "scontrol requeue" not in files["sbatch.sh"]


@pytest.mark.parametrize("options, fragment", [
    (dict(training={"lr": "1e-4"}), "data_path: a full run needs data_path and a tokenizer"),
    (dict(training={"lr": "1e-4"}, data_path="/d"), "tokenizer_type: a full run needs a tokenizer"),
    (dict(DATA), "training: model gpt2-xl gives no lr"),
    (dict(DATA, training={"lr": "fast"}), "training: lr: expected a number"),
    (dict(DATA, training={"learning_rate": "1"}), "unknown key 'learning_rate'"),
    (dict(DATA, training={"lr": "1e-4", "lr_warmup_fraction": "0.01", "lr_warmup_iters": "10"}), "takes one"),
])
def test_a_full_run_without_what_it_needs_is_refused(gpt2, cluster, options, fragment):
    with pytest.raises(InputError, match=fragment):
        render_plan(launchable(train_steps=100), gpt2, cluster, LaunchOptions(**options))


def test_the_model_files_training_table_with_overrides(cluster, tmp_path):
    llama = load_model("llama2-7b")
    plan = launchable(model="llama2-7b", model_file="llama2-7b", train_steps=100, gbs=64, tp=2, dp=1,
                      layers_per_stage=[8, 8, 8, 8])
    args = args_of(render_plan(plan, llama, cluster, LaunchOptions(**DATA, training={"min_lr": "0"})))
    expected = {"--lr": "0.0003", "--min-lr": "0.0", "--lr-decay-style": "cosine", "--lr-warmup-iters": "2000",
                "--weight-decay": "0.1", "--adam-beta1": "0.9", "--adam-beta2": "0.95", "--adam-eps": "1e-05",
                "--clip-grad": "1.0"}
    assert {flag: args[flag][0] for flag in expected} == expected
    model = tmp_path / "m.toml"
    model.write_text((Path(__file__).parents[1] / "models" / "gpt2-xl.toml").read_text() + '\n[training]\nlr = "x"\n')
    with pytest.raises(InputError, match=r"m.toml: training.lr: expected a number"):
        render_plan(launchable(train_steps=100), load_model(str(model)), cluster, LaunchOptions(**DATA))


def test_cpus_per_task_and_network_per_node_type(gpt2, tmp_path):
    path = write_cluster(tmp_path)
    text = path.read_text().replace('gres_type = "big"', 'gres_type = "big"\n' + NETWORK["big"])
    path.write_text(text.replace('gres_type = "small"', 'gres_type = "small"\n' + NETWORK["small"]))
    cluster = load_cluster(str(path))
    files = render_plan(launchable(train_steps=100), gpt2, cluster, FULL)
    cpus = [[line for line in c if line.startswith("--cpus")] for c in sbatch_components(files["sbatch.sh"])]
    assert cpus == [["--cpus-per-task=48"], [], ["--cpus-per-task=48"]]  # small big small; big gives none
    assert "SRUN_CPUS_PER_TASK" not in files["sbatch.sh"]  # the components differ
    run_inter = files["run_inter.sh"]
    # infiniband and ethernet in one job: both on sockets, each on its own interface
    assert "export NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME=ib0" in run_inter
    assert "export NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_SOCKET_IFNAME='=eth0'" in run_inter
    alone = render_plan(launchable(placement=["big", "big"], tp=2, dp=1, pp=2, layers_per_stage=[23, 25],
                                   train_steps=100), gpt2, cluster, FULL)
    assert "export NCCL_IB_HCA=mlx5_0:1,mlx5_1:1 NCCL_NET=IB NCCL_SOCKET_IFNAME=ib0" in alone["run_inter.sh"]
    assert "--cpus-per-task" not in alone["sbatch.sh"]
    assert "--cpus-per-task=8" in render_plan(launchable(train_steps=100), gpt2, cluster,
                                              LaunchOptions(**DATA, training={"lr": "1"}, cpus_per_task=8))["sbatch.sh"]


@pytest.mark.parametrize("network, fragment", [
    ('network = { fabric = "omnipath" }', "network.fabric: expected one of"),
    ('network = { fabric = "ethernet", socket_ifname = "eth0; reboot" }', "expected an NCCL interface list"),
    ('network = { fabric = "infiniband", ib_hca = "$(id)" }', "expected an NCCL device list"),
    ("cpus_per_node = 0", "cpus_per_node: expected an integer from 1"),
])
def test_bad_network_and_cpu_entries_are_refused(tmp_path, network, fragment):
    path = write_cluster(tmp_path)
    path.write_text(path.read_text().replace('gres_type = "big"', 'gres_type = "big"\n' + network))
    with pytest.raises(InputError, match=f"node_type.big.*{re.escape(fragment)}"):
        load_cluster(str(path))


def test_the_bundled_efa_nodes_export_efa_settings(gpt2):
    cluster = load_cluster("h100-a100-a10g")
    plan = launchable(model_file="gpt2-xl", cluster="h100-a100-a10g", placement=["H100", "A100"], tp=8, dp=1, pp=2,
                      layers_per_stage=[24, 24], gbs=64, train_steps=100)
    run_inter = render_plan(plan, gpt2, cluster, FULL)["run_inter.sh"]
    assert run_inter.count("export FI_EFA_USE_DEVICE_RDMA=1 FI_PROVIDER=efa NCCL_SOCKET_IFNAME='^lo,docker'") == 2


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_full_run_scripts_pass_shellcheck(gpt2, tmp_path):
    path = write_cluster(tmp_path)
    text = path.read_text().replace('gres_type = "big"', 'gres_type = "big"\n' + NETWORK["big"])
    path.write_text(text.replace('gres_type = "small"', 'gres_type = "small"\n' + NETWORK["small"]))
    files = render_plan(launchable(train_steps=100), gpt2, load_cluster(str(path)), FULL)
    for name in ("sbatch.sh", "run_inter.sh"):
        (tmp_path / name).write_text(files[name])
        result = subprocess.run(["shellcheck", "--severity=style", str(tmp_path / name)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


# -- the command line ----------------------------------------------------------------------------------------


def test_cli_full_run_prints_the_run_and_the_warning(tmp_path):
    write_cluster(tmp_path)
    plans = write_plans(tmp_path, [fresh_plan(tmp_path, train_steps=500000)])
    plan = json.loads(plans.read_text())[0]
    result = runner().invoke(emit, ["--plans", str(plans), "--out", str(tmp_path / "o"), "--data-path", "/d/t",
                                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/v", "--merge-file", "/m",
                                    "--training", "lr=1.5e-4", "--training", "lr_decay_style=cosine",
                                    "--time-limit", "1-00:00:00", "--stop-margin", "1200", "--save-interval", "99",
                                    "--checkpoint-dir", "/ckpt/run 1"])
    assert result.exit_code == 0, result.stderr
    args = flag_values(megatron_args((tmp_path / "o" / "run_inter.sh").read_text()))
    assert args["--train-iters"] == ["500000"] and args["--save-interval"] == ["99"]
    assert args["--save"] == ["/ckpt/run 1"]
    assert "export FASOP_EXIT_DURATION_MIN=1420 " in (tmp_path / "o" / "sbatch.sh").read_text()
    assert args["--lr"] == ["0.00015"] and args["--lr-decay-style"] == ["cosine"]
    jobs_exact = 500000 * plan["step_time_s"] / (1420 * 60)
    jobs = math.ceil(jobs_exact)
    assert "full run: 500000 iterations, a checkpoint every 99 in /ckpt/run 1" in result.stderr
    slow_jobs = math.ceil(bundled_band().high * jobs_exact)
    assert f"it takes {jobs} jobs ({slow_jobs} at the band's slow end) of 23.67 h of training each" in result.stderr


def test_cli_refuses_a_full_run_without_data_in_one_line(tmp_path):
    write_cluster(tmp_path)
    plans = write_plans(tmp_path, [fresh_plan(tmp_path, train_steps=100)])
    result = runner().invoke(emit, ["--plans", str(plans), "--out", str(tmp_path / "o"), "--training", "lr=1e-4"])
    one_line_error(result, "--data-path", "a full run needs data_path and a tokenizer", "smoke_test")
    assert not (tmp_path / "o").exists()
    result = runner().invoke(emit, ["--plans", str(plans), "--out", str(tmp_path / "o"), "--training", "lr"])
    one_line_error(result, "--training lr", "expected KEY=VALUE")
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0 and "smoke test: 50 iterations on mock data" in result.stderr


def test_search_emit_takes_the_run_options(tmp_path):
    write_cluster(tmp_path)
    search = ["search", "--model", "gpt2-xl", "--cluster", str(tmp_path / "mixed.toml"), "--gbs", "64",
              "--train-steps", "1000", "--emit", str(tmp_path / "run")]
    refused = runner().invoke(main, [*search, "--training", "lr=1e-4"])
    one_line_error(refused, "--data-path")
    result = runner().invoke(main, [*search, "--data-path", "/d/t", "--tokenizer-type", "GPT2BPETokenizer",
                                    "--vocab-file", "/v", "--merge-file", "/m", "--training", "lr=1e-4"])
    assert result.exit_code == 0, result.stderr
    assert "full run: 1000 iterations" in result.stderr
    args = flag_values(megatron_args((tmp_path / "run" / "run_inter.sh").read_text()))
    assert args["--train-iters"] == ["1000"] and args["--data-path"] == ["/d/t"]
    for option in ("--smoke-test", "--data-path", "--tokenizer-model", "--training"):
        assert option in runner().invoke(main, ["search", "--help"]).output
