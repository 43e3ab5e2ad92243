"""Stage-group plans (plan kind "stage-groups"): each pipeline stage with its own GPU type, tp, dp and layers.

A plan whose stages share one tp and dp is the 3D plan of that shape and estimates exactly as it does; the rank
layout, the resharding of activations between stages of different degrees and the refusals are checked by hand;
`fasop estimate --plan` takes stage-groups plan files."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fasop
from fasop.cli import main
from fasop.cost.communication import Links, boundary_bytes
from fasop.cost.memory import usable_gib
from fasop.cost.stagegroups import group_layout, reshard_s, slice_overlap
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import Derating, load_cluster
from fasop.inputs.model import load_model
from fasop.plans import Plan
from fasop.search import estimate
from fasop.search.stagegroups import StageGroup, estimate_stage_groups, stage_group_spec

RELATIVE_TOLERANCE = 1e-12
CLUSTERS = ("fasop-1xA100-3xA10", "fasop-1xA100-7xA10", "h100-a100-a10g")
MODELS = ("gpt2-xl", "llama2-7b")
MAX_NODES = 4  # sub-clusters stay small: an example estimates in well under a second


STAGES = [StageGroup("A100", 4, 1, 24), StageGroup("A10", 2, 2, 8), StageGroup("A10", 4, 1, 8),
          StageGroup("A10", 4, 1, 8)]


def _example() -> tuple:
    """gpt2-xl on 1 A100 node and 3 A10 nodes: the A100 node at tp 4, then an A10 node at tp 2 dp 2, two at tp 4;
    (model, cluster, plan)."""
    model, cluster = load_model("gpt2-xl"), load_cluster("fasop-1xA100-3xA10")
    spec = stage_group_spec(model, cluster, placement=["A100", "A10", "A10", "A10"], stages=STAGES, mbs=4)
    return model, cluster, estimate_stage_groups(model, cluster, spec)


def _figures_agree(left, right, path: str = "plan") -> None:
    """Every figure of two records equal (numbers to RELATIVE_TOLERANCE), the same keys."""
    if isinstance(left, dict):
        assert left.keys() == right.keys(), (path, sorted(left.keys() ^ right.keys()))
        for key in left:
            _figures_agree(left[key], right[key], f"{path}.{key}")
    elif isinstance(left, list):
        assert len(left) == len(right), path
        for i, (a, b) in enumerate(zip(left, right)):
            _figures_agree(a, b, f"{path}[{i}]")
    elif isinstance(left, float) and not isinstance(right, bool):
        assert math.isclose(left, right, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-300), (path, left, right)
    else:
        assert left == right, (path, left, right)


# -- a plan of uniform degrees is the 3D plan of its shape ----------------------------------------------------
@st.composite
def uniform_shapes(draw) -> tuple:
    """(model, cluster, tp, dp, pp, mbs, placement, layers, recompute): every stage on nodes of one type."""
    model = load_model(draw(st.sampled_from(MODELS)))
    cluster = load_cluster(draw(st.sampled_from(CLUSTERS)))
    gpn = cluster.gpus_per_node
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if gpn % t == 0 and model.num_attention_heads % t == 0]))
    dp = draw(st.sampled_from([1, 2, 4]))
    per_stage = tp * dp  # powers of two: a stage fills whole nodes, or a node holds whole stages
    if per_stage >= gpn:
        pp = draw(st.integers(2, max(2, MAX_NODES * gpn // per_stage)))
        placement = [name for _ in range(pp) for name in [draw(st.sampled_from(list(cluster.node_types)))]
                     for _ in range(per_stage // gpn)]
    else:
        placement = draw(st.lists(st.sampled_from(list(cluster.node_types)), min_size=1, max_size=MAX_NODES))
        pp = len(placement) * gpn // per_stage
    counts = {name: placement.count(name) for name in set(placement)}
    assume(all(counts[name] <= cluster.node_types[name].count for name in counts) and pp <= model.num_layers + 1)
    mbs = draw(st.sampled_from([m for m in (1, 2, 4) if model.global_batch_size % (m * dp) == 0]))
    # distinct cuts: every middle stage holds a layer, the first and last may hold only the embedding or the head
    cuts = sorted(draw(st.lists(st.integers(0, model.num_layers), min_size=pp - 1, max_size=pp - 1, unique=True)))
    layers = [int(n) for n in np.diff([0, *cuts, model.num_layers])]
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    return model, cluster.with_counts(counts), tp, dp, pp, mbs, placement, layers, recompute


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(uniform_shapes())
def test_a_stage_group_plan_of_one_tp_and_dp_estimates_as_the_3d_plan_of_its_shape(shape):
    model, cluster, tp, dp, pp, mbs, placement, layers, recompute = shape
    gpn = cluster.gpus_per_node
    stages = [StageGroup(placement[i * tp * dp // gpn], tp, dp, n) for i, n in enumerate(layers)]
    spec = stage_group_spec(model, cluster, placement=placement, stages=stages, mbs=mbs, recompute=recompute)
    grouped = estimate_stage_groups(model, cluster, spec).record()
    uniform = estimate(model, cluster, tp=tp, dp=dp, pp=pp, mbs=mbs, placement=placement, layers_per_stage=layers,
                       recompute=recompute).record()
    assert grouped.pop("kind") == "stage-groups" and uniform.pop("kind", "3d") == "3d"
    uniform.pop("placement_search", None)
    for row in grouped["stages"]:
        assert (row.pop("tp"), row.pop("dp"), row.pop("mbs")) == (tp, dp, mbs)
    _figures_agree(grouped, uniform)


# -- degrees, layers and memory of a non-uniform plan ---------------------------------------------------------
def test_every_stage_fills_its_gpus_holds_its_layers_and_is_held_to_its_own_gpus_memory():
    model, cluster, plan = _example()
    assert plan.is_stage_groups and (plan.tp, plan.dp, plan.pp, plan.mbs) == (4, 1, 4, 4)
    assert sum(s.layers for s in plan.stages) == model.num_layers == sum(plan.layers_per_stage)
    batch = plan.mbs * plan.dp  # samples of one micro-batch, over every stage's data-parallel ranks
    assert plan.num_microbatches == plan.gbs // batch
    for row, group in zip(plan.stages, STAGES):
        node = cluster.node_types[group.node_type]
        assert (row.tp, row.dp, row.layers, row.gpu) == (group.tp, group.dp, group.layers, node.gpu)
        assert row.mbs * row.dp == batch
        assert node.gpus_per_node % row.tp == 0
        assert row.tp * row.dp == len(row.nodes) * node.gpus_per_node  # each stage here fills its node
        assert row.memory_capacity_gib == node.gpu_memory_gib
        if plan.fits_memory:
            assert row.memory_gib <= usable_gib(cluster, row.memory_capacity_gib)
    assert plan.fits_memory


def test_the_step_is_no_faster_than_its_slowest_stage_or_one_micro_batch_through_every_stage():
    plan = _example()[2]
    compute = [s.compute_s for s in plan.stages]
    assert len(set(compute)) == len(compute)  # the stages really differ
    assert plan.step_time_s >= plan.num_microbatches * max(compute)
    assert plan.pipeline_time_s >= sum(compute)
    assert plan.step_time_s >= plan.pipeline_time_s


# -- the rank layout -------------------------------------------------------------------------------------------
def test_the_layout_puts_each_stages_ranks_after_the_previous_stages_tensor_rank_fastest():
    cluster = load_cluster("fasop-1xA100-3xA10")  # 4 GPUs per node
    layout = group_layout(cluster, ["A100", "A10", "A10", "A10"], [(4, 1), (2, 2), (2, 4)])
    assert layout.stage_nodes == ((0,), (1,), (2, 3))
    assert layout.rank_node[0].tolist() == [[0, 0, 0, 0]]
    assert layout.rank_node[1].tolist() == [[1, 1], [1, 1]]
    assert layout.rank_node[2].tolist() == [[2, 2], [2, 2], [3, 3], [3, 3]]
    shared = group_layout(cluster, ["A10", "A10"], [(1, 2), (2, 1), (1, 4), (2, 1)])  # stages sharing nodes
    assert shared.stage_nodes == ((0,), (0,), (1,), (1,))


MIXED_SIZES = """
[cluster]
name = "mixed"
[[node_type]]
name = "big"
gpu = "A100"
gpus_per_node = 8
intra_node_bandwidth = "300 GB/s"
inter_node_bandwidth = "400 Gbit/s"
price_per_hour_usd = 1.0
count = 1
[[node_type]]
name = "small"
gpu = "A10"
gpus_per_node = 4
intra_node_bandwidth = "16 GB/s"
inter_node_bandwidth = "40 Gbit/s"
price_per_hour_usd = 1.0
count = 2
"""


def test_the_layout_follows_nodes_of_different_sizes(tmp_path):
    path = tmp_path / "mixed.toml"
    path.write_text(MIXED_SIZES)
    cluster = load_cluster(str(path))
    layout = group_layout(cluster, ["big", "small", "small"], [(4, 1), (2, 2), (2, 2), (4, 1)])
    assert layout.stage_nodes == ((0,), (0,), (1,), (2,))  # ranks 0-3, 4-7 on the 8-GPU node, then 8-11, 12-15
    assert layout.rank_node[1].tolist() == [[0, 0], [0, 0]]
    assert layout.rank_node[2].tolist() == [[1, 1], [1, 1]]
    spanning = group_layout(cluster, ["big", "small", "small"], [(2, 5), (2, 1), (4, 1)])
    assert spanning.rank_node[0].tolist() == [[0, 0]] * 4 + [[1, 1]]  # ranks 8, 9: the first small node
    assert spanning.stage_nodes == ((0, 1), (1,), (2,))


def test_the_loader_takes_node_types_of_different_gpus_per_node(tmp_path):
    path = tmp_path / "mixed.toml"
    path.write_text(MIXED_SIZES)
    cluster = load_cluster(str(path))
    assert cluster.node_sizes == (4, 8) and cluster.num_gpus == 16 and cluster.num_nodes == 3
    # plans of one tp and dp need one count: asking for it is refused in one line naming the file and field
    with pytest.raises(InputError, match=r"mixed\.toml: node_type\.gpus_per_node: expected one GPU kind and count per node"):
        _ = cluster.gpus_per_node
    assert cluster.with_counts({"small": 2}).gpus_per_node == 4


# -- resharding between stages of different degrees ----------------------------------------------------------
@pytest.mark.parametrize("a, b, shares, per", [
    (2, 3, [[2, 1, 0], [0, 1, 2]], 6),  # [0, 1/2] meets [0, 1/3] over 2/6 and [1/3, 2/3] over 1/6
    (4, 2, [[1, 0], [1, 0], [0, 1], [0, 1]], 4),  # each quarter lies inside one half
    (3, 3, [[1, 0, 0], [0, 1, 0], [0, 0, 1]], 3),
])
def test_slice_overlap_is_the_share_of_the_dimension_two_slices_have_in_common(a, b, shares, per):
    assert np.allclose(dense_overlap(a, b), np.array(shares) / per, rtol=0, atol=1e-15)


def dense_overlap(a: int, b: int) -> np.ndarray:
    """(a, b) the share every pair of slices has in common, zero where they do not meet."""
    share = np.zeros((a, b))
    ia, ib, shared = slice_overlap(a, b)
    share[ia, ib] = shared
    return share


def brute_overlap(a: int, b: int) -> np.ndarray:
    """The same from the slices' ends, every pair compared."""
    edges_a, edges_b = np.arange(a + 1) / a, np.arange(b + 1) / b
    return np.array([[max(0.0, min(edges_a[i + 1], edges_b[j + 1]) - max(edges_a[i], edges_b[j])) for j in range(b)]
                     for i in range(a)])


