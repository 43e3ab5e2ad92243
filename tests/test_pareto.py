"""fasop pareto and fasop plot: the Pareto front, budget and deadline answers, compositions, the front file,
the charts, and bad input through the command line."""

import itertools
import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from fasop.cli import main
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.errorband import ErrorBand, bundled_band
from fasop.inputs.model import load_model
from fasop.market.choice import choose
from fasop.market.frontfile import REQUIRED_COLUMNS, front_as_csv, read_front_csv, write_front_csv
from fasop.market.pareto import DEFAULT_TRAIN_STEPS, check_limits, compositions, pareto_front, sweep
from fasop.plans import load_plans
from fasop.plot import plot_front, plot_stages, stage_times
from fasop.search import search_plans

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SVG = "{http://www.w3.org/2000/svg}"

NODE_TYPES = """
[[node_type]]
name = "A100"
gpu = "A100"
instance = "p4d.24xlarge"
gpus_per_node = 4
gpu_memory_gib = {a100_memory}
intra_node_bandwidth = "1840 Gbit/s"
inter_node_bandwidth = "40 Gbit/s"
price_per_hour_usd = 32.7726
price_source = "test"
price_date = "2023-03-01"
count = {a100}

[[node_type]]
name = "A10"
gpu = "A10"
instance = "g5.24xlarge"
gpus_per_node = 4
gpu_memory_gib = {a10_memory}
intra_node_bandwidth = "128 Gbit/s"
inter_node_bandwidth = "40 Gbit/s"
price_per_hour_usd = 8.144
price_source = "test"
price_date = "2023-03-01"
count = {a10}
"""


def cluster_toml(name, a100=2, a10=2, a100_memory=39.59, a10_memory=22.20):
    head = (f'[cluster]\nname = "{name}"\nmemory_margin = 1.10\n\n'
            '[cluster.derating]\np2p_intra_node = 3.5\np2p_inter_node = 1.05\n')
    return head + NODE_TYPES.format(a100=a100, a10=a10, a100_memory=a100_memory, a10_memory=a10_memory)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("pareto")


@pytest.fixture(scope="module")
def cluster_file(folder):
    path = folder / "small.toml"
    path.write_text(cluster_toml("small"))
    return path


@pytest.fixture(scope="module")
def model():
    return load_model("gpt2-xl")


@pytest.fixture(scope="module")
def cluster(cluster_file):
    return load_cluster(str(cluster_file))


@pytest.fixture(scope="module")
def records(model, cluster):
    return sweep(model, cluster, compositions(cluster), train_steps=10_000)


@pytest.fixture(scope="module")
def tight_records(model, folder):
    """One A100 node and one A10 node whose GPUs hold almost nothing: only the A100 node has a plan."""
    path = folder / "tight.toml"
    path.write_text(cluster_toml("tight", a100=1, a10=1, a10_memory=0.1))
    return sweep(model, load_cluster(str(path)), train_steps=1_000)


# -- the Pareto front on hand-made points -----------------------------------------------------------------

def dominated(i, times, costs):
    return any(times[j] <= times[i] and costs[j] <= costs[i] and (times[j] < times[i] or costs[j] < costs[i])
               for j in range(len(times)) if j != i)


def test_front_of_hand_made_points():
    times = [10, 8, 6, 6, 12, 9, 4]
    costs = [100, 120, 150, 140, 90, 130, 300]
    front = pareto_front(times, costs)
    # (6, 150) is dominated by (6, 140); (9, 130) by (8, 120); the rest trade time against cost
    assert front.tolist() == [True, True, False, True, True, False, True]


def test_front_ties_and_single_point():
    # equal points dominate neither each other: both stay on the front
    assert pareto_front([1, 1], [5, 5]).tolist() == [True, True]
    # the same time at a higher cost, or the same cost in more time, is dominated
    assert pareto_front([1, 1], [5, 6]).tolist() == [True, False]
    assert pareto_front([1, 2], [5, 5]).tolist() == [True, False]
    assert pareto_front([3.5], [7.0]).tolist() == [True]
    assert pareto_front([], []).tolist() == []


def test_front_ignores_points_without_a_plan():
    front = pareto_front([math.nan, 2, 1, math.inf], [1, 5, 9, 0])
    assert front.tolist() == [False, True, True, False]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=25))
