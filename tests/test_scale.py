"""The scalable search: the placement subset against exhaustive search, sound pruning, several processes."""

import importlib.util
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from test_partition import problems

import fasop
from fasop.search import search_plans
from fasop.search.partition import lower_bounds, optimal_partitions


def _measurement_script():
    """scripts/measure_accuracy.py holds the random clusters this test and the measurement share."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "measure_accuracy.py"
    spec = importlib.util.spec_from_file_location("measure_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


accuracy = _measurement_script()


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")
    accuracy.write_profiles(folder)
    return str(folder)


def test_placement_subset_is_within_three_percent_of_exhaustive(profiles):
    rng = random.Random(11)
    gaps = []
    while len(gaps) < 12:
        gap = accuracy.subset_gap(*accuracy.random_instance(rng), profiles)
        if gap is not None:
            gaps.append(gap)
    assert max(gaps) <= 0.03
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-7xA10")
    assert {p.placement_search for p in search_plans(model, cluster, placement_limit=0).plans} == {"type-blocks"}


@settings(max_examples=200, deadline=None)
@given(problems())
def test_lower_bound_never_exceeds_the_optimum(batch):
    # as in every plan's problem, the first micro-batch's pass (base_s) includes every stage's fixed compute and
    # sends, so that the closed form, like the exact schedule, is at least m busy periods of any stage
    batch = replace(batch, base_s=batch.base_s + batch.period_fixed_s.sum(-1))
    bound = lower_bounds(batch)
    _, value, feasible = optimal_partitions(batch)
    assert np.array_equal(np.isfinite(bound), feasible)
    assert (bound[feasible] <= value[feasible] * (1 + 1e-12)).all()


@pytest.mark.parametrize("cluster_name, keep", [("fasop-1xA100-7xA10", 5), ("fasop-8xA10", 10)])
def test_pruned_search_keeps_the_best_plans(cluster_name, keep):
    """t5 is an encoder-decoder model: each plan has several encoder splits, which must count as one plan."""
    model, cluster = fasop.load_model("t5"), fasop.load_cluster(cluster_name)
    full = search_plans(model, cluster)
    kept = search_plans(model, cluster, keep=keep)
    assert kept.pruned > 0 and kept.partitions_solved < full.partitions_solved
    assert kept.plans == full.plans[:keep]


class _Pool(ProcessPoolExecutor):
    """A process pool that records how many processes each search asked for."""

    sizes: list[int] = []

    def __init__(self, max_workers):
        _Pool.sizes.append(max_workers)
        super().__init__(max_workers)


def test_several_processes_find_the_same_plans(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # two processes even where the machine has one core
    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", _Pool)
    _Pool.sizes.clear()
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-7xA10")
    one = search_plans(model, cluster, workers=1)
    two = search_plans(model, cluster, workers=2)
    assert _Pool.sizes and set(_Pool.sizes) == {2}  # one pool per sub-search, each of two processes
    assert two.plans == one.plans
    assert (two.plans_evaluated, two.out_of_memory) == (one.plans_evaluated, one.out_of_memory)


def test_workers_are_at_most_one_per_core(monkeypatch):
    """Asking for more processes than cores starts one per core: more would only share them."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", _Pool)
    _Pool.sizes.clear()
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-7xA10")
    assert search_plans(model, cluster, workers=1000).plans == search_plans(model, cluster, workers=1).plans
    assert _Pool.sizes and set(_Pool.sizes) == {2}  # one pool per sub-search, each of two processes
