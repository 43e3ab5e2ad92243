"""Charts and pages of hostile plan and front files: texts drawn as written, schedules Megatron-LM cannot run
refused, label placement and chart sizes bounded, names and the parts of a plan checked when the file is read,
bad values, mixed and duplicated results refused in one line by plot and report alike."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error

from fasop import chart
from fasop.chart import LABEL_GID, MAX_LABELS, MAX_ROWS, figure_bytes
from fasop.cli import main
from fasop.cost.schedule import op_times
from fasop.market.frontfile import read_front_csv
from fasop.plans import Plan
from fasop.plot import front_chart, stage_chart
from fasop.timeline import timeline_chart

FRONT = Path(__file__).parent / "data" / "front-gpt2-xl-fasop-pareto.csv"  # the README's pareto example
# texts that matplotlib's mathematics parser refuses (an unclosed \frac, an unknown symbol), and one it would draw
# without its dollar signs
MATH = r"$\frac{$ a$b$c$\undefinedcmd$ cost $5 and $6"


def plan_record(pp: int = 4, microbatches: int = 8, virtual: int = 1, **changes) -> dict:
    """A 3D plan of `pp` stages (one layer per model chunk) whose parts agree, with the times that the stage chart,
    the timeline and the report draw."""
    stages = [{"stage": i, "gpu": "A100", "nodes": [i], "layers": virtual, "compute_s": 0.3, "forward_s": 0.1,
               "recompute_s": 0.0, "send_s": 0.01 if i < pp - 1 else 0.0, "p2p_s": 0.02, "dp_allreduce_s": 0.05,
               "memory_gib": 10.0, "memory_capacity_gib": 80.0} for i in range(pp)]
    interleaved: dict = {}
    if virtual > 1:
        for stage in stages:
            stage["chunks"] = [{"forward_s": 0.05, "recompute_s": 0.0, "backward_s": 0.1}] * virtual
        interleaved = {"virtual_stages": virtual, "layers_per_virtual_stage": [1] * (pp * virtual),
                       "wrap_send_s": 0.01}
    return {"rank": 1, "model": "gpt2-xl", "cluster": "fasop-1xA100-7xA10", "gbs": microbatches, "mbs": 1, "tp": 1,
            "dp": 1, "pp": pp, "num_microbatches": microbatches, "placement": ["A100"] * pp,
            "layers_per_stage": [virtual] * pp, "step_time_s": 10.0, "stages": stages, **interleaved, **changes}


def group_record(**changes) -> dict:
    """A stage-group plan of two stages, each of tp 1 and dp 2 on a node of its own type."""
    stages = [{**plan_record(pp=2)["stages"][i], "gpu": gpu, "tp": 1, "dp": 2, "mbs": 1} for i, gpu in
              enumerate(["A100", "A10"])]
    return plan_record(pp=2, microbatches=8, kind="stage-groups", gbs=16, dp=2, placement=["A100", "A10"],
                       stages=stages, **changes)


def write(path: Path, *records: dict) -> Path:
    path.write_text(json.dumps(list(records)))
    return path


def invoke(runner, *args):
    return runner.invoke(main, [str(arg) for arg in args])


def outputs(tmp_path: Path) -> dict[str, Path]:
    return {"stages": tmp_path / "stages.png", "timeline": tmp_path / "timeline.json", "page": tmp_path / "page.html"}


def refused_everywhere(runner, plans: Path, tmp_path: Path, *fragments: str) -> None:
    """`fasop plot --out`, `fasop plot --timeline` and `fasop report` each refuse `plans` in one line naming
    `fragments`, and write nothing."""
    out = outputs(tmp_path)
    one_line_error(invoke(runner, "plot", "--plan", plans, "--out", out["stages"]), *fragments)
    one_line_error(invoke(runner, "plot", "--plan", plans, "--timeline", out["timeline"]), *fragments)
    one_line_error(invoke(runner, "report", plans, "--output", out["page"]), *fragments)
    assert not any(path.exists() for path in out.values())


def front_rows(count: int, **names: str) -> list[dict]:
    """`count` compositions of one node type crowded along the front, each 0.05 samples/s faster and $0.70 dearer
    than the one before."""
    node = names.get("node", "A10")
    rows = []
    for i in range(count):
        throughput, cost = 10.0 + 0.05 * i, 1000.0 + 0.7 * i
        hours = 1e6 / (3600 * throughput)
        rows.append({"model": names.get("model", "gpt2-xl"), "cluster": names.get("cluster", "fasop-pareto"),
                     "gbs": 64, "train_steps": 1000, f"nodes_{node}": i + 1, "feasible": True, "on_front": True,
                     "throughput_samples_per_s": throughput, "train_hours": hours, "train_cost_usd": cost,
                     "cost_per_hour_usd": cost / hours})
    return rows


# -- texts drawn as written ---------------------------------------------------------------------------------


def test_dollar_signs_in_any_text_are_drawn_as_written_in_every_chart():
    from matplotlib.text import Text

    forward = np.array([[0.1, 0.1]])
    figures = [stage_chart(Plan.model_validate(plan_record(pp=2)), title=MATH)[0],
               timeline_chart(op_times(forward, 2 * forward, np.array([[0.01]]), 4), title=MATH,
                              stage_names=[MATH, "stage 1"])[0]]
    front, counts = front_chart(front_rows(3, model=MATH, cluster=MATH, node=MATH))
    assert counts[f"{MATH} only"] == 3
    for fig in [*figures, front]:
        for suffix in (".png", ".svg"):
            assert figure_bytes(fig, suffix)
        texts = fig.findobj(Text)  # the tick labels too, made as the figure is saved
        assert any(MATH in text.get_text() for text in texts) and not any(text.get_parse_math() for text in texts)


# -- schedules Megatron-LM cannot run ------------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "microbatches", "reason"), [
    (16, 3, "group size 16 must lie between the 16 stages and the 3 micro-batches"),
    (16, 17, "17 micro-batches leave a last group of 1"),
    (1, 4, "interleaving needs at least 2 pipeline stages")])
def test_an_interleaved_schedule_megatron_cannot_run_is_refused_and_noted(runner, tmp_path, pp, microbatches, reason):
    plans = write(tmp_path / "plans.json", plan_record(pp=pp, microbatches=microbatches, virtual=2))
    out = outputs(tmp_path)
    one_line_error(invoke(runner, "plot", "--plan", plans, "--timeline", out["timeline"]), "plan 1: virtual_stages",
                   reason)
    assert not out["timeline"].exists()
    result = invoke(runner, "report", plans, "--output", out["page"])
    assert result.exit_code == 0, result.output
    assert f"No schedule: {plans}: plan 1: virtual_stages: " in out["page"].read_text()


# -- label placement bounded -------------------------------------------------------------------------------------


def test_a_long_crowded_front_labels_at_most_max_labels_points_the_same_every_time():
    """120 front points in a crowd: the integer program of every point's label ran past two minutes."""
    rows = front_rows(120)
    fig, counts = front_chart(rows)
    first = figure_bytes(fig, ".png")
    drawn = [t.get_gid() for t in fig.axes[0].texts if (t.get_gid() or "").startswith(LABEL_GID)]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    named = [entry for entry in legend if entry.split(":")[0].isdigit()]
    full = [gid for gid in drawn if not gid.endswith("-number")]
    assert counts["front"] == 120 and full and len(full) + len(named) == MAX_LABELS  # each label drawn or named
    fig, _ = front_chart(rows)
    assert figure_bytes(fig, ".png") == first


