"""The Python API of the commands: fasop.pareto, fasop.compare and fasop.emit give what `fasop pareto`, `fasop compare`
and `fasop emit` print and write, on the same inputs; bad arguments are named as Python names them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from contextlib import nullcontext

import pytest
from click.testing import CliRunner

import fasop
from fasop.cli import main
from fasop.errors import ArgumentError, InputError
from fasop.market.frontfile import read_front_csv
from fasop.plans import load_plans
from fasop.search.compare import as_csv, plan_list, table

FLAG = re.compile(r"--[A-Za-z]")


def run(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def inputs(files):
    """The model and cluster of a `tiny` set of files, and its profiles folder as the API takes it."""
    return fasop.load_model(str(files.model)), fasop.load_cluster(str(files.cluster)), str(files.profiles)


@pytest.fixture
def starved(tiny):
    """Tiny inputs whose slow GPUs hold too little memory for any plan alone: a sweep with an infeasible row."""
    return tiny(nodes={"slow": {"gpu_memory_gib": 0.002}})


def test_pareto_is_the_front_the_command_writes(starved):
    front = starved.root / "front.csv"
    stdout = run("pareto", *starved.args("--train-steps", 100, "--deadline", 0.01, "--output", front))
    model, cluster, profiles = inputs(starved)
    frame = fasop.pareto(model, cluster, train_steps=100, deadline_hours=0.01, profiles_dir=profiles)
    # missing values (<NA>, NaN) as the front file's empty cells read back
    rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
    assert rows == read_front_csv(front)
    assert [row["feasible"] for row in rows] == [False, True, True]
    assert frame["mbs"].dtype == "Int64" and frame["nodes_fast"].tolist() == [0, 1, 1]
    assert frame.attrs["choice"].startswith("cheapest within the deadline") and frame.attrs["choice"] in stdout
    chosen = rows[frame.attrs["chosen"]]
    assert f"{chosen['train_hours']:,.2f} h, ${chosen['train_cost_usd']:,.2f}" in frame.attrs["choice"]


def test_pareto_caps_the_node_counts(tiny):
    model, cluster, profiles = inputs(tiny())
    frame = fasop.pareto(model, cluster, max_nodes={"slow": 0}, profiles_dir=profiles)
    assert frame[["nodes_fast", "nodes_slow"]].values.tolist() == [[1, 0]]
    assert frame.attrs == {"chosen": None, "choice": ""}


def test_compare_is_what_the_command_prints_and_writes(tiny):
    files = tiny()
    comparison, strategies = files.root / "compare.csv", files.root / "strategies.json"
    stdout = run("compare", *files.args("--gbs", 4, "--output", comparison, "--plans-out", strategies))
    model, cluster, profiles = inputs(files)
    families = fasop.compare(model, cluster, gbs=4, profiles_dir=profiles)
    assert table(families) in stdout
    assert as_csv(families) == comparison.read_text()
    assert [plan.record() for plan in plan_list(families)] == [plan.record() for plan in load_plans(strategies)]
    assert any(family.plan is not None and family.plan.is_data_parallel for family in families)


# -- emit ----------------------------------------------------------------------------------------------------
# per-type partitions that a plain partition replaces, and site defaults that the options override
LAUNCH_TABLE = '\n[launch]\npartition = { fast = "a100q", slow = "a10q" }\ntime_limit = "00:30:00"\nmaster_port = 6123\n'
SITE = {"time_limit": "02:00:00", "partition": "gpu", "gres_types": {"slow": "t4"}, "extra_flags": "--log-interval 1"}
SITE_OPTIONS = ["--time-limit", "02:00:00", "--partition", "gpu", "--gres-type", "slow=t4",
                "--extra-flags", "--log-interval 1"]


@pytest.mark.parametrize("command, output, rank, options, site", [
    ("search", "--output", 2, SITE_OPTIONS, SITE),
    ("search", "--output", 1, ["--launcher", "ssh", "--rendezvous", "file", "--rendezvous-file", "/shared/rdzv"],
     {"launcher": "ssh", "rendezvous": "file", "rendezvous_file": "/shared/rdzv"}),
    ("compare", "--plans-out", 1, SITE_OPTIONS, SITE),  # the fastest strategy splits the batch unevenly
], ids=["3D plan, Slurm", "3D plan, ssh", "data-parallel plan"])
def test_emit_writes_what_the_command_writes(tiny, command, output, rank, options, site):
    files = tiny(cluster_extra=LAUNCH_TABLE)
    plans = files.root / "plans.json"
    run(command, *files.args(output, plans))
    printed = run("emit", "--smoke-test", "--plans", plans, "--rank", rank, "--out", files.root / "cli", *options)
    model, cluster, _ = inputs(files)
    plan = load_plans(plans)[rank - 1]
    # the profiles the plan names; a 3D plan's run notes reach the caller as a warning, as the command prints them
    with pytest.warns(UserWarning, match="smoke test: 50 iterations") if command == "search" else nullcontext():
        written = fasop.emit(plan, model, cluster, files.root / "api", smoke_test=True, **site)
    assert printed.splitlines()[:len(written)] == [str(files.root / "cli" / path.name) for path in written]
    for path in written:
        assert path.read_bytes() == (files.root / "cli" / path.name).read_bytes(), path.name
    assert plan.is_data_parallel == (command == "compare")
    if site is SITE:  # a plain partition names every node type, over the table's; the table's port stays
        sbatch = (files.root / "api" / "sbatch.sh").read_text()
        assert sbatch.count("#SBATCH --partition=gpu\n") == sbatch.count("#SBATCH --nodes=") == 2
        assert "#SBATCH --gres=gpu:t4:2" in sbatch and "#SBATCH --time=02:00:00" in sbatch
        assert "MASTER_PORT:-6123" in sbatch


def test_emit_refuses_a_stale_plan_unless_forced(tiny):
    files = tiny()
    plans = files.root / "plans.json"
    run("search", *files.args("--output", plans))
    model, cluster, _ = inputs(files)
    plan = load_plans(plans)[0]
    stale = plan.model_copy(update={"step_time_s": plan.step_time_s / 2})
    with pytest.raises(InputError, match="stale plan: step_time_s") as refused:
        fasop.emit(stale, model, cluster, files.root / "run")
    assert refused.value.remedy == "force" and not (files.root / "run").exists()
    with pytest.warns(UserWarning) as warned:
        fasop.emit(stale, model, cluster, files.root / "run", force=True, smoke_test=True)
    notes = [str(w.message) for w in warned]
    assert any(re.search(r"stale plan.*\(forced\)", note) for note in notes) and any("smoke test" in n for n in notes)
    assert json.loads((files.root / "run" / "plan.json").read_text())["step_time_s"] == pytest.approx(plan.step_time_s,
                                                                                                   rel=1e-9)


# -- errors name the arguments -------------------------------------------------------------------------------
@pytest.fixture
def api(tiny):
    """(model, cluster, the best plan of a search, a file) of tiny inputs."""
    files = tiny()
    model, cluster, profiles = inputs(files)
    return model, cluster, fasop.search_plans(model, cluster, profiles_dir=profiles).plans[0], files.model


@pytest.mark.parametrize("call, argument", [
    (lambda model, cluster, plan, file: fasop.pareto(model, cluster, max_nodes={"H100": 1}), "max_nodes"),
    (lambda model, cluster, plan, file: fasop.pareto(model, cluster, budget_usd=100), "budget_usd"),
    (lambda model, cluster, plan, file: fasop.pareto(model, cluster, deadline_hours=-1, train_steps=10), "deadline_hours"),
    (lambda model, cluster, plan, file: fasop.compare(model, cluster, gbs=0), "gbs"),
    (lambda model, cluster, plan, file: fasop.emit(plan, model, cluster, file), "out_dir"),
    (lambda model, cluster, plan, file: fasop.emit(plan, model, cluster, file.parent / "run", launcher="pbs"), "launcher"),
])
def test_a_bad_argument_is_named(api, call, argument):
    with pytest.raises(ArgumentError) as caught:
        call(*api)
    assert caught.value.argument == argument and str(caught.value).startswith(argument)
    assert not FLAG.search(str(caught.value)), str(caught.value)


def test_emit_never_replaces_an_input(tiny):
    files = tiny()
    model, cluster, profiles = inputs(files)
    plan = fasop.search_plans(model, cluster, profiles_dir=profiles).plans[0]
    plans = files.root / "plan.json"  # the name of emit's copy of the plan
    plans.write_text("[]")
    with pytest.raises(ArgumentError, match="is an input of this run") as caught:
        fasop.emit(plan, model, cluster, files.root, force=True, inputs=[plans], smoke_test=True)
    assert caught.value.argument == "out_dir" and caught.value.value == plans and plans.read_text() == "[]"


def test_importing_fasop_loads_none_of_it():
    """The command line imports fasop on every start: pandas, charts, torch, the integer programs' solver, the
    sweep and the launch scripts load when first used."""
    code = ("import sys, fasop; print(sorted(m for m in sys.modules if m.split('.')[0] in ('pandas', 'matplotlib', "
            "'torch', 'pulp', 'highspy') or m.startswith(('fasop.launch', 'fasop.market', 'fasop.search.compare', "
            "'fasop.search.stageilp', 'scipy.optimize'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    from fasop.launch.write import emit
    from fasop.market.choice import pareto
    from fasop.search.compare import compare

    assert (fasop.emit, fasop.pareto, fasop.compare) == (emit, pareto, compare)
    assert set(fasop.__all__) >= {"emit", "pareto", "compare"}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        fasop.nothing  # noqa: B018