@given(st.integers(1, 40), st.integers(1, 40))
def test_slice_overlaps_are_every_meeting_pair_and_add_up_to_each_slice(a, b):
    share = dense_overlap(a, b)
    assert np.allclose(share, brute_overlap(a, b), rtol=0, atol=1e-12)
    assert np.allclose(share.sum(axis=1), 1 / a) and np.allclose(share.sum(axis=0), 1 / b)
    assert len(slice_overlap(a, b)[0]) <= a + b - 1


def brute_reshard_s(links, cluster, src, dst, activation_bytes):
    """reshard_s over every pair of ranks, met or not, each node a host of its own: the dense reference."""
    share = (dense_overlap(src.shape[0], dst.shape[0])[:, None, :, None]
             * dense_overlap(src.shape[1], dst.shape[1])[None, :, None, :]).reshape(src.size, dst.size)
    sent = activation_bytes * share
    src_node, dst_node = src.ravel(), dst.ravel()
    same = src_node[:, None] == dst_node[None, :]
    block = np.where(same, sent, 0.0)
    der = cluster.derating
    intra = max((block.sum(axis=1) / links.intra[src_node]).max(), (block.sum(axis=0) / links.intra[dst_node]).max())
    crossing = np.where(same, 0.0, sent)
    nodes = len(links.inter)
    out = np.bincount(src_node, weights=crossing.sum(axis=1), minlength=nodes)
    into = np.bincount(dst_node, weights=crossing.sum(axis=0), minlength=nodes)
    inter = (np.maximum(out, into) * der.p2p_inter_node / links.inter).max()
    latency = np.where(same, links.intra_latency[src_node][:, None],
                       np.maximum(links.inter_latency[src_node][:, None], links.inter_latency[dst_node][None, :]))
    return max(intra * der.p2p_intra_node, inter) + latency[sent > 0].max()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 6), st.integers(1, 4), st.data())
