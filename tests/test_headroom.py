"""The memory headroom: plans above it are flagged and ranked after every plan below it, each plan at its best
below it when it has one, and a pruned search returns exactly the unpruned search's best plans."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from test_search_trust import instances

from fasop.cli import main
from fasop.cli.tables import format_table
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.errorband import bundled_band
from fasop.plans import load_plans
from fasop.search import evaluation, search_plans
from fasop.search.headroom import memory_load, over_headroom, search_within_headroom


def _key(plan):
    """The plan's fasop.search.space.plan_key."""
    return plan.tp, plan.dp, plan.pp, tuple(plan.placement), plan.mbs, plan.cp or 1, plan.ep or 1, plan.etp or plan.tp


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["time", "cost"]), st.sampled_from([0.3, 0.6, 0.9]))
def test_pruned_headroom_search_returns_the_unpruned_best(instance, sort, headroom):
    model, cluster, profiles = instance
    options = dict(profiles=profiles, sort=sort, workers=1, use_all=True, memory_headroom=headroom)
    try:
        whole = search_plans(model, cluster, profiles=profiles, sort=sort, workers=1, use_all=True).plans
        ranked = search_within_headroom(model, cluster, **options).plans
    except InputError:  # no plan can use the batch size on these GPUs
        reject()
    flags = [over_headroom(plan, cluster, headroom) for plan in ranked]
    assert flags == sorted(flags)  # every plan below the headroom first
    assert [plan.rank for plan in ranked] == list(range(1, len(ranked) + 1))
    assert sorted(map(_key, ranked)) == sorted(map(_key, whole))  # the same plans, none lost or repeated
    # brute force: a plan below the headroom is the best of its key on GPUs with that share of their memory
    tight = replace(cluster, memory_margin=cluster.memory_margin / headroom)
    below = {_key(p): p for p in search_plans(model, tight, profiles=profiles, sort=sort, workers=1, use_all=True).plans}
    assert [p for p, over in zip(ranked, flags) if not over] == [p.model_copy(update={"rank": r}) for r, p in
                                                                  enumerate(below.values(), start=1)]
    for plan, over in zip(ranked, flags):
        if over:  # above it only when no variant of the plan fits below
            assert _key(plan) not in below and memory_load(plan, cluster) > headroom
    for keep in (1, 3):
        with pytest.MonkeyPatch.context() as patch:  # the threshold tightens after every problem
            patch.setattr(evaluation, "PRUNE_CHUNK", 1)
            pruned = search_within_headroom(model, cluster, keep=keep, **options).plans
        assert pruned == ranked[:keep]
        placed = search_within_headroom(model, cluster, places=keep, **options)
        flagged = lambda plan: over_headroom(plan, cluster, headroom)  # noqa: E731
        assert not ranked or format_table(placed.plans, keep, flagged=flagged) == format_table(ranked, keep,
                                                                                               flagged=flagged)
        if placed.headroom_only:  # the plans below the headroom filled the table: the counts are theirs
            assert not any(map(flagged, placed.plans))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["time", "cost"]), st.integers(0, 2**16))
def test_excluded_plans_are_left_out_and_nothing_else_changes(instance, sort, pick):
    """The second search of the headroom leaves out the plans the first found room for: the rest rank as in the
    whole search, with the same counts of plans out of memory."""
    model, cluster, profiles = instance
    options = dict(profiles=profiles, sort=sort, workers=1)
    try:
        whole = search_plans(model, cluster, **options)
    except InputError:
        reject()
    keys = sorted(map(_key, whole.plans))
    excluded = frozenset(key for i, key in enumerate(keys) if pick >> (i % 16) & 1)
    rest = search_plans(model, cluster, exclude=excluded, **options)
    kept = [plan for plan in whole.plans if _key(plan) not in excluded]
    assert rest.plans == [plan.model_copy(update={"rank": rank}) for rank, plan in enumerate(kept, start=1)]
    assert (rest.plans_evaluated, rest.out_of_memory) == (whole.plans_evaluated - len(excluded), whole.out_of_memory)


def test_headroom_one_is_the_plain_search():
    model, cluster, profiles = next(iter(_small()))
    plain = search_plans(model, cluster, profiles=profiles, workers=1).plans
    assert search_within_headroom(model, cluster, profiles=profiles, workers=1, memory_headroom=1).plans == plain


def _small():
    from test_search_trust import cluster_of, model_of, profile_of

    yield model_of("decoder", 4, 8), cluster_of([("g0", 2, 0.2, 1.0)], 2), {"g0": profile_of("g0", 1.0)}


@pytest.mark.parametrize("headroom", [0, -0.5, 1.5, True, float("nan")])
def test_bad_headroom_is_refused_by_argument_name(headroom):
    model, cluster, profiles = next(iter(_small()))
    with pytest.raises(InputError, match="memory_headroom"):
        search_within_headroom(model, cluster, profiles=profiles, memory_headroom=headroom)


