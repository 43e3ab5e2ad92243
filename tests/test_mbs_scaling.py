"""Micro-batch scaling of profiled times on the roofline's launch queue (fasop.inputs.profiles.Curve with a
shape): exact at the profiled sizes, the host and GPU factors nearest the spec's against a brute-force search,
mapped along the fitted queue between sizes; and the roofline's time per sample never growing with the micro-batch
but for tile and wave quantization and measured collective bandwidths."""

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import toml_table
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import GPU_SPECS, model_fields

from fasop import load_model
from fasop.cost.roofline import Rates, unit_times, unit_work
from fasop.inputs.profiles import Curve, fit_scales, load_profiles, roofline_shape

GPT2 = load_model("gpt2-xl")
A100 = GPU_SPECS["A100"]


def roofline(model, gpu, tp, kind, mbs):
    return unit_times(unit_work(model, tp, mbs)[kind], tp, Rates.of(GPU_SPECS[gpu], model))


def nearest_pair(queue, seconds: float) -> tuple[float, float]:
    """The (host, GPU) factors nearest (1, 1) in logarithms with which `queue` takes `seconds`, by brute force: for
    each host factor on a fine grid, the GPU factor that gives `seconds` by bisection."""
    best = (np.inf, 1.0, 1.0)
    for log_host in np.linspace(-4, 4, 8001):
        host = np.exp(log_host)
        if queue.seconds(host, 1e-9) >= seconds:
            continue
        lo, hi = -30.0, 30.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if queue.seconds(host, np.exp(mid)) < seconds else (lo, mid)
        best = min(best, (log_host ** 2 + lo ** 2, host, float(np.exp(lo))))
    return best[1], best[2]


def test_beyond_the_largest_profiled_size_the_launch_queue_scales_the_measurement():
    """FASOP's gpt2-xl A100 profile has mbs 1 only: its time there is the queue at the host and GPU factors nearest
    (1, 1) that give it (found here by brute force), and at mbs 8 the queue at the same factors."""
    profile = load_profiles(GPT2, ["A100"])["A100"]
    measured = profile.time(1, "layer", 1)
    shape = roofline_shape(GPT2, A100, 1, "layer")
    scaled = profile.time(1, "layer", 8)
    for column in range(2):
        host, gpu = nearest_pair(shape.queues(1)[column], measured[column])
        assert fit_scales([shape.queues(1)[column]], np.array([measured[column]])) == pytest.approx((host, gpu),
                                                                                                    rel=2e-3)
        assert scaled[column] == pytest.approx(shape.queues(8)[column].seconds(host, gpu), rel=2e-3)
    # the weights read once per micro-batch and the host's launches do not grow with it
    assert scaled[0] < 8 * measured[0] * (1 - 1e-3) and scaled[1] < 8 * measured[1] * (1 - 1e-3)
    # the embedding's backward is dominated by its dense table gradient: far below per-sample
    assert profile.time(1, "embedding", 8)[1] < 2 * profile.time(1, "embedding", 1)[1]


def test_between_profiled_sizes_the_measurements_are_mapped_along_the_fitted_queue():
    shape = roofline_shape(GPT2, A100, 2, "layer")
    curve = Curve(np.array([1.0, 4.0]), np.array([3e-3, 7e-3]), np.array([5e-3, 9e-3]), shape)
    for i, measured in enumerate(((3e-3, 7e-3), (5e-3, 9e-3))):
        queues = [shape.queues(b)[i] for b in (1, 4)]
        host, gpu = fit_scales(queues, np.array(measured))
        fitted = [shape.queues(b)[i].seconds(host, gpu) for b in (1, 2, 4)]
        share = (fitted[1] - fitted[0]) / (fitted[2] - fitted[0])
        assert curve.at(2)[i] == pytest.approx(measured[0] + (measured[1] - measured[0]) * share, rel=1e-12)
        assert measured[0] < curve.at(2)[i] < measured[1]
    # below the smallest size, the queue at the fitted factors times the smallest size's measured-to-fitted ratio
    below = Curve(np.array([2.0, 4.0]), np.array([3e-3, 7e-3]), np.array([5e-3, 9e-3]), shape)
    queues = [shape.queues(b)[0] for b in (2, 4)]
    host, gpu = fit_scales(queues, np.array([3e-3, 7e-3]))
    assert below.at(1)[0] == pytest.approx(
        shape.queues(1)[0].seconds(host, gpu) * 3e-3 / queues[0].seconds(host, gpu), rel=1e-12)


def test_without_a_gpu_spec_the_old_rule_stays():
    curve = Curve(np.array([1.0, 4.0]), np.array([1.0, 2.5]), np.array([2.0, 5.0]))
    assert curve.at(2) == (1.5, 3.0) and curve.at(8) == (5.0, 10.0)
    # a GPU type the catalogue lacks keeps it; one it has gets the shape
    profiles = load_profiles(GPT2, ["A100", "H100-measured"])
    assert all(c.shape is None for c in profiles["H100-measured"].curves.values())
    assert all(c.shape is not None for c in profiles["A100"].curves.values())
    assert profiles["H100-measured"].time(1, "layer", 16)[0] == pytest.approx(
        2 * profiles["H100-measured"].time(1, "layer", 8)[0], rel=1e-12)