def test_resharding_is_the_dense_sum_over_every_pair_of_ranks(dp_a, tp_a, dp_b, tp_b, data):
    cluster = load_cluster("h100-a100-a10g")
    placement = ("A100", "A10G", "H100", "A100")
    links = Links(cluster, placement)
    nodes = st.integers(0, len(placement) - 1)
    src = np.array(data.draw(st.lists(nodes, min_size=dp_a * tp_a, max_size=dp_a * tp_a))).reshape(dp_a, tp_a)
    dst = np.array(data.draw(st.lists(nodes, min_size=dp_b * tp_b, max_size=dp_b * tp_b))).reshape(dp_b, tp_b)
    assert reshard_s(links, cluster, src, dst, 1e8) == pytest.approx(brute_reshard_s(links, cluster, src, dst, 1e8),
                                                                    rel=1e-12)


def test_resharding_across_nodes_sends_every_byte_once_over_the_slower_interface():
    base = load_cluster("h100-a100-a10g")  # A100 400 Gbit/s, A10G 100 Gbit/s per node
    cluster = replace(base, derating=Derating(p2p_intra_node=3.5, p2p_inter_node=1.05, collective_intra_node=1.0,
                                              collective_inter_node=1.0))
    links = Links(cluster, ("A100", "A10G"))
    activation = 1e8
    src = np.zeros((1, 4), dtype=int)  # tp 4, dp 1 on node 0
    dst = np.ones((2, 2), dtype=int)  # tp 2, dp 2 on node 1
    latency = max(cluster.node_types["A100"].inter_node_latency_s, cluster.node_types["A10G"].inter_node_latency_s)
    expected = activation * 1.05 / (100e9 / 8) + latency
    assert reshard_s(links, cluster, src, dst, activation) == pytest.approx(expected, rel=1e-12)
    assert reshard_s(links, cluster, dst, src, activation) == pytest.approx(expected, rel=1e-12)


