"""Selective recomputation of Megatron-LM's --recompute-modules: what each module frees (hand counts), that more
modules never hold more memory nor take less time, the default reproducing the attention core's figures, the
plan fields, the emitted flags and the refusals."""

from __future__ import annotations

import json

import pytest
from conftest import one_line_error
from hypothesis import given, settings
from hypothesis import strategies as st

import fasop
from fasop.cli import main
from fasop.cost.config import DEFAULT_RECOMPUTE_MODULES
from fasop.cost.memory import layer_activation_bytes
from fasop.cost.roofline import RECOMPUTE_MODULES, Layout, Rates, module_time_share, unit_work
from fasop.errors import InputError
from fasop.inputs.catalogue import load_gpu_spec
from fasop.inputs.cluster import load_cluster
from fasop.search import estimate

DEEPSEEK = fasop.load_model("deepseek-v3")  # MLA, three dense layers, MoE layers with a shared expert
MIXTRAL = fasop.load_model("mixtral-8x7b")  # MoE on every layer, plain attention
LLAMA = fasop.load_model("llama3-8b")  # dense
H100 = load_gpu_spec("H100")


def _applicable(model) -> tuple[str, ...]:
    return tuple(m for m in RECOMPUTE_MODULES if not (m == "moe_act" and not model.is_moe)
                 and not (m == "mla_up_proj" and not model.multi_latent_attention))


EP8 = Layout(ep=8)


def _memory(model, kind: str, modules: tuple[str, ...], tp: int = 2, layout: Layout = EP8) -> float:
    return layer_activation_bytes(model, kind, 1, tp, True, "selective", layout, modules)


# -- what each module frees, counted by hand --------------------------------------------------------------
def test_moe_act_frees_the_experts_fc2_input():
    """Per sample on a rank of tp 2, etp 1: s / tp tokens, each routed to k experts, fc2's input F_e wide."""
    s, tp, k, f, p = MIXTRAL.seq_length, 2, MIXTRAL.moe_router_topk, MIXTRAL.expert_ffn_hidden_size, 2
    layout = Layout(ep=8, etp=1)
    freed = _memory(MIXTRAL, "layer", ("core_attn",), tp, layout) - _memory(MIXTRAL, "layer", ("moe_act",), tp, layout)
    assert freed == pytest.approx(p * s / tp * k * f * MIXTRAL.moe_load_imbalance, rel=1e-12)


def test_layernorm_frees_the_moe_norm_output_and_nothing_of_a_fused_one():
    """An MoE layer's pre-FFN norm is a module of its own (its output, the router's input, s / tp x h); a dense
    layer's norms are fused into the next linear layer: recomputing "layernorm" frees nothing there."""
    s, h, tp = MIXTRAL.seq_length, MIXTRAL.hidden_size, 2
    freed = _memory(MIXTRAL, "layer", ("core_attn",)) - _memory(MIXTRAL, "layer", ("core_attn", "layernorm"))
    assert freed == pytest.approx(2 * s / tp * h, rel=1e-12)
    assert _memory(LLAMA, "layer", ("layernorm",), layout=Layout()) == _memory(LLAMA, "layer", ("core_attn",),
                                                                             layout=Layout())


def test_mla_up_proj_frees_q_k_and_v():
    """Multi-latent attention's up-projected Q, K and V, heads x 128 wide each as fasop counts them, over tp."""
    s, tp, p = DEEPSEEK.seq_length, 2, 2
    q, kv = DEEPSEEK.attention_width, DEEPSEEK.kv_width  # every layer, dense or MoE, has the attention
    freed = _memory(DEEPSEEK, "layer", ("core_attn",)) - _memory(DEEPSEEK, "layer", ("mla_up_proj",))
    assert freed == pytest.approx(p * s * (q + 2 * kv) / tp, rel=1e-12)


def test_mlp_keeps_a_dense_ffn_input_alone():
    """A dense layer's FFN under "mlp": fc1's input (the norm's output) and fc1's output and fc2's input go; the
    norm's input, the checkpoint's own input, stays. Llama 3 8B: SwiGLU, bf16, no dropout."""
    s, h, f, tp = LLAMA.seq_length, LLAMA.hidden_size, LLAMA.ffn_hidden_size, 2
    freed = _memory(LLAMA, "layer", ("core_attn",), layout=Layout()) - _memory(LLAMA, "layer", ("mlp",),
                                                                               layout=Layout())
    assert freed == pytest.approx((2 * s * h + (2 * 2 + 2) * s * f) / tp, rel=1e-12)


