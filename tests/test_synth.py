"""Synthetic profiles (fasop.profile.synth, `fasop profile synth`) against FLOP and byte counts worked out by hand
from the layer shapes, and the bundled synthetic profiles against what the command regenerates."""

import dataclasses
import math
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from fasop import load_model
from fasop.cli import main
from fasop.cost import roofline
from fasop.errors import InputError
from fasop.inputs.model import Model
from fasop.inputs.profiles import load_profiles, read_profile
from fasop.profile import synth

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "profiles"

# The bundled synthetic profiles: the three-type cluster clusters/h100-a100-a10g.toml needs H100, A100 and
# A10G profiles; gpt2-xl's A100 (and A10) profiles are FASOP's measurements.
BUNDLED_SYNTHETIC = [
    ("llama2-70b", "H100"), ("llama2-70b", "A100"), ("llama2-70b", "A10G"),
    ("llama2-7b", "H100"), ("llama2-7b", "A100"), ("llama2-7b", "A10G"),
    ("gpt2-xl", "H100"), ("gpt2-xl", "A10G"),
]


def spec(name):
    return synth.load_gpu_spec(name)


def rows_by_key(rows):
    return {(r.tp, r.mbs, r.kind): r for r in rows}


def tiny_model(**changes):
    """A GPT-shaped toy: every unit is memory-bound on any GPU."""
    fields = dict(name="tiny", architecture="decoder", encoder_num_layers=0, decoder_num_layers=2,
                  hidden_size=64, num_attention_heads=4, kv_channels=16, num_query_groups=4,
                  ffn_hidden_size=256, encoder_seq_length=0, decoder_seq_length=8, vocab_size=128,
                  precision="fp16", global_batch_size=8)
    fields.update(changes)
    return Model(**fields)


# -- FLOPs ------------------------------------------------------------------------------------------------
def test_gpt_layer_flops_are_24bsh2_plus_4bs2h():
    model = load_model("gpt2-xl")
    b, s, h = 1, 1024, 1600
    expected = 24 * b * s * h**2 + 4 * b * s**2 * h
    assert expected == 69_625_446_400  # about 69.6 GFLOP
    assert roofline.layer_forward_flops(model, "layer", mbs=1, tp=1) == expected
    costs = roofline.unit_work(model, tp=1, mbs=1)
    assert costs["layer"].forward_flops == expected
    assert costs["layer"].backward_flops == 2 * expected
    # per GPU of a tensor-parallel group, and linear in the micro-batch
    assert roofline.unit_work(model, tp=4, mbs=2)["layer"].forward_flops == 2 * expected / 4


def test_llama2_70b_layer_flops_from_its_shapes():
    model = load_model("llama2-70b")
    b, s, h, ffn = 2, 4096, 8192, 28672
    heads, groups, head_dim = 64, 8, 128
    projections = {
        "query": h * heads * head_dim,
        "key": h * groups * head_dim,
        "value": h * groups * head_dim,
        "output": heads * head_dim * h,
        "gate": h * ffn, "up": h * ffn, "down": ffn * h,
    }
    matmuls = sum(2 * b * s * weights for weights in projections.values())
    # Q.K^T for every query head (shared K under GQA) and scores x V: the causal half, which llama2-70b's flash
    # attention computes
    scores = 2 * b * heads * s * s * head_dim / 2
    context = 2 * b * heads * s * s * head_dim / 2
    expected = matmuls + scores + context
    assert roofline.layer_forward_flops(model, "layer", mbs=b, tp=1) == pytest.approx(expected, rel=1e-15)
    assert roofline.unit_work(model, tp=8, mbs=b)["layer"].forward_flops == pytest.approx(expected / 8, rel=1e-15)
    # about 14.6 TFLOP per layer for two sequences of 4096 tokens
    assert expected == pytest.approx(14.569e12, rel=1e-3)


def test_t5_decoder_layer_adds_cross_attention():
    model = load_model("t5")
    b, s_enc, s_dec, h, ffn, qa = 1, 512, 512, 1024, 3072, 32 * 128
    self_attention = 2 * b * s_dec * 4 * h * qa + 4 * b * s_dec * s_dec * qa
    cross = 2 * b * (s_dec * 2 * h * qa + s_enc * 2 * h * qa) + 4 * b * s_dec * s_enc * qa
    mlp = 2 * b * s_dec * 2 * h * ffn
    assert roofline.layer_forward_flops(model, "decoder", mbs=1) == self_attention + cross + mlp
    encoder = 2 * b * s_enc * 4 * h * qa + 4 * b * s_enc**2 * qa + mlp
    assert roofline.layer_forward_flops(model, "encoder", mbs=1) == encoder


