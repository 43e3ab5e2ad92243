"""Activation recomputation and sequence parallelism: memory against Korthikanti et al. 2022's closed forms,
the time of recomputed forwards, the per-GPU memory overhead, and the search over recompute modes."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fasop
from fasop.cost.config import Config, recomputed_affine, recomputed_layers
from fasop.cost.memory import GIB, layer_activation_bytes, stage_memory_gib, stage_params
from fasop.cost.pipeline import in_flight
from fasop.cost.roofline import Rates, attention_core_share, module_time_share, unit_work
from fasop.errors import InputError
from fasop.inputs.catalogue import load_gpu_spec
from fasop.inputs.cluster import Cluster, Derating, NodeType, load_cluster
from fasop.inputs.model import Model
from fasop.search import search_plans

# GPT-3 175B's layer as Korthikanti et al. 2022 use it (Table 3): s = 2048, h = 12288, a = 96, dropout, no
# flash attention, 2-byte activations
GPT3 = Model(name="gpt3-175b", architecture="decoder", encoder_num_layers=0, decoder_num_layers=96, hidden_size=12288,
             num_attention_heads=96, kv_channels=128, num_query_groups=96, ffn_hidden_size=4 * 12288,
             encoder_seq_length=0, decoder_seq_length=2048, vocab_size=51200, precision="bf16")
GPT2_XL = fasop.load_model("gpt2-xl")


def table2(mode: str, sp: bool, s: int, b: int, h: int, a: int, t: int) -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer."""
    if mode == "full":
        return 2 * s * b * h / (t if sp else 1)
    scores = 0 if mode == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + scores) / t
    return s * b * h * (10 + 24 / t + scores / t)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("b", [1, 4])
def test_layer_memory_is_korthikanti_table_2(mode, sp, t, b):
    got = layer_activation_bytes(GPT3, "layer", b, t, sp, mode)
    assert got == pytest.approx(table2(mode, sp, 2048, b, 12288, 96, t), rel=1e-12)


def test_hand_worked_gpt3_layer():
    """s b h = 2048 x 12288 = 25,165,824 bytes-elements; 5 a s / h = 80 at b = 1."""
    sbh = 2048 * 12288
    assert layer_activation_bytes(GPT3, "layer", 1, 8, True, "none") == sbh * (34 + 80) / 8  # 358,612,992
    assert layer_activation_bytes(GPT3, "layer", 1, 8, True, "selective") == sbh * 34 / 8  # 106,954,752
    assert layer_activation_bytes(GPT3, "layer", 1, 8, False, "none") == sbh * (10 + 3 + 10)  # 578,813,952
    assert layer_activation_bytes(GPT3, "layer", 1, 8, False, "full") == 2 * sbh
    assert layer_activation_bytes(GPT3, "layer", 1, 8, True, "full") == 2 * sbh / 8


def test_flash_attention_makes_selective_recomputation_keep_what_none_keeps():
    flash = replace(GPT3, flash_attention=True)
    for t in (1, 8):
        assert layer_activation_bytes(flash, "layer", 1, t, True, "selective") == layer_activation_bytes(
            flash, "layer", 1, t, True, "none") == 34 * 2048 * 12288 / t


@settings(max_examples=60, deadline=None)
@given(t=st.sampled_from([1, 2, 4, 8]), mode=st.sampled_from(["none", "selective", "full"]),
       model=st.sampled_from(["gpt2-xl", "t5", "llama2-70b"]), b=st.integers(1, 8))
def test_sequence_parallelism_never_keeps_more(t, mode, model, b):
    """Sequence parallelism divides the replicated part by t and changes nothing at t = 1 (the dominance behind
    turning it on whenever t > 1: the same traffic, all-gather + reduce-scatter for each all-reduce)."""
    m = fasop.load_model(model)
    for kind in m.layer_kinds:
        on, off = (layer_activation_bytes(m, kind, b, t, sp, mode) for sp in (True, False))
        assert on <= off and (on == off) == (t == 1)


@pytest.mark.parametrize("model", ["gpt2-xl", "t5"])
def test_recompute_modes_keep_less_and_less(model):
    m = fasop.load_model(model)
    for kind in m.layer_kinds:
        none, selective, full = (layer_activation_bytes(m, kind, 2, 4, True, mode) for mode in ("none", "selective", "full"))
        assert full < selective < none


