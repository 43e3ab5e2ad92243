"""Charts a person can read: the labels of a front chart never overlap (their extents as the renderer draws them),
axes turn logarithmic where values span more than LOG_SPAN, titles are wrapped inside the figure, and timeline
rows name their stage, GPU type and layers."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fasop.chart import LABEL_GID, LOG_SPAN
from fasop.cost.schedule import op_times
from fasop.market.frontfile import read_front_csv
from fasop.market.pareto import mark_front
from fasop.plans import Plan
from fasop.plot import front_chart, stage_chart, stage_names
from fasop.timeline import timeline_chart

# The front file of the README's pareto example (fasop pareto --model gpt2-xl --cluster fasop-pareto
# --train-tokens 1e10 --budget 3000 --output front.csv): the chart the README shows, drawn from it.
README_FRONT = Path(__file__).parent / "data" / "front-gpt2-xl-fasop-pareto.csv"


def drawn(fig):
    """The renderer of the figure as saved (PNG at its dpi), after the save has laid it out."""
    fig.savefig(io.BytesIO(), format="png", dpi=100)
    return fig.canvas.get_renderer()


def label_boxes(fig, renderer) -> dict[str, object]:
    from matplotlib.text import Text

    return {text.get_gid(): Text.get_window_extent(text, renderer) for text in fig.findobj(Text)
            if (text.get_gid() or "").startswith(LABEL_GID) and text.get_text()}


def assert_readable(fig, labels: int) -> None:
    """No two labels intersect, every label lies inside the axes, and each label is drawn in full or as a number,
    or is named in the legend."""
    renderer = drawn(fig)
    boxes = label_boxes(fig, renderer)
    frame = fig.axes[0].get_window_extent(renderer)
    names = sorted(boxes)
    for i, a in enumerate(names):
        box = boxes[a]
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, a
        for b in names[i + 1:]:
            assert not box.overlaps(boxes[b]), (a, b)
    full = {name for name in names if not name.endswith("-number")}
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    numbered = [entry for entry in legend if entry.split(":")[0].isdigit()]
    assert len(full) + len(numbered) == labels
    assert len(boxes) - len(full) <= len(numbered)  # a number on the chart always has its legend entry


def test_the_readme_front_chart_has_no_overlapping_labels():
    records = read_front_csv(README_FRONT)
    chosen = max((r for r in records if r["train_cost_usd"] <= 3000), key=lambda r: r["throughput_samples_per_s"])
    fig, counts = front_chart(records, budget=3000, chosen=chosen)
    assert counts["front"] == 5 and counts["chosen"] == 1
    assert_readable(fig, labels=5)  # four front points and the chosen one, which is also on the front
    # the README's throughputs span 23 to 262 samples/s, more than LOG_SPAN: a logarithmic axis; costs do not
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "linear"


def front_records(hours: list[float], costs: list[float], nodes: list[tuple[int, int]]) -> list[dict]:
    samples = 1e6
    return [{"model": "m", "cluster": "c", "gbs": 64, "train_steps": 1000, "nodes_A100": a, "nodes_A10": b,
             "feasible": True, "on_front": False, "train_hours": h, "train_cost_usd": c,
             "throughput_samples_per_s": samples / (3600 * h), "cost_per_hour_usd": c / h}
            for h, c, (a, b) in zip(hours, costs, nodes)]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # a chart takes a second: no shrinking
@given(data=st.data(), count=st.integers(2, 40), x=st.sampled_from(["throughput", "time"]))
def test_a_crowd_of_front_points_gets_labels_that_never_overlap(data, count, x):
    """Front points only (hours up, cost down), crowded into a narrow band or spread over decades, with nodes
    that make labels of different widths, and the chosen one among them."""
    spread = data.draw(st.sampled_from([1.05, 3.0, 1e3]))
    hours = sorted(set(data.draw(st.lists(st.floats(1.0, spread), min_size=count, max_size=count))))
    costs = sorted(data.draw(st.lists(st.floats(100.0, 101.0 if spread < 2 else 1e5), min_size=len(hours),
                                      max_size=len(hours), unique=True)), reverse=True)
    nodes = data.draw(st.lists(st.tuples(st.integers(0, 16), st.integers(1, 16)), min_size=len(hours),
                               max_size=len(hours), unique=True))  # each composition once, as in a sweep
    records = front_records(hours, costs, nodes)
    mark_front(records)
    chosen = data.draw(st.sampled_from([None, *records]))
    fig, _ = front_chart(records, x=x, chosen=chosen)
    assert_readable(fig, labels=sum(r["on_front"] for r in records))


def test_a_crowd_too_dense_for_its_labels_numbers_them_in_the_legend():
    """Thirty compositions within a thousandth of an hour and a dollar of each other, between two far away."""
    hours = [0.5, *np.linspace(1.0, 1.001, 30), 10.0]
    costs = [4000.0, *np.linspace(2000.0, 1999.0, 30), 1000.0]
    records = front_records(hours, costs, [(16, 0), *[(8, 8)] * 30, (0, 1)])
    fig, _ = front_chart(records, x="time")
    assert_readable(fig, labels=32)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(re.fullmatch(r"\d+: 8A100\+8A10 \(1\.0\d* h, \$\d,\d{3}\)", entry) for entry in legend), legend


def test_axes_turn_logarithmic_beyond_the_span():
    """One slow composition (6,520 hours) beside ten-hour ones: a log axis of time and of cost; a span within
    LOG_SPAN stays linear."""
    wide = front_records([10.0, 12.0, 6520.0], [5000.0, 4000.0, 300.0], [(8, 0), (4, 0), (0, 1)])
    fig, _ = front_chart(wide, x="time")
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"
    narrow = front_records([10.0, 10 * LOG_SPAN * 0.99], [5000.0, 4000.0], [(8, 0), (4, 0)])
    fig, _ = front_chart(narrow, x="time")
    assert fig.axes[0].get_xscale() == "linear"


def test_wrapped_titles_fit_their_figure():
    long_title = "placement " + ",".join(["A10G*8", "H100*8"] * 12)
    records = front_records([1.0, 2.0], [200.0, 100.0], [(1, 0), (0, 1)])
    fig, _ = front_chart(records, title=long_title)
    renderer = drawn(fig)
    assert "\n" in fig.axes[0].title.get_text()
    title = fig.axes[0].title.get_window_extent(renderer)
    assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1


def three_stage_plan(**changes) -> Plan:
    stages = [{"stage": i, "gpu": gpu, "nodes": [i], "layers": layers, "compute_s": 0.3, "forward_s": 0.1,
               "recompute_s": 0.0, "send_s": 0.01 if i < 2 else 0.0, "p2p_s": 0.02, "dp_allreduce_s": 0.05,
               "memory_gib": 10.0, "memory_capacity_gib": 22.0}
              for i, (gpu, layers) in enumerate([("A100", 4), ("A10G", 3), ("H100", 5)])]
    record = {"rank": 1, "model": "gpt2-xl", "gbs": 8, "mbs": 1, "tp": 1, "dp": 1, "pp": 3, "num_microbatches": 8,
              "placement": ["A100", "A10G", "H100"], "layers_per_stage": [4, 3, 5], "step_time_s": 4.0,
              "stages": stages, **changes}
    return Plan.model_validate(record)


def test_stage_names_number_the_layers_in_pipeline_order():
    assert stage_names(three_stage_plan()) == ["stage 0 · A100 · layers 1-4", "stage 1 · A10G · layers 5-7",
                                               "stage 2 · H100 · layers 8-12"]
    # interleaved: chunk c of stage i is virtual stage c * pp + i
    interleaved = three_stage_plan(virtual_stages=2, layers_per_virtual_stage=[2, 2, 3, 2, 1, 2])
    assert stage_names(interleaved) == ["stage 0 · A100 · layers 1-2,8-9", "stage 1 · A10G · layers 3-4,10",
                                        "stage 2 · H100 · layers 5-7,11-12"]


def test_the_stage_chart_title_is_wrapped_inside_the_figure():
    plan = three_stage_plan(placement=["A10G"] * 8 + ["H100"] * 8 + ["A10G"] * 8 + ["H100"] * 8 + ["A100"] * 3,
                            model="a-model-with-a-rather-long-name")
    fig, _ = stage_chart(plan)
    renderer = drawn(fig)
    title = fig.axes[0].title
    assert "\n" in title.get_text()
    box = title.get_window_extent(renderer)
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][0] == "stage 0 · A100 · layers 1-4 · node 0"


@pytest.mark.parametrize("microbatches", [4, 256])
def test_timeline_rows_are_named_and_numbers_only_fill_bars_wide_enough(microbatches):
    forward = np.array([[1.0, 2.0, 1.5]])
    times = op_times(forward, 2 * forward, np.array([[0.2, 0.0]]), microbatches)
    names = stage_names(three_stage_plan())
    fig, _ = timeline_chart(times, stage_names=names)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == names
    renderer = drawn(fig)
    numbers = [t for t in ax.texts if t.get_text()]
    if microbatches == 4:  # wide bars: every forward and backward numbered
        assert len(numbers) == 2 * 3 * microbatches
    px_per_s = ax.get_window_extent(renderer).width / float(times.makespan_s[0])
    narrowest_px = 1.0 * px_per_s  # stage 0's forward
    hatched = [c.get_hatch() for c in ax.collections if c.get_hatch()]
    if microbatches == 256:  # bars under 4 pixels: blocks of colour, without hatching, only some numbered
        assert narrowest_px < 4 and len(numbers) < 2 * 3 * microbatches and not hatched
    else:
        assert hatched  # idle and send time hatched for a grey print
    for text in numbers:  # each number inside its bar: narrower than the bar it sits in
        width = text.get_window_extent(renderer).width
        x = text.get_position()[0]
        stage = round(text.get_position()[1])
        assert width < 2.0 * float(forward[0, stage]) * px_per_s, (text.get_text(), x)  # its backward: 2x


def test_a_stage_group_plans_rows_and_title_name_each_stages_degrees():
    from fasop.inputs.cluster import load_cluster
    from fasop.inputs.model import load_model
    from fasop.search.stagegroups import StageGroup, estimate_stage_groups, stage_group_spec
    from fasop.timeline import plan_op_times, timeline_title

    model, cluster = load_model("gpt2-xl"), load_cluster("fasop-1xA100-3xA10")
    stages = [StageGroup("A100", 4, 1, 24), StageGroup("A10", 2, 2, 8), StageGroup("A10", 4, 1, 8),
              StageGroup("A10", 4, 1, 8)]
    spec = stage_group_spec(model, cluster, placement=["A100", "A10", "A10", "A10"], stages=stages, mbs=4)
    plan = estimate_stage_groups(model, cluster, spec).model_copy(update={"rank": 1})
    assert stage_names(plan) == ["stage 0 · A100 tp4 dp1 · layers 1-24", "stage 1 · A10 tp2 dp2 · layers 25-32",
                                 "stage 2 · A10 tp4 dp1 · layers 33-40", "stage 3 · A10 tp4 dp1 · layers 41-48"]
    title = timeline_title(plan, plan_op_times(plan, "plan"))
    assert title.startswith("plan 1: stage groups, pp=4, micro-batch 4 across each stage's dp, 16 micro-batches")