def test_head_flops_are_the_logits_over_the_padded_vocabulary():
    model = load_model("gpt2-xl")
    assert model.padded_vocab(2) == 50432
    assert roofline.unit_work(model, tp=2, mbs=1)["head"].forward_flops == 2 * 1024 * 1600 * 50432 / 2
    assert roofline.unit_work(model, tp=2, mbs=1)["embedding"].forward_flops == 0


# -- times ------------------------------------------------------------------------------------------------
def test_large_layer_time_is_its_matmuls_at_achievable_peak_plus_small_terms():
    model = load_model("llama2-70b")
    rows = rows_by_key(synth.synthesize(model, spec("A100"), tps=[1], mbss=[1]))
    t, h, f = 4096, 8192, 28672  # tokens, hidden, FFN; QKV 8192 + 2 x 1024 wide (8 query groups of 128)
    # output tiles of 256 x 128 on 108 SMs: QKV 16 x 80 = 1280 tiles in 12 waves, attention output and FFN
    # out 16 x 64 = 1024 in 10, FFN in (SwiGLU, 2f wide) 16 x 448 = 7168 in 67; flash attention untiled
    matmuls = (2 * t * h * 10240 / (1280 / 1296) + 2 * t * h * h / (1024 / 1080)
               + 2 * t * h * 2 * f / (7168 / 7236) + 2 * t * f * h / (1024 / 1080)) / (312e12 * 0.869)
    attention = roofline.attention_core_forward_flops(model, "layer", 1) / (312e12 * 0.869)
    work = roofline.unit_work(model, 1, 1)["layer"]
    # flash attention, RoPE, SwiGLU, no dropout: norm, QKV, rotary (2), attention, output, residual add, norm,
    # FFN in, SwiGLU, FFN out, residual add
    assert work.forward_launches == 12 and work.backward_launches == 2 + 2 + 2 + 2 + 2 + 1 + 2 + 2 + 1 + 2 + 1
    elementwise = sum(k.bytes for k in work.forward if k.flops == 0) / 1555e9
    layer = rows[(1, 1, "layer")]
    # every kernel runs longer than a launch: the host stays ahead, and only the first launch shows
    assert layer.forward_s == pytest.approx(matmuls + attention + elementwise + 5e-6, rel=1e-12)
    assert layer.forward_s == pytest.approx(28.52e-3, rel=1e-3)  # 27.88 ms of matmuls in full waves
    # --efficiency replaces the table's matmul_efficiency
    slower = rows_by_key(synth.synthesize(model, spec("A100"), tps=[1], mbss=[1], efficiency=0.5))
    assert slower[(1, 1, "layer")].forward_s == pytest.approx(
        (matmuls + attention) * 0.869 / 0.5 + elementwise + 5e-6, rel=1e-12)


def test_gpt2_xl_layer_on_a100_and_the_measured_profile():
    """FASOP measured 1.64 ms; the matmuls take 0.26 ms in full waves, 0.42 ms in the waves their 256 x 128 tiles
    fill on 108 SMs (QKV 4 x 38 = 152 tiles in 2 waves, the 1600-wide outputs 4 x 13 = 52 in one); the softmax
    and dropout traffic on the unfused 16 x 1024 x 1024 scores and the first of 13 launches (the others run while
    the GPU works) bring the estimate to 0.57 ms."""
    model = load_model("gpt2-xl")
    layer = rows_by_key(synth.synthesize(model, "A100", tps=[1], mbss=[1]))[(1, 1, "layer")]
    matmuls = 69_625_446_400 / (312e12 * 0.869)
    scores = 16 * 1024 * 1024
    # Q.K^T writes, softmax reads and writes, dropout reads, writes and keeps a mask, scores.V reads (fp16)
    score_traffic = (2 + 2 * 2 + 2 * 2 + 1 + 2) * scores
    assert layer.forward_s > matmuls + score_traffic / 1555e9 + 5e-6
    assert roofline.wave_efficiency((1, 1024, 4800), 108) == pytest.approx(1024 * 4800 / 32768 / 216, rel=1e-12)
    assert layer.forward_s == pytest.approx(0.571e-3, rel=1e-2)
    measured = read_profile(PROFILES / "gpt2-xl" / "A100.csv", model, "A100").time(1, "layer", 1)[0]
    assert measured == pytest.approx(1.638e-3, rel=1e-3)
    assert 2.8 < measured / layer.forward_s < 2.95


