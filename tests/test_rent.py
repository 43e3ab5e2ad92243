"""What to rent from a catalogue (`fasop pareto --rent`, fasop/market/rent.py): the integer program under a cap on
the price per hour against exhaustive enumeration, its front against a sweep of every composition with the
stage-group search, a catalogue too large to sweep, the front file and the command line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from fasop.cli import main
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.market.frontfile import front_as_csv, read_front_csv
from fasop.market.pareto import cluster_profiles, compositions, pareto_front
from fasop.market.rent import rent_front
from fasop.search.groupsearch import search_stage_groups
from fasop.search.space import prepare
from fasop.search.stageilp import StageOptions, brute_force, solve_stage_ilp

GAP = 1e-4  # solve_stage_ilp's default relative gap, which the walk uses


def random_problem(seed: int):
    """A small program with two node types, prices and a cap between the cheapest and the dearest option."""
    rng = np.random.default_rng(seed)
    positions, count = int(rng.integers(2, 4)), int(rng.integers(2, 5))
    num_layers = int(rng.integers(positions, 9))
    costs = [rng.integers(0, 8, (positions, count)) / 4 for _ in range(5)]
    costs[1] = costs[1] + 0.25  # a layer always takes time
    options = StageOptions(tuple(rng.choice(["a", "b"], count)), rng.choice([1, 2], count), rng.choice([1, 2], count),
                           rng.integers(1, 3, count), *costs, lo=rng.integers(0, 2, positions),
                           hi=rng.integers(0, num_layers + 1, (positions, count)))
    capacity = {"a": int(rng.integers(1, 2 * positions + 1)), "b": int(rng.integers(1, 2 * positions + 1))}
    prices = {"a": float(rng.integers(1, 9)) / 2, "b": float(rng.integers(1, 9)) / 2}
    cap = float(rng.uniform(1, 6 * positions))
    return options, num_layers, int(rng.integers(1, 6)), capacity, prices, cap


@pytest.mark.parametrize("seed", range(30))
def test_the_program_under_a_price_cap_finds_the_brute_force_optimum(seed):
    options, num_layers, microbatches, capacity, prices, cap = random_problem(seed)
    best = brute_force(options, num_layers, microbatches, capacity, prices=prices, price_cap_per_hour=cap)
    found = solve_stage_ilp(options, num_layers, microbatches, capacity, gap_rel=0.0, prices=prices,
                            price_cap_per_hour=cap)
    assert (found is None) == (best is None)
    if found is not None and best is not None:
        assert found.objective_s == pytest.approx(best.objective_s, rel=1e-9, abs=1e-12)
        price = sum(prices[options.node_type[j]] * options.nodes[j] for j in found.option)
        assert price <= cap * (1 + 1e-6)


def test_a_price_cap_needs_prices():
    options, num_layers, microbatches, capacity, prices, _ = random_problem(0)
    with pytest.raises(ArgumentError, match="price_cap_per_hour"):
        solve_stage_ilp(options, num_layers, microbatches, capacity, price_cap_per_hour=10.0)
    with pytest.raises(ArgumentError, match="prices"):
        brute_force(options, num_layers, microbatches, capacity, prices={"a": 1.0}, price_cap_per_hour=10.0)


def closed_form_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (price per hour, closed-form step) points on the front of both, cheapest first, each once (compositions
    whose best plan leaves the same nodes idle give the same point)."""
    prices, steps = np.array(points).T
    on = pareto_front(steps, prices)
    return sorted({(float(p), float(s)) for p, s, keep in zip(prices, steps, on) if keep})


def assert_same_front(found, expected):
    assert len(found) == len(expected)
    for (price, step), (price_expected, step_expected) in zip(found, expected):
        assert price == pytest.approx(price_expected, rel=1e-9)
        assert step == pytest.approx(step_expected, rel=GAP)


@pytest.fixture(scope="module")
def bert():
    return load_model("bert")


def test_the_front_equals_a_sweep_of_every_composition_with_the_stage_group_search(bert):
    """Two A100 and three A10 nodes of 4 GPUs at most: the walk's points hold the same front of price per hour
    against the closed-form step as the best stage-group plan of each of the 11 compositions."""
    cluster = load_cluster("fasop-1xA100-3xA10").with_counts({"A100": 2, "A10": 3})
    profiles = cluster_profiles(bert, cluster, None, False)
    walk = rent_front(bert, cluster, gbs=16, profiles=profiles)
    assert walk.complete and walk.records and all(r["feasible"] for r in walk.records)
    program = [(plan["cost_per_hour_usd"], plan["closed_form_step_s"]) for plan in walk.plans]
    swept = []
    for composition in compositions(cluster):
        rows = search_stage_groups(prepare(bert, cluster.with_counts(composition), 16, profiles=profiles))
        if rows:
            best = min(rows, key=lambda row: row["closed_form_step_s"])
            swept.append((best["cost_per_hour_usd"], best["closed_form_step_s"]))
    assert_same_front(closed_form_front(program), closed_form_front(swept))
    for record, plan in zip(walk.records, walk.plans):
        assert record["kind"] == plan["kind"] == "stage-groups" and record["placement_search"] == "ilp"
        assert 0 <= record["optimality_gap"] <= GAP
        assert sum(record[f"nodes_{name}"] for name in cluster.node_types) == len(plan["placement"])
        assert record["stage_tp"] == [stage["tp"] for stage in plan["stages"]]
    prices = [r["cost_per_hour_usd"] for r in walk.records]
    assert prices == sorted(prices) and len(set(prices)) == len(prices)  # each cap below the last point's price


