"""A GPU at its power limit: a training step keeps the tensor cores busy for seconds, and a power-limited board
(the H100's 700 W) lowers its clock until a GEMM runs at the efficiency the table measured back to back
(sustained_matmul_efficiency and its FP8 one), below the one benchmarks time alone. fasop's training estimates
use the sustained figures where a GPU has them and slow the fused attention speeds, measured alone too, by the
same ratio; a GPU without them keeps its burst figures."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fasop import load_model
from fasop.cost import roofline
from fasop.cost.roofline import AttentionShape, Rates
from fasop.inputs.catalogue import load_gpu_spec
from fasop.inputs.model import with_precision
from fasop.profile.synth import header_lines, synthesize

CAUSAL_8K = AttentionShape(128, 8192, True, False)  # 529 TFLOP/s alone on an H100 (Shah et al. 2024)


def test_the_h100_runs_its_matmuls_and_attention_at_the_measured_sustained_rates():
    """989 TFLOP/s bf16 x 0.679, 1979 FP8 x 0.613; the attention table's 529 x 0.679 / 0.803."""
    spec = load_gpu_spec("H100")
    rates = Rates.of(spec, with_precision(load_model("llama3-8b"), "fp8", "tensorwise", False))
    assert math.isclose(rates.flops_per_s, 989e12 * 0.679)
    assert math.isclose(rates.fp8_flops_per_s, 1979e12 * 0.613)
    assert math.isclose(rates.attention_flops_per_s(CAUSAL_8K), 529e12 * 0.679 / 0.803)


def test_a_gpu_without_sustained_figures_keeps_its_burst_rates():
    spec = load_gpu_spec("A100")
    assert spec.sustained_matmul_efficiency is None and spec.training_matmul_efficiency == spec.matmul_efficiency
    assert math.isclose(Rates.of(spec, load_model("llama3-8b")).flops_per_s, 312e12 * spec.matmul_efficiency)
    h100 = load_gpu_spec("H100")
    assert math.isclose(Rates.of(h100.timed_alone(), load_model("llama3-8b")).attention_flops_per_s(CAUSAL_8K), 529e12)


def test_an_efficiency_given_is_the_training_one_and_scales_the_others_alike():
    """--efficiency 0.4 on an H100: bf16 at 0.4 of the peak, FP8 at 0.613 x 0.4 / 0.679, attention at the table's
    sustained speed x 0.4 / 0.679."""
    spec = load_gpu_spec("H100")
    rates = Rates.of(spec, with_precision(load_model("llama3-8b"), "fp8", "tensorwise", False), efficiency=0.4)
    assert math.isclose(rates.flops_per_s, 989e12 * 0.4)
    assert math.isclose(rates.fp8_flops_per_s, 1979e12 * 0.613 * 0.4 / 0.679)
    assert math.isclose(rates.attention_flops_per_s(CAUSAL_8K), 529e12 * 0.4 / 0.803)


def test_synth_uses_the_sustained_efficiency_and_says_so():
    spec = load_gpu_spec("H100")
    model = load_model("llama3-8b")
    sustained = synthesize(model, spec, tps=[1], mbss=[1])
    given = synthesize(model, spec, tps=[1], mbss=[1], efficiency=0.679)
    burst = synthesize(model, spec.timed_alone(), tps=[1], mbss=[1])
    assert sustained == given
    for slow, fast in zip(sustained, burst):  # the embedding's gather is memory-bound: no slower
        assert slow.forward_s >= fast.forward_s and slow.backward_s >= fast.backward_s
        assert slow.kind == "embedding" or (slow.forward_s > fast.forward_s and slow.backward_s > fast.backward_s)
    assert "Efficiency: 0.679 of peak (the table's sustained_matmul_efficiency, at the power limit; 0.803 timed " \
           "alone)" in "\n".join(header_lines(model, spec, [1], [1]))


@pytest.mark.parametrize("fp8", [False, True])
def test_a_layer_at_the_power_limit_is_slower_by_at_most_the_gemms_ratio(fp8):
    """Memory-bound kernels keep their speed: a layer slows by more than 1 and by less than the GEMMs do."""
    model = load_model("llama3-8b")
    if fp8:
        model = with_precision(model, "fp8", "tensorwise", False)
    spec = load_gpu_spec("H100")
    work = roofline.unit_work(model, 1, 1)["layer"]
    slow = sum(roofline.unit_times(work, 1, Rates.of(spec, model)))
    fast = sum(roofline.unit_times(work, 1, Rates.of(spec.timed_alone(), model)))
    worst = max(0.803 / 0.679, 0.659 / 0.613)
    assert 1.0 < slow / fast < worst


@settings(max_examples=40, deadline=None)
@given(share=st.floats(0.05, 1.0), fp8_share=st.floats(0.05, 1.0), mbs=st.sampled_from([1, 2, 4]),
       tp=st.sampled_from([1, 2, 8]), fp8=st.booleans())
def test_a_power_limit_never_makes_a_layer_faster(share, fp8_share, mbs, tp, fp8):
    """Any sustained efficiency at most the burst one: every pass of a layer at least as long as at the burst."""
    model = load_model("llama3-8b")
    if fp8:
        model = with_precision(model, "fp8", "tensorwise", False)
    burst = load_gpu_spec("H100").timed_alone()
    limited = dataclasses.replace(burst, sustained_matmul_efficiency=share * burst.matmul_efficiency,
                                  sustained_fp8_matmul_efficiency=fp8_share * burst.fp8_matmul_efficiency)
    work = roofline.unit_work(model, tp, mbs)["layer"]
    slow = roofline.unit_times(work, tp, Rates.of(limited, model))
    fast = roofline.unit_times(work, tp, Rates.of(burst, model))
    assert slow[0] >= fast[0] and slow[1] >= fast[1]
