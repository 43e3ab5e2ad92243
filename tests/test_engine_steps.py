"""Each step of the search's evaluation (fasop.search.evaluation) on small bundled examples, against a brute
force, a hand computation or the steps it is made of: placements grouped plan by plan, stage costs and the rows a
lighter recompute mode dominates, lower bounds, the partition and its pruning, the exact schedule against the
event simulation, the best problem of each plan, its record, and the plan closest to fitting memory."""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
from simulate import simulate_1f1b

import fasop
from fasop.cost.config import RECOMPUTE_MODES
from fasop.search import evaluation as steps
from fasop.search import search_plans
from fasop.search.partition import optimal_partitions
from fasop.search.record import plan_rows
from fasop.search.space import combinations, groups, prepare


def evaluated(model_name: str, cluster, recompute=RECOMPUTE_MODES):
    """The inputs, the plans (placements) and the batches by pipeline depth (stage costs) of an example."""
    cluster = fasop.load_cluster(cluster) if isinstance(cluster, str) else cluster
    inputs = prepare(fasop.load_model(model_name), cluster, recompute=recompute)
    plans = steps.plans_of(groups(inputs, combinations(inputs)))
    batches, unbuilt = steps.depth_batches(inputs, plans)
    return inputs, plans, batches, unbuilt


def partitioned(inputs, batch: steps.DepthBatch):
    """The partition and schedule of every problem of a batch that no lighter mode dominates (no pruning)."""
    keys, plan, weight = steps.plan_keys(batch, inputs.cluster, "time")
    found = [np.full(int(plan.max()) + 1, np.inf)]
    counts, terms, solved, beaten = steps.partition_modes(batch, np.zeros(len(plan)), None, plan, weight, found,
                                                          np.zeros(len(plan), dtype=bool))
    return keys, plan, counts, terms, solved, beaten


def test_placements_come_plan_by_plan_each_with_its_encoder_splits():
    inputs = prepare(fasop.load_model("t5"), fasop.load_cluster("fasop-1xA100-3xA10"))
    todo = groups(inputs, combinations(inputs))
    plans = steps.plans_of(todo)
    by_hand = [list(same) for _, same in itertools.groupby(todo, key=lambda g: (g.config.tp, g.config.dp, g.config.pp))]
    assert [[id(g) for g in plan] for plan in plans] == [[id(g) for g in plan] for plan in by_hand]
    for plan in plans:
        splits = [group.config.encoder_stages for group in plan]
        assert len(set(splits)) == len(splits)
    assert any(len(plan) > 1 for plan in plans)


def test_stage_costs_leave_out_only_what_a_lighter_recompute_mode_never_loses():
    inputs, _, batches, unbuilt = evaluated("bert", "fasop-1xA100-3xA10")
    beaten = expected_unbuilt = 0
    for batch in batches.values():
        for _, same in itertools.groupby(batch.entries, key=lambda entry: entry.order[:2]):  # plan, virtual size
            entries = list(same)
            assert [entry.order[2] for entry in entries] == list(range(len(entries)))  # lightest first
            # the optimum of each built setting, row by row: a dominated row's lighter modes do no worse
            optimum = [optimal_partitions(entry.costs.problem)[1] for entry in entries]
            assert not entries[0].beaten.any()
            for setting, entry in enumerate(entries[1:], start=1):
                lighter = np.min(optimum[:setting], axis=0)
                assert (lighter[entry.beaten] <= optimum[setting][entry.beaten] * (1 + 1e-12)).all()
                beaten += int(entry.beaten.sum())
            # settings left unbuilt: only once no built mode's memory binds on any placement
            settings = len(entries[0].splits[0].variants)
            if len(entries) < settings:
                placements = sum(len(group.geos) for group in entries[0].splits)
                binds = [entry.costs.problem.memory_binds().reshape(placements, -1).any(-1) for entry in entries]
                assert not np.logical_and.reduce(binds).any()
            expected_unbuilt += (settings - len(entries)) * len(entries[0].costs.mbs)
    assert beaten > 0 and unbuilt == expected_unbuilt > 0


