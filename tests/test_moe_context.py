"""Mixture-of-Experts models, expert and context parallelism: model files, parameter counts against the published
totals, the MoE layer's kernels and memory against hand counts, the all-to-all and ring costs on small
placements by hand, and what the plan space, the estimate and the launch scripts do with the new degrees."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from conftest import one_line_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fasop.cost import roofline
from fasop.cost.communication import Links, geometry, kv_chunk_bytes, layer_exchange_s
from fasop.cost.config import Config
from fasop.cost.memory import layer_activation_bytes, moe_ffn_bytes
from fasop.cost.roofline import DENSE, Layout, moe_kind, unit_work
from fasop.errors import InputError
from fasop.inputs.catalogue import load_gpu_spec
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model, with_seq_length
from fasop.search.estimate import estimate
from fasop.search.space import context_degrees, expert_degrees

# Parameter totals the shapes give, as round3.md part A section 7 recomputes them from the published configs
# (and the model cards' 116.8B for gpt-oss-120b, 671B for DeepSeek-V3 without its MTP module).
PUBLISHED_TOTALS_B = {"mixtral-8x7b": 46.70, "mixtral-8x22b": 140.6, "deepseek-v3": 671.0, "qwen3-30b-a3b": 30.53,
                      "qwen3-235b-a22b": 235.1, "gpt-oss-120b": 116.83}


@pytest.mark.parametrize("name, total_b", PUBLISHED_TOTALS_B.items())
def test_bundled_moe_models_have_their_published_sizes(name, total_b):
    model = load_model(name)
    assert model.is_moe
    decimals = len(f"{total_b}".split(".")[1])
    assert round(model.total_params() / 1e9, decimals) == total_b


def test_multi_latent_attention_parameters_by_hand():
    """DeepSeek-V3's MLA, module by module (megatron-core's multi_latent_attention.py): 187,107,328 per layer."""
    model = load_model("deepseek-v3")
    h, n, q_r, kv_r = 7168, 128, 1536, 512
    q = h * q_r + q_r + q_r * n * (128 + 64)
    kv = h * (kv_r + 64) + kv_r + kv_r * n * (128 + 128)
    assert q + kv + n * 128 * h == model._attention_params() == 187_107_328


def test_moe_layer_counts_follow_megatrons_layer_freq():
    dense_first = load_model("deepseek-v3")
    assert dense_first.moe_layers("layer") == 58 and dense_first.moe_share("layer") == 58 / 61
    every_other = replace(dense_first, moe_layer_freq=2)
    assert every_other.moe_layers("layer") == 31  # layers 0, 2, ..., 60
    assert load_model("mixtral-8x7b").moe_share("layer") == 1


def _moe_model(tmp_path, **fields):
    lines = ['[model]', 'name = "tiny-moe"', 'architecture = "decoder"', 'num_layers = 4', 'hidden_size = 64',
             'num_attention_heads = 4', 'seq_length = 128', 'vocab_size = 1000', 'global_batch_size = 8',
             'num_experts = 8']
    lines += [f"{key} = {value}" for key, value in fields.items()]
    path = tmp_path / "moe.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("fields, where, expected", [
    ({"moe_layer_freq": "[0, 1, 1]"}, "moe_layer_freq", "expected 4 entries of 0 or 1"),
    ({"moe_layer_freq": "[0, 2, 1, 1]"}, "moe_layer_freq", "expected 4 entries of 0 or 1"),
    ({"moe_layer_freq": 9}, "moe_layer_freq", "expected an integer from 1 to 4"),
    ({"moe_router_topk": 9}, "moe_router_topk", "at most num_experts = 8"),
    ({"moe_capacity_factor": "nan"}, "moe_capacity_factor", "expected a number > 0"),
    ({"q_lora_rank": 32}, "q_lora_rank", "only with multi_latent_attention"),
    ({"multi_latent_attention": "true", "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8},
     "v_head_dim", "missing"),
])
def test_bad_moe_fields_are_refused_by_name(tmp_path, fields, where, expected):
    with pytest.raises(InputError, match=f"model.{where}: .*{expected}"):
        load_model(_moe_model(tmp_path, **fields))


def test_moe_fields_without_experts_are_refused(tmp_path):
    path = tmp_path / "dense.toml"
    path.write_text(_moe_model(tmp_path) and (tmp_path / "moe.toml").read_text().replace("num_experts = 8",
                                                                                           "moe_router_topk = 2"))
    with pytest.raises(InputError, match="model.moe_router_topk: only with num_experts"):
        load_model(str(path))


# -- kernels -------------------------------------------------------------------------------------------------
def test_moe_layer_flops_by_hand():
    """The MoE layer's forward matmul FLOPs on one rank: attention as a dense layer's, the router (h x E), each
    token's top-k experts (SwiGLU: 3 h F_e) and the shared experts, per token; and a causal flash kernel's half
    of the s x s scores."""
    model = load_model("mixtral-8x7b")
    b, s, h, f, k, e = 1, model.seq_length, model.hidden_size, model.expert_ffn_hidden_size, 2, model.num_experts
    work = unit_work(model, 1, b)[moe_kind("layer")]
    attention = h * model.attention_width + 2 * h * model.kv_width + model.attention_width * h
    core = 2 * b * s * s / 2 * model.num_attention_heads * 2 * model.kv_channels
    expected = 2 * b * s * (attention + h * e + k * 3 * h * f) + core
    assert work.forward_flops == pytest.approx(expected, rel=1e-12)
    assert roofline.layer_forward_flops(model, "layer", b) == pytest.approx(expected, rel=1e-12)


def test_expert_parallelism_keeps_each_ranks_expert_work():
    """Balanced routing: a rank's experts process its own T k tokens' worth whatever ep, in fewer, fuller groups."""
    model = load_model("mixtral-8x7b")
    flops = {ep: sum(k.flops for k in unit_work(model, 1, 1, Layout(ep=ep, etp=1))[moe_kind("layer")].forward
                     if k.name.startswith("experts")) for ep in (1, 2, 8)}
    assert flops[1] == pytest.approx(flops[2], rel=1e-12) == pytest.approx(flops[8], rel=1e-12)


def test_the_dense_layout_is_the_default():
    model = load_model("llama3-8b")
    assert unit_work(model, 2, 1, DENSE) == unit_work(model, 2, 1)
    assert Config(2, 1, 1, 1, 8, 0, True, etp=2).layout == DENSE


def test_context_parallelism_splits_a_layers_work():
    """On a cp rank: every linear and element-wise kernel on s / cp tokens, attention of those queries over all
    s keys, one kernel per step of the ring: the layer's FLOPs divide by cp exactly."""
    model = load_model("llama3-8b")
    whole = unit_work(model, 1, 1)["layer"]
    split = unit_work(model, 1, 1, Layout(cp=4))["layer"]
    assert split.forward_flops * 4 == pytest.approx(whole.forward_flops, rel=1e-12)
    flash = [k for k in split.forward if k.name == "flash attention"]
    assert flash and flash[0].launches == 4