def test_front_matches_the_definition(points):
    times, costs = [p[0] for p in points], [p[1] for p in points]
    front = pareto_front(times, costs)
    for i in range(len(points)):
        assert front[i] == (not dominated(i, times, costs)), (i, points)
    assert front.any()


# -- budget and deadline -----------------------------------------------------------------------------------

def record(a100, a10, hours, cost, feasible=True):
    return {"nodes_A100": a100, "nodes_A10": a10, "feasible": feasible, "tp": 1, "dp": 1, "pp": a100 + a10, "mbs": 1,
            "train_hours": hours if feasible else None, "train_cost_usd": cost if feasible else None}


HAND = [record(0, 1, 20.0, 100.0), record(0, 2, 11.0, 110.0), record(1, 0, 9.0, 300.0),
        record(1, 1, 6.0, 250.0), record(2, 2, 4.0, 400.0), record(2, 1, None, None, feasible=False)]


def test_budget_gives_the_fastest_within_it():
    best, message = choose(HAND, budget_usd=260, margin=0)
    assert best is HAND[3]
    assert "1 A100 node + 1 A10 node (" in message and "fastest" in message
    assert choose(HAND, budget_usd=400, margin=0)[0] is HAND[4]  # a cost equal to the budget meets it


def test_deadline_gives_the_cheapest_within_it():
    best, message = choose(HAND, deadline_hours=10, margin=0)
    assert best is HAND[3]  # 9 h at $300, 6 h at $250 and 4 h at $400 meet it: $250 is the cheapest
    assert "cheapest" in message and "1 A100 node + 1 A10 node (" in message
    assert choose(HAND, deadline_hours=11, margin=0)[0] is HAND[1]  # the deadline itself counts as met


def test_budget_and_deadline_give_the_cheapest_meeting_both():
    assert choose(HAND, budget_usd=500, deadline_hours=10, margin=0)[0] is HAND[3]
    assert choose(HAND, budget_usd=500, deadline_hours=5, margin=0)[0] is HAND[4]
    assert choose(HAND, budget_usd=120, deadline_hours=15, margin=0)[0] is HAND[1]


def test_unmet_budget_names_the_cheapest_and_the_miss():
    best, message = choose(HAND, budget_usd=80, margin=0)
    assert best is None
    assert "0 A10" not in message and "cheapest, 1 A10 node (" in message
    assert "$20.00" in message and "25.0%" in message


def test_unmet_deadline_names_the_fastest_and_the_miss():
    best, message = choose(HAND, deadline_hours=3, margin=0)
    assert best is None
    assert "2 A100 nodes + 2 A10 nodes (" in message and "1.00 h" in message and "33.3%" in message


def test_unmet_budget_and_deadline_name_the_closest():
    best, message = choose(HAND, budget_usd=200, deadline_hours=5, margin=0)
    assert best is None
    # overshoots: 1 A100 + 1 A10 is 25% over budget and 20% late; 2 A100 + 2 A10 is 100% over budget
    assert "closest, 1 A100 node + 1 A10 node (" in message
    assert "$50.00 (25.0%) over budget" in message and "1.00 h (20.0%) late" in message


BAND = ErrorBand(1.1, 1.5, 2, "a test band")


def test_margin_keeps_a_choice_off_the_limit():
    # 6 h x 1.5 = 9 h meets a 10 h deadline; 6 h x 1.7 = 10.2 h does not, and 4 h x 1.7 = 6.8 h does
    assert choose(HAND, deadline_hours=10, margin=0.5)[0] is HAND[3]
    best, message = choose(HAND, deadline_hours=10, margin=0.7, band=BAND)
    assert best is HAND[4]
    assert "deadline of 10.00 h with a 70% margin (given): 2 A100 nodes + 2 A10 nodes (" in message
    assert message.endswith("at the band's slow end (1.50x) 6.00 h, $600.00")  # 4 h and $400 times 1.5
    # $250 x 1.05 = $262.50 is over a $260 budget: the fastest left within it is 11 h at $110
    assert choose(HAND, budget_usd=260, margin=0.05)[0] is HAND[1]
    assert choose(HAND, budget_usd=500, deadline_hours=5, margin=0.25)[0] is HAND[4]  # 5 h and $500: just met
    assert choose(HAND, budget_usd=500, deadline_hours=5, margin=0.26)[0] is None


