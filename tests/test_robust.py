"""`fasop search --noise`: perturbed re-estimates of the best plans, and a robust ranking that prefers the plan
less exposed to profiling error."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fasop.cli import main
from fasop.cost.step import breakdown
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.search import search_plans
from fasop.search.estimate import plan_costs
from fasop.search.robust import MAX_SEED, MAX_TRIALS, factor_keys, perturbed, plan_metric, robustness
from fasop.search.space import prepare

# Both node types carry the same GPU, so compute shares its factors; their network interfaces are equally
# slow. A data-parallel plan over both nodes (tp=1 dp=4 pp=1) spends a third of its step in an all-reduce
# through both interfaces, so its time follows the slower of two independent link factors; a pipeline plan
# with one stage per node (tp=2 dp=1 pp=2) is bound by compute. The first wins by 1% on exact numbers.
SAME_GPU_SLOW_NICS = {"fast": {"gpu": "slow", "inter_node_bandwidth": "28 Mbit/s"},
                      "slow": {"inter_node_bandwidth": "28 Mbit/s"}}


def _inputs(tiny):
    files = tiny(nodes=SAME_GPU_SLOW_NICS)
    model, cluster = load_model(str(files.model)), load_cluster(str(files.cluster))
    return files, model, cluster, prepare(model, cluster, None, str(files.profiles))


def _degrees(plan):
    return plan.tp, plan.dp, plan.pp


def test_equal_factors_scale_every_plan_and_unit_factors_leave_it_unchanged(tiny):
    _, model, cluster, inputs = _inputs(tiny)
    plans = search_plans(model, cluster, None, profiles=inputs.profiles).plans[:8]
    assert all(plan.optimizer_s > 0 for plan in plans)
    keys = factor_keys(cluster, model)
    assert keys[:4] == [("unit", "slow", "embedding"), ("unit", "slow", "layer"), ("unit", "slow", "head"),
                        ("memory", "slow", "optimizer")]
    assert keys[4:] == [("link", "fast", "intra"), ("link", "fast", "inter"), ("link", "slow", "intra"),
                        ("link", "slow", "inter")]
    for factor in (1.0, 1.17):
        c, p = perturbed(cluster, inputs.profiles, dict.fromkeys(keys, factor))
        for plan in plans:  # every term of the step time is a sum and maximum of times: they scale alike
            assert plan_metric(model, c, p, plan, "time") == pytest.approx(factor * plan.step_time_s, rel=1e-12)
            assert plan_metric(model, c, p, plan, "cost") == pytest.approx(factor * plan.cost_per_step_usd, rel=1e-12)


@pytest.mark.parametrize("factor", [0.83, 1.17])
def test_the_optimizer_step_scales_with_its_gpus_factor(tiny_inputs, factor):
    """The optimizer step is the GPU's work: its memory bandwidth is divided by the GPU type's factor, so the
    step takes `factor` times as long; the profile and link factors leave it alone."""
    model, cluster, inputs, plan = tiny_inputs
    keys = factor_keys(cluster, model)

    def optimizer_s(factors):
        return breakdown(*plan_costs(model, *perturbed(cluster, inputs.profiles, factors), plan))["optimizer_s"][0]

    exact = optimizer_s(dict.fromkeys(keys, 1.0))
    assert exact == pytest.approx(plan.optimizer_s, rel=1e-12) and exact > 0
    assert optimizer_s({**dict.fromkeys(keys, 1.0), ("memory", "slow", "optimizer"): factor}) == pytest.approx(
        factor * exact, rel=1e-12)
    others = {key: 1.0 if key[0] == "memory" else factor for key in keys}
    assert optimizer_s(others) == pytest.approx(exact, rel=1e-12)


@settings(max_examples=20, deadline=None)
@given(st.floats(0.8, 1.2), st.floats(0.8, 1.2))
def test_a_plan_through_both_interfaces_pays_the_slower_one(tiny_inputs, fast_inter, slow_inter):
    """The data-parallel plan's all-reduce term is set by the larger of the two inter-node factors."""
    model, cluster, inputs, plan = tiny_inputs
    keys = factor_keys(cluster, model)

    def step_s(fast, slow):
        factors = dict.fromkeys(keys, 1.0)
        factors["link", "fast", "inter"], factors["link", "slow", "inter"] = fast, slow
        return plan_metric(model, *perturbed(cluster, inputs.profiles, factors), plan, "time")

    assert step_s(1.0, 1.0) == pytest.approx(plan.step_time_s, rel=1e-12)
    inter_s = step_s(2.0, 2.0) - plan.step_time_s  # the all-reduce's part through the interfaces
    assert 0.9 * plan.dp_allreduce_s < inter_s <= plan.dp_allreduce_s
    expected = plan.step_time_s + (max(fast_inter, slow_inter) - 1) * inter_s
    assert step_s(fast_inter, slow_inter) == pytest.approx(expected, rel=1e-9)


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    from conftest import cluster_toml, model_toml, profile_csv

    root = tmp_path_factory.mktemp("robust")
    (root / "profiles").mkdir()
    (root / "model.toml").write_text(model_toml())
    (root / "cluster.toml").write_text(cluster_toml(None, SAME_GPU_SLOW_NICS))
    (root / "profiles" / "slow.csv").write_text(profile_csv("slow"))
    model, cluster = load_model(str(root / "model.toml")), load_cluster(str(root / "cluster.toml"))
    inputs = prepare(model, cluster, None, str(root / "profiles"))
    plan = search_plans(model, cluster, None, profiles=inputs.profiles).plans[0]
    assert _degrees(plan) == (1, 4, 1) and plan.dp_allreduce_s > 0.3 * plan.step_time_s
    return model, cluster, inputs, plan


