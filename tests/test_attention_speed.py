"""A fused attention kernel's time: its FLOPs as the FlashAttention benchmarks count them (backward 2.5 times the
forward) at the GPU table's measured speed for its head dim, key length, mask and direction (Rates.
attention_flops_per_s), checked against the table's figures by hand; without a table, at the matmuls' rate."""

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fasop import load_model
from fasop.cost import roofline
from fasop.cost.roofline import AttentionShape, Layout, Rates
from fasop.inputs.catalogue import load_gpu_spec


def _rates(gpu="H100", model="llama3-8b", **spec_changes):
    """The GPU's rates timed alone: without its power-limited efficiencies, which slow the table's speeds
    (tests/test_power_limit.py)."""
    spec = dataclasses.replace(load_gpu_spec(gpu).timed_alone(), **spec_changes)
    return Rates.of(spec, load_model(model))


def _flash(work):
    forward = next(k for k in work.forward if k.name == "flash attention")
    backward = next(k for k in work.backward if k.name == "flash attention grad")
    return forward, backward


def test_the_backward_does_two_and_a_half_times_the_forwards_flops():
    """Dao 2023, Algorithm 2: the backward recomputes Q.K^T and takes four gradients, five matmuls to two."""
    model = load_model("llama3-8b")
    forward, backward = _flash(roofline.unit_work(model, 1, 1)["layer"])
    s, heads, d = model.seq_length, model.num_attention_heads, 128
    assert forward.flops == 4 * s * s * heads * d / 2  # causal: half the query-key pairs
    assert backward.flops == 2.5 * forward.flops
    assert forward.attention == AttentionShape(128, s, True, False)
    assert backward.attention == AttentionShape(128, s, True, True)


def test_the_h100s_speeds_are_the_published_ones_and_interpolate_between_them():
    """cuDNN on an H100 (Shah et al. 2024, Figures 5 and 6): head dim 128 at 8K tokens, 529 TFLOP/s forward
    causal, 600 without the mask, 518 backward without it; the causal backward 518 x 529 / 600."""
    rates = _rates()
    speed = rates.attention_flops_per_s
    assert math.isclose(speed(AttentionShape(128, 8192, True, False)), 529e12)
    assert math.isclose(speed(AttentionShape(128, 8192, False, False)), 600e12)
    assert math.isclose(speed(AttentionShape(128, 8192, False, True)), 518e12)
    assert math.isclose(speed(AttentionShape(128, 8192, True, True)), 518e12 * 529 / 600)
    # halfway between 4K and 8K in log length: the mean of 518 and 529; head dim 96: the mean of 64's and 128's
    assert math.isclose(speed(AttentionShape(128, 4096 * 2**0.5, True, False)), (518e12 + 529e12) / 2)
    assert math.isclose(speed(AttentionShape(96, 8192, True, False)), (379e12 + 529e12) / 2)
    # held at the table's ends: below 512 tokens, above head dim 128
    assert math.isclose(speed(AttentionShape(128, 100, True, False)), 315e12)
    assert math.isclose(speed(AttentionShape(192, 65536, False, False)), 595e12)


def test_a_layers_attention_takes_its_flops_at_that_speed():
    rates = _rates()
    forward, backward = _flash(roofline.unit_work(load_model("llama3-8b"), 1, 1)["layer"])
    assert math.isclose(roofline.kernel_gpu_s(forward, rates), forward.flops / 529e12)
    assert math.isclose(roofline.kernel_gpu_s(backward, rates), backward.flops / (518e12 * 529 / 600))


def test_context_parallel_steps_are_timed_at_each_steps_key_length():
    """cp 4 of 8K tokens: four ring steps over 2K keys each."""
    model = load_model("llama3-8b")
    forward, _ = _flash(roofline.unit_work(model, 1, 1, Layout(cp=4))["layer"])
    assert forward.attention.key_length == 2048 and forward.launches == 4
    assert math.isclose(roofline.kernel_gpu_s(forward, _rates()), forward.flops / 484e12)


def test_without_a_table_the_kernel_runs_at_the_matmuls_rate():
    rates = _rates("A100")
    assert not rates.attention_speeds
    assert rates.attention_flops_per_s(AttentionShape(128, 8192, True, True)) == rates.flops_per_s
    forward, _ = _flash(roofline.unit_work(load_model("llama3-8b"), 1, 1)["layer"])
    assert math.isclose(roofline.kernel_gpu_s(forward, rates), forward.flops / rates.flops_per_s)


def test_an_efficiency_given_scales_the_attention_speeds_as_the_matmuls():
    spec = load_gpu_spec("H100")
    half = Rates.of(spec, load_model("llama3-8b"), efficiency=spec.training_matmul_efficiency / 2)
    sustained = spec.training_matmul_efficiency / spec.matmul_efficiency  # the power limit's slowing
    assert math.isclose(half.attention_flops_per_s(AttentionShape(128, 8192, True, False)), 529e12 * sustained / 2)


@settings(max_examples=40, deadline=None)
@given(slower=st.floats(0.1, 1.0), mbs=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 8]))
def test_a_slower_attention_kernel_never_makes_a_layer_faster(slower, mbs, tp):
    model = load_model("llama3-8b")
    spec = load_gpu_spec("H100")
    slow = dataclasses.replace(spec, attention_tflops=tuple((d, n, *(slower * v for v in speeds))
                                                            for d, n, *speeds in spec.attention_tflops))
    work = roofline.unit_work(model, tp, mbs)["layer"]
    fast_s = roofline.unit_times(work, tp, Rates.of(spec, model))
    slow_s = roofline.unit_times(work, tp, Rates.of(slow, model))
    assert slow_s[0] >= fast_s[0] and slow_s[1] >= fast_s[1]
