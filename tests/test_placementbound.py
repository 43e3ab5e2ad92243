"""The integer program's bound on the type-blocks placement heuristic (fasop.search.placementbound): never above
the best placement that enumerating every placement finds, and the gap it gives a plan no smaller than how far
that plan really is from the best."""

from __future__ import annotations

from collections import defaultdict

import pytest

from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.search.engine import search_plans
from fasop.search.placementbound import placement_gaps
from fasop.search.space import prepare

SHAPES = 10  # shapes bounded per cluster: each bound is an integer program


def _shape(plan):
    return plan.tp, plan.dp, plan.pp, plan.mbs, plan.recompute, plan.virtual_stages


@pytest.mark.parametrize("model_name, cluster_name", [("gpt2-xl", "fasop-1xA100-7xA10"),
                                                      ("bert", "fasop-1xA100-3xA10")])
def test_the_bound_is_below_every_placement_and_the_gap_above_the_true_distance(model_name, cluster_name):
    """The best ranked plan of each of the first shapes (degrees, micro-batch, recompute, virtual stages) that the
    type-block subset found, against every placement of that shape."""
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    inputs = prepare(model, cluster)
    every = search_plans(model, cluster, use_all=True).plans  # few enough placements to enumerate
    blocks = search_plans(model, cluster, use_all=True, placement_limit=1).plans
    best = defaultdict(lambda: float("inf"))
    for plan in every:
        assert plan.placement_search == "exhaustive"
        best[_shape(plan)] = min(best[_shape(plan)], plan.closed_form_step_s)
    firsts = list({_shape(p): p for p in reversed(blocks)
                   if p.placement_search == "type-blocks" and p.virtual_stages == 1}.values())[::-1]
    assert len(firsts) >= 3
    for plan in placement_gaps(inputs, firsts[:SHAPES]):
        assert plan.optimality_gap is not None
        optimum = best[_shape(plan)]
        distance = (plan.closed_form_step_s - optimum) / plan.closed_form_step_s
        assert plan.optimality_gap >= distance - 1e-9
        assert plan.closed_form_step_s * (1 - plan.optimality_gap) <= optimum * (1 + 1e-9)  # the bound itself


def test_interleaved_plans_get_no_bound():
    model, cluster = load_model("gpt2-xl"), load_cluster("fasop-1xA100-7xA10")
    plans = [p for p in search_plans(model, cluster, use_all=True, placement_limit=1).plans
             if p.placement_search == "type-blocks" and p.virtual_stages > 1][:3]
    assert plans and all(p.optimality_gap is None for p in placement_gaps(prepare(model, cluster), plans))


def test_plans_of_an_enumerated_placement_keep_no_gap():
    model, cluster = load_model("gpt2-xl"), load_cluster("fasop-1xA100-3xA10")
    plans = search_plans(model, cluster, use_all=True).plans[:5]
    assert all(plan.placement_search == "exhaustive" for plan in plans)
    assert placement_gaps(prepare(model, cluster), plans) == plans


def test_the_search_bounds_its_first_plans_and_no_others():
    model, cluster = load_model("gpt2-xl"), load_cluster("fasop-1xA100-7xA10")
    plans = search_plans(model, cluster, use_all=True, placement_limit=1, bound_placements=8).plans
    first = [p for p in plans[:8] if p.placement_search == "type-blocks" and p.virtual_stages == 1]
    assert first and all(p.optimality_gap is not None and 0 <= p.optimality_gap < 1 for p in first)
    assert all(p.optimality_gap is None for p in plans[8:])
