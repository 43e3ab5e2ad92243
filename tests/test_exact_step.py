"""What follows the pipeline in the exact step (fasop/cost/exact.py): the data-parallel reduction overlapped
bucket by bucket with the last backward, the optimizer step, the parameter gather overlapped with the next
forward; checked by hand and against the plan with free and with unoverlapped communication."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from simulate import simulate_1f1b, simulate_interleaved_1f1b

import fasop
from fasop.cost.exact import ScheduleBatch, bucket_params, chunk_layers
from fasop.cost.pipeline import in_flight
from fasop.cost.schedule import makespan_s
from fasop.errors import InputError
from fasop.inputs.bundled import locate
from fasop.search import search_plans


def batch(forward, backward, send, m, grad, gather, optimizer, params, overlap, embedding=0.0) -> ScheduleBatch:
    """One plan whose stages hold no partitioned layers: every time is a fixed time."""
    row = lambda values: np.array([values], dtype=float)  # noqa: E731
    p = len(forward)
    zeros = np.zeros((1, p))
    return ScheduleBatch(
        fixed_s=row(forward) + row(backward), layer_s=zeros, fixed_forward_s=row(forward), layer_forward_s=zeros,
        boundary_s=row(send).reshape(1, p - 1), num_microbatches=np.array([m]), grad_fixed_s=row(grad),
        grad_layer_s=zeros, gather_fixed_s=row(gather), gather_layer_s=zeros, optimizer_fixed_s=row(optimizer),
        optimizer_layer_s=zeros, params_fixed=row(params), params_layer=zeros, bucket_params=np.array([100.0]),
        embedding_allreduce_s=np.array([embedding]), overlap_grad_reduce=np.array([overlap]),
        overlap_param_gather=np.array([overlap]), virtual_stages=np.array([1]), wrap_s=np.array([0.0]),
        recompute_fixed_s=zeros, recompute_layer_s=zeros, recomputed_per_chunk=np.array([0.0]))


def step(b: ScheduleBatch) -> float:
    return float(b.step_terms(np.zeros(b.fixed_s.shape))["step_time_s"][0])


def test_a_hand_worked_two_stage_step():
    # p = 2, m = 2, forward 1 s and backward 2 s everywhere, free sends. Stage 0 runs F0 [0,1] F1 [1,2]
    # B0 [4,6] B1 [7,9]; stage 1 runs F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]: the pipeline ends at 9.
    args = dict(forward=[1, 1], backward=[2, 2], send=[0], m=2, grad=[3, 3], gather=[2, 2], optimizer=[0.5, 0.5],
                params=[200, 200])  # two buckets of 100 parameters on each stage
    plain = batch(**args, overlap=False)
    terms = plain.step_terms(np.zeros((1, 2)))
    assert terms["pipeline_time_s"][0] == pytest.approx(9)
    # without overlap each stage reduces after its last backward (stage 1 at 7, stage 0 at 9), steps, gathers
    assert terms["stage_done_s"][0].tolist() == pytest.approx([9 + 3 + 0.5 + 2, 7 + 3 + 0.5 + 2])
    assert step(plain) == pytest.approx(14.5)
    # with overlap stage 0's first bucket is ready at 8 (half of B1 [7,9]), reduced by 9.5, the second one,
    # ready at 9, by 11; stage 1's by 9. The next forward of stage 0 needs its first bucket (1 s of gather)
    # at once, and its second after half its 1 s forward: 1.5 s exposed; stage 1 waits 1 s for its input
    # anyway: 0.5 s exposed.
    overlapped = batch(**args, overlap=True)
    assert overlapped.step_terms(np.zeros((1, 2)))["stage_done_s"][0].tolist() == pytest.approx(
        [11 + 0.5 + 1.5, 9 + 0.5 + 0.5])
    assert step(overlapped) == pytest.approx(13)
    # one bucket: nothing of the reduction can overlap, and the whole gather precedes stage 0's forward
    assert step(batch(**{**args, "params": [100, 100]}, overlap=True)) == pytest.approx(14.5)


seconds = st.floats(0.1, 3.0)


@st.composite
def plans(draw):
    p = draw(st.integers(1, 6))
    times = lambda lo=0.0, hi=3.0: draw(st.lists(st.floats(lo, hi), min_size=p, max_size=p))  # noqa: E731
    return dict(forward=times(0.1), backward=times(0.1), send=draw(st.lists(st.floats(0, 1), min_size=p - 1,
                                                                           max_size=p - 1)),
                m=draw(st.integers(1, 12)), grad=times(), gather=times(), optimizer=times(0, 1),
                params=draw(st.lists(st.floats(1, 1000), min_size=p, max_size=p)),
                embedding=draw(st.floats(0, 1)))


@settings(max_examples=200, deadline=None)
@given(plans())
def test_overlap_is_never_faster_than_free_communication_nor_slower_than_none(plan):
    free = step(batch(**{**plan, "grad": [0.0] * len(plan["grad"]), "gather": [0.0] * len(plan["gather"])},
                      overlap=False))
    overlapped, plain = step(batch(**plan, overlap=True)), step(batch(**plan, overlap=False))
    assert free <= overlapped + 1e-9
    assert overlapped <= plain + 1e-9
    # free communication: the pipeline, the slowest stage's optimizer step after its last backward, the embedding
    assert free >= makespan_s([plan["forward"]], [plan["backward"]], [plan["send"]], plan["m"])[0] - 1e-9


@settings(max_examples=50, deadline=None)
@given(plans())
def test_the_step_starts_from_the_exact_pipeline(plan):
    terms = batch(**plan, overlap=False).step_terms(np.zeros((1, len(plan["forward"]))))
    simulated = simulate_1f1b(plan["forward"], plan["backward"], plan["send"] + [0.0], plan["m"])
    assert terms["pipeline_time_s"][0] == pytest.approx(simulated, rel=1e-9, abs=1e-9)


def test_megatron_default_bucket():
    assert bucket_params(8) == 40_000_000 and bucket_params(128) == 128_000_000


def test_the_optimizer_step_is_a_pass_over_the_optimizer_shard():
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-4xA10")
    args = dict(tp=1, dp=4, pp=4, mbs=1, placement=["A10"] * 4, layers_per_stage=[12] * 4, overlap_grad_reduce=False)
    sharded = fasop.estimate(model, cluster, **args)
    whole = fasop.estimate(model, cluster, **args, distributed_optimizer=False)
    layers = 12 * model.layer_params("layer")
    params = max(model.embedding_params(1) + layers, model.head_params(1, shares_stage_with_embedding=False) + layers)
    bandwidth = 600e9  # the bundled catalogue's A10
    # fp16 Adam: the fp32 main gradient read twice (8), fp32 weight and moments read and written (24), the fp16
    # weight written (2)
    assert whole.optimizer_s == pytest.approx(params * 34 / bandwidth)
    assert sharded.optimizer_s == pytest.approx(whole.optimizer_s / 4)
    assert sharded.step_time_s > sharded.pipeline_time_s + sharded.optimizer_s


# an A10 with half the bundled catalogue's memory bandwidth (600 GB/s), the rest as bundled
A10_AT_300_GB_PER_S = """
[[gpu]]
name = "A10"
dense_fp16_tflops = 125.0
dense_bf16_tflops = 125.0
memory_gib = 22.49
memory_bandwidth_gb_per_s = 300.0
intra_node_link = "64 GB/s"
matmul_efficiency = 0.58
"""


def test_the_optimizer_step_runs_at_the_memory_bandwidth_the_cluster_file_gives(tmp_path):
    """The GPU's memory bandwidth is the cluster file's where it gives one: its own [[gpu]] table over the bundled
    catalogue, a node type's gpu_memory_bandwidth over both; a GPU in neither, without it, is refused."""
    model = fasop.load_model("gpt2-xl")
    bundled_text = locate("clusters", "fasop-4xA10", ".toml", "--cluster")[0].read_text()
    path = tmp_path / "cluster.toml"

    def optimizer_s(text: str) -> float:
        path.write_text(text)
        return fasop.estimate(model, fasop.load_cluster(str(path)), tp=1, dp=4, pp=4, mbs=1, placement=["A10"] * 4,
                              layers_per_stage=[12] * 4, overlap_grad_reduce=False).optimizer_s

    as_bundled = optimizer_s(bundled_text)
    assert optimizer_s(bundled_text + A10_AT_300_GB_PER_S) == pytest.approx(2 * as_bundled, rel=1e-12)
    own = bundled_text.replace('gpu = "A10"\n', 'gpu = "A10"\ngpu_memory_bandwidth = "150 GB/s"\n')
    assert optimizer_s(own + A10_AT_300_GB_PER_S) == pytest.approx(4 * as_bundled, rel=1e-12)
    path.write_text(bundled_text.replace('gpu = "A10"\n', 'gpu = "MI50"\n'))
    with pytest.raises(InputError) as refused:
        fasop.load_cluster(str(path))
    assert "node_type.A10.gpu_memory_bandwidth: missing, and GPU 'MI50' is in neither" in str(refused.value)