def test_the_program_reaches_a_catalogue_too_large_to_sweep(bert):
    """64 nodes each of A100 and A10 are 4,224 compositions, more than a sweep takes; the program's first point,
    without a cap, is the best of the stage-group search over the whole catalogue, and the next is cheaper."""
    cluster = load_cluster("fasop-1xA100-3xA10").with_counts({"A100": 64, "A10": 64})
    with pytest.raises(ArgumentError, match="compositions to sweep"):
        compositions(cluster)
    profiles = cluster_profiles(bert, cluster, None, False)
    walk = rent_front(bert, cluster, gbs=4, profiles=profiles, max_points=2)
    assert walk.quotas == {"A100": 64, "A10": 64} and len(walk.plans) == 2
    cheaper, fastest = walk.plans  # cheapest per hour first
    rows = search_stage_groups(prepare(bert, cluster, 4, profiles=profiles))
    assert fastest["closed_form_step_s"] == pytest.approx(min(r["closed_form_step_s"] for r in rows), rel=GAP)
    assert cheaper["cost_per_hour_usd"] < fastest["cost_per_hour_usd"]
    assert cheaper["closed_form_step_s"] >= fastest["closed_form_step_s"] * (1 - GAP)


def test_the_walk_stops_at_its_point_limit_with_the_fastest_plan(bert):
    cluster = load_cluster("fasop-1xA100-3xA10")
    whole = rent_front(bert, cluster, gbs=16)
    first = rent_front(bert, cluster, gbs=16, max_points=1)
    assert first.stopped_by == "the point limit" and len(first.records) == 1
    assert first.records[0]["step_time_s"] == min(r["step_time_s"] for r in whole.records)


def test_a_program_out_of_time_widens_the_gap_or_stops_the_walk(bert, monkeypatch):
    """With almost no time per program, a program's unproven lower bound enters its cap's gap, and a cap whose
    programs all run out of time ends the walk at the time limit rather than as complete."""
    from fasop.search import groupsearch

    monkeypatch.setattr(groupsearch, "PROGRAM_TIME_LIMIT_S", 1e-6)
    walk = rent_front(bert, load_cluster("fasop-1xA100-3xA10"), gbs=16)
    whole = rent_front(bert, load_cluster("fasop-1xA100-3xA10"), gbs=16, max_points=1)
    assert walk.stopped_by in (None, "the time limit")
    for record in walk.records:
        assert 0 <= record["optimality_gap"] <= 1
        assert record["step_time_s"] >= whole.records[0]["step_time_s"] * (1 - 1e-9)


def test_an_encoder_decoder_model_has_no_stage_group_plans():
    with pytest.raises(InputError, match="decoder-only"):
        rent_front(load_model("t5"), load_cluster("fasop-1xA100-3xA10"))


def test_the_front_file_keeps_each_stages_degrees(bert, tmp_path):
    walk = rent_front(bert, load_cluster("fasop-1xA100-3xA10"), gbs=16, max_points=2)
    text = front_as_csv(walk.records)
    assert text.splitlines()[0].endswith("note,kind,stage_tp,stage_dp,placement_search,optimality_gap")
    path = tmp_path / "front.csv"
    path.write_text(text)
    back = read_front_csv(path)
    for record, read in zip(walk.records, back):
        assert read["stage_tp"] == record["stage_tp"] and read["stage_dp"] == record["stage_dp"]
        assert read["kind"] == "stage-groups" and read["optimality_gap"] == record["optimality_gap"]


def test_cli_pareto_rent_prints_and_writes_the_programs_points(tmp_path):
    out = tmp_path / "front.csv"
    result = CliRunner().invoke(main, ["pareto", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", "--gbs", "16",
                                       "--rent", "--train-steps", "1000", "--budget", "20", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "what to rent, at most 1 A100, 3 A10 nodes" in result.output
    assert "the integer program's fastest stage-group plan under a cap on the price per hour" in result.output
    assert "fastest within the budget of $20.00" in result.output
    records = read_front_csv(out)
    assert records and all(r["kind"] == "stage-groups" and r["placement_search"] == "ilp" for r in records)
    assert any(r["on_front"] for r in records)


@pytest.mark.parametrize("arguments,named", [
    (["--time-limit", "5"], "--time-limit"),
    (["--rent", "--time-limit", "0"], "--time-limit"),
])
def test_cli_pareto_rent_refuses_bad_options(arguments, named):
    result = CliRunner().invoke(main, ["pareto", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", *arguments])
    assert result.exit_code == 2 and named in result.output


def test_cli_pareto_help_names_rent():
    result = CliRunner().invoke(main, ["pareto", "--help"])
    assert result.exit_code == 0 and "--rent" in result.output and "--time-limit" in result.output


def test_the_api_rents_with_the_same_walk(bert):
    import fasop

    frame = fasop.pareto(bert, load_cluster("fasop-1xA100-3xA10"), gbs=16, rent=True, train_steps=1000,
                         deadline_hours=1.0)
    assert frame.attrs["complete"] and (frame["kind"] == "stage-groups").all()
    assert frame.attrs["chosen"] is not None and "cheapest within the deadline" in frame.attrs["choice"]


def test_the_pareto_command_loads_the_solver_only_when_the_walk_runs():
    code = ("import sys; from click.testing import CliRunner; from fasop.cli import main; "
            "r = CliRunner().invoke(main, ['pareto', '--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pulp', 'highspy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