def test_resharding_inside_a_node_is_set_by_the_busiest_gpu_on_the_intra_node_link():
    cluster = load_cluster("fasop-1xA100-3xA10")  # p2p_intra_node derating 3.5
    links = Links(cluster, ("A10",))
    node = cluster.node_types["A10"]
    activation = 1e8
    # tp 2, dp 1 -> tp 1, dp 3: each source GPU sends its half of the sequence (1/2), each destination
    # receives its third of the batch (1/3); the senders are the busiest
    busiest = activation / 2 * 3.5 / node.intra_node_bytes_per_s
    got = reshard_s(links, cluster, np.zeros((1, 2), dtype=int), np.zeros((3, 1), dtype=int), activation)
    assert got == pytest.approx(busiest + node.intra_node_latency_s, rel=1e-12)
    # tp 4, dp 1 -> tp 2, dp 2: every GPU sends and receives a quarter
    got = reshard_s(links, cluster, np.zeros((1, 4), dtype=int), np.zeros((2, 2), dtype=int), activation)
    assert got == pytest.approx(activation / 4 * 3.5 / node.intra_node_bytes_per_s + node.intra_node_latency_s,
                                rel=1e-12)


def test_the_plans_boundary_sends_one_global_micro_batch():
    model, cluster, plan = _example()
    activation = boundary_bytes(model, 0, 4 * 1, 1)  # mbs x dp of the first stage, the whole sequence
    expected = activation * 1.05 / 5e9 + cluster.node_types["A10"].inter_node_latency_s  # every pair crosses nodes
    assert [s.send_s for s in plan.stages] == pytest.approx([expected] * 3 + [0.0], rel=1e-12)