# -- interleaved (virtual) stages ------------------------------------------------------------------------------


def test_layers_split_evenly_over_chunks_the_first_taking_one_more():
    assert chunk_layers(np.array([[7, 4, 0]]), 2).tolist() == [[[4, 3], [2, 2], [0, 0]]]


def test_interleaved_stages_hold_more_micro_batches_counted_from_the_schedule():
    # p = 2, v = 2, m = 4: stage 0 runs 4 warm-up forwards (chunks 0 0 1 1), then a forward before each
    # backward: 5 chunks of activations at most, 2.5 stages' worth; stage 1 runs 2 warm-up forwards: 3 chunks
    assert in_flight(2, np.array([4]), 2).tolist() == [[2.5, 1.5]]
    assert in_flight(2, np.array([4]), 1).tolist() == [[2, 1]]
    assert in_flight(2, np.array([3]), 2).tolist() == [[2, 1]]  # Megatron does not interleave 3 over 2 stages


def test_an_interleaved_estimate_is_the_interleaved_schedule_of_its_chunks():
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-4xA10")
    args = dict(tp=1, dp=4, pp=4, mbs=1, placement=["A10"] * 4, layers_per_stage=[13, 11, 12, 12], overlap_grad_reduce=False)
    plain, interleaved = fasop.estimate(model, cluster, **args), fasop.estimate(model, cluster, **args, virtual_stages=2)
    assert interleaved.virtual_stages == 2 and interleaved.layers_per_virtual_stage == [7, 6, 6, 6, 6, 5, 6, 6]
    stages = interleaved.stages
    # every chunk's time from the plain plan's per-stage times: layers alike, embedding on chunk 0 of stage 0,
    # head on chunk 1 of stage 3
    layer_f, layer_c = stages[1].forward_s / 11, stages[1].compute_s / 11
    fixed_f = [stages[0].forward_s - 13 * layer_f, 0, 0, stages[3].forward_s - 12 * layer_f]
    fixed_c = [stages[0].compute_s - 13 * layer_c, 0, 0, stages[3].compute_s - 12 * layer_c]
    chunks = interleaved.layers_per_virtual_stage
    forward = [[(fixed_f[i] if (i, c) in ((0, 0), (3, 1)) else 0) + layer_f * chunks[c * 4 + i] for c in range(2)]
               for i in range(4)]
    compute = [[(fixed_c[i] if (i, c) in ((0, 0), (3, 1)) else 0) + layer_c * chunks[c * 4 + i] for c in range(2)]
               for i in range(4)]
    backward = [[c - f for c, f in zip(cs, fs)] for cs, fs in zip(compute, forward)]
    sends = [s.send_s for s in stages[:-1]]
    geo = fasop.cost.communication.geometry(cluster, ("A10",) * 4, 1, 4, 4)
    wrap = geo.wrap_s_per_byte * 2 * 1024 * 1600 + geo.wrap_latency_s
    simulated = simulate_interleaved_1f1b(forward, backward, sends, wrap, interleaved.num_microbatches)
    assert interleaved.pipeline_time_s == pytest.approx(simulated, rel=1e-9)
    assert interleaved.pipeline_time_s < plain.pipeline_time_s  # the bubble shrinks
    assert interleaved.peak_memory_gib > plain.peak_memory_gib  # more micro-batches in flight
    # 64 / (4 x 8) = 2 micro-batches: fewer than the 4 stages Megatron interleaves them over
    with pytest.raises(InputError, match="virtual_stages: 2: the micro-batch group size 4 must lie between"):
        fasop.estimate(model, cluster, **{**args, "mbs": 8}, virtual_stages=2)