def _stage_memory(config: Config, mbs: int = 2, m: int = 8):
    segment = np.zeros(config.pp, dtype=int)
    params = stage_params(GPT3, config, segment)
    return params, stage_memory_gib(GPT3, config, segment, params, np.array([mbs]), np.array([m]))


def test_stage_memory_of_each_recompute_mode_by_hand():
    """A stage of n layers, r of them recomputed, for `held` samples in flight: none keeps n whole layers;
    selective n layers without their scores; full the r recomputed layers' inputs and the others whole. A
    recomputed layer is rebuilt whole in its backward, for one micro-batch (2 samples)."""
    base = Config(8, 1, 4, 2, 64, 0, False, sequence_parallel=True)
    sbh = 2048 * 12288
    whole, selective, layer_input = sbh * (34 + 80) / 8, sbh * 34 / 8, 2 * sbh / 8  # bytes per sample and layer
    held = np.minimum(4 - np.arange(4), 8) * 2  # samples in flight on each stage
    n = 20
    (_, layer_params), none = _stage_memory(base)
    state = none.fixed_gib[0] + n * layer_params * 18 / GIB  # bf16 without the distributed optimizer: 18 bytes

    def memory(config: Config, recomputed: int) -> np.ndarray:
        return _stage_memory(config)[1].at(n, recomputed)[0]

    assert memory(base, 0) == pytest.approx(state + n * whole * held / GIB, rel=1e-12)
    assert memory(replace(base, recompute="selective"), n) == pytest.approx(
        state + (n * selective * held + (whole - selective) * 2) / GIB, rel=1e-12)
    uniform = replace(base, recompute="full", recompute_method="uniform", recompute_num_layers=1)
    assert memory(uniform, n) == pytest.approx(state + (n * layer_input * held + (whole - layer_input) * 2) / GIB,
                                               rel=1e-12)
    block = replace(uniform, recompute_method="block", recompute_num_layers=3)
    assert memory(block, 3) == pytest.approx(
        state + ((n - 3) * whole * held + 3 * layer_input * held + (whole - layer_input) * 2) / GIB, rel=1e-12)
    # a stage without layers rebuilds none
    for config in (replace(base, recompute="selective"), uniform, block):
        assert (_stage_memory(config)[1].at(0, 0) == none.fixed_gib).all()


def test_recomputed_layers_of_each_model_chunk():
    """Megatron-LM's block method recomputes the first N layers of every model chunk; uniform (one layer per
    checkpoint) and selective every layer; a stage's sum over its v chunks is min(n, N v)."""
    counts = np.array([[7, 5, 1, 0]])
    assert recomputed_layers(counts, 2, 2.0).tolist() == [[[2, 2], [2, 2], [1, 0], [0, 0]]]
    assert recomputed_layers(counts, 2, np.array([math.inf])).tolist() == [[[4, 3], [3, 2], [1, 0], [0, 0]]]
    assert recomputed_layers(counts, 1, 0.0).tolist() == [[[0], [0], [0], [0]]]
    for v in range(1, 5):
        for most in range(1, 5):
            n = np.arange(40)
            per_layer, fixed = recomputed_affine(float(most), v)
            total = recomputed_layers(n, v, float(most)).sum(-1)
            assert total.tolist() == np.minimum(n, most * v).tolist()
            assert (total == per_layer * n + fixed)[n >= fixed].all() and fixed == most * v
    assert recomputed_affine(math.inf, 3) == (1.0, 0.0)


def _gpt2_xl_on_8_a10s(layers: list[int], virtual_stages: int = 1, gbs: int = 64, **recompute):
    # bf16: its fp32 gradient buffer needs no copy at the optimizer step, so the passes' activations set the peak
    model = replace(fasop.load_model("gpt2-xl"), precision="bf16")
    return fasop.estimate(model, fasop.load_cluster("fasop-8xA10"), tp=4, dp=1, pp=8, mbs=1,
                          placement=["A10"] * 8, layers_per_stage=layers, gbs=gbs, virtual_stages=virtual_stages, **recompute)