def test_shared_experts_and_mlp_touch_only_their_layers():
    """DeepSeek-V3's shared expert lives in its 58 MoE layers, its dense FFN in the 3 others."""
    base = _memory(DEEPSEEK, "layer", ("core_attn",))
    assert _memory(DEEPSEEK, "layer", ("core_attn", "shared_experts")) < base
    assert _memory(DEEPSEEK, "layer", ("core_attn", "mlp")) < base
    assert _memory(MIXTRAL, "layer", ("core_attn", "shared_experts")) == _memory(MIXTRAL, "layer", ("core_attn",))


# -- properties ---------------------------------------------------------------------------------------------
@st.composite
def nested_module_sets(draw):
    model = draw(st.sampled_from([DEEPSEEK, MIXTRAL, LLAMA]))
    modules = _applicable(model)
    larger = draw(st.lists(st.sampled_from(modules), min_size=1, unique=True))
    smaller = draw(st.lists(st.sampled_from(larger), min_size=1, unique=True))
    return model, tuple(smaller), tuple(larger)


@settings(max_examples=60, deadline=None)
@given(nested_module_sets(), st.sampled_from([1, 2, 4]))
def test_more_modules_never_hold_more_memory_nor_rerun_less(case, tp):
    model, smaller, larger = case
    layout = Layout(ep=8) if model.is_moe else Layout()
    assert _memory(model, "layer", larger, tp, layout) <= _memory(model, "layer", smaller, tp, layout)
    rates = Rates.of(H100, model)
    units = unit_work(model, tp, 1, layout)
    for unit in units.values():
        if unit.kind in ("embedding", "head"):
            continue
        assert module_time_share(unit, tp, rates, larger) >= module_time_share(unit, tp, rates, smaller) - 1e-12
        assert module_time_share(unit, tp, rates, larger) < 1


def test_every_module_frees_something_where_it_applies():
    """Each module frees memory in some layer of a model that has it; none is a silent no-op everywhere."""
    for module in RECOMPUTE_MODULES:
        model = DEEPSEEK if module != "core_attn" else fasop.load_model("gpt2-xl")  # gpt2-xl: unfused attention
        layout = Layout(ep=8) if model.is_moe else Layout()
        base = layer_activation_bytes(model, "layer", 1, 2, True, "none", layout)
        assert _memory(model, "layer", (module,), 2, layout) < base, module


# -- plans ----------------------------------------------------------------------------------------------------
DEEPSEEK_PLAN = dict(tp=2, dp=16, pp=2, ep=16, etp=1, mbs=1, gbs=64, placement=["H100"] * 8, layers_per_stage=[30, 31])


def test_the_default_modules_are_the_attention_core():
    cluster = load_cluster("h100-a100-a10g")
    plain = estimate(DEEPSEEK, cluster, recompute="selective", **DEEPSEEK_PLAN)
    core = estimate(DEEPSEEK, cluster, recompute="selective", recompute_modules=["core_attn"], **DEEPSEEK_PLAN)
    assert plain.record() == core.record()
    assert "recompute_modules" not in plain.record()


def test_a_plan_with_modules_holds_less_and_takes_longer_and_reads_back():
    cluster = load_cluster("h100-a100-a10g")
    core = estimate(DEEPSEEK, cluster, recompute="selective", **DEEPSEEK_PLAN)
    modules = estimate(DEEPSEEK, cluster, recompute="selective",
                       recompute_modules=["mlp", "mla_up_proj", "moe_act", "layernorm"], **DEEPSEEK_PLAN)
    assert modules.recompute_modules == ["layernorm", "moe_act", "mla_up_proj", "mlp"]  # canonical order
    assert modules.peak_memory_gib < core.peak_memory_gib
    assert modules.recompute_s > 0 and modules.step_time_s != core.step_time_s
    again = fasop.plans.Plan.model_validate(json.loads(json.dumps(modules.record())))
    from fasop.search.spec import spec_of

    assert estimate(DEEPSEEK, cluster, spec_of(again, DEEPSEEK, cluster)).record() == modules.record()


@pytest.mark.parametrize("fields, fragment", [
    (dict(recompute="selective", recompute_modules=["moe"]), "whole MoE layer"),
    (dict(recompute="selective", recompute_modules=["attention"]), "expected some of core_attn"),
    (dict(recompute="selective", recompute_modules=["mlp", "mlp"]), "each once"),
    (dict(recompute="full", recompute_modules=["mlp"]), "go with selective recomputation"),
])
def test_modules_that_megatron_or_fasop_would_not_run_are_refused(fields, fragment):
    with pytest.raises(InputError, match=fragment):
        estimate(DEEPSEEK, load_cluster("h100-a100-a10g"), **fields, **DEEPSEEK_PLAN)


