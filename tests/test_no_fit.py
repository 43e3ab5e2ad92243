"""A fast "no plan fits": memory decides it before any schedule is timed, and the closest plan's memory factor is
found for all the problems of a batch at once (bisected one problem at a time, it took 20 times the search)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import fasop
from fasop.cost.exact import ScheduleBatch
from fasop.cost.problem import PartitionBatch, segment_sums
from fasop.search import evaluation as steps
from fasop.search import search_plans
from fasop.search.partition import least_admitting
from fasop.search.space import combinations, groups, prepare


def unfit_problems(inputs):
    """Each depth's batch and its rows that no partition fits (every problem partitioned, no pruning)."""
    batches, _ = steps.depth_batches(inputs, steps.plans_of(groups(inputs, combinations(inputs))))
    unfit = []
    for batch in batches.values():
        _, plan, weight = steps.plan_keys(batch, inputs.cluster, "time")
        found = [np.full(int(plan.max()) + 1, np.inf)]
        _, terms, solved, beaten = steps.partition_modes(batch, np.zeros(len(plan)), None, plan, weight, found,
                                                         np.zeros(len(plan), dtype=bool))
        unfit.append((batch, np.flatnonzero(np.isinf(terms["step_time_s"]) & (solved | beaten))))
    return unfit


def brute_force_factor(costs, row: int, cluster) -> float:
    """The least factor on the GPUs' memory at which some partition of problem `row` fits, over every partition:
    a stage of n layers needs fixed + n per-layer GiB of usable memory, (capacity x factor - overhead) / margin."""
    problem = costs.problem
    lo, most = problem.lo[row], problem.most_layers[row]
    counts = np.array(list(itertools.product(*(range(a, b + 1) for a, b in zip(lo, most)))))
    segment = np.broadcast_to(problem.segment_of_stage, problem.lo.shape)[row]
    counts = counts[(segment_sums(counts, segment, len(problem.segment_layers)) == problem.segment_layers).all(-1)]
    needed_gib = costs.mem_fixed_gib[row] + costs.mem_layer_gib[row] * counts
    factors = (needed_gib * cluster.memory_margin + cluster.gpu_memory_overhead_gib) / costs.capacity_gib[row]
    return float(factors.max(-1).min())


@pytest.mark.parametrize("fast_gib, slow_gib", [(0.001, 0.001), (0.002, 0.0005), (0.0003, 0.004)])
def test_the_memory_factor_is_the_least_over_every_partition(tiny, fast_gib, slow_gib):
    t = tiny(nodes={"fast": {"gpu_memory_gib": fast_gib}, "slow": {"gpu_memory_gib": slow_gib}})
    inputs = prepare(fasop.load_model(str(t.model)), fasop.load_cluster(str(t.cluster)), profiles_dir=str(t.profiles))
    unfit = unfit_problems(inputs)
    assert sum(len(rows) for _, rows in unfit) > 20
    for batch, rows in unfit:
        factors = steps.memory_overshoots(batch.costs, rows, inputs.cluster)
        exact = [brute_force_factor(batch.costs, row, inputs.cluster) for row in rows.tolist()]
        assert factors == pytest.approx(exact, rel=1e-12)
    factor, config = steps.closest_fit(unfit, inputs.cluster)
    assert factor == pytest.approx(min(brute_force_factor(batch.costs, row, inputs.cluster)
                                       for batch, rows in unfit for row in rows.tolist()), rel=1e-12)


def test_least_admitting_by_hand():
    """Three layers on two stages, a stage of n layers needing 1.0 + 0.1 n and 0.5 + 0.3 n: (3, 0) needs 1.3,
    (2, 1) 1.2, (1, 2) 1.1 and (0, 3) 1.4; with two layers at least on each stage no partition exists."""
    def problems(lo):
        zeros = np.zeros((2, 2))
        return PartitionBatch(np.zeros(2, dtype=int), np.array([3]), np.array(lo), np.full((2, 2), -1), zeros, zeros,
                              zeros, zeros, np.ones(2), np.zeros(2))

    fixed, per_layer = np.array([[1.0, 0.5]] * 2), np.array([[0.1, 0.3]] * 2)
    assert least_admitting(fixed, per_layer, problems([[0, 0], [2, 0]])) == pytest.approx([1.1, 1.2])
    assert least_admitting(fixed, per_layer, problems([[2, 2], [0, 0]]))[0] == np.inf


@pytest.fixture
def timed_rows(monkeypatch):
    """The problems the search times with the exact schedule, counted."""
    timed = []
    step_terms = ScheduleBatch.step_terms
    monkeypatch.setattr(ScheduleBatch, "step_terms", lambda self, counts: timed.append(len(counts))
                        or step_terms(self, counts))
    return timed


def test_no_fit_times_no_schedule(tiny, timed_rows):
    t = tiny(nodes={"fast": {"gpu_memory_gib": 0.001}, "slow": {"gpu_memory_gib": 0.001}})
    result = search_plans(fasop.load_model(str(t.model)), fasop.load_cluster(str(t.cluster)),
                          profiles_dir=str(t.profiles))
    assert not result.plans and result.closest_memory_factor > 1
    assert sum(timed_rows) == 0
    roomy = tiny("roomy")  # the count sees the problems that fit
    assert search_plans(fasop.load_model(str(roomy.model)), fasop.load_cluster(str(roomy.cluster)),
                        profiles_dir=str(roomy.profiles)).plans
    assert sum(timed_rows) > 0


def test_the_issue_case_finds_the_closest_plan_batch_by_batch(monkeypatch, timed_rows):
    """llama2-70b on 1 H100 + 3 A10G nodes: no plan fits, no schedule is timed, and the memory factors come a
    batch of problems at a time: fewer batches than the plans out of memory."""
    batches = []
    least_admitting = steps.least_admitting
    monkeypatch.setattr(steps, "least_admitting", lambda fixed, per_layer, batch: batches.append(len(batch))
                        or least_admitting(fixed, per_layer, batch))
    cluster = fasop.load_cluster("h100-a100-a10g").with_counts({"H100": 1, "A10G": 3})
    result = search_plans(fasop.load_model("llama2-70b"), cluster, keep=3)
    assert not result.plans and result.closest_plan is not None and result.closest_memory_factor > 1
    assert sum(timed_rows) == 0
    assert 0 < len(batches) < result.out_of_memory and max(batches) > 1