def test_block_recomputation_reruns_the_first_layers_of_every_chunk():
    """6 layers a stage in two chunks of 3, N = 2: every chunk recomputes 2 layers, its own, and each stage 4.
    (Before: 2 layers a stage, all on the first stage's first chunk and the last stage's last.)"""
    plan = _gpt2_xl_on_8_a10s([6] * 8, 2, recompute="full", recompute_method="block", recompute_num_layers=2)
    layer_forward_s = plan.stages[1].chunks[0].forward_s / 3  # a chunk without the embedding or the head
    for stage in plan.stages:
        assert [c.recompute_s for c in stage.chunks] == pytest.approx([2 * layer_forward_s] * 2, rel=1e-12)
        assert stage.recompute_s == pytest.approx(4 * layer_forward_s, rel=1e-12)
    uniform = _gpt2_xl_on_8_a10s([6] * 8, 2, recompute="full")
    # the memory of the 2 layers of each stage kept whole
    layer = [layer_activation_bytes(GPT2_XL, "layer", 1, 4, True, mode) for mode in ("none", "full")]
    held = in_flight(8, np.array([64]), 2)[0]
    assert [b.memory_gib - u.memory_gib for b, u in zip(plan.stages, uniform.stages)] == pytest.approx(
        2 * (layer[0] - layer[1]) * held / GIB, rel=1e-9)


def test_block_recomputation_of_every_layer_of_each_chunk_is_uniform_recomputation():
    """N at least each chunk's layers (chunks of 3; of 4, 3 and 2) recomputes every layer: the same plan as
    uniform recomputation. (Before: N layers a stage.)"""
    for layers, n in (([6] * 8, 3), ([7, 5, 6, 6, 6, 6, 6, 6], 4)):
        block = _gpt2_xl_on_8_a10s(layers, 2, recompute="full", recompute_method="block", recompute_num_layers=n)
        uniform = _gpt2_xl_on_8_a10s(layers, 2, recompute="full")
        for name in ("step_time_s", "pipeline_time_s", "recompute_s", "peak_memory_gib"):
            assert getattr(block, name) == pytest.approx(getattr(uniform, name), rel=1e-12), name
        assert [s.memory_gib for s in block.stages] == pytest.approx([s.memory_gib for s in uniform.stages], rel=1e-12)
        assert [c.recompute_s for s in block.stages for c in s.chunks] == pytest.approx(
            [c.recompute_s for s in uniform.stages for c in s.chunks], rel=1e-12)


@pytest.mark.parametrize("layers", [[7, 7, 7, 7, 7, 7, 5, 1], [0, 8, 8, 8, 8, 8, 7, 1]])
def test_recomputation_adds_no_memory_to_a_stage_of_one_layer_or_none(layers):
    """The last stage holds one micro-batch of its one layer: rebuilt whole, it holds just what it holds without
    recomputation, under full and selective recomputation alike; a stage without layers rebuilds none. (Before:
    full recomputation counted the layer's input twice and charged the stage without layers a whole layer.)"""
    plans = {mode: _gpt2_xl_on_8_a10s(layers, recompute=mode) for mode in ("none", "selective", "full")}
    memory = {mode: np.array([s.memory_gib for s in plan.stages]) for mode, plan in plans.items()}
    ends = [0, 7] if layers[0] == 0 else [7]
    for mode in ("selective", "full"):
        assert memory[mode][ends] == pytest.approx(memory["none"][ends], rel=1e-12)
    assert (memory["full"] <= memory["selective"] * (1 + 1e-12)).all()
    assert (memory["selective"] <= memory["none"] * (1 + 1e-12)).all()


