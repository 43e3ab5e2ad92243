"""Every command of `fasop`: its help text describes it and names each of its options (a group's, each of its
commands), and each command run with minimal valid arguments on the tiny inputs does what it says."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from collections.abc import Callable

import click
import pytest
import test_profile_links
from click.testing import CliRunner
from conftest import Tiny

from fasop.cli import main
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.inputs.profiles import read_profile, required_kinds
from fasop.search import estimate, search_plans


def all_commands(group: click.Group, path: tuple[str, ...] = ()):
    yield path, group
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from all_commands(command, path + (name,))
        else:
            yield path + (name,), command


COMMANDS = list(all_commands(main))
LEAVES = {path for path, command in COMMANDS if not isinstance(command, click.Group)}


def ok(result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result.stdout


def run(runner: CliRunner, *args) -> str:
    return ok(runner.invoke(main, [str(a) for a in args]))


def listed_options(help_text: str) -> set[str]:
    """The option names a help text lists: the lines that start with an option, up to its help column."""
    names = set()
    for line in help_text.splitlines():
        if re.match(r"^ {2}-", line):
            names.update(re.findall(r"(?:^|[\s,/])(-{1,2}[\w-]+)", re.split(r"\s{2,}", line.strip())[0]))
    return names


# -- help ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) or "fasop" for p, _ in COMMANDS])
def test_help_describes_the_command_and_names_every_option(runner, path, command):
    name = " ".join(path) or "fasop"
    text = run(runner, *path, "--help")
    flat = " ".join(text.split())
    description = (command.help or "").strip()
    assert description, f"{name} has no description"
    assert description.splitlines()[0].strip() in flat
    for param in command.params:
        if isinstance(param, click.Option):
            assert (param.help or "").strip(), f"option {param.opts} of {name} has no help"
            missing = set(param.opts + param.secondary_opts) - listed_options(text)
            assert not missing, f"{name} --help does not list {sorted(missing)}"
        else:
            assert param.make_metavar(click.Context(command)) in flat, f"{name} --help lacks {param.name}"
    if isinstance(command, click.Group):
        for sub in command.commands:
            assert re.search(rf"^\s+{sub}\s", text, re.M), f"{name} --help lacks its command {sub}"


# -- minimal runs ----------------------------------------------------------------------------------------
MINIMAL_RUNS: dict[tuple[str, ...], Callable[[CliRunner, Tiny], None]] = {}
# commands whose minimal run needs several processes: the test that starts them, in its module
RUN_ELSEWHERE = {("profile", "links"): (test_profile_links, "test_two_processes_on_one_node_write_the_intra_node_field")}


def minimal_run(*path: str):
    def register(check: Callable[[CliRunner, Tiny], None]):
        MINIMAL_RUNS[path] = check
        return check
    return register


def best_step_s(tiny: Tiny) -> float:
    model, cluster = load_model(str(tiny.model)), load_cluster(str(tiny.cluster))
    return search_plans(model, cluster, profiles_dir=str(tiny.profiles)).plans[0].step_time_s


@minimal_run("search")
def search_ranks_and_writes_every_plan(runner, tiny):
    out = tiny.root / "plans.json"
    stdout = run(runner, "search", *tiny.args("--top", 2, "--output", out))
    # 27 on both nodes, 22 on one node type alone (tests/test_idle_nodes.py checks the union)
    assert "49 plans evaluated" in stdout and "49 plans written" in stdout
    header = next(line for line in stdout.splitlines() if line.split()[:1] == ["rank"])
    rows = stdout.splitlines()[stdout.splitlines().index(header) + 1:][:2]
    assert [row.split()[0] for row in rows] == ["1", "2"]
    plans = json.loads(out.read_text())
    assert len(plans) == 49 and plans[0]["step_time_s"] == pytest.approx(best_step_s(tiny))


@minimal_run("estimate")
def estimate_breaks_down_one_plan(runner, tiny):
    stdout = run(runner, "estimate", *tiny.args("--tp", 1, "--dp", 2, "--pp", 1, "--mbs", 1, "--placement", "fast",
                                                "--layers", 4, "--json"))
    row = json.loads(stdout)
    expected = estimate(load_model(str(tiny.model)), load_cluster(str(tiny.cluster)), tp=1, dp=2, pp=1, mbs=1,
                        placement=["fast"], layers_per_stage=[4], profiles_dir=str(tiny.profiles))
    assert row["layers_per_stage"] == [4] and row["step_time_s"] == pytest.approx(expected.step_time_s)


@minimal_run("emit")
def emit_writes_the_launch_files_of_the_best_plan(runner, tiny):
    plans, out = tiny.root / "plans.json", tiny.root / "run"
    run(runner, "search", *tiny.args("--output", plans))
    stdout = run(runner, "emit", "--smoke-test", "--plans", plans, "--out", out, "--profiles", tiny.profiles)
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "run_inter.sh", "sbatch.sh"]
    assert stdout.split() == [str(out / name) for name in ("sbatch.sh", "run_inter.sh", "plan.json")]
    assert "#SBATCH" in (out / "sbatch.sh").read_text()
    assert json.loads((out / "plan.json").read_text())["step_time_s"] == pytest.approx(best_step_s(tiny))


@minimal_run("compare")
def compare_writes_one_row_per_strategy(runner, tiny):
    out = tiny.root / "compare.csv"
    run(runner, "compare", *tiny.args("--output", out))
    rows = {row["family"]: row for row in csv.DictReader(out.open())}
    assert {"DDP even", "DDP uneven", "3D (best)"} <= set(rows)
    assert float(rows["3D (best)"]["step_time_s"]) == pytest.approx(best_step_s(tiny))


@minimal_run("profile", "synth")
def profile_synth_writes_a_profile_that_loads(runner, tiny):
    out = tiny.root / "A100.csv"
    run(runner, "profile", "synth", "--model", tiny.model, "--gpu", "A100", "--tp", 1, "--mbs", 1, "--out", out)
    model = load_model(str(tiny.model))
    profile = read_profile(out, model, "A100")
    forward_s, backward_s = profile.time(1, "layer", 1)
    assert 0 < forward_s < backward_s


@minimal_run("profile", "layers")
def profile_layers_measures_every_unit(runner, tiny):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    out = tiny.root / "cpu.csv"
    run(runner, "profile", "layers", "--model", tiny.model, "--gpu", "cpu", "--device", "cpu", "--mbs", 1,
        "--repeat", 1, "--warmup", 0, "--out", out)
    model = load_model(str(tiny.model))
    profile = read_profile(out, model, "cpu")
    assert all(min(profile.time(1, kind, 1)) > 0 for kind in required_kinds(model))


@minimal_run("pareto")
def pareto_sweeps_every_composition(runner, tiny):
    out = tiny.root / "front.csv"
    stdout = run(runner, "pareto", *tiny.args("--output", out))
    rows = list(csv.DictReader(out.open()))
    assert sorted((row["nodes_fast"], row["nodes_slow"]) for row in rows) == [("0", "1"), ("1", "0"), ("1", "1")]
    assert "3 compositions swept" in stdout and any(row["on_front"] == "true" for row in rows)


@minimal_run("plot")
def plot_draws_a_front(runner, tiny):
    front, chart = tiny.root / "front.csv", tiny.root / "chart.png"
    run(runner, "pareto", *tiny.args("--output", front))
    stdout = run(runner, "plot", front, "--out", chart)
    assert "3 compositions" in stdout and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@minimal_run("report")
def report_writes_one_page(runner, tiny):
    plans, page = tiny.root / "plans.json", tiny.root / "report.html"
    run(runner, "search", *tiny.args("--output", plans))
    stdout = run(runner, "report", plans, "-o", page)
    assert "plans of plans.json written to" in stdout and page.read_text().startswith("<!DOCTYPE html>")


def runs_csv(tiny: Tiny, factor: float):
    """Two measured runs on the "fast" node, each `factor` times its estimate: data parallel and pipeline."""
    model, cluster = load_model(str(tiny.model)), load_cluster(str(tiny.cluster))
    lines = ["run,model_file,cluster_file,gbs,mbs,tp,dp,pp,placement,layers_per_stage,measured_step_s"]
    for name, dp, pp, layers in (("r1", 2, 1, [4]), ("r2", 1, 2, [2, 2])):
        step_s = estimate(model, cluster, tp=1, dp=dp, pp=pp, mbs=1, placement=["fast"], layers_per_stage=layers,
                          profiles_dir=str(tiny.profiles)).step_time_s
        lines.append(f"{name},model.toml,cluster.toml,8,1,1,{dp},{pp},fast,{' '.join(map(str, layers))},"
                     f"{step_s * factor!r}")
    path = tiny.root / "runs.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@minimal_run("validate")
def validate_scores_the_estimates(runner, tiny):
    stdout = run(runner, "validate", "--measured", runs_csv(tiny, 1.25), "--profiles", tiny.profiles)
    assert stdout.count("-20.0%") == 2 and "MAPE 20.0% over 2 runs" in stdout


@minimal_run("calibrate")
def calibrate_fits_the_factors_and_writes_a_cluster(runner, tiny):
    out = tiny.root / "calibrated.toml"
    stdout = run(runner, "calibrate", "--measured", runs_csv(tiny, 1.25), "--profiles", tiny.profiles, "--out", out)
    # every time 1.25x: the fast GPUs' compute and the links inside a node both 1.25x slower
    assert re.search(r"compute_time_scale\.fast\s+1\.2500", stdout) and "0.0% after" in stdout
    derating = load_cluster(str(out)).derating
    assert derating.p2p_intra_node == pytest.approx(1.25, rel=1e-4) and derating.p2p_inter_node == 1.0


def test_every_command_has_a_minimal_run():
    assert set(MINIMAL_RUNS) | set(RUN_ELSEWHERE) == LEAVES and not set(MINIMAL_RUNS) & set(RUN_ELSEWHERE)
    for module, name in RUN_ELSEWHERE.values():
        assert callable(getattr(module, name))


@pytest.mark.parametrize("path", sorted(MINIMAL_RUNS), ids=[" ".join(p) for p in sorted(MINIMAL_RUNS)])
def test_minimal_run(runner, tiny, path):
    MINIMAL_RUNS[path](runner, tiny())
