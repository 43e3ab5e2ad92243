"""The search over stage-group plans: its integer programs against exhaustive enumeration on the bundled clusters,
its plans against a fresh estimate, and `fasop search --stage-groups`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fasop.cli import main
from fasop.inputs import bundled
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.plans import read_plan_file
from fasop.search.groupsearch import lower_bound_s, option_degrees, search_stage_groups, stage_options
from fasop.search.space import prepare
from fasop.search.stagegroups import estimate_stage_groups, spec_of_stage_groups
from fasop.search.stageilp import brute_force, objective, solve_stage_ilp


@pytest.fixture(scope="module")
def small():
    """gpt2-xl on one A100 and three A10 nodes of 4 GPUs: small enough to enumerate every assignment."""
    return prepare(load_model("gpt2-xl"), load_cluster("fasop-1xA100-3xA10"))


def _capacity(inputs):
    return {name: node.count for name, node in inputs.cluster.node_types.items()}


@pytest.mark.parametrize("pp,batch,mode", [(2, 4, "none"), (2, 8, "full"), (3, 4, "none"), (4, 16, "none")])
def test_the_program_finds_the_exhaustive_optimum(small, pp, batch, mode):
    options = stage_options(small, pp, batch, mode)
    assert options is not None
    m = small.gbs // batch
    args = (options, small.model.num_layers, m, _capacity(small))
    exhaustive = brute_force(*args, same_degrees_first_last=small.model.tie_embeddings)
    found = solve_stage_ilp(*args, same_degrees_first_last=small.model.tie_embeddings)
    assert (exhaustive is None) == (found is None)
    if found is not None and exhaustive is not None:
        assert found.objective_s == pytest.approx(exhaustive.objective_s, rel=1e-9)
        # the optimum itself; its proof may stop within the solver's relative gap (solve_stage_ilp's gap_rel)
        assert found.status == "optimal" and 0.0 <= found.gap <= 1e-4
        assert lower_bound_s(options, small.model.num_layers, m) <= found.objective_s * (1 + 1e-12)


def test_options_fill_whole_nodes_and_split_the_micro_batch(small):
    for name, tp, dp in option_degrees(small, 8):
        node = small.cluster.node_types[name]
        assert (tp * dp) % node.gpus_per_node == 0 and tp * dp // node.gpus_per_node <= node.count
        assert 8 % dp == 0 and node.gpus_per_node % tp == 0


def test_the_programs_objective_is_the_closed_form_of_a_uniform_plan(small):
    """An assignment of one option everywhere is a uniform plan: the program's objective of it is the closed form
    the estimate reports for that plan, its sends included."""
    options = stage_options(small, 2, 8, "none")
    j = next(j for j in range(len(options.tp)) if options.node_type[j] == "A10" and options.nodes[j] == 1)
    layers = (24, 24)
    value = objective(options, small.gbs // 8, (j, j), layers)
    from fasop.search.estimate import estimate

    tp, dp = int(options.tp[j]), int(options.dp[j])
    plan = estimate(small.model, small.cluster, tp=tp, dp=dp, pp=2, mbs=8 // dp, placement=["A10", "A10"],
                    layers_per_stage=list(layers))
    assert value == pytest.approx(plan.closed_form_step_s, rel=1e-9)


def test_search_returns_fitting_plans_that_estimate_afresh_to_their_figures(small):
    rows = search_stage_groups(small)
    assert rows
    for row in rows[:3]:
        assert row["kind"] == "stage-groups" and row["placement_search"] == "ilp"
        assert 0.0 <= row["optimality_gap"] <= 1.0
        assert sum(row["layers_per_stage"]) == small.model.num_layers
        from fasop.plans import Plan

        plan = Plan.model_validate(row)
        fresh = estimate_stage_groups(small.model, small.cluster, spec_of_stage_groups(plan, small.model, small.cluster))
        assert fresh.step_time_s == pytest.approx(row["step_time_s"], rel=1e-12)
        assert fresh.fits_memory


def test_an_upper_bound_no_plan_can_beat_returns_nothing(small):
    assert search_stage_groups(small, upper_bound_s=1e-6) == []


def test_cli_search_stage_groups_writes_plans_that_estimate(tmp_path):
    runner = CliRunner()
    out = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10", "--use-all",
                                  "--stage-groups", "--output", str(out), "--top", "50"])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    kinds = {r["kind"] for r in records}
    assert kinds <= {"3d", "stage-groups"}
    groups = [r for r in records if r["kind"] == "stage-groups"]
    for record in groups:  # every stage-group plan the command ranks beats the best uniform plan's closed form
        assert record["closed_form_step_s"] < min(r["closed_form_step_s"] for r in records if r["kind"] == "3d")
    if groups:
        rank = groups[0]["rank"]
        plan = read_plan_file(out, rank)
        assert plan.is_stage_groups
        estimated = runner.invoke(main, ["estimate", "--plan", str(out), "--rank", str(rank), "--json"])
        assert estimated.exit_code == 0, estimated.output
        assert json.loads(estimated.output)["step_time_s"] == pytest.approx(groups[0]["step_time_s"], rel=1e-12)


def test_cli_search_help_names_stage_groups():
    result = CliRunner().invoke(main, ["search", "--help"])
    assert result.exit_code == 0 and "--stage-groups" in result.output


def test_stage_groups_give_the_slow_gpus_work_where_they_pay(small):
    """On the A100 + 3 A10 cluster with gpt2-xl, the best stage-group plan gives every stage layers and uses the
    A10 nodes."""
    rows = sorted(search_stage_groups(small), key=lambda r: r["step_time_s"])
    best = rows[0]
    assert all(stage["layers"] >= 1 for stage in best["stages"])
    assert "A10" in best["placement"]
    assert np.isfinite(best["step_time_s"])


BUNDLED_CLUSTERS = sorted(path.stem for path in bundled.data_dir("clusters").glob("*.toml"))


@pytest.mark.parametrize("cluster_name", BUNDLED_CLUSTERS)
def test_the_program_finds_the_exhaustive_optimum_on_every_bundled_cluster(cluster_name):
    """Two-stage programs, where enumerating every pair of options and every layer split runs on any bundled
    cluster: the program's optimum is the enumeration's, at the largest and the smallest micro-batch that has
    options, with and without recomputation."""
    inputs = prepare(load_model("llama2-7b"), load_cluster(cluster_name))
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if inputs.gbs % b == 0
               and stage_options(inputs, 2, b, "none") is not None]
    assert batches, "no micro-batch has options"
    for batch, mode in ((batches[0], "none"), (batches[-1], "none"), (batches[-1], "full")):
        options = stage_options(inputs, 2, batch, mode)
        args = (options, inputs.model.num_layers, inputs.gbs // batch, _capacity(inputs))
        exhaustive = brute_force(*args, same_degrees_first_last=inputs.model.tie_embeddings)
        found = solve_stage_ilp(*args, same_degrees_first_last=inputs.model.tie_embeddings)
        assert (exhaustive is None) == (found is None), (batch, mode)
        if found is not None and exhaustive is not None:
            assert found.objective_s == pytest.approx(exhaustive.objective_s, rel=1e-9), (batch, mode)
            assert found.status == "optimal"