@pytest.mark.parametrize("layers, seq", [(1, 32), (2, 32), (2, 256), (3, 256)])
def test_full_recomputation_holds_no_more_than_selective_on_one_stage(tmp_path, layers, seq):
    """One stage of L layers (unfused attention, dropout), micro-batches of b = 2, one in flight: none keeps
    L b s h (34 + 5 a s / h) bytes; selective recomputation L - 1 layers' scores less (5 a s^2 b each: the
    rebuilt layer's are held); full (L - 1)(whole - input) less (input 2 s b h). (Before: full held more
    than selective at L = 1 and at s = 256, and more than none at L = 1.)"""
    model, cluster, profiles = _tiny(tmp_path, seq=seq, layers=layers)
    memory = {mode: fasop.estimate(model, cluster, tp=1, dp=2, pp=1, mbs=2, placement=["G", "G"], layers_per_stage=[layers],
                                   profiles_dir=profiles, recompute=mode).stages[0].memory_gib * GIB
              for mode in ("none", "selective", "full")}
    s, b, h, a = seq, 2, 64, 4
    whole, layer_input, scores = s * b * h * (34 + 5 * a * s / h), 2 * s * b * h, 5 * a * s * s * b
    assert memory["none"] - memory["selective"] == pytest.approx((layers - 1) * scores, rel=1e-9)
    assert memory["none"] - memory["full"] == pytest.approx((layers - 1) * (whole - layer_input), rel=1e-9)
    assert memory["full"] <= memory["selective"] <= memory["none"]


# -- time -----------------------------------------------------------------------------------------------------


def test_attention_core_share_of_a_gpt_layer():
    """4 b s^2 h of 24 b s h^2 + 4 b s^2 h: s / (6 h + s)."""
    m = fasop.load_model("gpt2-xl")
    assert attention_core_share(m, "layer") == pytest.approx(1024 / (6 * 1600 + 1024), rel=1e-12)


def _tiny(tmp_path, memory_gib=16.0, overhead_gib=0.0, gpus=1, seq=32, layers=4, precision="fp16"):
    model = Model(name="tiny", architecture="decoder", encoder_num_layers=0, decoder_num_layers=layers, hidden_size=64,
                  num_attention_heads=4, kv_channels=16, num_query_groups=4, ffn_hidden_size=256,
                  encoder_seq_length=0, decoder_seq_length=seq, vocab_size=1000, precision=precision,
                  global_batch_size=4, make_vocab_size_divisible_by=8)
    rows = ["tp,mbs,kind,forward_s,backward_s", "1,1,embedding,0.001,0.002", "1,1,layer,0.010,0.020",
            "1,1,head,0.002,0.004", "2,1,embedding,0.001,0.002", "2,1,layer,0.006,0.012", "2,1,head,0.002,0.004"]
    (tmp_path / "G.csv").write_text("\n".join(rows) + "\n")
    # memory without a bandwidth limit: the optimizer step takes no time
    node = NodeType(name="G", gpu="G", gpus_per_node=gpus, gpu_memory_gib=memory_gib, intra_node_bytes_per_s=10e9,
                    inter_node_bytes_per_s=1e9, price_per_hour_usd=3.6, count=2, gpu_memory_bytes_per_s=math.inf)
    cluster = Cluster(name="t", node_types={"G": node}, derating=Derating(), gpu_memory_overhead_gib=overhead_gib)
    return model, cluster, str(tmp_path)


@pytest.mark.parametrize("recompute, method, k, extra_s", [
    ("none", None, None, [0, 0]),
    ("full", "uniform", 1, [3 * 0.010, 1 * 0.010]),  # one forward per layer
    ("full", None, None, [3 * 0.010, 1 * 0.010]),  # the same by default
    ("full", "block", 1, [0.010, 0.010]),  # one layer per stage
    ("selective", None, None, None),
])
def test_recomputed_forwards_add_to_stage_compute(tmp_path, recompute, method, k, extra_s):
    model, cluster, profiles = _tiny(tmp_path)
    if extra_s is None:  # a GPU the catalogue lacks: the attention core's share of the FLOPs, 4 s^2 q of
        # 2 s (4 h^2 + 2 h f) + 4 s^2 q
        share = 4 * 32 * 32 * 64 / (2 * 32 * (4 * 64 * 64 + 2 * 64 * 256) + 4 * 32 * 32 * 64)
        extra_s = [3 * 0.010 * share, 0.010 * share]
    row = fasop.estimate(model, cluster, tp=1, dp=1, pp=2, mbs=1, placement=["G", "G"], layers_per_stage=[3, 1],
                         profiles_dir=profiles, recompute=recompute, recompute_method=method, recompute_num_layers=k)
    base = [0.003 + 3 * 0.030, 0.030 + 0.006]
    assert [s.compute_s for s in row.stages] == pytest.approx([b + e for b, e in zip(base, extra_s)])
    assert [s.recompute_s for s in row.stages] == pytest.approx(extra_s)
    assert row.recompute_s == pytest.approx(4 * extra_s[0])  # stage 0 has the most compute; 4 micro-batches
    assert row.recompute == recompute and row.sequence_parallel is False
    assert (row.recompute_method, row.recompute_num_layers) == ((method or "uniform", k or 1) if recompute == "full"
                                                                else (None, None))