def test_robust_ranking_prefers_the_plan_bound_by_compute(tiny):
    _, model, cluster, inputs = _inputs(tiny)
    plans = search_plans(model, cluster, None, profiles=inputs.profiles).plans[:8]
    link_bound = plans[0]
    compute_bound = next(p for p in plans if _degrees(p) == (2, 1, 2))
    assert _degrees(link_bound) == (1, 4, 1)
    assert 1 < compute_bound.step_time_s / link_bound.step_time_s < 1.02  # near-equal on exact numbers
    ranked = robustness(model, cluster, inputs.profiles, plans, 0.2, 400, seed=3)
    assert ranked[0].exact_rank == compute_bound.rank
    by_rank = {r.exact_rank: r for r in ranked}
    assert by_rank[compute_bound.rank].best_fraction > by_rank[link_bound.rank].best_fraction
    # the fractions of trials won add up to one: every trial has exactly one best
    assert sum(r.best_fraction for r in ranked) == pytest.approx(1.0)
    assert all(0 <= r.mean_slowdown <= r.worst_slowdown for r in ranked)


def test_noise_report_is_the_same_for_the_same_seed(runner, tiny):
    files, *_ = _inputs(tiny)

    def report(seed):
        result = runner.invoke(main, ["search", *files.args("--top", "4", "--noise", "0.2", "--trials", "300",
                                                             "--seed", str(seed))])
        assert result.exit_code == 0, result.output
        return result.stdout[result.stdout.index("Under +-0.2 noise"):]

    first = report(11)
    assert first == report(11)
    assert first != report(12)
    rows = [line.split() for line in first.splitlines()[2:]]
    assert len(rows) == 4
    robust_first = rows[0]  # robust, rank, mbs, tp, dp, pp, ...
    assert robust_first[3:6] == ["2", "1", "2"] and robust_first[1] != "1"
    assert float(robust_first[7]) > 0.5 and robust_first[8].endswith("%")


@pytest.mark.parametrize("noise", ["0", "1", "-0.1", "nan", "inf"])
def test_bad_noise_gets_one_line(runner, tiny, noise):
    files = tiny()
    result = runner.invoke(main, ["search", *files.args("--noise", noise)])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "--noise" in result.stderr
    assert np.all([line.startswith("Error:") for line in result.stderr.splitlines()])


@pytest.mark.parametrize("trials, seed, option", [(MAX_TRIALS + 1, 0, "trials="), (0, 0, "trials="),
                                                  (10, -1, "seed="), (10, MAX_SEED + 1, "seed=")])
def test_the_api_bounds_trials_and_seed(tiny_inputs, trials, seed, option):
    """The work is trials x candidates estimates: bounded before any is drawn, as the command line bounds it."""
    model, cluster, inputs, plan = tiny_inputs
    with pytest.raises(InputError, match=f"^{option}"):
        robustness(model, cluster, inputs.profiles, [plan], 0.1, trials, seed)