sizes = st.lists(st.integers(1, 64), min_size=1, max_size=5, unique=True).map(sorted)
times = st.floats(1e-5, 1.0)


@settings(max_examples=60, deadline=None)
@given(sizes, st.data(), st.sampled_from(["embedding", "layer", "head"]), st.sampled_from([1, 2, 4]))
def test_at_a_profiled_size_the_time_is_the_measurement_exactly(profiled, data, kind, tp):
    forward = data.draw(st.lists(times, min_size=len(profiled), max_size=len(profiled)))
    backward = data.draw(st.lists(times, min_size=len(profiled), max_size=len(profiled)))
    curve = Curve(np.array(profiled, dtype=float), np.array(forward), np.array(backward),
                  roofline_shape(GPT2, A100, tp, kind))
    for b, f, w in zip(profiled, forward, backward):
        assert curve.at(b) == (f, w)


def model_from(fields):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.toml"
        path.write_text(toml_table("[model]", {**fields, "global_batch_size": 8}))
        return load_model(str(path))


@settings(max_examples=40, deadline=None)
@given(model_fields(), st.sampled_from(sorted(g for g, s in GPU_SPECS.items() if s.dense_bf16_tflops > 0)),
       st.sampled_from([1, 2]), st.data())
def test_time_per_sample_never_grows_with_the_micro_batch(fields, gpu, tp, data):
    """Every kernel's FLOPs and bytes are a + c b with a, c >= 0 (weights and launches fixed, the rest per
    sample), so the roofline's time per sample cannot grow with b; nor can a measured time scaled by it beyond
    the largest profiled size. Not so with tile and wave quantization or a measured collective curve (a wave
    part-filled, a payload NCCL moves slower than a smaller one): the property is of the GPU without them."""
    spec = dataclasses.replace(GPU_SPECS[gpu], sm_count=None, allreduce_busbw=())
    model = model_from(fields)
    if model.num_attention_heads % tp or model.num_query_groups % tp or model.ffn_hidden_size % tp:
        tp = 1
    kind = data.draw(st.sampled_from(list(unit_work(model, tp, 1))))
    rates = Rates.of(spec, model)
    per_sample = [np.array(unit_times(unit_work(model, tp, b)[kind], tp, rates)) / b for b in (1, 2, 3, 5, 8, 13, 32)]
    for smaller, larger in zip(per_sample, per_sample[1:]):
        assert np.all(larger <= smaller * (1 + 1e-12))
    largest = data.draw(st.integers(1, 8))
    measured = data.draw(times)
    curve = Curve(np.array([1.0, float(largest)]) if largest > 1 else np.array([1.0]),
                  np.array([measured, measured * largest][:1 + (largest > 1)]),
                  np.array([2 * measured, 2 * measured * largest][:1 + (largest > 1)]),
                  roofline_shape(model, spec, tp, kind))
    beyond = [np.array(curve.at(b)) / b for b in range(largest, largest + 20, 3)]
    for smaller, larger in zip(beyond, beyond[1:]):
        assert np.all(larger <= smaller * (1 + 1e-12))


def test_a_precision_without_a_tensor_core_peak_keeps_the_old_rule(tmp_path):
    """fp32 (no peak in the table) and bf16 on the V100 (none): measured profiles still load, scaled per sample."""
    profile = "tp,mbs,kind,forward_s,backward_s\n" + "".join(f"1,1,{kind},0.001,0.002\n"
                                                            for kind in ("embedding", "layer", "head"))
    for precision, gpu in (("fp32", "A100"), ("bf16", "V100")):
        folder = tmp_path / precision
        folder.mkdir()
        (folder / f"{gpu}.csv").write_text(profile)
        model = model_from({"name": "tiny", "architecture": "decoder", "num_layers": 2, "seq_length": 64,
                            "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1000, "precision": precision})
        loaded = load_profiles(model, [gpu], str(folder))[gpu]
        assert loaded.time(1, "layer", 4) == (0.004, 0.008)


def test_a_scaled_curve_keeps_its_shape():
    """Calibration and the robust ranking scale profiles: the scaled curve is the curve of the scaled measurements,
    fitted afresh on the same roofline."""
    curve = load_profiles(GPT2, ["A100"])["A100"].curves[1, "layer"]
    doubled = curve.scaled(2.0)
    assert doubled.at(1) == tuple(2 * t for t in curve.at(1))
    again = Curve(curve.mbs, 2 * curve.forward_s, 2 * curve.backward_s, curve.shape)
    assert doubled.at(8) == again.at(8) and doubled.at(8)[0] > curve.at(8)[0]