def test_every_kernel_of_a_tiny_layer_by_hand():
    """h 64, 4 heads of 16, FFN 256, s 8, b 1, fp16, unfused attention with dropout, learned positions: every
    kernel is memory-bound on an A100 and shorter than a launch, so the GPU waits on the host for each: a pass is
    its launches, 5 us each, then the last kernel's bytes over 1555 GB/s (the launch queue)."""
    model = tiny_model()
    untiled = dataclasses.replace(spec("A100"), sm_count=None)  # test_tile_and_wave_quantization_by_hand
    rows = rows_by_key(synth.synthesize(model, untiled, tps=[1], mbss=[1]))
    T, h, p, bandwidth, launch = 8, 64, 2, 1555e9, 5e-6
    scores = 4 * 8 * 8
    forward_bytes = {
        "norm": p * 2 * T * h,
        "QKV": p * (T * h + h * 3 * h + T * 3 * h),
        "scores Q.K^T": p * (T * h + T * h + scores),
        "scale-mask-softmax": p * 2 * scores,
        "attention dropout": p * 2 * scores + scores,
        "context scores.V": p * (scores + T * h + T * h),
        "attention output": p * (T * h + h * h + T * h),
        "bias-dropout-add": p * 3 * T * h + T * h,  # reads output and residual, writes, 1-byte mask
        "FFN in": p * (T * h + h * 256 + T * 256),
        "gelu": p * 2 * T * 256,
        "FFN out": p * (T * 256 + 256 * h + T * h),
    }
    assert forward_bytes["QKV"] == 28672 and forward_bytes["FFN in"] == 37888
    work = roofline.unit_work(model, 1, 1)["layer"]
    by_name = {k.name: k.bytes for k in work.forward}
    assert by_name == forward_bytes
    flops = {k.name: k.flops for k in work.forward if k.flops}
    assert flops == {"QKV": 2 * T * h * 3 * h, "scores Q.K^T": 2 * 8 * 8 * 64, "context scores.V": 2 * 8 * 8 * 64,
                     "attention output": 2 * T * h * h, "FFN in": 2 * T * h * 256, "FFN out": 2 * T * 256 * h}
    total = sum(forward_bytes.values()) + forward_bytes["norm"] + forward_bytes["bias-dropout-add"]
    assert total == 141568
    assert work.forward_launches == 13
    last = forward_bytes["bias-dropout-add"]
    assert rows[(1, 1, "layer")].forward_s == pytest.approx(13 * launch + last / bandwidth, rel=1e-12)
    # the attention core: scores, softmax, dropout, context: 4 kernels
    core = sum(forward_bytes[k] for k in ("scores Q.K^T", "scale-mask-softmax", "attention dropout",
                                          "context scores.V"))
    assert core > 0 and roofline.module_time_share(work, 1, roofline.Rates.of(untiled, model)) == \
        pytest.approx((4 * launch + forward_bytes["context scores.V"] / bandwidth) / (13 * launch + last / bandwidth),
                      rel=1e-12)
    # backward: each matmul twice (the weight gradient adds 8 bytes per weight of fp32 main gradient); each
    # element-wise kernel reads its inputs and the output gradient and writes the input gradients
    backward = {k.name: k.bytes for k in work.backward}
    assert backward["FFN in weight grad"] == p * (T * h + T * 256) + 8 * h * 256 == 136192
    assert backward["FFN in input grad"] == forward_bytes["FFN in"]
    assert backward["gelu grad"] == p * 3 * T * 256
    assert backward["bias-dropout-add grad"] == p * 5 * T * h + T * h
    assert work.backward_launches == 8 + 2 * 2 + 4 + 1 + 1 + 2 + 1
    # autograd runs them last layer first: the first norm's two kernels end the pass
    assert work.backward[-1].name == "norm grad" and work.backward[-1].launches == 2
    assert rows[(1, 1, "layer")].backward_s == pytest.approx(21 * launch + p * 3 * T * h / 2 / bandwidth, rel=1e-12)
    # the embedding: own rows read and the full output written, learned positions added, dropout
    embedding = p * (T * h + T * h) + p * (T * h + 8 * h + T * h) + (p * 2 * T * h + T * h)
    assert embedding == 2048 + 3072 + 2560  # the dropout (2560 bytes) last
    assert rows[(1, 1, "embedding")].forward_s == pytest.approx(3 * launch + 2560 / bandwidth, rel=1e-12)
    # the head: final norm, logits over the padded vocabulary (128), cross-entropy on fp32 logits
    head = p * 2 * T * h + p * (T * h + h * 128 + T * 128) + T * 128 * (p + 28)
    assert head == 2048 + 19456 + 30720  # the cross-entropy's six kernels last, 30720 bytes among them
    assert rows[(1, 1, "head")].forward_s == pytest.approx((1 + 1 + 6) * launch + 30720 / 6 / bandwidth, rel=1e-12)