# -- memory -------------------------------------------------------------------------------------------------
def test_moe_activation_bytes_by_hand():
    """Mixtral's MoE FFN on one sample, tp 2, etp 1: router input and fp32 scores, the permuted tokens, fc1 out
    (2 F_e), fc2 in (F_e) and the experts' outputs, on T = s / tp tokens, each routed k times."""
    model = load_model("mixtral-8x7b")
    s, h, f, k, e, p = model.seq_length, model.hidden_size, model.expert_ffn_hidden_size, 2, 8, 2
    t = s / 2
    expected = p * t * h + 4 * t * e + p * t * k * (h + 2 * f + f) + p * t * k * h
    assert moe_ffn_bytes(model, "layer", 2, 1) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_context_parallelism_divides_activations(recompute):
    model = load_model("mixtral-8x7b")
    whole = layer_activation_bytes(model, "layer", 2, 2, True, recompute, Layout(etp=1))
    split = layer_activation_bytes(model, "layer", 2, 2, True, recompute, Layout(cp=4, etp=1))
    assert split * 4 == pytest.approx(whole, rel=1e-12)


# -- communication --------------------------------------------------------------------------------------------
def test_alltoall_across_two_nodes_by_hand():
    """Two 4-GPU nodes, one all-to-all of 8 members: each sends 3/8 of its byte over NVLink and 4/8 through its
    node's interface, which four members share."""
    cluster = load_cluster("h100x8-a10gx4")
    node = cluster.node_types["A10G"]
    links = Links(cluster, ("A10G", "A10G"))
    group = np.array([[[0, 0, 0, 0, 1, 1, 1, 1]]])
    per_byte, _ = links.alltoall(group)
    der = cluster.derating
    intra = 3 / 8 * der.collective_intra_node / node.intra_node_bytes_per_s
    inter = 4 * 4 / 8 * der.collective_inter_node / node.inter_node_bytes_per_s
    assert per_byte[0] == pytest.approx(max(intra, inter), rel=1e-12)


