"""fasop emit given hostile site options: numbers beyond what bash, Slurm or Megatron-LM hold, values that a
program would read as flags, per-type names of no node type, and a forced emit over an earlier one. Each is
refused in one line with exit code 2 and nothing written, or leaves the folder holding the new emit alone."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from conftest import one_line_error
from test_emit import SMOKE, flag_values, fresh_plan, launchable, megatron_args, sbatch_components, write_cluster, write_plans

from fasop.cli.emit import emit
from fasop.errors import ArgumentError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch import write
from fasop.launch.options import launch_options
from fasop.plans import MAX_PLAN_INT
from fasop.search.stagegroups import StageGroup, estimate_stage_groups, stage_group_spec

FULL_RUN = ["--data-path", "/data/text", "--vocab-file", "/data/vocab.json", "--training", "lr=1e-4"]


def emit_args(tmp_path: Path, *extra: str, launch: str = "") -> list[str]:
    """`fasop emit` of a full run of 100 iterations on the mixed cluster (`launch`: its [launch] table) into
    tmp_path/run, then `extra`."""
    write_cluster(tmp_path, launch)
    plans = write_plans(tmp_path, [fresh_plan(tmp_path, train_steps=100)])
    return ["--plans", str(plans), "--out", str(tmp_path / "run"), *FULL_RUN, *extra]


def refused(runner, tmp_path: Path, args: list[str], *fragments: str) -> str:
    """The emit of `args` refused in one line naming `fragments`, with no folder written."""
    line = one_line_error(runner.invoke(emit, args), *fragments)
    assert not (tmp_path / "run").exists()
    return line


def files_of(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


# -- numbers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--train-iters", "--save-interval"])
def test_iterations_beyond_bash_arithmetic_are_refused(runner, tmp_path, option):
    # bash reads 2**64 - 1 as -1: the job would stop as complete at iteration 0
    refused(runner, tmp_path, emit_args(tmp_path, option, str(2**64 - 1)), option, f"from 1 to {MAX_PLAN_INT:,}")


def test_the_largest_iteration_count_is_written_whole(runner, tmp_path):
    result = runner.invoke(emit, emit_args(tmp_path, "--train-iters", str(MAX_PLAN_INT)))
    assert result.exit_code == 0, result.stderr
    assert f"TRAIN_ITERS={MAX_PLAN_INT}\n" in (tmp_path / "run" / "sbatch.sh").read_text()


@pytest.mark.parametrize("key, value, expected", [
    ("train_iters", 2**64 - 1, f"from 1 to {MAX_PLAN_INT:,}"),
    ("save_interval", 2**63 - 1, f"from 1 to {MAX_PLAN_INT:,}"),
    ("cpus_per_task", 10**26, "from 1 to 1,000,000"),
    ("time_limit", '"100000000000000000000000"', "at most 365 days"),
])
def test_launch_table_numbers_out_of_range_are_refused(runner, tmp_path, key, value, expected):
    args = emit_args(tmp_path, launch=f"{key} = {value}\n")
    refused(runner, tmp_path, args, f"mixed.toml: launch.{key}", expected)


@pytest.mark.parametrize("option, value, expected", [
    ("--time-limit", "99999999999999999999999", "at most 365 days"),
    ("--time-limit", "366-00:00:00", "at most 365 days"),
    ("--time-limit", "1" + "0" * 5000, "at most 365 days"),  # more digits than int() reads
    ("--cpus-per-task", "99999999999999999999999999", "from 1 to 1,000,000"),
    ("--stop-margin", str(365 * 86400 + 1), "from 1 to 31,536,000"),
])
def test_slurm_numbers_out_of_range_are_refused(runner, tmp_path, option, value, expected):
    refused(runner, tmp_path, emit_args(tmp_path, option, value), option, expected)


def test_the_longest_time_limit_and_most_cpus_are_written(runner, tmp_path):
    result = runner.invoke(emit, emit_args(tmp_path, "--time-limit", "365-00:00:00", "--cpus-per-task", "1000000"))
    assert result.exit_code == 0, result.stderr
    sbatch = (tmp_path / "run" / "sbatch.sh").read_text()
    assert all({"--time=365-00:00:00", "--cpus-per-task=1000000"} <= set(c) for c in sbatch_components(sbatch))
    assert "export FASOP_EXIT_DURATION_MIN=525590 " in sbatch  # 365 days less the stop margin of 600 s


# -- values read as flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize("option, value", [
    ("--data-path", "--lr=100"),
    ("--vocab-file", "--load=/etc"),
    ("--merge-file", "-m"),
    ("--tokenizer-model", "--tokenizer-type=x"),
    ("--tokenizer-type", "-x"),
    ("--checkpoint-dir", "--no-load-optim"),
    ("--megatron-path", "-x"),  # torchrun would read "-x/pretrain_gpt.py" as an option
])
def test_values_starting_with_a_dash_are_refused(runner, tmp_path, option, value):
    refused(runner, tmp_path, emit_args(tmp_path, option, value), option, f"{value!r} would be read as a flag",
            f"./{value}")


def test_a_relative_path_starting_with_a_dash_is_given_with_its_folder(runner, tmp_path):
    result = runner.invoke(emit, emit_args(tmp_path, "--data-path", "./--lr=100", "--checkpoint-dir", "./-ckpt"))
    assert result.exit_code == 0, result.stderr
    flags = flag_values(megatron_args((tmp_path / "run" / "run_inter.sh").read_text()))
    assert flags["--data-path"] == ["./--lr=100"] and flags["--save"] == flags["--load"] == ["./-ckpt"]
    assert "--lr=100" not in flags and "--lr" in flags


def test_launch_table_values_starting_with_a_dash_are_refused(runner, tmp_path):
    args = emit_args(tmp_path, launch='data_path = "--lr=5"\n')
    refused(runner, tmp_path, args, "mixed.toml: launch.data_path", "'--lr=5' would be read as a flag")


@pytest.mark.parametrize("argument, value", [("data_path", "--lr=5"), ("flagscale_dir", "-P")])
def test_flagscale_values_starting_with_a_dash_are_refused(argument, value):
    # FlagScale's runner turns data_path into --data-path; commands.txt runs `cd FLAGSCALE_DIR`
    with pytest.raises(ArgumentError, match="would be read as a flag") as caught:
        launch_options({}, **{argument: value})
    assert caught.value.argument == argument


# -- per-type names -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--partition", "--gres-type"])
def test_a_per_type_name_of_no_node_type_is_refused(runner, tmp_path, option):
    refused(runner, tmp_path, emit_args(tmp_path, option, "NOPE=x"), f"{option} NOPE=x",
            "NOPE is no node type or GPU of cluster mixed", "expected one of A10G, H100, big, small")


def test_a_per_type_name_may_name_a_gpu(runner, tmp_path):
    result = runner.invoke(emit, emit_args(tmp_path, "--partition", "H100=hgx", "--partition", "small=cheap"))
    assert result.exit_code == 0, result.stderr
    partitions = [[d for d in c if d.startswith("--partition")]
                  for c in sbatch_components((tmp_path / "run" / "sbatch.sh").read_text())]
    assert partitions == [["--partition=cheap"], ["--partition=hgx"], ["--partition=cheap"]]  # small big small


# -- forced emits over earlier ones -------------------------------------------------------------------------


def test_force_leaves_the_new_emits_files_and_the_users(runner, tmp_path):
    args = emit_args(tmp_path)
    assert runner.invoke(emit, [*args, "--launcher", "ssh"]).exit_code == 0
    run = tmp_path / "run"
    (run / "notes.txt").write_text("mine")
    (run / "logs").mkdir()
    result = runner.invoke(emit, [*args, "--time-limit", "soon", "--force"])
    one_line_error(result, "--time-limit")
    assert files_of(run) == ["hosts", "launch.sh", "logs", "notes.txt", "plan.json", "run_inter.sh"]  # untouched
    result = runner.invoke(emit, [*args, "--force"])
    assert result.exit_code == 0, result.stderr
    assert files_of(run) == ["logs", "notes.txt", "plan.json", "run_inter.sh", "sbatch.sh"]


def test_force_keeps_an_input_among_the_earlier_files(runner, tmp_path):
    args = emit_args(tmp_path)
    assert runner.invoke(emit, [*args, "--launcher", "ssh"]).exit_code == 0
    hosts = tmp_path / "run" / "hosts"
    hosts.write_text("".join(f"10.0.0.{rank} {node_type}\n" for rank, node_type in enumerate(["small", "big", "big", "small"])))
    result = runner.invoke(emit, [*args, "--launcher", "manual", "--hosts", str(hosts), "--force"])
    assert result.exit_code == 0, result.stderr
    assert files_of(tmp_path / "run") == ["commands.txt", "hosts", "plan.json", "run_inter.sh"]


def stage_group_run():
    """A FlagScale plan of llama2-7b on a bundled cluster of three node types: (plan, model, cluster)."""
    model = load_model("llama2-7b")
    cluster = load_cluster("h100-a100-a10g").with_counts({"H100": 1, "A100": 2, "A10G": 2})
    spec = stage_group_spec(model, cluster, placement=["H100", "A100", "A100", "A10G", "A10G"],
                            stages=[StageGroup("H100", 8, 1, 10), StageGroup("A100", 4, 4, 14),
                                    StageGroup("A10G", 4, 4, 8)], mbs=4)
    return estimate_stage_groups(model, cluster, spec), model, cluster


def test_force_over_a_flagscale_emit_leaves_no_config(tmp_path):
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the smoke test's run notes
        write.emit(*stage_group_run(), run, smoke_test=True, launcher="manual")
    assert "train/fasop.yaml" in files_of(run)
    cluster = load_cluster(str(write_cluster(tmp_path)))
    write.emit_plan(launchable(), load_model("gpt2-xl"), cluster, run, SMOKE, force=True)
    assert files_of(run) == ["plan.json", "run_inter.sh", "sbatch.sh"]


@pytest.mark.parametrize("launcher, extra", [
    ("slurm", []), ("ssh", []), ("manual", ["--rendezvous", "file", "--rendezvous-file", "/shared/rendezvous"])])
def test_force_knows_every_file_an_emit_writes(runner, tmp_path, launcher, extra):
    result = runner.invoke(emit, emit_args(tmp_path, "--launcher", launcher, *extra))
    assert result.exit_code == 0, result.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write.emit(*stage_group_run(), tmp_path / "flagscale", smoke_test=True, launcher=launcher)
    emitted = (set(files_of(tmp_path / "run")) | set(files_of(tmp_path / "flagscale"))) - {"train"}  # its folder
    assert emitted <= set(write.EMITTED_FILES)
