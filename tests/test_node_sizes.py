"""Clusters whose node types hold different GPU counts per node (8-GPU H100 beside 4-GPU A10G nodes,
clusters/h100x8-a10gx4.toml): plans of one tp and dp run on node types of one size, stage-group plans on every
node, and their FlagScale files pass FlagScale's rules."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_emit_flagscale import hostfile_rows, mesh_nodes, read_yaml, schema_errors

from fasop.cli import main
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.search import estimate
from fasop.search.compare import compare
from fasop.search.engine import node_type_subsets, search_plans

CLUSTER = "h100x8-a10gx4"


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(CLUSTER)


def test_the_bundled_cluster_has_nodes_of_two_sizes(cluster):
    assert {n: (t.gpus_per_node, t.count) for n, t in cluster.node_types.items()} == {"H100": (8, 2), "A10G": (4, 4)}
    assert cluster.node_sizes == (4, 8) and cluster.num_gpus == 32
    with pytest.raises(InputError, match="h100x8-a10gx4: node_type.gpus_per_node: expected one GPU kind and count"):
        _ = cluster.gpus_per_node


def test_uniform_plans_are_searched_on_node_types_of_one_size(cluster):
    subsets = node_type_subsets(cluster)
    assert [sorted(sub.node_types) for sub in subsets] == [["A10G"], ["H100"]]  # most nodes first
    plans = search_plans(load_model("llama3-8b"), cluster, keep=20).plans
    assert plans and all(len(set(p.placement)) == 1 for p in plans)
    for plan in plans:
        gpus = cluster.node_types[plan.placement[0]].gpus_per_node
        assert plan.tp * (plan.cp or 1) * plan.dp * plan.pp == len(plan.placement) * gpus


def test_use_all_needs_stage_groups(cluster):
    with pytest.raises(ArgumentError, match="only stage-group plans can use every node"):
        search_plans(load_model("llama3-8b"), cluster, use_all=True)
    result = CliRunner().invoke(main, ["search", "--model", "llama3-8b", "--cluster", CLUSTER, "--use-all"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert lines == ["Error: --use-all: the nodes of h100x8-a10gx4 differ in GPU count or hold several GPU kinds: "
                     "only stage-group plans can use every node (--stage-groups)"]


def test_a_uniform_plan_is_estimated_on_one_size_and_refused_across_sizes(cluster):
    model = load_model("llama3-8b")
    plan = estimate(model, cluster, tp=8, dp=1, pp=2, mbs=1, placement=["H100", "H100"], layers_per_stage=[16, 16])
    assert plan.step_time_s > 0
    with pytest.raises(ArgumentError, match="its node types hold 4 and 8 GPUs per node"):
        estimate(model, cluster, tp=4, dp=1, pp=3, mbs=1, placement=["H100", "A10G"], layers_per_stage=[10, 11, 11])


def test_compare_refuses_in_one_line(cluster):
    with pytest.raises(InputError, match="expected one GPU kind and count per node"):
        compare(load_model("gpt2-xl"), cluster)


def test_stage_groups_plan_on_every_node_and_emit_for_flagscale(tmp_path):
    runner = CliRunner()
    plans = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "llama3-8b", "--cluster", CLUSTER, "--use-all",
                                  "--stage-groups", "--output", str(plans), "--top", "5"])
    assert result.exit_code == 0, result.output
    records = json.loads(plans.read_text())
    both = [r for r in records if r["kind"] == "stage-groups" and set(r["placement"]) == {"H100", "A10G"}]
    assert both, records
    record = both[0]
    out = tmp_path / "run"
    emitted = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--rank", str(record["rank"]),
                                   "--out", str(out), "--launcher", "manual"])
    assert emitted.exit_code == 0, emitted.output
    train = read_yaml((out / "train" / "fasop.yaml").read_text())
    rows = hostfile_rows((out / "hostfile").read_text())
    slots = [slots for _, slots, _ in rows]
    assert slots == [{"H100": 8, "A10G": 4}[name] for name in record["placement"]]
    model = load_model("llama3-8b")
    assert schema_errors(train, model, slots) == []
    # every mesh lands on the nodes of its stages
    meshes = mesh_nodes(train, rows)
    stage_nodes = [set(s["nodes"]) for s in record["stages"]]
    assert set().union(*meshes) == set(range(len(rows)))
    for mesh in meshes:
        assert any(mesh >= nodes for nodes in stage_nodes)
    envs = read_yaml((out / "flagscale.yaml").read_text())["experiment"]["envs"]["device_type_specific"]
    assert envs["A10G"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