def test_the_ring_is_exposed_only_beyond_the_attention_it_hides_behind():
    model = with_seq_length(load_model("llama3-8b"), 32768)
    cluster = load_cluster("h100x8-a10gx4")
    config = Config(1, 1, 1, 1, 1, 0, True, cp=8)
    geo = geometry(cluster, ("H100",), 1, 1, 1, cp=8)
    send = kv_chunk_bytes(model, 1, 8) * 32768 * geo.ring_s_per_byte[0] + geo.ring_latency_s[0]
    segment = np.zeros((1, 1), dtype=int)
    for core in (0.0, 8 * send / 2, 8 * send * 2):
        forward, backward = layer_exchange_s(model, [geo], config, segment, np.array([1]), np.array([[core]]))
        assert forward[0, 0] == pytest.approx(7 * max(send - core / 8, 0.0), rel=1e-12)
        assert backward[0, 0] == pytest.approx(2 * forward[0, 0], rel=1e-12)


# -- the plan space ------------------------------------------------------------------------------------------
def test_context_degrees_follow_megatrons_rule():
    model = with_seq_length(load_model("llama3-70b"), 131072)
    degrees = context_degrees(model, 64)
    assert degrees[0] == 1 and all(131072 % (2 * c) == 0 and 131072 // c >= 4096 for c in degrees)
    assert context_degrees(load_model("gpt2-xl"), 64) == [1]  # no flash attention


def test_expert_degrees_fold_out_of_the_dense_grid():
    model = load_model("mixtral-8x7b")
    for ep, etp in expert_degrees(model, 4, 16):
        assert 8 % ep == 0 and 16 % (ep * etp) == 0 and etp in (1, 4)
    assert expert_degrees(load_model("llama3-8b"), 4, 16) == [(1, 4)]
    assert {etp for _, etp in expert_degrees(load_model("gpt-oss-120b"), 4, 16)} == {1}  # biases: etp 1


def test_mixtral_plan_memory_never_rises_with_ep_or_cp():
    """Everything else fixed, more expert ranks split the experts further, and more context ranks (each on GPUs
    of its own) the activations."""
    model = load_model("mixtral-8x7b")
    cluster = load_cluster("h100x8-a10gx4")
    base = dict(tp=2, dp=4, pp=1, mbs=1, placement=["H100"], layers_per_stage=[32], recompute="full", gbs=256)
    memory = [estimate(model, cluster, ep=ep, etp=1, **base).peak_memory_gib for ep in (1, 2, 4, 8)]
    assert memory == sorted(memory, reverse=True) and memory[-1] < memory[0]
    long = with_seq_length(model, 16384)
    base.update(dp=1, gbs=8)
    memory = [estimate(long, cluster, cp=cp, ep=1, etp=1, **{**base, "placement": ["A10G"] * (cp // 2)}).peak_memory_gib
              for cp in (2, 4, 8)]
    assert memory == sorted(memory, reverse=True) and memory[-1] < memory[0]


def test_megatrons_rules_are_checked_by_name():
    model = load_model("mixtral-8x7b")
    cluster = load_cluster("h100x8-a10gx4")
    base = dict(tp=2, dp=4, pp=1, mbs=1, placement=["H100"], layers_per_stage=[32])
    with pytest.raises(InputError, match="ep: expected a divisor of the 8 experts, got 3"):
        estimate(model, cluster, ep=3, **base)
    with pytest.raises(InputError, match="etp: etp x ep = 16 must divide tp x cp x dp = 8"):
        estimate(model, cluster, ep=8, etp=2, **base)
    with pytest.raises(InputError, match="sequence_parallel: MoE layers with tp > 1 need sequence parallelism"):
        estimate(model, cluster, ep=2, sequence_parallel=False, **base)
    with pytest.raises(InputError, match="cp: the sequence length 4096 must be divisible by 2 cp = 24"):
        estimate(model, cluster, cp=12, **{**base, "dp": 1, "placement": ["A10G"] * 3, "tp": 1})
    with pytest.raises(InputError, match="ep: expert parallelism needs an MoE model"):
        estimate(load_model("llama3-8b"), cluster, ep=2, **base)
    with pytest.raises(InputError, match="etp: experts with linear biases need etp 1"):
        estimate(load_model("gpt-oss-120b"), cluster, ep=2, etp=2, **base)


def test_the_dense_path_is_untouched_by_cp_1_and_ep_1():
    """A dense plan with cp = 1 and ep = 1 given is the plan without them, figure for figure; its geometry has no
    ring, all-to-all or expert groups, and adds no exchange to any layer."""
    model, cluster = load_model("llama3-8b"), load_cluster("h100x8-a10gx4")
    base = dict(tp=2, dp=2, pp=2, mbs=1, placement=["H100"], layers_per_stage=[16, 16])
    assert estimate(model, cluster, cp=1, ep=1, **base).record() == estimate(model, cluster, **base).record()
    geo = geometry(cluster, ("H100",), 2, 2, 2)
    assert geo.ring_s_per_byte is None and geo.alltoall_s_per_byte is None


def test_moe_search_plans_are_what_the_estimate_gives():
    """Plans of an MoE search carry ep and etp, satisfy Megatron-LM's rules, and estimate to the same figures."""
    from fasop.search.engine import search_plans
    from fasop.search.spec import spec_of

    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("h100x8-a10gx4")
    result = search_plans(model, cluster, gbs=64, keep=8)
    assert any(plan.ep > 1 for plan in result.plans)
    for plan in result.plans:
        assert model.num_experts % plan.ep == 0
        assert (plan.tp * (plan.cp or 1) * plan.dp) % (plan.ep * plan.etp) == 0
        assert plan.sequence_parallel == (plan.tp > 1)
        again = estimate(model, cluster, spec_of(plan, model, cluster))
        assert again.step_time_s == plan.step_time_s and again.peak_memory_gib == plan.peak_memory_gib


def test_a_long_context_search_uses_context_parallelism():
    """llama3-70b at 128K tokens on 8 DGX-like H100 nodes: the best plans split the sequence."""
    from fasop.search.engine import search_plans

    model = with_seq_length(load_model("llama3-70b"), 131072)
    cluster = load_cluster("h100-a100-a10g").with_counts(Counter({"H100": 8}))
    result = search_plans(model, cluster, gbs=16, keep=5)
    assert result.plans and all((plan.cp or 1) > 1 for plan in result.plans)
    assert all(plan.seq_length == 131072 for plan in result.plans)


def test_profiles_time_moe_units():
    from fasop.inputs.profiles import required_kinds, synthesised_profile

    model = load_model("deepseek-v3")
    assert required_kinds(model) == ("embedding", "layer", "moe_layer", "head")
    assert required_kinds(load_model("mixtral-8x7b")) == ("embedding", "moe_layer", "head")
    profile = synthesised_profile(model, "H100", load_gpu_spec("H100"))
    mean = profile.layer_times_s(model, 1, "layer", (1,))
    dense, moe = profile.times_s(1, "layer", (1,)), profile.times_s(1, "moe_layer", (1,))
    assert mean == pytest.approx(3 / 61 * dense + 58 / 61 * moe, rel=1e-12)


# -- launch ------------------------------------------------------------------------------------------------
def _run_inter_flags(model, cluster, plan) -> dict[str, list[str]]:
    from test_emit import SMOKE, flag_values, megatron_args

    from fasop.launch.write import render_plan

    return flag_values(megatron_args(render_plan(plan, model, cluster, SMOKE)["run_inter.sh"]))


# DeepSeek-V3's plan: the best `fasop search --model deepseek-v3 --cluster h100-a100-a10g --prune` finds
DEEPSEEK_BEST = dict(tp=1, dp=24, pp=32, cp=1, ep=8, etp=1, layers=[1, *[4] * 10, *[1] * 20, 0],
                     placement=["A100"] * 3 + ["H100"] * 32 + ["A100"] * 61)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name, fields", [
    ("qwen3-30b-a3b", dict(tp=2, dp=4, pp=1, cp=1, ep=8, etp=1, layers=[48])),
    ("deepseek-v3", dict(tp=1, dp=8, pp=2, cp=1, ep=8, etp=1, layers=[30, 31])),
    ("deepseek-v3", DEEPSEEK_BEST),
    ("mixtral-8x7b", dict(tp=2, dp=2, pp=1, cp=2, ep=4, etp=2, layers=[32])),
])
def test_megatron_core_accepts_the_emitted_expert_and_context_flags(name, fields):
    """The flags of an MoE plan, read as Megatron-LM's argument parser converts them (its --moe-layer-freq
    expression evaluated as it does), make the TransformerConfig (MLATransformerConfig for multi-latent
    attention) that megatron-core's own checks accept, with the plan's degrees."""
    transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
    torch = pytest.importorskip("torch")
    from fasop.launch.megatron import moe_layer_freq

    model = load_model(name)
    fields = dict(fields)
    layers = fields.pop("layers")
    cluster = load_cluster("h100-a100-a10g")
    world = fields["tp"] * fields["cp"] * fields["dp"] * len(layers)
    placement = fields.pop("placement", ["H100"] * (world // 8))
    plan = estimate(model, cluster, **fields, mbs=1, placement=placement, layers_per_stage=layers, recompute="full")
    args = _run_inter_flags(model, cluster, plan)
    assert args["--expert-model-parallel-size"] == [str(fields["ep"])]
    assert args["--expert-tensor-parallel-size"] == [str(fields["etp"])]
    assert ("--context-parallel-size" in args) == (fields["cp"] > 1)
    freq_text = args["--moe-layer-freq"][0]
    assert set(freq_text) <= set("0123456789[]()+*,")  # Megatron-LM's parser allows only these, no spaces
    freq = eval(freq_text) if freq_text.startswith("[") else int(freq_text)  # as Megatron-LM's parser does
    assert freq == (list(model.moe_layer_freq) if isinstance(model.moe_layer_freq, tuple) else model.moe_layer_freq)
    assert moe_layer_freq((0, 0, 1, 1, 1)) == "[0]*2+[1]*3"
    one = {flag: values[0] for flag, values in args.items() if len(values) == 1}
    common = dict(
        num_layers=int(one["--num-layers"]), hidden_size=int(one["--hidden-size"]),
        num_attention_heads=int(one["--num-attention-heads"]), kv_channels=int(one["--kv-channels"]),
        num_moe_experts=int(one["--num-experts"]), moe_router_topk=int(one["--moe-router-topk"]),
        moe_ffn_hidden_size=int(one["--moe-ffn-hidden-size"]), moe_layer_freq=freq,
        moe_token_dispatcher_type=one["--moe-token-dispatcher-type"], moe_grouped_gemm="--moe-grouped-gemm" in args,
        moe_shared_expert_intermediate_size=int(one.get("--moe-shared-expert-intermediate-size", 0)) or None,
        tensor_model_parallel_size=int(one["--tensor-model-parallel-size"]),
        pipeline_model_parallel_size=int(one["--pipeline-model-parallel-size"]),
        context_parallel_size=int(one.get("--context-parallel-size", 1)),
        expert_model_parallel_size=int(one["--expert-model-parallel-size"]),
        expert_tensor_parallel_size=int(one["--expert-tensor-parallel-size"]),
        sequence_parallel="--sequence-parallel" in args, add_bias_linear="--disable-bias-linear" not in args,
        pipeline_dtype=torch.bfloat16, bf16=True)
    if "--multi-latent-attention" in args:
        config = transformer_config.MLATransformerConfig(
            multi_latent_attention=True, q_lora_rank=int(one["--q-lora-rank"]), kv_lora_rank=int(one["--kv-lora-rank"]),
            qk_head_dim=int(one["--qk-head-dim"]), qk_pos_emb_head_dim=int(one["--qk-pos-emb-head-dim"]),
            v_head_dim=int(one["--v-head-dim"]), **common)
        assert (config.q_lora_rank, config.kv_lora_rank) == (model.q_lora_rank, model.kv_lora_rank)
    else:
        common["num_query_groups"] = int(one.get("--num-query-groups", one["--num-attention-heads"]))
        config = transformer_config.TransformerConfig(**common)
    assert config.expert_model_parallel_size == fields["ep"] and config.num_moe_experts == model.num_experts
    assert config.context_parallel_size == fields["cp"]
    if "--pipeline-model-parallel-layout" in args:  # an uneven split: megatron-core's own layout reads it
        layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
        enums = pytest.importorskip("megatron.core.transformer.enums")
        layout = layout_module.PipelineParallelLayerLayout(one["--pipeline-model-parallel-layout"], len(layers))
        layout.validate_layer_layout(num_layers=model.num_layers, mtp_num_layers=None)
        assert [row[0].count(enums.LayerType.decoder) for row in layout.layout] == layers


def test_emit_refuses_encoder_moe_models(tmp_path):
    """Stock Megatron-LM has MoE layers only in GPT-style decoders: one line says so."""
    from fasop.launch.megatron import model_flags
    from fasop.launch.options import LaunchOptions

    model = replace(load_model("bert"), num_experts=4, moe_router_topk=1)
    with pytest.raises(InputError, match="encoder MoE models: stock Megatron-LM has MoE layers only in GPT-style"):
        model_flags(model, LaunchOptions(smoke_test=True))


def test_load_imbalance_scales_the_busiest_ranks_experts():
    model = load_model("mixtral-8x7b")
    hot = replace(model, moe_load_imbalance=2.0)
    def experts_flops(m):
        return sum(k.flops for k in unit_work(m, 1, 1, Layout(ep=8, etp=1))[moe_kind("layer")].forward
                   if k.name.startswith("experts"))
    assert experts_flops(hot) == pytest.approx(2 * experts_flops(model), rel=1e-12)
    assert moe_ffn_bytes(hot, "layer", 1, 1) > moe_ffn_bytes(model, "layer", 1, 1)


# -- properties -----------------------------------------------------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(experts=st.sampled_from([2, 4, 8, 16]), topk=st.integers(1, 4), freq=st.sampled_from([1, 2]),
       seq=st.sampled_from([4096, 8192, 16384]), h100=st.integers(1, 4), a10g=st.integers(0, 4))
def test_every_searched_plan_keeps_megatrons_rules(experts, topk, freq, seq, h100, a10g):
    """On random MoE shapes and clusters, every plan a search returns has degrees Megatron-LM runs: ep divides the
    experts, etp x ep divides tp x cp x dp, the GPUs are tp x cp x dp x pp, the sequence divides by 2 cp,
    sequence parallelism whenever tp > 1; and its estimate is the search's."""
    from fasop.search.engine import search_plans
    from fasop.search.spec import spec_of

    model = with_seq_length(replace(load_model("mixtral-8x7b"), num_experts=experts, moe_router_topk=min(topk, experts),
                                    moe_layer_freq=freq, decoder_num_layers=8, global_batch_size=16), seq)
    cluster = load_cluster("h100x8-a10gx4").with_counts(Counter({"H100": h100, "A10G": a10g}))
    result = search_plans(model, cluster, keep=4)
    for plan in result.plans:
        cp, gpus = plan.cp or 1, len(plan.placement) * cluster.node_types[plan.placement[0]].gpus_per_node
        assert plan.tp * cp * plan.dp * plan.pp == gpus
        assert experts % plan.ep == 0 and (plan.tp * cp * plan.dp) % (plan.ep * plan.etp) == 0
        assert seq % (2 * cp) == 0 and plan.sequence_parallel == (plan.tp > 1)
        assert estimate(model, cluster, spec_of(plan, model, cluster)).step_time_s == plan.step_time_s


@settings(max_examples=12, deadline=None)
@given(tp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2]), recompute=st.sampled_from(["none", "full"]),
       mbs=st.sampled_from([1, 2]))
def test_memory_never_rises_as_ep_or_cp_doubles(tp, ep, recompute, mbs):
    """Everything else fixed, doubling ep (over the same ranks) or cp (on twice the GPUs) never raises any
    stage's memory."""
    model = with_seq_length(replace(load_model("mixtral-8x7b"), decoder_num_layers=8), 16384)
    cluster = load_cluster("h100-a100-a10g")
    plan = dict(tp=tp, pp=2, mbs=mbs, gbs=8, layers_per_stage=[4, 4], etp=1, recompute=recompute,
                recompute_method="uniform" if recompute == "full" else None,
                recompute_num_layers=1 if recompute == "full" else None)

    def memory(cp: int, experts: int) -> list[float]:
        dp = 4
        nodes = tp * cp * dp * 2 // 8
        row = estimate(model, cluster, dp=dp, cp=cp, ep=experts, placement=["H100"] * nodes, **plan)
        return [stage.memory_gib for stage in row.stages]

    for cp in (1, 2):
        base, doubled = memory(cp, ep), memory(cp, 2 * ep)
        assert all(b >= d - 1e-9 for b, d in zip(base, doubled))
    assert all(b >= d - 1e-9 for b, d in zip(memory(1, ep), memory(2, ep)))


# -- hostile input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, fragment", [("0", "0 is not in the range x>=1"), ("nan", "'nan' is not a valid integer"),
                                             ("99999999999", "expected an integer from 1 to 16,777,216")])