def test_out_of_time_no_label_is_drawn_and_each_is_named_in_the_legend(monkeypatch):
    monkeypatch.setattr(chart, "LABEL_TIME_LIMIT_S", 0.0)
    fig, counts = front_chart(read_front_csv(FRONT))
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert not [t for t in fig.axes[0].texts if (t.get_gid() or "").startswith(LABEL_GID)]
    assert len([entry for entry in legend if entry.split(":")[0].isdigit()]) == counts["front"] == 5


def test_the_overlapping_label_pairs_are_the_pairs_of_boxes_that_meet():
    rng = np.random.default_rng(7)
    corners = rng.uniform(0, 300, (200, 2))
    boxes = np.column_stack([corners, corners + rng.uniform(0, 40, (200, 2))])
    owner = rng.integers(0, 25, 200)
    gap = chart.GAP_PX
    meet = ((boxes[:, None, 0] < boxes[None, :, 2] + gap) & (boxes[None, :, 0] < boxes[:, None, 2] + gap)
            & (boxes[:, None, 1] < boxes[None, :, 3] + gap) & (boxes[None, :, 1] < boxes[:, None, 3] + gap))
    a, b = np.nonzero(np.triu(meet & (owner[:, None] != owner[None, :]), k=1))
    found = chart._meeting(boxes, owner)
    assert len(a) > 100 and np.array_equal(found[0], a) and np.array_equal(found[1], b)