@pytest.mark.parametrize("module, model", [("moe_act", "llama3-8b"), ("mla_up_proj", "mixtral-8x7b")])
def test_modules_the_model_lacks_are_refused_in_one_line(runner, module, model):
    result = runner.invoke(main, ["search", "--model", model, "--cluster", "h100-a100-a10g", "--recompute-modules",
                                  module])
    one_line_error(result, "--recompute-modules", module)


def test_search_takes_the_modules_to_its_selective_plans(runner, tmp_path):
    """Llama 3 8B has flash attention: selective recomputation of the core alone is never searched, of the FFN
    ("mlp") it is, and its plans carry the modules."""
    out = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "llama3-8b", "--cluster", "h100-a100-a10g", "--use-all",
                                  "--recompute", "selective", "--recompute-modules", "mlp", "--output", str(out)])
    assert result.exit_code == 0, result.output
    plans = json.loads(out.read_text())
    assert plans and all(p["recompute"] == "selective" and p["recompute_modules"] == ["mlp"] for p in plans)


def test_measured_runs_read_the_modules(tmp_path):
    from fasop.calibration.measured import read_runs_csv

    path = tmp_path / "runs.csv"
    path.write_text("tp,dp,pp,mbs,gbs,placement,layers_per_stage,recompute,recompute_modules,measured_step_s\n"
                    "2,4,1,1,8,H100,32,selective,mlp core_attn,1.5\n")
    (run,) = read_runs_csv(path, model="llama3-8b", cluster="h100-a100-a10g")
    assert run.spec_fields["recompute_modules"] == ("mlp", "core_attn")


# -- launch -----------------------------------------------------------------------------------------------------
def test_emitted_flags_name_the_modules_only_when_not_the_default():
    from test_moe_context import _run_inter_flags

    cluster = load_cluster("h100-a100-a10g")
    for modules, expected in ((None, None), (["core_attn"], None), (["mlp", "mla_up_proj"], ["mla_up_proj", "mlp"])):
        plan = estimate(DEEPSEEK, cluster, recompute="selective", recompute_modules=modules, **DEEPSEEK_PLAN)
        args = _run_inter_flags(DEEPSEEK, cluster, plan)
        assert args["--recompute-granularity"] == ["selective"]
        assert args.get("--recompute-modules") == expected


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name, modules", [("deepseek-v3", ["layernorm", "moe_act", "mla_up_proj", "mlp",
                                                             "shared_experts"]),
                                           ("mixtral-8x7b", ["core_attn", "moe_act", "layernorm"])])
def test_megatron_core_accepts_the_emitted_modules(name, modules):
    """megatron-core's TransformerConfig checks the modules (moe_act needs grouped GEMMs, mla_up_proj multi-latent
    attention) and keeps them as given."""
    transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
    torch = pytest.importorskip("torch")
    from test_moe_context import _run_inter_flags

    model, cluster = fasop.load_model(name), load_cluster("h100-a100-a10g")
    fields = dict(DEEPSEEK_PLAN, layers_per_stage=[model.num_layers // 2, model.num_layers - model.num_layers // 2],
                  ep=8)
    plan = estimate(model, cluster, recompute="selective", recompute_modules=modules, **fields)
    args = _run_inter_flags(model, cluster, plan)
    one = {flag: values[0] for flag, values in args.items() if len(values) == 1}
    common = dict(num_layers=model.num_layers, hidden_size=model.hidden_size,
                  num_attention_heads=model.num_attention_heads, num_moe_experts=model.num_experts,
                  moe_router_topk=model.moe_router_topk, moe_grouped_gemm="--moe-grouped-gemm" in args,
                  tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=8,
                  expert_tensor_parallel_size=int(one["--expert-tensor-parallel-size"]),
                  add_bias_linear="--disable-bias-linear" not in args, sequence_parallel=True,
                  pipeline_dtype=torch.bfloat16, bf16=True,
                  recompute_granularity=one["--recompute-granularity"], recompute_modules=args["--recompute-modules"])
    if model.multi_latent_attention:
        config = transformer_config.MLATransformerConfig(
            multi_latent_attention=True, q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank,
            qk_head_dim=model.qk_head_dim, qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
            **common)
    else:
        config = transformer_config.TransformerConfig(num_query_groups=model.num_query_groups, **common)
    assert sorted(config.recompute_modules) == sorted(modules)


def test_recompute_module_names_are_one_list():
    """The plan schema's names are the cost model's (fasop.plans cannot import the cost model's tuple)."""
    import typing

    from fasop.plans import RecomputeModule

    assert typing.get_args(RecomputeModule) == RECOMPUTE_MODULES
    assert set(DEFAULT_RECOMPUTE_MODULES) <= set(RECOMPUTE_MODULES)