def test_flash_attention_rope_and_swiglu_kernels():
    plain = roofline.unit_work(tiny_model(), 1, 2)["layer"]
    flash = roofline.unit_work(tiny_model(flash_attention=True), 1, 2)["layer"]
    assert (plain.forward_launches, plain.backward_launches) == (13, 21)
    assert (flash.forward_launches, flash.backward_launches) == (10, 17)
    core = roofline.attention_core_forward_flops(tiny_model(), "layer", 2)
    assert flash.forward_flops == plain.forward_flops - core / 2  # the causal half of the scores, no s x s traffic
    b, s, heads, d, p = 2, 8, 4, 16, 2
    kernel = next(k for k in flash.forward if k.name == "flash attention")
    assert kernel.bytes == p * 4 * b * s * heads * d  # Q, K, V read, output written
    rope = roofline.unit_work(tiny_model(flash_attention=True, position_embedding="rope"), 1, 2)["layer"]
    assert (rope.forward_launches, rope.backward_launches) == (12, 19)
    swiglu = roofline.unit_work(tiny_model(ffn_activation="swiglu"), 1, 2)["layer"]
    activation = next(k for k in swiglu.forward if k.name == "swiglu")
    assert activation.bytes == p * (2 * b * s * 256 + b * s * 256)


def test_tensor_parallel_collectives_for_tp2():
    """tp=2 adds 2 all-gathers + 2 reduce-scatters of b*s*h each way to the kernels' time: at the A100's
    measured all-reduce bus bandwidth for that payload, or at a link bandwidth given instead."""
    model = load_model("gpt2-xl")
    b, s, h, p = 1, 1024, 1600, 2
    payload = b * s * h * p  # 3.1 MiB: between nccl-tests' 2 MiB (36.18 GB/s) and 4 MiB (72.33 GB/s) rows
    measured = math.exp(math.log(36.18) + math.log(payload / 2**21) / math.log(2) * math.log(72.33 / 36.18)) * 1e9
    for gpu, link_text, link in (("A100", None, measured), ("A100", "100 GB/s", 100e9),
                                 ("A100", "400 Gbit/s", 50e9), ("A10G", None, 31.5e9)):
        rows = rows_by_key(synth.synthesize(model, gpu, tps=[2], mbss=[1], link_bandwidth=link_text))
        rates = roofline.Rates.of(spec(gpu), model)
        work = roofline.unit_work(model, 2, 1)["layer"]
        collective = 4 * (2 - 1) / 2 * payload / link
        assert rows[(2, 1, "layer")].forward_s == pytest.approx(roofline.pass_s(work.forward, rates) + collective,
                                                                rel=1e-12)
        assert rows[(2, 1, "layer")].backward_s == pytest.approx(roofline.pass_s(work.backward, rates) + collective,
                                                                 rel=1e-12)