def test_selective_recomputation_on_a_catalogue_gpu_reruns_the_cores_share_of_the_time(tmp_path):
    """With the A100's roofline the core's share of the forward is its kernels' time (the s x s softmax and
    dropout traffic included), more than its share of the FLOPs."""
    model, cluster, profiles = _tiny(tmp_path)
    (tmp_path / "G.csv").rename(tmp_path / "A100.csv")
    node = replace(cluster.node_types["G"], name="A100", gpu="A100")
    cluster = replace(cluster, node_types={"A100": node})
    row = fasop.estimate(model, cluster, tp=1, dp=1, pp=2, mbs=1, placement=["A100", "A100"], layers_per_stage=[3, 1],
                         profiles_dir=profiles, recompute="selective")
    share = module_time_share(unit_work(model, 1, 1)["layer"], 1, Rates.of(load_gpu_spec("A100"), model))
    assert share > 1.5 * attention_core_share(model, "layer")
    assert [s.recompute_s for s in row.stages] == pytest.approx([3 * 0.010 * share, 0.010 * share], rel=1e-12)


def test_block_recomputation_needs_k_layers_per_stage(tmp_path):
    model, cluster, profiles = _tiny(tmp_path)
    with pytest.raises(InputError, match="at least the 2 layers block recomputation reruns"):
        fasop.estimate(model, cluster, tp=1, dp=1, pp=2, mbs=1, placement=["G", "G"], layers_per_stage=[3, 1],
                       profiles_dir=profiles, recompute="full", recompute_method="block", recompute_num_layers=2)


@pytest.mark.parametrize("recompute, method, k, message", [
    ("full", None, 2, "needs a method"),
    ("full", "uniform", 2, "one layer per checkpoint"),
    ("selective", "block", 1, "takes no method"),
    ("some", None, None, "expected one of"),
])
def test_recompute_settings_refused_in_one_line(tmp_path, recompute, method, k, message):
    model, cluster, profiles = _tiny(tmp_path)
    with pytest.raises(InputError, match=message):
        fasop.estimate(model, cluster, tp=1, dp=1, pp=2, mbs=1, placement=["G", "G"], layers_per_stage=[3, 1],
                       profiles_dir=profiles, recompute=recompute, recompute_method=method, recompute_num_layers=k)


# -- the per-GPU overhead ---------------------------------------------------------------------------------------


def test_overhead_comes_off_the_gpu_memory(tmp_path):
    model, cluster, profiles = _tiny(tmp_path)
    row = fasop.estimate(model, cluster, tp=1, dp=1, pp=2, mbs=1, placement=["G", "G"], layers_per_stage=[2, 2],
                         profiles_dir=profiles)
    peak = row.peak_memory_gib
    fits = replace(cluster, gpu_memory_overhead_gib=16.0 - peak * 1.001)
    tight = replace(cluster, gpu_memory_overhead_gib=16.0 - peak * 0.999)
    for c, expected in ((fits, True), (tight, False)):
        plan = fasop.estimate(model, c, tp=1, dp=1, pp=2, mbs=1, placement=["G", "G"], layers_per_stage=[2, 2],
                              profiles_dir=profiles)
        assert plan.fits_memory is expected


def test_cluster_file_overhead_field(tmp_path):
    path = tmp_path / "c.toml"
    body = ('\n[[node_type]]\nname = "a"\ngpu = "A100"\ngpus_per_node = 8\ngpu_memory_gib = 80.0\n'
            'intra_node_bandwidth = "600 GB/s"\ninter_node_bandwidth = "200 Gbit/s"\nprice_per_hour_usd = 1.0\ncount = 1\n')
    path.write_text('[cluster]\nname = "c"\n' + body)
    assert load_cluster(str(path)).gpu_memory_overhead_gib == 1.5
    path.write_text('[cluster]\nname = "c"\ngpu_memory_overhead_gib = 2.25\n' + body)
    assert load_cluster(str(path)).gpu_memory_overhead_gib == 2.25
    path.write_text('[cluster]\nname = "c"\ngpu_memory_overhead_gib = -1.0\n' + body)
    with pytest.raises(InputError, match="gpu_memory_overhead_gib"):
        load_cluster(str(path))