def test_lower_bounds_never_exceed_the_exact_step_of_the_partition():
    inputs, _, batches, _ = evaluated("gpt2-xl", "fasop-1xA100-3xA10")
    for batch in batches.values():
        bound = steps.depth_bounds(batch, bounded=True)
        beaten = np.concatenate([entry.beaten for entry in batch.entries])
        assert np.isinf(bound[beaten]).all()  # dominated: never partitioned, so not bounded
        rows = np.flatnonzero(~beaten)
        counts, value, _ = optimal_partitions(batch.costs.problem.take(rows))
        fits = np.isfinite(value)
        exact = batch.costs.schedule.take(rows[fits]).step_terms(counts[fits])["step_time_s"]
        assert (bound[rows[fits]] <= exact * (1 + 1e-9)).all()
        assert not (np.isinf(bound[rows]) & fits).any()
        assert not steps.depth_bounds(batch, bounded=False).any()


def test_the_partition_solves_what_it_keeps_and_prunes_only_what_cannot_be_among_the_best(monkeypatch):
    inputs, _, batches, _ = evaluated("gpt2-xl", "fasop-1xA100-3xA10", recompute=("none",))
    batch = max(batches.values(), key=lambda b: len(b.costs.mbs))
    problems, schedule = batch.costs.problem, batch.costs.schedule
    keys, plan, weight = steps.plan_keys(batch, inputs.cluster, "time")
    assert (weight == 1).all()
    _, _, by_cost = steps.plan_keys(batch, inputs.cluster, "cost")
    prices = [sum(inputs.cluster.node_types[n].price_per_hour_usd for n in key[3]) for key in keys]
    assert by_cost == pytest.approx(np.array(prices) / 3600, rel=1e-15)
    nothing = np.zeros(len(plan), dtype=bool)
    # without bounds or keep nothing is skipped: the optimal partitions, timed by the exact schedule
    counts, terms, solved, outdone = steps.partition(problems, schedule, np.zeros(len(plan)), None, plan, weight,
                                                     [np.full(int(plan.max()) + 1, np.inf)], nothing)
    expected, value, _ = optimal_partitions(problems)
    fits = np.isfinite(value)
    assert solved.all() and not outdone.any() and np.array_equal(counts, expected)
    assert np.array_equal(np.isfinite(terms["step_time_s"]), fits)
    for name, column in schedule.take(np.flatnonzero(fits)).step_terms(expected[fits]).items():
        assert np.array_equal(terms[name][fits], column)
    best_of_plan = np.full(int(plan.max()) + 1, np.inf)
    np.minimum.at(best_of_plan, plan, terms["step_time_s"])
    monkeypatch.setattr(steps, "PRUNE_CHUNK", 1)  # the threshold tightens after every problem
    for keep in (1, 3):  # with bounds and keep, the keep best plans all the same, for less work
        found = [np.full(int(plan.max()) + 1, np.inf)]
        _, _, kept, _ = steps.partition(problems, schedule, steps.depth_bounds(batch, True), steps.Cut(keep), plan,
                                        weight, found, nothing)
        assert not kept.all()
        assert np.array_equal(np.sort(found[0])[:keep], np.sort(best_of_plan)[:keep])


def test_the_schedule_times_a_partition_as_the_event_simulation_does():
    inputs, _, batches, _ = evaluated("gpt2-xl", "fasop-1xA100-3xA10", recompute=("none",))
    checked = 0
    for pp, batch in batches.items():
        schedule = batch.costs.schedule
        rows = np.flatnonzero(schedule.virtual_stages == 1)[::7]  # plain 1F1B
        counts = np.zeros(batch.costs.problem.lo.shape, dtype=int)
        found, value, _ = optimal_partitions(batch.costs.problem.take(rows))
        fits = np.isfinite(value)
        counts[rows[fits]] = found[fits]
        rows = rows[fits]
        terms = {"step_time_s": np.full(len(schedule), np.inf)}
        steps.scheduled(schedule, rows, counts, terms)
        assert np.isnan(np.delete(terms["pipeline_time_s"], rows)).all()
        for row in rows.tolist():
            n = counts[row]
            forward = schedule.fixed_forward_s[row] + schedule.layer_forward_s[row] * n
            backward = schedule.fixed_s[row] - schedule.fixed_forward_s[row] + (
                schedule.layer_s[row] - schedule.layer_forward_s[row]) * n
            simulated = simulate_1f1b(list(forward), list(backward), [*schedule.boundary_s[row], 0.0],
                                      int(schedule.num_microbatches[row]))
            assert terms["pipeline_time_s"][row] == pytest.approx(simulated, rel=1e-9)
            checked += pp > 1
    assert checked > 10