def test_default_margin_is_the_bands_slow_end():
    best, message = choose(HAND, deadline_hours=9, band=BAND)  # 50%: 6 h x 1.5 = 9 h meets it, nothing cheaper does
    assert best is HAND[3] and "with a 50% margin (the slow end of the error band, a test band)" in message
    bundled = bundled_band()
    assert choose(HAND, deadline_hours=6 * bundled.high)[0] is HAND[3]
    assert choose(HAND, deadline_hours=6 * bundled.high * 0.999)[0] is HAND[4]


def test_unmet_limit_with_a_margin_says_how_far():
    best, message = choose(HAND, deadline_hours=4, margin=0.5, band=BAND)
    assert best is None  # 4 h x 1.5 = 6 h: 2 h (50%) beyond
    assert "with a 50% margin (given)" in message and "takes 2.00 h (50.0%) longer" in message


@pytest.mark.parametrize("margin", [-0.1, math.nan, math.inf, 11, True])
def test_bad_margins_are_refused_by_argument_name(margin):
    with pytest.raises(InputError, match="margin"):
        choose(HAND, deadline_hours=10, margin=margin)


def test_no_feasible_composition_and_no_limit():
    assert choose([HAND[-1]], budget_usd=10) == (None, "no composition has a plan that fits in memory")
    assert choose(HAND) == (None, "")


@pytest.mark.parametrize("limits", [{"budget_usd": -5}, {"budget_usd": 0}, {"deadline_hours": 0},
                                    {"deadline_hours": -1.5}, {"budget_usd": math.nan}])
def test_non_positive_limits_are_refused(limits):
    with pytest.raises(InputError):
        choose(HAND, **limits)
    with pytest.raises(InputError):
        check_limits(**limits)


# -- compositions -------------------------------------------------------------------------------------------

def test_every_composition_once(cluster):
    found = compositions(cluster)
    assert len(found) == 3 * 3 - 1
    assert found[0] == {"A100": 0, "A10": 1} and found[-1] == {"A100": 2, "A10": 2}
    assert sorted(tuple(c.values()) for c in found) == [c for c in itertools.product(range(3), range(3)) if any(c)]
    assert compositions(cluster) == found  # deterministic


def test_caps(cluster):
    assert compositions(cluster, {"A100": 0}) == [{"A100": 0, "A10": 1}, {"A100": 0, "A10": 2}]
    assert len(compositions(cluster, {"A100": 1, "A10": 1})) == 3
    assert compositions(cluster, {"A10": 99}) == compositions(cluster)  # a cap above what is there changes nothing
    with pytest.raises(InputError, match="nothing to sweep"):
        compositions(cluster, {"A100": 0, "A10": 0})


def test_unknown_or_negative_caps_are_refused(cluster):
    with pytest.raises(InputError) as err:
        compositions(cluster, {"H100": 1})
    assert str(err.value).startswith("max_nodes: unknown node type 'H100'") and "A100, A10" in str(err.value)
    with pytest.raises(InputError, match="^max_nodes: expected a node count >= 0 for A10, got -1"):
        compositions(cluster, {"A10": -1})


def test_compositions_of_three_node_types(folder):
    third = cluster_toml("x", a100=3).split("[[node_type]]")[1].replace('name = "A100"', 'name = "A100b"')
    path = folder / "three.toml"
    path.write_text(cluster_toml("three", a100=2, a10=1) + "\n[[node_type]]" + third)
    three = load_cluster(str(path))
    found = compositions(three)
    assert len(found) == 3 * 2 * 4 - 1
    assert all(list(c) == ["A100", "A10", "A100b"] for c in found)
    assert len({tuple(c.values()) for c in found}) == len(found)


# -- the sweep ----------------------------------------------------------------------------------------------