def test_collective_bandwidth_follows_the_measured_curve():
    """Exactly the measured bus bandwidth at a measured payload; below the smallest, that payload's time (all
    latency); above the largest, its bandwidth."""
    rates = roofline.Rates.of(spec("A100"), load_model("gpt2-xl"))
    assert rates.collective_bytes_per_s(2**26) == pytest.approx(171.54e9, rel=1e-12)  # 64 MiB
    assert rates.collective_bytes_per_s(2**34) == pytest.approx(234.89e9, rel=1e-12)  # 16 GiB
    assert rates.collective_bytes_per_s(2**40) == pytest.approx(234.89e9, rel=1e-12)
    assert 1024 / rates.collective_bytes_per_s(1024) == pytest.approx(32768 / 1.31e9, rel=1e-12)
    # nominal without a curve
    assert roofline.Rates.of(spec("A10G"), load_model("gpt2-xl")).collective_bytes_per_s(2**26) == 31.5e9


def test_tile_and_wave_quantization_by_hand():
    """256 x 128 output tiles, one per SM at a time, in waves of the GPU's SM count."""
    assert roofline.wave_efficiency((1, 1024, 10240), 108) == pytest.approx(320 / 324, rel=1e-12)  # 3 waves
    assert roofline.wave_efficiency((1, 2048, 4608), 108) == pytest.approx(288 / 324, rel=1e-12)
    assert roofline.wave_efficiency((1, 256 * 108, 128), 108) == 1.0  # one full wave
    assert roofline.wave_efficiency((1, 256 * 109, 128), 108) == pytest.approx(109 / 216, rel=1e-12)
    # edge tiles part-filled: 300 x 100 takes two 256 x 128 tiles (or three 128 x 256) of one wave
    assert roofline.wave_efficiency((1, 300, 100), 108) == pytest.approx(300 * 100 / 32768 / 108, rel=1e-12)
    # batched matmuls tile each output; the better orientation is taken
    assert roofline.wave_efficiency((12, 2048, 128), 108) == pytest.approx(96 / 108, rel=1e-12)
    assert roofline.wave_efficiency((1, 128, 256 * 108), 108) == 1.0
    assert roofline.wave_efficiency((1, 300, 100), None) == roofline.wave_efficiency(None, 108) == 1.0
    # a matmul's time divides by it; other kernels are untouched
    model = tiny_model()
    tiled = roofline.Rates.of(spec("A100"), model)
    untiled = dataclasses.replace(tiled, sm_count=None)
    qkv = next(k for k in roofline.unit_work(model, 1, 1)["layer"].forward if k.name == "QKV")
    assert roofline.pass_s((qkv,), tiled) - 5e-6 == pytest.approx(
        qkv.flops / (tiled.flops_per_s * 8 * 192 / 32768 / 108), rel=1e-12)
    norm = next(k for k in roofline.unit_work(model, 1, 1)["layer"].forward if k.name == "norm")
    assert roofline.pass_s((norm,), tiled) == roofline.pass_s((norm,), untiled)


def test_backward_does_twice_the_forward_flops_for_every_kind():
    """Twice, but a flash attention kernel's 2.5 times (it recomputes the scores)."""
    for name in ("gpt2-xl", "bert", "t5", "llama3-8b"):
        model = load_model(name)
        for kind, cost in roofline.unit_work(model, tp=2, mbs=4).items():
            flash = sum(k.flops for k in cost.forward if k.attention is not None)
            layer = model.flash_attention and kind in model.layer_kinds
            assert flash == pytest.approx(roofline.attention_core_forward_flops(model, kind, 4, 2) if layer else 0,
                                          rel=1e-12)
            assert cost.backward_flops == pytest.approx(2 * cost.forward_flops + 0.5 * flash, rel=1e-12)
            if kind != "head":  # the head's forward cross-entropy passes over the fp32 logits several times
                assert cost.backward_bytes > cost.forward_bytes
                assert cost.backward_launches > cost.forward_launches
        layers = {kind: roofline.layer_forward_flops(model, kind, 4, 2) for kind in model.layer_kinds}
        for kind, flops in layers.items():  # the kernels add up to the closed form
            assert roofline.unit_work(model, 2, 4)[kind].forward_flops == pytest.approx(flops, rel=1e-12)
        assert roofline.unit_work(model, 2, 4)["head"].forward_flops == pytest.approx(
            roofline.head_forward_flops(model, 4, 2), rel=1e-12)