def test_a_bad_sequence_length_is_one_line_and_writes_nothing(runner, tmp_path, value, fragment):
    from fasop.cli import main

    out = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "llama3-8b", "--cluster", "h100x8-a10gx4", "--seq-length", value,
                                  "--output", str(out)])
    one_line_error(result, "--seq-length", fragment)
    assert not out.exists()


def test_a_sequence_beyond_the_model_files_is_noted(runner):
    from fasop.cli import main

    result = runner.invoke(main, ["estimate", "--model", "llama3-8b", "--cluster", "h100x8-a10gx4", "--tp", "2", "--dp",
                                  "2", "--cp", "2", "--pp", "1", "--mbs", "1", "--placement", "H100", "--layers", "32",
                                  "--seq-length", "16384"])
    assert result.exit_code in (0, 3), result.output
    assert ("note: --seq-length 16384 is beyond the 8192 tokens llama3-8b was set up for; its rope positions must "
            "stretch to it") in result.stderr
    assert "cp=2" in result.stdout


@pytest.mark.parametrize("options, fragments", [
    (["--ep", "3"], ("--ep", "expected a divisor of the 8 experts, got 3")),
    (["--ep", "8", "--etp", "2"], ("--etp", "etp x ep = 16 must divide tp x cp x dp = 8")),
    (["--cp", "3"], ("--cp", "must be divisible by 2 cp = 6")),
    (["--ep", str(2**70)], ("--ep", "expected a divisor of the 8 experts")),
])
def test_bad_degrees_on_the_command_line_are_one_line(runner, options, fragments):
    from fasop.cli import main

    result = runner.invoke(main, ["estimate", "--model", "mixtral-8x7b", "--cluster", "h100x8-a10gx4", "--tp", "2",
                                  "--dp", "4", "--pp", "1", "--mbs", "1", "--placement", "H100", "--layers", "32",
                                  *options])
    one_line_error(result, *fragments)


@pytest.mark.parametrize("field, value, fragment", [
    ("cp", 0, "cp: expected an integer from 1"), ("ep", 2**60, "ep: expected an integer from 1"),
    ("seq_length", 2**40, "seq_length: expected an integer from 1 to 16,777,216"),
    ("ep", 3, "ep: expected a divisor of the 8 experts, got 3"),
])
def test_bad_degrees_in_a_plan_file_are_one_line(runner, tmp_path, field, value, fragment):
    import json

    from fasop.cli import main

    plan = estimate(load_model("mixtral-8x7b"), load_cluster("h100x8-a10gx4"), tp=2, dp=4, pp=1, mbs=1, ep=8, etp=1,
                    placement=["H100"], layers_per_stage=[32]).record()
    path = tmp_path / "plans.json"
    path.write_text(json.dumps([{**plan, "rank": 1, field: value}]))
    one_line_error(runner.invoke(main, ["estimate", "--plan", str(path)]), str(path), fragment)