def rank(batch: steps.DepthBatch, terms: dict, i: int) -> tuple:
    """What ranks row i among its plan's problems: step time, encoder stages, recompute mode, chunks, row."""
    entry, _, split = batch.at(i)
    config = entry.configs[split]
    return (terms["step_time_s"][i], config.encoder_stages, RECOMPUTE_MODES.index(config.recompute),
            config.virtual_stages, i)


def test_the_best_of_each_plan_is_its_fastest_problem_ties_to_fewer_encoder_stages_lighter_modes_fewer_chunks():
    inputs, _, batches, _ = evaluated("t5", "fasop-1xA100-3xA10")
    for batch in batches.values():
        keys, plan, counts, terms, _, _ = partitioned(inputs, batch)
        best = steps.best_of_plans(batch, keys, plan, counts, terms)
        rows_of: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            rows_of.setdefault(key, []).append(i)
        assert list(best) == list(dict.fromkeys(sorted(rows_of, key=lambda key: plan[rows_of[key][0]])))
        for key, candidate in best.items():
            assert candidate.at == min(rows_of[key], key=partial(rank, batch, terms))
            entry, row, split = batch.at(candidate.at)
            assert candidate.config == entry.configs[split] and candidate.step_time_s == terms["step_time_s"][candidate.at]
            assert candidate.geo.placement == key[3] and int(entry.costs.mbs[row]) == key[4]
            assert np.array_equal(candidate.counts, counts[candidate.at])


def test_the_records_are_each_best_plans_own():
    inputs, _, batches, _ = evaluated("bert", "fasop-1xA100-3xA10")
    best = {}
    for batch in batches.values():
        keys, plan, counts, terms, _, _ = partitioned(inputs, batch)
        best.update(steps.best_of_plans(batch, keys, plan, counts, terms))
    rows = steps.records(inputs, best, batches)
    fitting = {key: c for key, c in best.items() if np.isfinite(c.step_time_s)}
    assert len(rows) == len(fitting) > 0
    by_key = {(r["tp"], r["dp"], r["pp"], tuple(r["placement"]), r["mbs"], r.get("cp", 1), r.get("ep", 1),
               r.get("etp", r["tp"])): r for r in rows}
    for key, c in list(fitting.items())[::5]:
        at = np.array([c.at])
        alone = plan_rows(inputs, [(c.config, c.geo, c.exhaustive)], batches[c.config.pp].costs.take(at),
                          np.array([c.counts]), {name: column[at] for name, column in c.terms.items()})
        assert by_key[key] == alone[0] and alone[0]["step_time_s"] == c.step_time_s


def test_the_closest_plan_fits_once_the_memory_grows_by_its_factor():
    cluster = fasop.load_cluster("fasop-4xA10")

    def with_memory(gib: float):
        return replace(cluster, node_types={n: replace(t, gpu_memory_gib=gib) for n, t in cluster.node_types.items()})

    inputs, _, batches, _ = evaluated("gpt2-xl", with_memory(3.0))
    unfit = []
    for batch in batches.values():
        _, _, _, terms, solved, beaten = partitioned(inputs, batch)
        assert np.isinf(terms["step_time_s"]).all()  # nothing fits 3 GiB
        unfit.append((batch, np.flatnonzero(solved | beaten)))
    closest = steps.closest_fit(unfit, inputs.cluster)
    assert closest is not None
    factor, config = closest
    assert factor > 1
    model = inputs.model
    grown = search_plans(model, with_memory(3.0 * factor * (1 + 1e-6)), workers=1).plans
    assert any((p.tp, p.dp, p.pp, p.mbs, p.recompute) == (config.tp, config.dp, config.pp, config.mbs, config.recompute)
               for p in grown)
    assert not search_plans(model, with_memory(3.0 * factor * (1 - 1e-6)), workers=1).plans
