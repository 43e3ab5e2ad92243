"""Hostile inputs: every file under tests/hostile/ makes the command line stop with exit code 2 and one line on
stderr naming the file and the field, without a traceback and without leaving an output file behind. Then the
outputs of a run: never written over one of its inputs, written whole or not at all, and one line when they
cannot be written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fasop.cli import main
from fasop.errors import InputError
from fasop.files import check_finite, write_atomically
from fasop.inputs import bundled
from fasop.plans import Plan, PlanFile

HOSTILE = Path(__file__).parent / "hostile"
VALID_CLUSTER = HOSTILE / "valid" / "cluster.toml"

SEARCH = ["search", "--model", "bert", "--cluster", "{case}", "--output", "{out}/plans.json"]
SEARCH_MODEL = ["search", "--model", "{case}", "--cluster", "{valid}", "--output", "{out}/plans.json"]
SEARCH_PROFILE = ["search", "--model", "bert", "--cluster", "{valid}", "--profiles", "{profiles}",
                  "--output", "{out}/plans.json", "--emit", "{out}/run", "--smoke-test"]
PLOT_PLAN = ["plot", "--plan", "{case}", "--out", "{out}/stages.png"]
EMIT = ["emit", "--smoke-test", "--plans", "{case}", "--out", "{out}/run"]
VALIDATE = ["validate", "--measured", "{case}", "--chart", "{out}/validate.png"]
CALIBRATE = ["calibrate", "--measured", "{case}", "--out", "{out}/calibrated.toml", "--profiles-out", "{out}/profiles"]

# file -> (command, what the one line must say besides the file name)
CASES = {
    "cluster-infinite-bandwidth.toml": (SEARCH, ["node_type.A100.inter_node_bandwidth", "1 kB/s to 1 PB/s"]),
    "cluster-tiny-bandwidth.toml": (SEARCH, ["node_type.A100.intra_node_bandwidth", "1 kB/s to 1 PB/s"]),
    "cluster-huge-price.toml": (SEARCH, ["node_type.A100.price_per_hour_usd", "<= 1e+06"]),
    "cluster-inf-memory.toml": (SEARCH, ["node_type.A100.gpu_memory_gib", "got inf"]),
    "cluster-nan-memory.toml": (SEARCH, ["node_type.A100.gpu_memory_gib", "got nan"]),
    "cluster-huge-memory.toml": (SEARCH, ["node_type.A100.gpu_memory_gib", "<= 65536"]),
    "cluster-huge-count.toml": (SEARCH, ["node_type.A100.count", "from 0 to 1,000,000"]),
    "cluster-nested.toml": (SEARCH, ["nested too deeply"]),
    "cluster-nan-latency.toml": (SEARCH, ["node_type.A100.inter_node_latency_us", "got nan"]),
    "cluster-huge-latency.toml": (SEARCH, ["node_type.A100.intra_node_latency_us", "<= 1e+06"]),
    "cluster-inf-overhead.toml": (SEARCH, ["gpu_memory_overhead_gib", "got inf"]),
    "cluster-gpu-decreasing-busbw.toml": (SEARCH, ["gpu.A100.allreduce_busbw", "payloads increasing"]),
    "cluster-gpu-nan-busbw.toml": (SEARCH, ["gpu.A100.allreduce_busbw", "nan"]),
    "cluster-gpu-inf-fp8.toml": (SEARCH, ["gpu.A100.dense_fp8_tflops", "got inf"]),
    "cluster-gpu-fp8-without-efficiency.toml": (SEARCH, ["gpu.A100", "fp8_matmul_efficiency and compute_capability"]),
    "cluster-gpu-bad-capability.toml": (SEARCH, ["gpu.A100.compute_capability", "a compute capability such as 9.0"]),
    "model-unknown-fp8-recipe.toml": (SEARCH_MODEL, ["model.fp8_recipe", "'$(reboot)'"]),
    "model-huge-hidden-size.toml": (SEARCH_MODEL, ["model.hidden_size", "from 1 to 1,048,576"]),
    "model-huge-layers.toml": (SEARCH_MODEL, ["model.num_layers", "from 1 to 1,024"]),
    "profile-missing-column.csv": (SEARCH_PROFILE, ["line 5", "expected 5 cells", "got 4"]),
    "profile-extra-column.csv": (SEARCH_PROFILE, ["line 5", "expected 5 cells", "got 6"]),
    "profile-huge-time.csv": (SEARCH_PROFILE, ["line 5: forward_s", "<= 3600"]),
    "profile-nan-time.csv": (SEARCH_PROFILE, ["line 5: forward_s", "'nan'"]),
    "profile-huge-mbs.csv": (SEARCH_PROFILE, ["line 5: mbs", "from 1 to 65536"]),
    "profile-other-model.csv": (SEARCH_PROFILE, ["line 2: model", "made for model gpt2-xl, not bert",
                                                 "--allow-profile-mismatch"]),
    "profile-other-gpu.csv": (SEARCH_PROFILE, ["line 2: gpu", "made for gpu A10, not A100"]),
    "profile-unknown-precision.csv": (SEARCH_PROFILE, ["line 2", "precision one of fp16, bf16, fp32, fp8"]),
    "plan-nan-stage-time.json": (PLOT_PLAN, ["NaN is not a finite number"]),
    "plan-infinite-step-time.json": (PLOT_PLAN, ["entry 0", "step_time_s: expected a finite number, got inf"]),
    "plan-negative-stage-time.json": (PLOT_PLAN, ["plan 1: stages[0].p2p_s", "got -0.5"]),
    "plan-huge-tp.json": (EMIT, ["entry 0: tp", "from 1 to"]),
    "plan-nested.json": (EMIT, ["nested too deeply"]),
    "plan-unknown-recompute.json": (EMIT, ["entry 0: recompute", "'partial'"]),
    "plan-unknown-fp8-recipe.json": (EMIT, ["entry 0: fp8_recipe", "'$(reboot)'"]),
    "plan-huge-virtual-stages.json": (EMIT, ["entry 0: virtual_stages", "from 1 to"]),
    "measured-zero-step.csv": (VALIDATE, ["line 4: measured_step_s", "from 1e-06 to 1e+06", "'0'"]),
    "measured-denormal-step.csv": (CALIBRATE, ["line 4: measured_step_s", "'5e-324'"]),
    "measured-huge-step.csv": (VALIDATE, ["line 3: measured_step_s", "'1e300'"]),
    "measured-zero3-row.csv": (CALIBRATE, ["line 3: kind", "a zero3 plan's batch split is in its plan.json"]),
    "measured-unknown-recompute.csv": (VALIDATE, ["line 3: recompute", "'partial'"]),
}


def run_cli(args: list[str]):
    result = CliRunner().invoke(main, args)
    return result, result.stderr


def assert_one_line_error(result, stderr: str, *expected: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("Error: ") and "Traceback" not in stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def test_every_hostile_file_has_a_case():
    assert sorted(p.name for p in HOSTILE.iterdir() if p.is_file()) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input_is_one_line_and_exit_2(name, tmp_path):
    command, expected = CASES[name]
    case = HOSTILE / name
    out = tmp_path / "out"
    out.mkdir()
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    shutil.copy(case, profiles / "A100.csv")
    args = [a.format(case=case, out=out, valid=VALID_CLUSTER, profiles=profiles) for a in command]
    result, stderr = run_cli(args)
    line = assert_one_line_error(result, stderr, *expected)
    assert str(profiles / "A100.csv" if command is SEARCH_PROFILE else case) in line
    assert list(out.iterdir()) == []  # nothing written, not even a temporary file


def test_the_valid_inputs_of_the_corpus_pass(tmp_path):
    """The cases fail for what they break, not for something else."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    text = (HOSTILE / "profile-other-gpu.csv").read_text().replace("gpu=A10\n", "gpu=A100\n")
    (profiles / "A100.csv").write_text(text)
    result, _ = run_cli(["search", "--model", "bert", "--cluster", str(VALID_CLUSTER), "--profiles", str(profiles)])
    assert result.exit_code == 0, result.output


