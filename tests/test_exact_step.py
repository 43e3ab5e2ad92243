"""What follows the pipeline in the exact step (fasop/cost/exact.py): the data-parallel reduction overlapped
bucket by bucket with the last backward, the optimizer step, the parameter gather overlapped with the next
forward; checked by hand and against the plan with free and with unoverlapped communication."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fasop
from fasop.cost.exact import OPTIMIZER_BYTES_MIXED, ScheduleBatch, bucket_params
from fasop.cost.schedule import makespan_s
from fasop.cost.simulate import simulate_1f1b


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
        overlap_param_gather=np.array([overlap]))


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
    args = dict(tp=1, dp=4, pp=4, mbs=1, placement=["A10"] * 4, layers=[12] * 4, overlap=False)
    sharded = fasop.estimate(model, cluster, **args)
    whole = fasop.estimate(model, cluster, **args, distributed_optimizer=False)
    layers = 12 * model.layer_params("layer")
    params = max(model.embedding_params(1) + layers, model.head_params(1, shares_stage_with_embedding=False) + layers)
    bandwidth = 600e9  # the bundled catalogue's A10
    assert whole.optimizer_s == pytest.approx(params * OPTIMIZER_BYTES_MIXED / bandwidth)
    assert sharded.optimizer_s == pytest.approx(whole.optimizer_s / 4)
    assert sharded.step_time_s > sharded.pipeline_time_s + sharded.optimizer_s
