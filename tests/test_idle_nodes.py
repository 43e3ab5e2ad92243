"""Plans that leave whole node types idle compete with plans on every node (fasop.search.engine): the search is
the union of the searches of every node-type subset, and says when leaving a type idle is faster or cheaper."""

from __future__ import annotations

import importlib
import sys

import pytest
from test_cli_search import invoke, ok

from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.search.engine import IdleChoice, idle_bests, idle_choices, merge_idle_bests, node_type_subsets, search_plans

KEY = ("tp", "dp", "pp", "mbs", "placement", "layers_per_stage", "recompute", "virtual_stages", "step_time_s")


def plan_keys(plans) -> set[tuple]:
    return {tuple(str(getattr(plan, name)) for name in KEY) for plan in plans}


def test_subsets_are_every_set_of_whole_node_types_most_nodes_first():
    cluster = load_cluster("h100-a100-a10g")
    subsets = node_type_subsets(cluster)
    assert subsets[0] is cluster
    kept = [tuple(sub.node_types) for sub in subsets[1:]]
    assert sorted(kept) == sorted([("H100", "A100"), ("H100", "A10G"), ("A100", "A10G"), ("H100",), ("A100",),
                                   ("A10G",)])
    nodes = [sub.num_nodes for sub in subsets]
    assert nodes == sorted(nodes, reverse=True) and nodes[0] == 128
    for sub in subsets:  # whole node types only
        assert all(t.count == cluster.node_types[name].count for name, t in sub.node_types.items())


def test_the_search_is_the_union_of_the_subsets_searches(tiny):
    """Brute force: every plan of every subset searched on its own, and nothing else, in one ranking."""
    setup = tiny()
    model, cluster = load_model(str(setup.model)), load_cluster(str(setup.cluster))
    profiles = str(setup.profiles)
    every = search_plans(model, cluster, profiles_dir=profiles)
    union = set()
    for sub in node_type_subsets(cluster):
        union |= plan_keys(search_plans(model, sub, profiles_dir=profiles, use_all=True).plans)
    assert plan_keys(every.plans) == union
    assert len(union) > len(plan_keys(search_plans(model, cluster, profiles_dir=profiles, use_all=True).plans))
    times = [plan.step_time_s for plan in every.plans]
    assert times == sorted(times) and [plan.rank for plan in every.plans] == list(range(1, len(times) + 1))


@pytest.mark.parametrize("sort", ["time", "cost"])
def test_a_pruned_search_keeps_the_best_of_every_subset(tiny, sort):
    """Each subset's search is pruned on its own; their union cut to `keep` is the full search's best."""
    setup = tiny()
    model, cluster = load_model(str(setup.model)), load_cluster(str(setup.cluster))
    full = search_plans(model, cluster, profiles_dir=str(setup.profiles), sort=sort).plans
    for keep in (1, 3, 10):
        pruned = search_plans(model, cluster, profiles_dir=str(setup.profiles), sort=sort, keep=keep).plans
        assert pruned == full[:keep]


def test_use_all_keeps_every_node(tiny):
    setup = tiny()
    model, cluster = load_model(str(setup.model)), load_cluster(str(setup.cluster))
    result = search_plans(model, cluster, profiles_dir=str(setup.profiles), use_all=True)
    assert result.plans and result.idle == []
    assert all(len(plan.placement) == cluster.num_nodes for plan in result.plans)


def _row(placement, step_s, cost_usd):
    return {"placement": placement, "step_time_s": step_s, "cost_per_step_usd": cost_usd}


def test_idle_choices_name_the_subset_that_beats_every_node():
    cluster = load_cluster("h100-a100-a10g")
    rows = [_row(["H100", "A100", "A10G"], 10.0, 8.0), _row(["H100", "A100"], 9.0, 7.5), _row(["H100"], 12.0, 5.0),
            _row(["A10G"], 30.0, 6.0)]
    expected = [IdleChoice(("A10G",), "step_time_s", 9.0, 10.0), IdleChoice(("A100", "A10G"), "cost_per_step_usd", 5.0, 8.0)]
    assert idle_choices(idle_bests(rows, cluster)) == expected
    # the rows of two searches (below the memory headroom and above it) merge into the same answer
    assert idle_choices(merge_idle_bests(idle_bests(rows[:2], cluster), idle_bests(rows[2:], cluster))) == expected
    # nothing beats every node: nothing to say
    assert idle_choices(idle_bests([_row(["H100", "A100", "A10G"], 1.0, 1.0), _row(["H100"], 2.0, 1.0)], cluster)) == []
    # no plan fits on every node
    assert idle_choices(idle_bests([_row(["H100"], 2.0, 1.0)], cluster)) == [
        IdleChoice(("A100", "A10G"), "step_time_s", 2.0, None), IdleChoice(("A100", "A10G"), "cost_per_step_usd", 1.0, None)]


def test_a_fast_node_type_alone_is_at_least_matched():
    """4 x 8 H100 beside 8 x 8 A10G, llama3-8b: the answer is at least as fast, and (ranked by price) at least as
    cheap per sample, as the H100 nodes alone; the A10G nodes are left idle where that is better, and said so."""
    model = load_model("llama3-8b")
    cluster = load_cluster("h100-a100-a10g").with_counts({"H100": 4, "A10G": 8})
    alone = cluster.with_counts({"H100": 4})
    for sort, metric in (("time", "step_time_s"), ("cost", "cost_per_step_usd")):
        best = search_plans(model, cluster, sort=sort, keep=5)
        h100 = search_plans(model, alone, sort=sort, keep=1, use_all=True).plans[0]
        assert getattr(best.plans[0], metric) <= getattr(h100, metric)
        every = search_plans(model, cluster, sort=sort, keep=1, use_all=True).plans[0]
        if getattr(h100, metric) < getattr(every, metric):
            assert any(choice.metric == metric and "A10G" in choice.idle for choice in best.idle)


def test_the_command_line_says_when_leaving_a_type_idle_pays(runner):
    result = invoke(runner, ["search", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", "--top", "3"])
    ok(result)
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: leaving")]
    assert notes == ["note: leaving A100 (1 node) idle is cheaper per sample: $0.00793 per step against $0.01063 on "
                     "every node (--use-all keeps every node)."]
    kept = invoke(runner, ["search", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", "--top", "3", "--use-all"])
    ok(kept)
    assert "note: leaving" not in kept.stdout


@pytest.mark.parametrize("command", ["pareto", "compare"])
def test_the_market_and_the_families_search_every_node(runner, command, monkeypatch):
    """pareto sweeps node counts itself, compare sets every strategy on the same GPUs."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_all"))
        return search_plans(*args, **kwargs)

    # pareto imports search_plans from the package when it runs; compare holds its own name for it
    monkeypatch.setattr(sys.modules["fasop.search"], "search_plans", spy)
    monkeypatch.setattr(importlib.import_module("fasop.search.compare"), "search_plans", spy)
    args = ["--model", "bert", "--cluster", "fasop-1xA100-3xA10"]
    if command == "pareto":
        args += ["--train-steps", "10"]
    ok(invoke(runner, [command, *args]))
    assert seen and all(seen)