def test_the_measured_runs_of_the_corpus_pass_once_mended(tmp_path):
    """Each measured-runs case fails for its one broken cell: with that cell mended, validate runs."""
    mends = {"measured-zero-step.csv": (",0\n", ",0.9\n"), "measured-denormal-step.csv": (",5e-324", ",0.9"),
             "measured-huge-step.csv": (",1e300", ",0.9"), "measured-zero3-row.csv": (",zero3,", ",3d,"),
             "measured-unknown-recompute.csv": (",partial,", ",selective,")}
    assert sorted(mends) == sorted(name for name in CASES if name.startswith("measured-"))
    for name, (broken, mended) in mends.items():
        case = tmp_path / name
        case.write_text((HOSTILE / name).read_text().replace(broken, mended))
        shutil.copy(VALID_CLUSTER, tmp_path / "cluster.toml")
        case.write_text(case.read_text().replace("valid/cluster.toml", "cluster.toml"))
        result, _ = run_cli(["validate", "--measured", str(case)])
        assert result.exit_code == 0, (name, result.output)


def test_allow_profile_mismatch_uses_the_profile(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    shutil.copy(HOSTILE / "profile-other-model.csv", profiles / "A100.csv")
    args = ["search", "--model", "bert", "--cluster", str(VALID_CLUSTER), "--profiles", str(profiles)]
    assert run_cli(args)[0].exit_code == 2
    assert run_cli([*args, "--allow-profile-mismatch"])[0].exit_code == 0


@pytest.mark.parametrize("model, gpu", [(m, p.stem) for m in ("bert", "gpt2-xl", "llama2-7b", "t5")
                                        for p in sorted((bundled.data_dir("profiles") / m).glob("*.csv"))])
def test_bundled_profiles_name_their_model_and_gpu(model, gpu):
    text = (bundled.data_dir("profiles") / model / f"{gpu}.csv").read_text()
    assert re.search(rf"^# fasop-profile: model={model} gpu={gpu}( precision=(fp16|bf16))?$", text, re.MULTILINE)


# -- files that are not regular, or too large ------------------------------------------------------------------
def test_a_device_as_model_is_refused():
    result, stderr = run_cli(["search", "--model", "/dev/null", "--cluster", str(VALID_CLUSTER)])
    assert_one_line_error(result, stderr, "/dev/null", "not a regular file")


def test_a_fifo_as_cluster_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "cluster.toml"
    os.mkfifo(fifo)
    # a subprocess, so that a reader blocked on the FIFO fails the test instead of hanging it
    done = subprocess.run([sys.executable, "-m", "fasop", "search", "--model", "bert", "--cluster", str(fifo)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"Error: {fifo}: not a regular file"


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    huge = tmp_path / "model.toml"
    with open(huge, "wb") as handle:
        handle.truncate(64 * 2**20)  # sparse: no disk used
    result, stderr = run_cli(["search", "--model", str(huge), "--cluster", str(VALID_CLUSTER)])
    assert_one_line_error(result, stderr, str(huge), "larger than 1 MiB")


# -- outputs ---------------------------------------------------------------------------------------------------
@pytest.fixture
def inputs(tmp_path):
    """A cluster file and a profile folder of bert in tmp_path, and a plan list searched from them."""
    shutil.copy(VALID_CLUSTER, tmp_path / "cluster.toml")
    shutil.copytree(bundled.data_dir("profiles") / "bert", tmp_path / "profiles")
    result, _ = run_cli(["search", "--model", "bert", "--cluster", str(tmp_path / "cluster.toml"),
                         "--profiles", str(tmp_path / "profiles"), "--output", str(tmp_path / "plans.json")])
    assert result.exit_code == 0
    return tmp_path


def search_args(tmp_path, output):
    return ["search", "--model", "bert", "--cluster", str(tmp_path / "cluster.toml"), "--profiles",
            str(tmp_path / "profiles"), "--output", str(output)]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("link", ["same", "symlink", "hardlink", "dotted"])
def test_search_output_never_replaces_an_input(inputs, link):
    profile = inputs / "profiles" / "A100.csv"
    output = {"same": profile, "dotted": inputs / "profiles" / ".." / "profiles" / "A100.csv"}.get(link)
    if link == "symlink":
        output = inputs / "out.csv"
        output.symlink_to(profile)
    elif link == "hardlink":
        output = inputs / "out.csv"
        os.link(profile, output)
    before = snapshot(inputs)
    result, stderr = run_cli(search_args(inputs, output))
    assert_one_line_error(result, stderr, f"--output {output}", "is an input of this run")
    assert snapshot(inputs) == before


def test_search_output_may_not_be_the_cluster_file(inputs):
    before = snapshot(inputs)
    link = inputs / "plans-link.json"
    link.symlink_to(inputs / "cluster.toml")
    result, stderr = run_cli(search_args(inputs, link))
    assert_one_line_error(result, stderr, "is an input of this run")
    assert snapshot(inputs) == {**before, "plans-link.json": before["cluster.toml"]}


def test_emit_out_never_replaces_its_plan_file(inputs):
    plans = inputs / "plan.json"  # the name emit writes its plan copy under
    (inputs / "plans.json").rename(plans)
    before = plans.read_bytes()
    result, stderr = run_cli(["emit", "--smoke-test", "--plans", str(plans), "--out", str(inputs), "--force"])
    assert_one_line_error(result, stderr, f"--out {plans}", "is an input of this run")
    assert plans.read_bytes() == before
    assert not (inputs / "sbatch.sh").exists()


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_unwritable_outputs_are_one_line(inputs, where):
    """Every command that writes a file, and no output of a command left behind when another of its outputs
    cannot be written; /proc takes no new files, even from root."""
    folder = inputs / "cluster.toml" if where == "under a file" else Path("/proc")
    if not Path("/proc/self").is_dir() and where == "in /proc":
        pytest.skip("no /proc")
    (inputs / "runs.csv").write_text("model,cluster_file,gbs,mbs,tp,dp,pp,placement,layers_per_stage,measured_step_s\n"
                                     "bert,cluster.toml,32,1,1,8,1,A100 A100,24,0.75\n"
                                     "bert,cluster.toml,32,1,1,4,2,A100 A100,12 12,0.9\n")
    bert = ["--model", "bert", "--cluster", str(inputs / "cluster.toml"), "--profiles", str(inputs / "profiles")]
    measured = ["--measured", str(inputs / "runs.csv"), "--profiles", str(inputs / "profiles")]
    commands = [
        search_args(inputs, folder / "plans.json"),
        [*search_args(inputs, inputs / "fine.json"), "--emit", str(folder / "run"), "--smoke-test"],
        ["pareto", *bert, "--output", str(folder / "front.csv")],
        ["pareto", *bert, "--output", str(inputs / "front.csv"), "--chart", str(folder / "front.png")],
        ["plot", "--plan", str(inputs / "plans.json"), "--out", str(folder / "stages.svg")],
        ["plot", "--plan", str(inputs / "plans.json"), "--timeline", str(folder / "schedule.svg")],
        ["profile", "synth", "--model", "bert", "--gpu", "A100", "--out", str(folder / "A100.csv")],
        ["emit", "--smoke-test", "--plans", str(inputs / "plans.json"), "--out", str(folder / "run")],
        ["compare", *bert, "--output", str(inputs / "compare.csv"), "--plans-out", str(folder / "strategies.json")],
        ["compare", *bert, "--plans-out", str(inputs / "strategies.json"), "--chart", str(folder / "compare.png")],
        ["validate", *measured, "--chart", str(folder / "validate.png")],
        ["calibrate", *measured, "--out", str(folder / "calibrated.toml")],
        ["calibrate", *measured, "--out", str(inputs / "calibrated.toml"), "--profiles-out", str(folder / "profiles")],
    ]
    before = snapshot(inputs)
    for args in commands:
        result, stderr = run_cli(args)
        assert_one_line_error(result, stderr, str(folder))
        assert snapshot(inputs) == before, args


def test_search_writes_no_plan_list_when_emit_fails(inputs):
    """--output and --emit: the launch scripts cannot be made (the [launch] table is wrong), so no plans.json."""
    cluster = inputs / "cluster.toml"
    cluster.write_text(cluster.read_text() + '\n[launch]\nmegatron_flavor = "no-such-flavor"\n')
    result, stderr = run_cli([*search_args(inputs, inputs / "new.json"), "--emit", str(inputs / "run"), "--smoke-test"])
    assert_one_line_error(result, stderr, "megatron_flavor")
    assert not (inputs / "new.json").exists() and not (inputs / "run").exists()


def test_search_output_inside_the_emit_directory(inputs):
    run = inputs / "run"
    result, _ = run_cli([*search_args(inputs, run / "plans.json"), "--emit", str(run), "--smoke-test"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in run.iterdir()) == ["plan.json", "plans.json", "run_inter.sh", "sbatch.sh"]
    result, stderr = run_cli([*search_args(inputs, inputs / "other" / "plan.json"), "--emit", str(inputs / "other"),
                              "--smoke-test"])
    assert_one_line_error(result, stderr, "plan.json", "is also the output of --output")
    assert not (inputs / "other").exists()


def test_pareto_writes_no_front_file_when_the_chart_fails(inputs):
    result, stderr = run_cli(["pareto", "--model", "bert", "--cluster", str(inputs / "cluster.toml"), "--profiles",
                              str(inputs / "profiles"), "--output", str(inputs / "front.csv"),
                              "--chart", str(inputs / "plans.json" / "chart.png")])
    assert_one_line_error(result, stderr, "--chart")
    assert not (inputs / "front.csv").exists()


# -- non-finite numbers never reach an output file -----------------------------------------------------------
def test_non_finite_numbers_are_refused_and_nothing_is_left_behind(tmp_path):
    good = json.loads((HOSTILE / "plan-negative-stage-time.json").read_text())[0]
    bad = {**good, "rank": 2, "cost_per_hour_usd": float("inf")}  # written after a good plan: the file is streamed
    for suffix in (".json", ".csv"):
        output = tmp_path / f"plans{suffix}"
        with pytest.raises(InputError, match=r"cost_per_hour_usd is inf"):
            write_atomically(output, PlanFile([Plan.trusted(good), Plan.trusted(bad)], output).chunks())
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary one
    with pytest.raises(InputError, match=r"a\[1\]\.b is nan"):
        check_finite({"a": [1.0, {"b": float("nan")}]}, "x")