def test_rows_cover_every_kind_tp_and_mbs_in_order():
    model = load_model("t5")
    rows = synth.synthesize(model, "H100", tps=[4, 1, 2, 2], mbss=[2, 1])
    assert [(r.tp, r.mbs) for r in rows[::5]] == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
    assert [r.kind for r in rows[:5]] == ["embedding", "encoder", "decoder_embedding", "decoder", "head"]
    assert all(r.forward_s > 0 and r.backward_s > 0 for r in rows)


# -- refusals ---------------------------------------------------------------------------------------------
def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(InputError) as err:
        synth.load_gpu_spec("h100")
    assert err.value.where == "gpu=h100"
    assert "A100" in err.value.problem and "A10G" in err.value.problem and "did you mean H100" in err.value.problem


def test_refuses_precision_the_gpu_lacks_and_degrees_megatron_refuses():
    with pytest.raises(InputError, match="no bf16"):
        synth.synthesize(load_model("llama2-7b"), "V100", tps=[1], mbss=[1])
    assert synth.synthesize(load_model("gpt2-xl"), "V100", tps=[1], mbss=[1])  # fp16 is fine
    with pytest.raises(InputError, match="fp32"):
        synth.synthesize(tiny_model(precision="fp32"), "A100", tps=[1], mbss=[1])
    with pytest.raises(InputError, match="num_attention_heads"):
        synth.synthesize(load_model("gpt2-xl"), "A100", tps=[3], mbss=[1])
    with pytest.raises(InputError, match="num_query_groups"):
        synth.synthesize(load_model("llama3-8b"), "A100", tps=[16], mbss=[1])
    with pytest.raises(InputError, match="efficiency"):
        synth.synthesize(load_model("gpt2-xl"), "A100", tps=[1], mbss=[1], efficiency=1.5)
    with pytest.raises(InputError, match="^link_bandwidth: expected a bandwidth"):
        synth.synthesize(load_model("gpt2-xl"), "A100", tps=[1], mbss=[1], link_bandwidth="450 Gbps")


# -- the file ---------------------------------------------------------------------------------------------
def test_written_profile_is_readable_and_deterministic(tmp_path):
    model = load_model("llama2-70b")
    gpu = spec("H100")
    tps, mbss = (1, 2, 4, 8), (1, 2, 4, 8)
    rows = synth.synthesize(model, gpu, tps, mbss)
    lines = synth.header_lines(model, gpu, tps, mbss, date="2026-11-22")
    path = synth.write_profile(tmp_path / "H100.csv", rows, lines)
    first = path.read_bytes()
    with pytest.raises(InputError, match="already exists"):
        synth.write_profile(path, rows, lines)
    synth.write_profile(path, synth.synthesize(model, gpu, tps, mbss), lines, force=True)
    assert path.read_bytes() == first
    text = first.decode()
    assert text.startswith("# Synthetic profile of llama2-70b on H100")
    assert "# Written 2026-11-22." in text and "0.803" in text and "stas00/ml-engineering" in text
    assert "# Formula: per kernel g = max(F / (peak x efficiency x waves)" in text and "kernel launch 5 us" in text
    profile = read_profile(path, model, "H100")
    assert profile.tensor_degrees == tps
    by_key = rows_by_key(rows)
    for tp in tps:
        for mbs in mbss:
            for kind in ("embedding", "layer", "head"):
                forward, backward = profile.time(tp, kind, mbs)
                assert forward == pytest.approx(by_key[(tp, mbs, kind)].forward_s, rel=1e-11)
                assert backward == pytest.approx(by_key[(tp, mbs, kind)].backward_s, rel=1e-11)
    assert "Written" not in synth.format_profile(rows, synth.header_lines(model, gpu, tps, mbss))


# -- the command ------------------------------------------------------------------------------------------
@pytest.fixture
def runner():
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click 8.2 and later keep stderr apart already
        return CliRunner()


def test_cli_help_documents_every_option(runner):
    result = runner.invoke(main, ["profile", "synth", "--help"])
    assert result.exit_code == 0
    for option in ("--model", "--gpu", "--tp", "--mbs", "--efficiency", "--link-bandwidth", "--out", "--force"):
        assert option in result.output
    assert "profiles/<model>/<gpu>.csv" in result.output and "--profiles" in result.output
    assert runner.invoke(main, ["profile", "--help"]).exit_code == 0