def test_sweep_keeps_each_compositions_fastest_plan(model, cluster, records):
    assert len(records) == 8
    assert [(r["nodes_A100"], r["nodes_A10"]) for r in records] == [tuple(c.values()) for c in compositions(cluster)]
    mixed = next(r for r in records if r["nodes_A100"] == 1 and r["nodes_A10"] == 1)
    best = search_plans(model, cluster.with_counts({"A100": 1, "A10": 1}), train_steps=10_000).plans[0]
    for key in ("mbs", "tp", "dp", "pp", "placement", "layers_per_stage", "step_time_s", "throughput_samples_per_s",
                "cost_per_hour_usd", "train_hours", "train_cost_usd"):
        assert mixed[key] == getattr(best, key), key
    assert mixed["gpus"] == 8
    for r in records:
        assert r["feasible"] and r["plans_evaluated"] > 0 and r["train_steps"] == 10_000
        assert r["train_cost_usd"] == pytest.approx(r["cost_per_hour_usd"] * r["train_hours"])


def test_sweep_marks_the_front(records):
    times = [r["train_hours"] for r in records]
    costs = [r["train_cost_usd"] for r in records]
    for i, r in enumerate(records):
        assert r["on_front"] == (not dominated(i, times, costs))
    assert any(r["on_front"] for r in records)


def test_compositions_without_a_plan_stay_in_the_sweep(tight_records):
    assert [(r["nodes_A100"], r["nodes_A10"], r["feasible"]) for r in tight_records] == [
        (0, 1, False), (1, 0, True), (1, 1, False)]
    for r in tight_records:
        if not r["feasible"]:
            assert not r["on_front"] and r["step_time_s"] is None and r["tp"] is None
            assert "memory" in r["note"]
    assert tight_records[1]["on_front"]


def test_run_length(model, cluster):
    one = [{"A100": 1, "A10": 0}]
    by_tokens = sweep(model, cluster, one, train_tokens=1e9)[0]
    assert by_tokens["train_steps"] == math.ceil(1e9 / (64 * 1024))
    assert sweep(model, cluster, one)[0]["train_steps"] == DEFAULT_TRAIN_STEPS
    with pytest.raises(InputError):
        sweep(model, cluster, one, train_steps=10, train_tokens=1e9)
    with pytest.raises(InputError):
        sweep(model, cluster, [{"A100": 0, "A10": 0}])
    with pytest.raises(InputError, match="H100"):
        sweep(model, cluster, [{"H100": 1}])


# -- the front file -----------------------------------------------------------------------------------------

def test_csv_columns_and_round_trip(records, tight_records, folder):
    path = folder / "front.csv"
    write_front_csv(records, path)
    header = path.read_text().splitlines()[0].split(",")
    assert header[:5] == ["model", "cluster", "gbs", "nodes_A100", "nodes_A10"]
    assert set(REQUIRED_COLUMNS) <= set(header) and "on_front" in header and "note" in header
    assert len(path.read_text().splitlines()) == 1 + len(records)
    assert read_front_csv(path) == records
    write_front_csv(tight_records, path)
    assert read_front_csv(path) == tight_records
    assert front_as_csv(tight_records) == path.read_text()  # the same records give the same bytes