# -- refusals --------------------------------------------------------------------------------------------------
A100_A10 = ["A100", "A10", "A10", "A10"]
REFUSALS = [
    pytest.param("gpt2-xl", A100_A10, [("A100", 4, 1, 24), ("A10", 4, 1, 8), ("A10", 4, 1, 8), ("A10", 2, 2, 8)], 4,
                 "first and last stages need the same tp and dp", id="tied-embeddings"),
    pytest.param("gpt2-xl", A100_A10, [("A100", 4, 1, 24), ("A10", 1, 4, 8), ("A10", 4, 1, 8), ("A10", 4, 1, 8)], 2,
                 "dp 4 must divide the micro-batch's 2 samples", id="dp-not-dividing"),
    pytest.param("gpt2-xl", A100_A10, [("A100", 4, 1, 24), ("A10", 8, 1, 8), ("A10", 4, 1, 8), ("A10", 4, 1, 8)], 4,
                 "tp 8 must divide the 4 GPUs per node", id="tp-not-dividing-node"),
    pytest.param("gpt2-xl", A100_A10, [("A100", 4, 1, 24), ("A10", 4, 1, 12), ("A10", 4, 1, 12)], 4,
                 "add up to 12 GPUs, the placement's nodes hold 16", id="rank-total"),
    pytest.param("gpt2-xl", A100_A10, [("A10", 4, 1, 24), ("A10", 4, 1, 8), ("A10", 4, 1, 8), ("A10", 4, 1, 8)], 4,
                 "stage 0 (A10) would sit on nodes of A100", id="other-node-type"),
    pytest.param("gpt2-xl", ["A10", "A10", "A10"],  # stage 1 takes ranks 2-5: GPUs 2, 3 of node 0, 0, 1 of node 1
                 [("A10", 2, 1, 16), ("A10", 4, 1, 8), ("A10", 2, 1, 8), ("A10", 2, 1, 8), ("A10", 2, 1, 8)], 1,
                 "stage 1: a tensor-parallel group of 4 would span two nodes", id="tensor-group-spanning"),
    pytest.param("gpt2-xl", ["A100"], [("A100", 4, 1, 48)], 4, "two stages or more", id="one-stage"),
    pytest.param("t5", ["A100", "A10"], [("A100", 4, 1, 12), ("A10", 4, 1, 12)], 4, "decoder-only",
                 id="encoder-decoder"),
]