# -- names and the parts of a plan -------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "fragments"), [
    ({"stage_gpu": "A" * 100_000}, ["entry 0: stages[0].gpu", "GPU type names joined by +"]),
    ({"stage_gpu": ""}, ["entry 0: stages[0].gpu", "got ''"]),
    ({"stage_gpu": "A10\nX"}, ["entry 0: stages[0].gpu", "got 'A10\\nX'"]),
    ({"placement": ["A 10", "A100", "A100", "A100"]}, ["entry 0: placement[0]", "a node-type name", "'A 10'"]),
    ({"model": "<script>\"&'x"}, ["entry 0: model", "a name of 1 to 64"])])
def test_names_in_a_plan_file_follow_the_name_rule(runner, tmp_path, change, fragments):
    record = plan_record(**{k: v for k, v in change.items() if k != "stage_gpu"})
    if "stage_gpu" in change:
        record["stages"][0]["gpu"] = change["stage_gpu"]
    refused_everywhere(runner, write(tmp_path / "plans.json", record), tmp_path, *fragments)


def stages_of(pp: int) -> list[dict]:
    return plan_record(pp=pp)["stages"]


@pytest.mark.parametrize(("change", "fragments"), [
    ({"pp": 2**53}, ["entry 0: layers_per_stage: 4 entries", "pp = 9007199254740992"]),
    ({"pp": 2, "layers_per_stage": [1, 1]}, ["entry 0: stages: 4 rows", "(pp = 2)"]),
    ({"stages": stages_of(4) * 250}, ["entry 0: stages: 1000 rows", "(pp = 4)"]),
    ({"layers_per_stage": [1, 2]}, ["entry 0: layers_per_stage: 2 entries", "(pp = 4)"]),
    ({"layers_per_stage": [2**53] * 4, "stages": [{**s, "layers": 2**53} for s in stages_of(4)]},
     ["entry 0: layers_per_stage", "layers in all, expected at most"]),
    ({"layers_per_stage": [1, 1, 1, 2]}, ["entry 0: stages: 4 layers in all, expected the 5 of layers_per_stage"]),
    ({"stages": [{**s, "layers": 2**53} for s in stages_of(4)]}, ["entry 0: stages: 36,028,797,018,963,968 layers"]),
    ({"stages": [{**s, "stage": 3 - s["stage"]} for s in stages_of(4)]}, ["entry 0: stages[0].stage", "got 3"]),
    ({"stages": [{**s, "nodes": [2**53]} for s in stages_of(4)]}, ["entry 0: stages[0].nodes", "4 nodes"])])
def test_the_parts_of_a_plan_agree(runner, tmp_path, change, fragments):
    refused_everywhere(runner, write(tmp_path / "plans.json", {**plan_record(), **change}), tmp_path, *fragments)


def test_a_stage_group_plan_whose_stage_no_longer_fits_its_nodes_is_refused(runner, tmp_path):
    good = write(tmp_path / "good.json", group_record())
    assert invoke(runner, "plot", "--plan", good, "--out", tmp_path / "good.png").exit_code == 0
    record = group_record()
    record["stages"][1]["dp"] = 10**15
    refused_everywhere(runner, write(tmp_path / "plans.json", record), tmp_path,
                       "entry 0: stages[1].dp", "1,000,000,000,000,000 GPUs do not fit on its 1 nodes")
    refused_everywhere(runner, write(tmp_path / "tp.json", group_record(tp=2)), tmp_path,
                       "entry 0: tp: expected the first stage's tp and dp (1, 2), got (2, 2)")


# -- chart sizes ---------------------------------------------------------------------------------------------------


def test_a_plan_of_more_stages_than_a_chart_draws_is_refused_by_plot_and_noted_by_report(runner, tmp_path):
    most = write(tmp_path / "most.json", plan_record(pp=MAX_ROWS, microbatches=1))
    assert invoke(runner, "plot", "--plan", most, "--out", tmp_path / "most.png").exit_code == 0
    plans = write(tmp_path / "plans.json", plan_record(pp=MAX_ROWS + 1, microbatches=1))
    out = outputs(tmp_path)
    fragments = ("plan 1: pp", f"{MAX_ROWS + 1} stages", f"at most {MAX_ROWS}")
    one_line_error(invoke(runner, "plot", "--plan", plans, "--out", out["stages"]), *fragments)
    one_line_error(invoke(runner, "plot", "--plan", plans, "--timeline", tmp_path / "timeline.png"), *fragments)
    assert not out["stages"].exists() and not (tmp_path / "timeline.png").exists()
    result = invoke(runner, "report", plans, "--output", out["page"])
    assert result.exit_code == 0, result.output
    assert f"No stage chart: {plans}: plan 1: pp: {MAX_ROWS + 1} stages" in out["page"].read_text()