def test_csv_that_is_not_a_front_is_refused(records, folder):
    plans = folder / "plans.csv"
    plans.write_text("rank,mbs,tp,dp,pp,step_time_s\n1,1,1,4,1,3.0\n")
    with pytest.raises(InputError) as err:
        read_front_csv(plans)
    assert str(plans) in str(err.value) and "train_cost_usd" in str(err.value)
    lines = front_as_csv(records).splitlines()
    columns = lines[0].split(",")
    at = columns.index("train_hours")
    cut = folder / "cut.csv"
    cut.write_text("\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != at) for line in lines))
    with pytest.raises(InputError, match="missing column train_hours"):
        read_front_csv(cut)
    bad = folder / "bad.csv"
    bad.write_text(lines[0] + "\n" + lines[1].replace(",true,", ",maybe,", 1) + "\n")
    with pytest.raises(InputError, match="line 2"):
        read_front_csv(bad)


# -- charts -------------------------------------------------------------------------------------------------

def drawn_shapes(element):
    """Markers drawn inside an SVG element: matplotlib writes each point as a <use> of a marker defined in
    <defs>, or, for a few points, as its own <path>."""
    count = 0
    for child in element:
        if child.tag == f"{SVG}defs":
            continue
        count += child.tag in (f"{SVG}use", f"{SVG}path") and child.tag != f"{SVG}g"
        count += drawn_shapes(child)
    return count


def svg_groups(path):
    """{group id: number of markers drawn in it} of an SVG written by matplotlib."""
    root = ET.parse(path).getroot()
    return {g.get("id"): drawn_shapes(g) for g in root.iter(f"{SVG}g") if g.get("id")}


def expected_series(records):
    kinds = {"A10 only": 0, "A100 only": 0, "mixed": 0}
    for r in records:
        if r["feasible"]:
            used = [t for t in ("A100", "A10") if r[f"nodes_{t}"]]
            kinds["mixed" if len(used) > 1 else f"{used[0]} only"] += 1
    return kinds


def test_front_chart_png(records, folder):
    best, _ = choose(records, budget_usd=300)
    path = folder / "front.png"
    counts = plot_front(records, path, budget=300, deadline=6, chosen=best)
    assert path.read_bytes()[:8] == PNG_MAGIC
    for kind, n in expected_series(records).items():
        assert counts[kind] == n
    assert counts["front"] == sum(r["on_front"] for r in records)
    assert counts["chosen"] == 1 and counts["not shown"] == 0
    from matplotlib.image import imread
    assert imread(path).shape[2] in (3, 4)


def test_front_chart_svg_read_back(records, folder):
    path = folder / "front.svg"
    counts = plot_front(records, path, x="time", deadline=5, chosen=records[-1])
    groups = svg_groups(path)
    for kind, n in expected_series(records).items():
        assert groups[f"series-{kind.replace(' ', '-')}"] == n == counts[kind]
    front = next(g for g in ET.parse(path).getroot().iter(f"{SVG}g") if g.get("id") == "front")
    markers = len(front.findall(f".//{SVG}use"))  # the step line is one <path>, its markers <use> elements
    assert markers == counts["front"] == sum(r["on_front"] for r in records)
    assert groups["chosen"] == 1
    assert ET.parse(path).getroot().tag == f"{SVG}svg"


def test_front_chart_leaves_out_compositions_without_a_plan(tight_records, folder):
    counts = plot_front(tight_records, folder / "tight.svg")
    assert counts == {"A100 only": 1, "front": 1, "chosen": 0, "not shown": 2}


def test_chart_refuses_other_formats_and_axes(records, folder):
    with pytest.raises(InputError, match=".png or .svg"):
        plot_front(records, folder / "front.pdf")
    with pytest.raises(InputError):
        plot_front(records, folder / "front.png", x="cost")
    with pytest.raises(InputError):
        plot_front(records, folder / "front.png", budget=-1)


@pytest.fixture(scope="module")
def plan(model, cluster):
    return search_plans(model, cluster.with_counts({"A100": 1, "A10": 2})).plans[0]


def test_stage_chart(plan, folder):
    path = folder / "stages.svg"
    drawn = plot_stages(plan, path)
    assert set(drawn) == {"compute", "p2p", "dp all-reduce", "idle"}
    assert all(len(values) == plan.pp for values in drawn.values())
    m = plan.num_microbatches
    for s, stage in enumerate(plan.stages):
        assert drawn["compute"][s] == pytest.approx(m * stage.compute_s)
        assert drawn["p2p"][s] == pytest.approx(m * stage.p2p_s)
        total = sum(values[s] for values in drawn.values())
        assert total == pytest.approx(plan.step_time_s)  # every stage's bar spans the step
    root = ET.parse(path).getroot()
    bars = [g.get("id") for g in root.iter(f"{SVG}g") if (g.get("id") or "").startswith("bar-compute-")]
    assert len(bars) == plan.pp
    png = folder / "stages.png"
    plot_stages(plan, png)
    assert png.read_bytes()[:8] == PNG_MAGIC
    for name, values in stage_times(plan).items():
        assert values == pytest.approx(drawn[name])


# -- the command line ---------------------------------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_pareto_command(cluster_file, folder):
    front, chart = folder / "cli-front.csv", folder / "cli-front.png"
    result = run("pareto", "--model", "gpt2-xl", "--cluster", cluster_file, "--train-steps", 10000, "--budget", 300,
                 "--max-nodes", "A100=1", "--output", front, "--chart", chart)
    assert result.exit_code == 0, result.output
    assert "5 compositions swept" in result.output and "plans evaluated" in result.output
    margin = f"{bundled_band().slow_margin:.0%}"
    assert f"fastest within the budget of $300.00 with a {margin} margin (the slow end of the error band" in result.output
    assert len(read_front_csv(front)) == 5
    assert chart.read_bytes()[:8] == PNG_MAGIC
    replot = folder / "cli-replot.svg"
    result = run("plot", front, "--out", replot, "--x", "time", "--deadline", 100, "--margin", 0.1)
    assert result.exit_code == 0, result.output
    assert "cheapest within the deadline of 100.00 h with a 10% margin (given): " in result.output
    assert svg_groups(replot)["chosen"] == 1
    calibrated = folder / "calibrated.toml"
    calibrated.write_text(Path(cluster_file).read_text().replace(
        "[[node_type]]", '[cluster.error_band]\nlow = 0.95\nhigh = 1.12\nruns = 4\nsource = "my runs"\n\n[[node_type]]', 1))
    result = run("plot", front, "--out", folder / "cli-banded.svg", "--deadline", 100, "--cluster", calibrated)
    assert result.exit_code == 0, result.output
    assert "deadline of 100.00 h with a 12% margin (the slow end of the error band, my runs)" in result.output
    one_line_error(run("plot", front, "--out", folder / "cli-unbanded.svg", "--cluster", calibrated), "--cluster")


def test_plot_plan_command(cluster_file, folder):
    plans = folder / "plans.json"
    assert run("search", "--model", "gpt2-xl", "--cluster", cluster_file, "--output", plans).exit_code == 0
    out = folder / "cli-stages.png"
    result = run("plot", "--plan", plans, "--rank", 2, "--out", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_timeline_command(cluster_file, folder):
    plans = folder / "timeline-plans.json"
    assert run("search", "--model", "gpt2-xl", "--cluster", cluster_file, "--output", plans).exit_code == 0
    first, again = folder / "timeline.png", folder / "timeline-again.png"
    plan = next(p for p in load_plans(plans) if p.virtual_stages == 1 and p.pp > 1)
    result = run("plot", "--plan", plans, "--rank", plan.rank, "--timeline", first)
    assert result.exit_code == 0, result.output
    assert f"schedule of plan {plan.rank} ({plan.pp} stages, {plan.num_microbatches} micro-batches" in result.output
    assert first.read_bytes()[:8] == PNG_MAGIC
    assert run("plot", "--plan", plans, "--rank", plan.rank, "--timeline", again).exit_code == 0
    assert again.read_bytes() == first.read_bytes()  # deterministic
    interleaved = next(p for p in load_plans(plans) if p.virtual_stages > 1)
    drawn = folder / "interleaved.png"
    result = run("plot", "--plan", plans, "--rank", interleaved.rank, "--timeline", drawn)
    assert result.exit_code == 0, result.output
    assert drawn.read_bytes()[:8] == PNG_MAGIC
    trace = folder / "timeline.json"  # the same schedule as a Chrome trace, its stages named
    result = run("plot", "--plan", plans, "--rank", plan.rank, "--timeline", trace)
    assert result.exit_code == 0, result.output
    events = json.loads(trace.read_text())["traceEvents"]
    stage = plan.stages[0]
    assert {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": f"stage 0 · {stage.gpu} · layers 1-{stage.layers}"}} in events
    spans = [e for e in events if e["ph"] == "X"]
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(plan.pipeline_time_s * 1e6, rel=1e-9)
    assert sum(e["cat"] == "forward" for e in spans) == plan.pp * plan.num_microbatches
    one_line_error(run("plot", "--plan", plans, "--rank", 9999, "--timeline", folder / "t.png"), "--rank 9999")
    one_line_error(run("plot", "--plan", plans, "--rank", plan.rank, "--timeline", folder / "t.pdf"), "--timeline")
    one_line_error(run("plot", "--plan", plans, "--timeline", folder / "t.png", "--out", folder / "s.png"), "--timeline")
    # a plan file without the per-stage forward times (older fasop) cannot be drawn
    records = json.loads(plans.read_text())
    for stage in records[plan.rank - 1]["stages"]:
        del stage["forward_s"]
    old = folder / "old-plans.json"
    old.write_text(json.dumps(records))
    one_line_error(run("plot", "--plan", old, "--rank", plan.rank, "--timeline", folder / "t.png"), "stages[0].forward_s")
    # nor an interleaved plan without its chunks' times
    records = json.loads(plans.read_text())
    del records[interleaved.rank - 1]["stages"][1]["chunks"]
    old.write_text(json.dumps(records))
    one_line_error(run("plot", "--plan", old, "--rank", interleaved.rank, "--timeline", folder / "t.png"),
                   "stages[1].chunks", "2 model chunks")
    # nor one whose chunk times are negative or absurd
    for bad in (-1.0, 1e12):
        records = json.loads(plans.read_text())
        records[interleaved.rank - 1]["stages"][0]["chunks"][1]["backward_s"] = bad
        old.write_text(json.dumps(records))
        one_line_error(run("plot", "--plan", old, "--rank", interleaved.rank, "--timeline", folder / "t.png"),
                       "stages[0].chunks[1].backward_s", "expected seconds from 0")
    assert not (folder / "t.png").exists() and not (folder / "t.pdf").exists()


@pytest.mark.parametrize("args, words", [
    (["--budget", "-5", "--train-steps", "10"], ["--budget", "from 0.01"]),
    (["--deadline", "0", "--train-steps", "10"], ["--deadline"]),
    (["--budget", "100"], ["--train-steps"]),
    (["--margin", "0.2", "--train-steps", "10"], ["--margin", "--budget or --deadline"]),
    (["--budget", "100", "--train-steps", "10", "--margin", "-0.1"], ["--margin"]),
    (["--budget", "100", "--train-steps", "10", "--margin", "nan"], ["--margin"]),
    (["--max-nodes", "H100=2"], ["--max-nodes", "H100", "A100, A10"]),
    (["--max-nodes", "A100"], ["--max-nodes", "TYPE=N"]),
    (["--max-nodes", "A100=two"], ["--max-nodes", "TYPE=N"]),
    (["--max-nodes", "A100=-1"], ["--max-nodes"]),
    (["--chart", "front.pdf"], ["--chart"]),
    (["--output", "front.json"], ["--output"]),
])
def test_pareto_bad_input(cluster_file, args, words):
    one_line_error(run("pareto", "--model", "gpt2-xl", "--cluster", cluster_file, *args), *words)


def test_margin_is_in_the_help():
    for command in ("pareto", "plot"):
        result = run(command, "--help")
        assert result.exit_code == 0 and "--margin F" in result.output and "error band" in result.output


def test_plot_bad_input(cluster_file, records, folder):
    not_front = folder / "not-front.csv"
    not_front.write_text("rank,mbs,tp\n1,1,1\n")
    one_line_error(run("plot", not_front, "--out", folder / "x.png"), str(not_front), "missing column")
    front = folder / "good-front.csv"
    write_front_csv(records, front)
    one_line_error(run("plot", front, "--out", folder / "x.pdf"), "--out")
    one_line_error(run("plot", front, "--out", folder / "x.png", "--budget", "-1"), "--budget")
    one_line_error(run("plot", "--out", folder / "x.png"), "--plan")
    not_plans = folder / "not-plans.json"
    for content in ('{"rank": 1}', "[]", "[1, 2]", "not json", '[{"rank": 1, "tp": 1}]'):
        not_plans.write_text(content)
        one_line_error(run("plot", "--plan", not_plans, "--out", folder / "x.png"), str(not_plans))
    plans = folder / "few-plans.json"
    one_a10 = load_cluster(str(cluster_file)).with_counts({"A10": 1})
    plans.write_text(json.dumps([p.record() for p in search_plans(load_model("gpt2-xl"), one_a10).plans[:3]]))
    one_line_error(run("plot", "--plan", plans, "--rank", 4, "--out", folder / "x.png"), "--rank", "ranks 1-3")
    one_line_error(run("plot", "--plan", plans, "--rank", 0, "--out", folder / "x.png"), "--rank")


def test_search_does_not_import_matplotlib(cluster_file):
    code = ("import sys; from click.testing import CliRunner; from fasop.cli import main; import fasop.market.pareto; "
            f"r = CliRunner().invoke(main, ['search', '--model', 'gpt2-xl', '--cluster', {str(cluster_file)!r}, '--top', '1']); "
            "assert r.exit_code == 0, r.output; print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
