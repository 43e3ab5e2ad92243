"""Names that reach launch scripts: checked where the files are read, and quoted in the scripts whatever they hold.

The scripts are also built from objects made through the Python API, which skips the loaders' checks, with
names that carry shell syntax; bash then runs them (with stand-ins for srun, scontrol and torchrun) and no
hidden command may run.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from test_emit import SMOKE, fake_torchrun, make_plan, megatron_args, write_cluster

from fasop.cli import main
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.options import LaunchOptions, launch_options
from fasop.launch.write import render_plan
from fasop.market.frontfile import read_front_csv, write_front_csv
from fasop.market.pareto import sweep
from fasop.plans import Plan

# Each piece would create a file named PWNED* if a shell ran the text instead of reading it as data.
PAYLOAD = "x\ntouch PWNED_NEWLINE\n$(touch PWNED_SUBST)`touch PWNED_BACKQUOTE`';touch PWNED_SQ;'\";touch PWNED_DQ;#"
PAYLOADS = [PAYLOAD, "x\ntouch PWNED_NEWLINE\n", "$(touch PWNED_SUBST)"]


# -- names, where the files are read ------------------------------------------------------------------------

BAD_NAMES = ["a b", "a$(touch x)", "a`id`", "a'b", 'a"b', "a\nb", "a\n", "a;b", "a/b", "-a", ".a", "a" * 65, "é"]
GOOD_NAMES = ["A100-80GB", "p4d.24xlarge", "a+b_c", "9x", "a" * 64]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_the_loaders_refuse_names_outside_the_documented_set(tiny, name):
    inputs = tiny(model={"name": name})
    with pytest.raises(InputError, match=r"model\.toml: model\.name: expected a name of 1 to 64 letters"):
        load_model(str(inputs.model))
    inputs = tiny("cluster-name", cluster={"name": name})
    with pytest.raises(InputError, match=r"cluster\.toml: cluster\.name: expected a name"):
        load_cluster(str(inputs.cluster))
    inputs = tiny("node-name", nodes={"slow": {"name": name}})
    with pytest.raises(InputError, match=r"cluster\.toml: node_type\[1\]\.name: expected a name"):
        load_cluster(str(inputs.cluster))
    inputs = tiny("gpu-name", nodes={"slow": {"gpu": name}})
    with pytest.raises(InputError, match=r"cluster\.toml: node_type\.slow\.gpu: expected a name"):
        load_cluster(str(inputs.cluster))


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_the_loaders_accept_every_name_in_the_set(tiny, name):
    inputs = tiny(model={"name": name}, cluster={"name": name}, nodes={"slow": {"name": name}})
    assert load_model(str(inputs.model)).name == name
    cluster = load_cluster(str(inputs.cluster))
    assert cluster.name == name and name in cluster.node_types


def test_a_bad_name_is_one_line_on_the_command_line(tiny, runner):
    inputs = tiny(nodes={"slow": {"name": "slow\n$(touch PWNED)"}})
    result = runner.invoke(main, ["search", *inputs.args()])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "node_type[1].name" in lines[0] and "letters, digits" in lines[0]


# -- names in CSV files -------------------------------------------------------------------------------------


def test_node_type_names_with_dashes_survive_the_plan_csv(tiny, runner):
    inputs = tiny(nodes={"fast": {"name": "fast-1.x"}, "slow": {"name": "slow-2"}})
    for suffix in ("json", "csv"):
        result = runner.invoke(main, ["search", *inputs.args("--output", str(inputs.root / f"plans.{suffix}"))])
        assert result.exit_code == 0, result.stderr
    plans = json.loads((inputs.root / "plans.json").read_text())
    with open(inputs.root / "plans.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(plans) and any(len(set(p["placement"])) == 2 for p in plans)
    for row, plan in zip(rows, plans):
        assert row["placement"].split(" ") == plan["placement"]
        assert [int(n) for n in row["layers_per_stage"].split(" ")] == plan["layers_per_stage"]


def test_node_type_names_with_dashes_survive_the_front_csv(tiny):
    inputs = tiny(nodes={"fast": {"name": "fast-1.x"}, "slow": {"name": "slow-2"}})
    records = sweep(load_model(str(inputs.model)), load_cluster(str(inputs.cluster)),
                    profiles_dir=str(inputs.profiles), train_steps=100)
    assert {"fast-1.x", "slow-2"} <= {name for r in records for name in r["placement"] or []}
    path = inputs.root / "front.csv"
    write_front_csv(records, path)
    assert read_front_csv(path) == records


# -- the scripts, whatever the names hold -------------------------------------------------------------------


def hostile_inputs(tmp_path: Path, payload: str = PAYLOAD):
    """gpt2-xl on the mixed cluster of test_emit, every name carrying `payload` (a plan's rank is an integer)."""
    cluster = load_cluster(str(write_cluster(tmp_path)))
    renamed = {old: f"{old}{payload}" for old in cluster.node_types}
    types = {renamed[old]: replace(t, name=renamed[old], gpu=f"{t.gpu}{payload}", gres_type=None)
             for old, t in cluster.node_types.items()}
    cluster = replace(cluster, name=f"c{payload}", node_types=types)
    model = replace(load_model("gpt2-xl"), name=f"m{payload}")
    plan = make_plan()  # a record made in Python: a plan file with these names is refused when read
    return Plan.trusted({**plan, "placement": [renamed[n] for n in plan["placement"]]}), model, cluster


def stub_commands(directory: Path) -> dict[str, str]:
    """An environment whose srun runs its command as task 0, whose scontrol knows one node, and whose
    torchrun writes its arguments to $ARGS_OUT."""
    bin_dir = fake_torchrun(directory)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nif [[ $1 == show ]]; then echo node1; '
                                      'else echo "NodeName=node1 NodeAddr=10.0.0.1 State=IDLE"; fi\n')
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                                  'SLURM_PROCID=0 exec "$@"\n')
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGS_OUT": str(directory / "args"),
            "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NODELIST_HET_GROUP_0": "node1"}