# -- out-of-range, mixed and duplicated results ---------------------------------------------------------------------


@pytest.mark.parametrize(("change", "fragment"), [
    ({"compute_s": -1.0}, "stages[0].compute_s: expected seconds from 0 to 1e+09, got -1.0"),
    ({"compute_s": 1e300}, "stages[0].compute_s: expected seconds from 0 to 1e+09, got 1e+300"),
    ({"step_time_s": 0.0}, "step_time_s: expected a positive number up to 1e+09, got 0.0")])
def test_report_refuses_the_values_plot_refuses(runner, tmp_path, change, fragment):
    record = plan_record()
    if "compute_s" in change:
        record["stages"][0].update(change)
    else:
        record.update(change)
    plans = write(tmp_path / "plans.json", plan_record(rank=2), record)
    refused_everywhere(runner, plans, tmp_path, f"plans.json: plan 1: {fragment}")


def test_a_result_of_several_models_or_clusters_is_refused(runner, tmp_path):
    page = tmp_path / "page.html"
    plans = write(tmp_path / "plans.json", plan_record(), plan_record(rank=2, model="bert"))
    one_line_error(invoke(runner, "report", plans, "--output", page), "plans.json: model", "'gpt2-xl' and 'bert'")
    rows = list(csv.reader(io.StringIO(FRONT.read_text())))
    rows[-1][rows[0].index("cluster")] = "another-cluster"
    front = tmp_path / "front.csv"
    with front.open("w", newline="") as handle:
        csv.writer(handle, lineterminator="\n").writerows(rows)
    one_line_error(invoke(runner, "report", front, "--output", page), "front.csv: cluster", "'another-cluster'")
    one_line_error(invoke(runner, "plot", front, "--out", tmp_path / "front.png"), "front: cluster", "another-cluster")
    assert not page.exists() and not (tmp_path / "front.png").exists()


def test_a_rank_or_a_key_given_twice_is_refused(runner, tmp_path):
    twice = write(tmp_path / "twice.json", plan_record(), plan_record())
    refused_everywhere(runner, twice, tmp_path, "entry 1: rank", "1 is also the rank of entry 0")
    text = json.dumps([plan_record()])
    key = tmp_path / "key.json"
    key.write_text(text.replace('"rank": 1,', '"rank": 1, "rank": 1,', 1))
    refused_everywhere(runner, key, tmp_path, "key.json: not a fasop plan", "'rank' given twice")


# -- messages ------------------------------------------------------------------------------------------------------


def test_an_integer_too_long_to_read_is_refused_naming_its_field_and_range(runner, tmp_path):
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps([plan_record()]).replace('"gbs": 8', '"gbs": ' + "9" * 5000, 1))
    line = one_line_error(invoke(runner, "report", plans, "--output", tmp_path / "page.html"),
                          "entry 0: gbs: expected an integer from 1 to 9,007,199,254,740,992",
                          "got an integer of 5,000 digits")
    assert "set_int_max_str_digits" not in line


@pytest.mark.parametrize(("change", "fragment"), [
    ({"placement": []}, "entry 0: placement: expected a list of one or more node-type names, got []"),
    ({"stages": "A10"}, "entry 0: stages: expected a list of stage objects, got 'A10'")])
def test_a_bad_list_is_refused_in_the_words_of_a_json_file(runner, tmp_path, change, fragment):
    plans = write(tmp_path / "plans.json", plan_record(**change))
    line = one_line_error(invoke(runner, "plot", "--plan", plans, "--out", tmp_path / "o.png"), fragment)
    assert "[[" not in line and "tables" not in line


@pytest.mark.parametrize(("option", "what"), [("--model", "model"), ("--cluster", "cluster")])
def test_compare_refuses_an_empty_model_or_cluster_naming_the_option(runner, option, what):
    names = {"--model": "gpt2-xl", "--cluster": "fasop-1xA100-7xA10", option: ""}
    one_line_error(invoke(runner, "compare", "--model", names["--model"], "--cluster", names["--cluster"]),
                   f"Error: {option}: an empty name is no {what}")