def test_the_search_tries_interleaving_where_megatron_runs_it():
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-7xA10")
    plans = search_plans(model, cluster).plans
    interleaved = [p for p in plans if p.virtual_stages > 1]
    assert interleaved and all(p.pp >= 2 and p.num_microbatches % p.pp == 0 for p in interleaved)
    for plan in interleaved[:5]:
        assert sum(plan.layers_per_virtual_stage) == model.num_layers
        assert len(plan.layers_per_virtual_stage) == plan.pp * plan.virtual_stages


def test_overlap_is_a_plan_choice_and_emitted_as_megatron_flags():
    from fasop.launch.options import LaunchOptions
    from fasop.launch.write import render_plan

    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-4xA10")
    args = dict(tp=1, dp=4, pp=4, mbs=1, placement=["A10"] * 4, layers_per_stage=[12] * 4)
    overlapped, plain = fasop.estimate(model, cluster, **args), fasop.estimate(model, cluster, **args, overlap_grad_reduce=False)
    assert (overlapped.overlap_grad_reduce, overlapped.overlap_param_gather) == (True, True)
    assert (plain.overlap_grad_reduce, plain.overlap_param_gather) == (False, False)
    assert overlapped.pipeline_time_s == plain.pipeline_time_s
    assert overlapped.step_time_s < plain.step_time_s and overlapped.dp_exposed_s < plain.dp_exposed_s
    no_sharding = fasop.estimate(model, cluster, **args, distributed_optimizer=False)
    assert (no_sharding.overlap_grad_reduce, no_sharding.overlap_param_gather) == (True, False)
    for plan, flags in ((overlapped, {"--overlap-grad-reduce", "--overlap-param-gather"}), (plain, set()),
                        (no_sharding, {"--overlap-grad-reduce"})):
        script = render_plan(plan, model, cluster, LaunchOptions(smoke_test=True))["run_inter.sh"]
        assert {flag for flag in ("--overlap-grad-reduce", "--overlap-param-gather") if flag in script} == flags