# -- the search over recompute modes ----------------------------------------------------------------------------


def _best_by_plan(plans):
    return {(p.tp, p.dp, p.pp, tuple(p.placement), p.mbs): p.step_time_s for p in plans}


@pytest.mark.parametrize("memory_gib, modes", [(16.0, {"none"}), (0.06, {"selective", "full"}), (0.03, {"full"})])
def test_search_takes_each_plans_best_mode(tmp_path, memory_gib, modes):
    """With every mode, each plan's step time is the best of the searches restricted to one mode: the pruning of
    heavier modes (PartitionBatch.dominates) never loses a plan. Tight memory makes recomputation win."""
    model, cluster, profiles = _tiny(tmp_path, memory_gib, seq=512, layers=32)
    single = [_best_by_plan(search_plans(model, cluster, profiles_dir=profiles, recompute=(mode,)).plans)
              for mode in ("none", "selective", "full")]
    result = search_plans(model, cluster, profiles_dir=profiles)
    both = _best_by_plan(result.plans)
    assert set(both) == set().union(*single)
    for key, step in both.items():
        assert step == min(s[key] for s in single if key in s)
    assert {p.recompute for p in result.plans} == modes
    if modes == {"none"}:
        assert result.dominated > 0  # nothing binds: heavier modes were not even solved


def test_sequence_parallelism_is_on_whenever_tp_exceeds_one(tmp_path):
    # bf16: no fp32 gradient copy at the optimizer step, so the activations set every peak
    model, cluster, profiles = _tiny(tmp_path, gpus=2, precision="bf16")
    on = search_plans(model, cluster, profiles_dir=profiles).plans
    off = search_plans(model, cluster, profiles_dir=profiles, sequence_parallel=False).plans
    assert {p.tp for p in on} == {1, 2}
    assert all(p.sequence_parallel == (p.tp > 1) for p in on) and not any(p.sequence_parallel for p in off)
    memory_off = {(p.tp, p.dp, p.pp, p.mbs, tuple(p.layers_per_stage)): p.peak_memory_gib for p in off}
    for p in on:
        key = (p.tp, p.dp, p.pp, p.mbs, tuple(p.layers_per_stage))
        if key in memory_off:
            assert (p.peak_memory_gib < memory_off[key]) == (p.tp > 1)


# -- the command line -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, names", [
    (["search", "--recompute", "none,sometimes"], ["--recompute", "sometimes"]),
    (["estimate", "--tp", "1", "--dp", "4", "--pp", "1", "--mbs", "1", "--placement", "fast,slow", "--layers", "4",
      "--recompute", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     ["--recompute", "one layer per checkpoint"]),
    (["estimate", "--tp", "1", "--dp", "4", "--pp", "1", "--mbs", "1", "--placement", "fast,slow", "--layers", "4",
      "--sequence-parallel"], ["--sequence-parallel", "tp > 1"]),
])
def test_bad_recompute_options_are_one_line(runner, tiny, args, names):
    from test_cli_search import assert_input_error, invoke

    setup = tiny()
    assert_input_error(invoke(runner, [args[0], *setup.args(*args[1:])]), *names)


def test_search_table_and_plan_file_show_the_mode(runner, tiny):
    from test_cli_search import invoke, ok

    setup = tiny()
    output = setup.root / "plans.json"
    result = invoke(runner, ["search", *setup.args("--output", str(output), "--recompute", "full")])
    ok(result)
    assert "recompute" in result.stdout and " full " in result.stdout
    plans = fasop.plans.load_plans(output)
    assert {(p.recompute, p.recompute_method, p.recompute_num_layers) for p in plans} == {("full", "uniform", 1)}
    assert all(p.recompute_s > 0 and p.sequence_parallel == (p.tp > 1) for p in plans)
