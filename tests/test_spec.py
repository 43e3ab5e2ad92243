"""The plan specification (fasop.search.spec): one check for the API, plan files and launching; the options it
derives; and `fasop estimate --plan`, which estimates a plan file's plan with the inputs it names."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_cli_search import assert_input_error, invoke, ok

from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.write import render_plan
from fasop.plans import Plan, load_plans
from fasop.search import estimate, plan_spec
from fasop.search.spec import spec_of

GPT2_PLAN = dict(tp=1, dp=8, pp=4, mbs=1, placement=["A10"] * 8, layers_per_stage=[11, 13, 13, 11])


@pytest.fixture(scope="module")
def gpt2():
    return load_model("gpt2-xl"), load_cluster("fasop-8xA10")


def test_defaults_are_derived_once(gpt2):
    spec = plan_spec(*gpt2, **GPT2_PLAN)
    assert (spec.gbs, spec.encoder_stages, spec.gpus_per_node) == (gpt2[0].global_batch_size, 0, 4)
    assert spec.overlap_grad_reduce and spec.overlap_param_gather  # both overlapped with the distributed optimizer
    assert not spec.sequence_parallel  # tp = 1
    assert not plan_spec(*gpt2, **GPT2_PLAN, distributed_optimizer=False).overlap_param_gather
    assert not plan_spec(*gpt2, **GPT2_PLAN, overlap_grad_reduce=False).overlap_param_gather
    assert not plan_spec(*gpt2, **GPT2_PLAN, overlap_param_gather=False).overlap_param_gather
    assert plan_spec(*gpt2, **{**GPT2_PLAN, "tp": 2, "dp": 4}).sequence_parallel
    full = plan_spec(*gpt2, **GPT2_PLAN, recompute="full")
    assert (full.recompute_method, full.recompute_num_layers) == ("uniform", 1)
    interleaved = plan_spec(*gpt2, **{**GPT2_PLAN, "gbs": 32}, virtual_stages=2)
    assert interleaved.layers_per_virtual_stage == (6, 7, 7, 6, 5, 6, 6, 5)  # chunk-major, first chunks one more


@pytest.mark.parametrize("change, field, words", [
    ({"tp": 3, "dp": 1}, "tp", "divisor of the 4 GPUs per node"),
    ({"dp": 4}, "placement", "tp x cp x dp x pp = 16 GPUs"),
    ({"placement": ["A10"] * 7 + ["H100"]}, "placement", "node type H100 is not in cluster"),
    ({"placement": ["A10"] * 9, "dp": 9, "pp": 4, "tp": 1}, "placement", "uses 9 nodes of type A10"),
    ({"mbs": 3}, "mbs", "dp x mbs = 24 must divide"),
    ({"layers_per_stage": [12, 12, 12, 11]}, "layers_per_stage", "summing to 48 layers"),
    ({"layers_per_stage": [0, 24, 0, 24], "recompute": "full", "recompute_method": "block",
      "recompute_num_layers": 2}, "layers_per_stage", "at least the 2 layers"),
    ({"recompute": "selective", "recompute_num_layers": 2}, "recompute", "takes no method and no layer count"),
    ({"sequence_parallel": True}, "sequence_parallel", "needs tensor parallelism"),
    ({"virtual_stages": 2, "gbs": 16}, "virtual_stages", "micro-batch group size"),
    ({"layers_per_virtual_stage": [6] * 8}, "layers_per_virtual_stage", "virtual_stages is 1"),
    ({"encoder_stages": 1}, "encoder_stages", "expected 0"),
])
def test_every_caller_gets_the_same_check(gpt2, change, field, words):
    """The API names the argument; a plan file names its file and field; launching a plan checks it the same way."""
    fields = {**GPT2_PLAN, **change}
    with pytest.raises(ArgumentError, match=words) as api:
        plan_spec(*gpt2, **fields)
    assert api.value.argument == field
    # a record made in Python: the plan schema refuses some of these before the check, when a file is read
    plan = Plan.trusted({"rank": 1, "gbs": gpt2[0].global_batch_size, **fields})
    with pytest.raises(InputError, match=words) as from_file:
        spec_of(plan, *gpt2, where="plans.json: plan 1")
    assert from_file.value.where == f"plans.json: plan 1: {field}"
    with pytest.raises(InputError, match=words):
        render_plan(plan, *gpt2)


def test_a_searched_plan_specifies_itself(gpt2):
    """Every plan the search returns passes the check and re-estimates to its own figures."""
    from fasop.search import search_plans

    model, cluster = gpt2
    plans = search_plans(model, cluster.with_counts({"A10": 2}), gbs=16).plans[:20]
    assert plans
    for plan in plans:
        spec = spec_of(plan, model, cluster)
        assert (spec.tp, spec.dp, spec.pp, spec.mbs, list(spec.layers_per_stage)) == (
            plan.tp, plan.dp, plan.pp, plan.mbs, plan.layers_per_stage)
        assert estimate(model, cluster, spec).step_time_s == pytest.approx(plan.step_time_s, rel=1e-12)


def test_estimate_takes_a_spec_or_its_fields_not_both(gpt2):
    spec = plan_spec(*gpt2, **GPT2_PLAN)
    assert estimate(*gpt2, spec).record() == estimate(*gpt2, **GPT2_PLAN).record()
    with pytest.raises(TypeError, match="not both"):
        estimate(*gpt2, replace(spec), tp=1)


# -- fasop estimate --plan ---------------------------------------------------------------------------------
@pytest.fixture
def searched(runner, tiny, tmp_path):
    setup = tiny()
    out = tmp_path / "plans.json"
    ok(invoke(runner, ["search", *setup.args("--output", out)]))
    return setup, out


def test_estimate_of_a_plan_file_is_its_plan(runner, searched):
    """The plan's model, cluster and profiles come from the plan file; the figures are the search's."""
    _, plans_file = searched
    plans = load_plans(plans_file)
    for rank in (1, len(plans)):
        result = invoke(runner, ["estimate", "--plan", plans_file, "--rank", rank, "--json"])
        ok(result)
        fresh = json.loads(result.stdout)
        given = plans[rank - 1].record()
        assert fresh.pop("fits_memory") is True
        assert fresh == {key: value for key, value in given.items() if key not in ("rank",)}


def test_estimate_of_a_plan_file_prints_the_breakdown(runner, searched):
    _, plans_file = searched
    result = invoke(runner, ["estimate", "--plan", plans_file])
    ok(result)
    best = load_plans(plans_file)[0]
    assert f"tp={best.tp} dp={best.dp} pp={best.pp} mbs={best.mbs}" in result.stdout
    assert f"step time        {best.step_time_s:.4f} s" in result.stdout


@pytest.mark.parametrize("extra, names", [
    (["--tp", "1"], ["--tp", "the plan file gives the plan"]),
    (["--layers", "4"], ["--layers", "the plan file gives the plan"]),
    (["--no-overlap"], ["--overlap", "the plan file gives the plan"]),
    (["--rank", "99"], ["--rank 99", "no such plan"]),
])
def test_estimate_of_a_plan_file_refuses_options_it_would_ignore(runner, searched, extra, names):
    _, plans_file = searched
    assert_input_error(invoke(runner, ["estimate", "--plan", plans_file, *extra]), *names)


def test_estimate_without_a_plan_file_needs_the_plan_options(runner, tiny):
    setup = tiny()
    assert_input_error(invoke(runner, ["estimate", *setup.args("--tp", "1")]), "--dp", "missing")
    assert_input_error(invoke(runner, ["estimate", *setup.args("--rank", "2")]), "--rank", "--plan")