def test_search_command_flags_and_ranks_plans_above_the_headroom(runner, tmp_path):
    args = ["search", "--model", "gpt2-xl", "--cluster", "fasop-8xA10", "--top", "1000", "--all-placements"]
    result = runner.invoke(main, [*args, "--memory-headroom", "0.3", "--output", str(tmp_path / "plans.json")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    rows = lines[header + 1:next(i for i, line in enumerate(lines) if line.startswith("!: "))]
    marked = [line.split()[-2].endswith("!") for line in rows]  # used/cap GiB
    plans, cluster = load_plans(tmp_path / "plans.json"), load_cluster("fasop-8xA10")
    flags = [over_headroom(plan, cluster, 0.3) for plan in plans]
    assert any(flags) and not all(flags) and flags == sorted(flags) == marked
    assert f"!: {sum(flags)} of {len(plans)} plans peak above 30% of a GPU's usable memory" in result.output
    assert any(line.startswith(f"error band: {bundled_band().describe()}") for line in lines)
    plain = runner.invoke(main, [*args, "--memory-headroom", "1"])
    assert "!" not in plain.output


def test_estimate_flags_a_plan_above_the_headroom(runner):
    args = ["estimate", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", "--tp", "1", "--dp", "4", "--pp", "4",
            "--mbs", "8", "--placement", "A100,A10,A10,A10", "--layers", "13,5,5,1"]
    result = runner.invoke(main, args)  # 16.32 GiB of 39.59 - 5.5 GiB overhead: 47%
    assert result.exit_code == 0, result.output
    assert "peak memory      16.32 of 39.59 GiB, 47% of usable (headroom 90%)" in result.output
    # the step, 0.8436 s, over the band (0.97-1.56x, tests/test_error_band.py)
    assert f"  error band     0.8187-1.3175 s: {bundled_band().describe()}" in result.output
    flagged = runner.invoke(main, [*args, "--memory-headroom", "0.4"])
    assert "47% of usable (! above the 40% headroom)" in flagged.output


@pytest.mark.parametrize("command", ["search", "estimate"])
def test_headroom_option_is_in_the_help_and_refuses_bad_values(runner, command):
    result = runner.invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "--memory-headroom F" in result.output
    bad = runner.invoke(main, [command, "--model", "bert", "--cluster", "fasop-4xA10", "--memory-headroom", "1.5"])
    assert bad.exit_code == 2 and "--memory-headroom" in bad.output


def test_the_two_searches_build_each_placements_geometry_once(monkeypatch):
    """The search above the headroom reuses the geometries of the search below it (Inputs.geometries): each grid's
    placements are built once, and the plans are those of two searches that build their own."""
    from fasop import load_model
    from fasop.search import headroom, space

    model, cluster = load_model("llama2-7b"), load_cluster("fasop-8xA10")
    built = []
    build = space._dense_geometries
    monkeypatch.setattr(space, "_dense_geometries", lambda inputs, links, placements, *a: built.append(
        (tuple(inputs.cluster.node_types), *a[:3])) or build(inputs, links, placements, *a))  # a: tp, dp, cp, ...
    shared = search_within_headroom(model, cluster, workers=1)
    assert any(over_headroom(plan, cluster, 0.9) for plan in shared.plans)  # the second search ran
    assert built and len(built) == len(set(built))
    with monkeypatch.context() as patch:  # each search its own geometries
        patch.setattr(headroom, "search_plans", lambda *a, geometries=None, **k: search_plans(*a, **k))
        apart = search_within_headroom(model, cluster, workers=1)
    assert [plan.record() for plan in shared.plans] == [plan.record() for plan in apart.plans]


def test_a_table_full_below_the_headroom_leaves_the_search_above_it_out(monkeypatch):
    """Llama 2 7B on eight A10 nodes: 51 plans fit below the headroom, 4 only above it. Five rows are full below
    it, so the search above it is left out (its node-type set has a plan below), and the five rows are the full
    search's; sixty rows need the plans above it, and both searches run."""
    from fasop import load_model
    from fasop.search import headroom

    model, cluster = load_model("llama2-7b"), load_cluster("fasop-8xA10")
    searches = []

    def counted(*args, **kwargs):
        searches.append(kwargs.get("only_combos"))
        return search_plans(*args, **kwargs)

    monkeypatch.setattr(headroom, "search_plans", counted)
    full = search_within_headroom(model, cluster, workers=1)
    assert len(searches) == 2 and not full.headroom_only
    flagged = lambda plan: over_headroom(plan, cluster, 0.9)  # noqa: E731
    assert 0 < sum(map(flagged, full.plans)) < len(full.plans)
    searches.clear()
    five = search_within_headroom(model, cluster, workers=1, places=5)
    assert len(searches) == 1 and five.headroom_only and not any(map(flagged, five.plans))
    assert format_table(five.plans, 5, flagged=flagged) == format_table(full.plans, 5, flagged=flagged)
    searches.clear()
    sixty = search_within_headroom(model, cluster, workers=1, places=60)
    assert len(searches) == 2 and not sixty.headroom_only
    assert format_table(sixty.plans, 60, flagged=flagged) == format_table(full.plans, 60, flagged=flagged)