@pytest.mark.parametrize("model_name, placement, stages, mbs, problem", REFUSALS)
def test_stage_group_spec_refuses_a_plan_and_names_the_problem(model_name, placement, stages, mbs, problem):
    model, cluster = load_model(model_name), load_cluster("fasop-1xA100-3xA10")
    with pytest.raises(ArgumentError, match=re.escape(problem)) as caught:
        stage_group_spec(model, cluster, placement=placement, stages=[StageGroup(*s) for s in stages], mbs=mbs)
    assert "--" not in str(caught.value)


# -- fasop estimate --plan -------------------------------------------------------------------------------------
def _plan_file(tmp_path, **changes) -> tuple:
    plan = _example()[2]
    record = plan.record()
    for index, fields in changes.items():
        record["stages"][int(index.removeprefix("stage"))].update(fields)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(record))
    return plan, path


def test_estimate_of_a_stage_groups_plan_file_gives_the_same_record(tmp_path):
    plan, path = _plan_file(tmp_path)
    result = CliRunner().invoke(main, ["estimate", "--plan", str(path), "--json"])
    assert result.exit_code == 0, result.output
    _figures_agree(json.loads(result.stdout), plan.record())
    assert CliRunner().invoke(main, ["estimate", "--plan", str(path), "--json"]).stdout == result.stdout
    text = CliRunner().invoke(main, ["estimate", "--plan", str(path)])
    assert text.exit_code == 0, text.output
    header = next(line for line in text.stdout.splitlines() if line.lstrip().startswith("stage"))
    assert header.split()[:6] == ["stage", "gpu", "tp", "dp", "mbs", "layers"]
    rows = [line.split() for line in text.stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [row[:6] for row in rows] == [["0", "A100", "4", "1", "4", "24"], ["1", "A10", "2", "2", "2", "8"],
                                         ["2", "A10", "4", "1", "4", "8"], ["3", "A10", "4", "1", "4", "8"]]
    assert "stage groups" in text.stdout


def test_estimate_of_a_stage_groups_plan_over_memory_exits_3(tmp_path):
    model, cluster = load_model("gpt2-xl"), load_cluster("fasop-1xA100-3xA10")
    stages = [StageGroup("A100", 4, 1, 2), StageGroup("A10", 4, 1, 44), StageGroup("A10", 4, 1, 1),
              StageGroup("A10", 4, 1, 1)]  # 44 layers of micro-batch 16 on one A10 stage
    plan = estimate_stage_groups(model, cluster, stage_group_spec(model, cluster, placement=A100_A10, stages=stages,
                                                                  mbs=16))
    assert not plan.fits_memory
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.record()))
    result = CliRunner().invoke(main, ["estimate", "--plan", str(path)])
    assert result.exit_code == 3, result.output
    assert "stage 1 (A10)" in result.stderr and result.stderr.count("\n") == 1


def test_estimate_refuses_a_stage_groups_plan_file_with_a_bad_stage_in_one_line(tmp_path):
    _, path = _plan_file(tmp_path, stage1={"tp": 1, "dp": 3})
    result = CliRunner().invoke(main, ["estimate", "--plan", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"Error: {path}: plan 1: stages: stage 1: dp 3 must divide"), result.stderr


def test_estimate_help_names_stage_groups_plan_files_and_the_api_exports_them():
    result = CliRunner().invoke(main, ["estimate", "--help"])
    assert result.exit_code == 0 and "stage-groups plan" in " ".join(result.output.split())
    assert (fasop.StageGroup, fasop.stage_group_spec, fasop.estimate_stage_groups) == (
        StageGroup, stage_group_spec, estimate_stage_groups)


def test_a_stage_groups_plan_needs_each_stages_degrees():
    record = _example()[2].record()
    del record["stages"][2]["dp"]
    with pytest.raises(ValueError, match="each with its gpu, tp and dp"):
        Plan.model_validate(record)