@pytest.mark.parametrize("payload", PAYLOADS)
def test_names_with_shell_syntax_run_no_command(tmp_path, payload):
    plan, model, cluster = hostile_inputs(tmp_path, payload)
    files = render_plan(plan, model, cluster, SMOKE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("sbatch.sh", "run_inter.sh"):
        (run_dir / name).write_text(files[name])
        check = subprocess.run(["bash", "-n", name], cwd=run_dir, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    env = {**stub_commands(tmp_path),  # the GPU name on one line (each line is one GPU)
           "FASOP_GPU_NAME": cluster.node_types[plan.placement[0]].gpu.replace("\n", " ")}
    result = subprocess.run(["bash", "sbatch.sh"], cwd=run_dir, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.rglob("PWNED*")) == []
    assert f"(plan: small{payload})" in result.stdout  # the name reaches the log as text
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.1"
    assert argv[11:] == megatron_args(files["run_inter.sh"])


def test_names_cannot_end_the_sbatch_directives(tmp_path):
    plan, model, cluster = hostile_inputs(tmp_path)
    sbatch = render_plan(plan, model, cluster, SMOKE)["sbatch.sh"].splitlines()
    plain_plan = Plan.model_validate(make_plan())
    plain = render_plan(plain_plan, load_model("gpt2-xl"), load_cluster(str(tmp_path / "mixed.toml")), SMOKE)["sbatch.sh"]
    last = max(i for i, line in enumerate(sbatch) if line.startswith("#SBATCH"))
    # sbatch reads directives up to the first line that is not a comment
    assert all(line.startswith("#") for line in sbatch[:last + 1])
    directives = [line for line in sbatch if line.startswith("#SBATCH")]
    assert len(directives) == plain.count("\n#SBATCH")
    assert all(line.isprintable() for line in sbatch)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_with_hostile_names_pass_shellcheck(tmp_path):
    full_run = LaunchOptions(train_iters=100, data_path="/data/$(id) x", tokenizer_type="GPT2BPETokenizer",
                             vocab_file="/v`id`", checkpoint_dir="ckpt $(id) 'dir'", training={"lr": "1e-4"})
    files = render_plan(*hostile_inputs(tmp_path), full_run)
    for name in ("sbatch.sh", "run_inter.sh"):
        path = tmp_path / name
        path.write_text(files[name])
        result = subprocess.run(["shellcheck", "--severity=style", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("options, field", [
    (dict(time_limit="01:00:00\n"), "time.limit"),  # "--time-limit" on the command line
    (dict(job_name="job\n"), "job.name"),
    (dict(account="acct\n"), "account"),
    (dict(partition="gpu\n"), "partition"),
    (dict(gres_types={"big": "h100\n"}), "gres.types: big"),
    (dict(time_limit="\u0661:00"), "time.limit"),  # an Arabic-Indic digit is a digit to \d, not to Slurm
])
def test_slurm_values_with_a_trailing_newline_are_refused(tmp_path, options, field):
    cluster = load_cluster(str(write_cluster(tmp_path)))
    with pytest.raises(InputError, match=field):
        render_plan(Plan.model_validate(make_plan()), load_model("gpt2-xl"), cluster, LaunchOptions(smoke_test=True, **options))
    with pytest.raises(InputError, match=field):
        launch_options({}, **options)


@pytest.mark.parametrize("field, value", [("slurm_partition", "gpu\n"), ("gres_type", "h100\n")])
def test_node_type_slurm_values_with_a_trailing_newline_are_refused(tmp_path, field, value):
    cluster = load_cluster(str(write_cluster(tmp_path)))
    types = {n: replace(t, **{field: value}) for n, t in cluster.node_types.items()}
    with pytest.raises(InputError, match=field):
        render_plan(Plan.model_validate(make_plan()), load_model("gpt2-xl"), replace(cluster, node_types=types), SMOKE)


def test_gpus_per_node_must_be_an_integer(tmp_path):
    cluster = load_cluster(str(write_cluster(tmp_path)))
    types = {n: replace(t, gpus_per_node=2.0) for n, t in cluster.node_types.items()}
    with pytest.raises(InputError, match="gpus_per_node"):
        render_plan(Plan.model_validate(make_plan()), load_model("gpt2-xl"), replace(cluster, node_types=types), SMOKE)