def test_cli_unknown_gpu_is_one_line_and_exit_2(runner, tmp_path):
    result = runner.invoke(main, ["profile", "synth", "--model", "gpt2-xl", "--gpu", "B300",
                                  "--out", str(tmp_path / "B300.csv")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: --gpu B300:")
    assert "H100" in result.stderr
    assert not (tmp_path / "B300.csv").exists()


def test_cli_writes_a_loadable_profile_and_keeps_existing_files(runner, tmp_path):
    out = tmp_path / "llama3-8b" / "H100.csv"
    args = ["profile", "synth", "--model", "llama3-8b", "--gpu", "H100", "--tp", "1,2", "--mbs", "1,2,4",
            "--efficiency", "0.5", "--link-bandwidth", "376 GB/s", "--out", str(out)]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "written to" in result.stdout
    model = load_model("llama3-8b")
    profiles = load_profiles(model, ["H100"], str(out.parent))
    assert profiles["H100"].tensor_degrees == (1, 2)
    text = out.read_text()
    assert "Efficiency: 0.5 of peak (--efficiency" in text and "376 GB/s (--link-bandwidth)" in text
    assert '--efficiency 0.5 --link-bandwidth "376 GB/s"' in text
    assert "Written" not in text  # no date from the command: the output is deterministic
    again = runner.invoke(main, args)
    assert again.exit_code == 2 and "already exists" in again.stderr and again.stderr.count("\n") == 1
    assert out.read_text() == text
    forced = runner.invoke(main, args + ["--force"])
    assert forced.exit_code == 0 and out.read_text() == text


@pytest.mark.parametrize("bad, message", [
    (["--tp", "1,x"], "--tp"), (["--mbs", "0"], "--mbs"), (["--tp", "3"], "--tp 3"),
    (["--efficiency", "0"], "--efficiency"), (["--link-bandwidth", "fast"], "--link-bandwidth"),
])
def test_cli_bad_options_are_one_line(runner, tmp_path, bad, message):
    result = runner.invoke(main, ["profile", "synth", "--model", "gpt2-xl", "--gpu", "A100",
                                  "--out", str(tmp_path / "A100.csv")] + bad)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr


# -- bundled inputs ---------------------------------------------------------------------------------------
def test_llama_presets_have_their_published_parameter_counts():
    published = {  # the parameter counts of Meta's released checkpoints
        "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
        "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
    }
    for name, count in published.items():
        model = load_model(name)
        assert model.total_params() == count, name
        assert model.source and not model.tie_embeddings and not model.linear_bias
        assert (model.normalization, model.ffn_activation, model.precision) == ("rmsnorm", "swiglu", "bf16")
    assert load_model("llama2-70b").num_query_groups == 8 and load_model("llama2-70b").global_batch_size == 1024
    assert load_model("llama3-8b").num_query_groups == 8 and load_model("llama2-7b").num_query_groups == 32


def test_the_three_type_cluster_has_profiles_for_its_gpus():
    for name in ("llama2-70b", "llama2-7b", "gpt2-xl"):
        profiles = load_profiles(load_model(name), ["H100", "A100", "A10G"])
        common = set.intersection(*(set(p.tensor_degrees) for p in profiles.values()))
        assert common >= {1, 2, 4}, name


def regenerate_command(path):
    for line in path.read_text().splitlines():
        if line.startswith("# Regenerate: fasop "):
            return shlex.split(line[len("# Regenerate: fasop "):])
    raise AssertionError(f"{path} has no Regenerate line")


@pytest.mark.parametrize("model, gpu", BUNDLED_SYNTHETIC)
def test_bundled_synthetic_profiles_are_what_the_command_writes(runner, tmp_path, model, gpu):
    bundled = PROFILES / model / f"{gpu}.csv"
    assert bundled.read_text().startswith("# Synthetic profile")
    args = regenerate_command(bundled)
    assert args[:2] == ["profile", "synth"] and "--out" not in args
    out = tmp_path / f"{gpu}.csv"
    result = runner.invoke(main, args + ["--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == bundled.read_bytes()


def test_every_synthetic_profile_is_listed_above():
    found = {(p.parent.name, p.stem) for p in PROFILES.glob("*/*.csv")
             if p.read_text().startswith("# Synthetic profile")}
    assert found == set(BUNDLED_SYNTHETIC)
