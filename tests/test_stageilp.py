"""The integer program of stage-group plans (fasop/search/stageilp.py) against exhaustive enumeration and hand
computation: the same optimum, every constraint held, ties, capacity, cutoffs and determinism."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fasop.errors import ArgumentError
from fasop.search.stageilp import StageOptions, brute_force, objective, solve_stage_ilp

ROOT = Path(__file__).resolve().parents[1]


def options_of(node_type, tp, dp, nodes, sum_fixed, layer, period_fixed, tail_fixed, tail_layer, lo, hi) -> StageOptions:
    return StageOptions(tuple(node_type), np.array(tp), np.array(dp), np.array(nodes), np.array(sum_fixed, float),
                        np.array(layer, float), np.array(period_fixed, float), np.array(tail_fixed, float),
                        np.array(tail_layer, float), np.array(lo), np.array(hi))


@st.composite
def problems(draw):
    positions, count = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    num_layers = draw(st.integers(positions, 10))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    costs = [rng.integers(0, 8, (positions, count)) / 4 for _ in range(5)]  # quarters: many exact ties
    costs[1] = costs[1] + 0.25  # a layer always takes time
    options = options_of(rng.choice(["a", "b"], count), rng.choice([1, 2], count), rng.choice([1, 2], count),
                         rng.integers(1, 3, count), *costs, lo=rng.integers(0, 2, positions),
                         hi=rng.integers(-1, num_layers + 1, (positions, count)))
    capacity = {"a": int(rng.integers(0, 2 * positions + 1)), "b": int(rng.integers(0, 2 * positions + 1))}
    return options, num_layers, draw(st.integers(1, 6)), capacity, draw(st.booleans())


def holds_every_constraint(options, num_layers, capacity, tied, found) -> bool:
    option, layers = np.array(found.option), np.array(found.layers)
    positions = np.arange(options.positions)
    used = {kind: int(options.nodes[option][np.array(options.node_type)[option] == kind].sum()) for kind in capacity}
    return (layers.sum() == num_layers and (layers >= options.lo).all() and (layers <= options.hi[positions, option]).all()
            and all(used[kind] <= capacity[kind] for kind in capacity)
            and (not tied or (options.tp[option[0]], options.dp[option[0]]) == (options.tp[option[-1]], options.dp[option[-1]])))


@settings(max_examples=40, deadline=None)
@given(problems())
def test_the_program_finds_the_brute_force_optimum(problem):
    options, num_layers, microbatches, capacity, tied = problem
    best = brute_force(options, num_layers, microbatches, capacity, same_degrees_first_last=tied)
    found = solve_stage_ilp(options, num_layers, microbatches, capacity, same_degrees_first_last=tied, gap_rel=0.0)
    assert (found is None) == (best is None)
    if found is not None:
        assert found.objective_s == pytest.approx(best.objective_s, rel=1e-9, abs=1e-12)
        assert found.objective_s == objective(options, microbatches, found.option, found.layers)
        assert holds_every_constraint(options, num_layers, capacity, tied, found)
        assert holds_every_constraint(options, num_layers, capacity, tied, best)
        assert found.status == "optimal" and found.gap == 0.0 and found.bound_s == found.objective_s


def two_stages(**changes) -> StageOptions:
    """Option 0: a fast type-a stage (1 node); option 1: a slow type-b stage (1 node); both fit 6 layers."""
    fields = dict(node_type=["a", "b"], tp=[2, 1], dp=[1, 1], nodes=[1, 1], sum_fixed=[[0.5, 0.5], [0.5, 0.5]],
                  layer=[[1.0, 2.0], [1.0, 2.0]], period_fixed=[[0.0, 0.0], [0.0, 0.0]],
                  tail_fixed=[[1.0, 1.0], [1.0, 1.0]], tail_layer=[[0.0, 0.0], [0.0, 0.0]], lo=[1, 1], hi=[[6, 6], [6, 6]])
    return options_of(**{**fields, **changes})


def test_a_hand_computed_two_stage_pipeline():
    """6 layers, m = 3, one node of each type. Fast + slow with n fast and 6 - n slow layers:
    F = (1 + n + 2(6 - n)) + 2 max(n, 2(6 - n)) + 1, least at n = 4: 1 + 4 + 4 + 2*4 + 1 = 18."""
    found = solve_stage_ilp(two_stages(), 6, 3, {"a": 1, "b": 1})
    assert (sorted(zip(found.option, found.layers)) == [(0, 4), (1, 2)] and found.objective_s == 18.0
            and found.status == "optimal" and found.gap == 0.0)
    # two nodes of the fast type: 3 layers each, F = (1 + 6) + 2 * 3 + 1 = 14
    found = solve_stage_ilp(two_stages(), 6, 3, {"a": 2, "b": 1})
    assert found.option == (0, 0) and found.layers == (3, 3) and found.objective_s == 14.0


def test_capacity_binds():
    # no node of the slow type: the fast type alone, which has one node, cannot fill two stages
    assert solve_stage_ilp(two_stages(), 6, 3, {"a": 1, "b": 0}) is None
    assert brute_force(two_stages(), 6, 3, {"a": 1, "b": 0}) is None
    # the fast option takes 2 nodes of the 3: only one stage may have it
    found = solve_stage_ilp(two_stages(nodes=[2, 1]), 6, 3, {"a": 3, "b": 2})
    assert sorted(found.option) == [0, 1] and found.objective_s == 18.0


def test_tied_first_and_last_stages_share_their_degrees():
    """Untied, the best is the fast option (tp 2) beside the slow one (tp 1); tied, both stages take one of them:
    two slow stages (F = (1 + 12) + 2 * 6 + 1 = 26) or two fast ones, which capacity {a: 1} forbids."""
    untied = solve_stage_ilp(two_stages(), 6, 3, {"a": 1, "b": 2})
    tied = solve_stage_ilp(two_stages(), 6, 3, {"a": 1, "b": 2}, same_degrees_first_last=True)
    assert sorted(untied.option) == [0, 1] and tied.option == (1, 1) and tied.objective_s == 26.0
    assert brute_force(two_stages(), 6, 3, {"a": 1, "b": 2}, same_degrees_first_last=True).objective_s == 26.0


def test_memory_limits_the_layers_of_a_stage():
    """The fast option fits only 3 layers: F = (1 + 3 + 6) + 2 * 6 + 1 = 23 with 3 fast and 3 slow layers."""
    found = solve_stage_ilp(two_stages(hi=[[3, 6], [3, 6]]), 6, 3, {"a": 1, "b": 1})
    assert sorted(zip(found.option, found.layers)) == [(0, 3), (1, 3)] and found.objective_s == 23.0


def test_the_cutoff_keeps_only_better_assignments():
    assert solve_stage_ilp(two_stages(), 6, 3, {"a": 1, "b": 1}, cutoff_s=17.5) is None
    assert solve_stage_ilp(two_stages(), 6, 3, {"a": 1, "b": 1}, cutoff_s=18.5).objective_s == 18.0


@settings(max_examples=10, deadline=None)
@given(problems())
def test_solves_are_repeatable(problem):
    options, num_layers, microbatches, capacity, tied = problem
    assert (solve_stage_ilp(options, num_layers, microbatches, capacity, same_degrees_first_last=tied)
            == solve_stage_ilp(options, num_layers, microbatches, capacity, same_degrees_first_last=tied))


def test_one_stage_and_one_microbatch():
    """P = 1: the stage takes every layer; m = 1 leaves the period out: F = 0.5 + 6 + 1 on the fast option."""
    options = options_of(["a", "b"], [2, 1], [1, 1], [1, 1], [[0.5, 0.5]], [[1.0, 2.0]], [[9.0, 9.0]], [[1.0, 1.0]],
                         [[0.0, 0.0]], [1], [[6, 6]])
    found = solve_stage_ilp(options, 6, 1, {"a": 1, "b": 1}, same_degrees_first_last=True)
    assert found.option == (0,) and found.layers == (6,) and found.objective_s == 7.5


def test_bad_arguments_name_the_python_argument():
    with pytest.raises(ArgumentError, match="num_layers"):
        solve_stage_ilp(two_stages(), 0, 3, {"a": 1, "b": 1})
    with pytest.raises(ArgumentError, match="capacity.*node type b"):
        solve_stage_ilp(two_stages(), 6, 3, {"a": 1})
    with pytest.raises(ArgumentError, match="hi has shape"):
        two_stages(hi=[[6, 6]])
    with pytest.raises(ArgumentError, match="layer_s must hold finite seconds"):
        two_stages(layer=[[1.0, -2.0], [1.0, 2.0]])


def test_the_benchmark_runs_on_a_small_instance():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_stage_ilp.py"), "--model", "gpt2-xl",
                           "--cluster", "fasop-1xA100-3xA10", "--gbs", "64", "--stages", "2", "--time-limit", "20"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "P = 2:" in done.stdout and "gap" in done.stdout and "Running HiGHS" not in done.stdout
