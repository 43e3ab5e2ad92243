"""FP8 training (fasop.cost.fp8, fasop.search.precision): which GPUs run which recipe, what FP8 changes in the
roofline, memory and traffic (each checked by hand), the precision of profiles, plans ranked across precisions,
and the stock Megatron-LM flags an fp8 plan is launched with."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_emit import SMOKE, flag_values, megatron_args

from fasop.cli import main
from fasop.cost.fp8 import cast_bytes_per_element, recipe_error, weight_cast_bytes, weight_memory_bytes
from fasop.cost.memory import layer_activation_bytes
from fasop.cost.roofline import Rates, pass_s, unit_times, unit_work, wave_efficiency
from fasop.errors import InputError
from fasop.inputs.catalogue import load_gpu_spec
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model, with_precision
from fasop.inputs.profiles import load_profiles, read_profile
from fasop.launch.write import render_plan
from fasop.plans import Plan
from fasop.profile.synth import format_profile, header_lines, synthesize
from fasop.search.estimate import estimate
from fasop.search.precision import parse_precisions, precision_spaces


@pytest.mark.parametrize("gpu, recipes", [
    ("H100", {"delayed", "tensorwise", "blockwise"}), ("B200", {"delayed", "tensorwise", "blockwise", "mxfp8"}),
    ("L4", {"delayed", "tensorwise"}), ("A100", set()), ("T4", set()), ("V100", set())])
def test_transformer_engines_recipe_rules(gpu, recipes):
    """quantization.py: FP8 from compute capability 8.9, block scaling from 9.0, MXFP8 on 10.x only."""
    spec = load_gpu_spec(gpu)
    assert {r for r in ("delayed", "tensorwise", "blockwise", "mxfp8") if recipe_error(spec, r) is None} == recipes


def test_an_fp8_layer_runs_its_linear_gemms_at_the_fp8_rate_and_casts_their_inputs():
    model = load_model("llama2-70b")
    fp8 = with_precision(model, "fp8")
    spec = load_gpu_spec("H100")
    rates = Rates.of(spec, fp8)
    assert rates.fp8_flops_per_s == pytest.approx(1979e12 * 0.613)  # both sustained at the power limit
    assert rates.flops_per_s == pytest.approx(989e12 * 0.679)
    bf16_work, fp8_work = unit_work(model, 4, 1)["layer"], unit_work(fp8, 4, 1)["layer"]
    assert fp8_work.forward_flops == bf16_work.forward_flops  # the same work, at another rate
    gemms = [k for k in fp8_work.forward if k.fp8]
    assert [k.name for k in gemms] == ["QKV", "attention output", "FFN in", "FFN out"]
    # the attention output and FFN out inputs are cast by their own kernels; QKV and FFN in by the norms before
    casts = {k.name: k for k in fp8_work.forward if k.name.endswith("input cast")}
    assert set(casts) == {"attention output input cast", "FFN out input cast"}
    tokens, ffn = 4096, 28672 / 4
    assert casts["FFN out input cast"].bytes == pytest.approx((2 + 2) * tokens * ffn)  # read bf16, two FP8 copies
    fc2 = next(k for k in gemms if k.name == "FFN out")
    assert pass_s((fc2,), rates) == pytest.approx(
        max(fc2.flops / (rates.fp8_flops_per_s * wave_efficiency(fc2.output, rates.sm_count)),
            fc2.bytes / rates.memory_bytes_per_s) + rates.kernel_launch_s)
    # every backward GEMM in FP8, and one output-gradient cast per GEMM
    assert sum(k.fp8 for k in fp8_work.backward) == 8
    assert sum(k.name.endswith("output grad cast") for k in fp8_work.backward) == 4
    # the norms' outputs are all-gathered in FP8: two of the four collectives at one byte an element
    assert fp8_work.collectives == (tokens * 8192,) * 2 + (2 * tokens * 8192,) * 2
    assert sum(unit_times(fp8_work, 4, rates)) < sum(unit_times(bf16_work, 4, Rates.of(spec, model))) / 1.3


def test_tensorwise_scaling_reads_each_cast_tensor_twice():
    model = with_precision(load_model("llama2-70b"), "fp8")
    assert cast_bytes_per_element(model) == 4
    assert cast_bytes_per_element(replace(model, fp8_recipe="tensorwise")) == 6


def test_fp8_memory_terms_by_hand():
    """Cached FP8 weights (two bytes a weight, none with --fp8-param-gather) and the FP8 copies of the saved GEMM
    inputs: QKV's and FFN in's inputs at one byte, FFN out's too, and the attention output kept in bf16 by flash
    attention and in FP8 by the projection."""
    model = load_model("llama2-70b")  # SwiGLU, flash attention, no dropout
    fp8 = with_precision(model, "fp8")
    assert (weight_memory_bytes(model), weight_memory_bytes(fp8)) == (0, 2)
    assert weight_memory_bytes(with_precision(model, "fp8", fp8_param_gather=True)) == 0
    assert (weight_cast_bytes(model), weight_cast_bytes(fp8), weight_cast_bytes(replace(fp8, fp8_param_gather=True))) == (0, 4, 2)
    s, h, qa, f = 4096, 8192, 8192, 28672
    saved = layer_activation_bytes(model, "layer", 1, 1) - layer_activation_bytes(fp8, "layer", 1, 1)
    assert saved == pytest.approx(s * h + s * h + s * f - s * qa)  # QKV in, FFN in, FFN out; + the FP8 attention output


def test_a_bf16_profile_is_converted_for_fp8_by_the_roofline_ratio(tmp_path):
    model = load_model("llama2-7b")
    spec = load_gpu_spec("H100")
    path = tmp_path / "H100.csv"
    rows = [row._replace(forward_s=2 * row.forward_s, backward_s=3 * row.backward_s)  # a "measured" bf16 file
            for row in synthesize(model, spec, tps=[1], mbss=[1, 4])]
    path.write_text(format_profile(rows, header_lines(model, spec, [1], [1, 4])))
    fp8 = with_precision(model, "fp8")
    read = read_profile(path, fp8, "H100", spec=spec)
    assert (read.precision, read.derived_from) == ("bf16", "bf16")
    bf16_rates, fp8_rates = Rates.of(spec, model), Rates.of(spec, fp8)
    for mbs in (1, 4):
        forward_bf16, backward_bf16 = unit_times(unit_work(model, 1, mbs)["layer"], 1, bf16_rates)
        forward_fp8, backward_fp8 = unit_times(unit_work(fp8, 1, mbs)["layer"], 1, fp8_rates)
        assert read.time(1, "layer", mbs) == pytest.approx((2 * forward_bf16 * forward_fp8 / forward_bf16,
                                                            3 * backward_bf16 * backward_fp8 / backward_bf16))
    assert read_profile(path, model, "H100", spec=spec).derived_from is None


def test_precisions_parse_and_fp8_leaves_out_gpus_without_it():
    assert parse_precisions("bf16, fp8,bf16") == ("bf16", "fp8")
    with pytest.raises(InputError, match="precision"):
        parse_precisions("int4")
    cluster = load_cluster("h100-a100-a10g")
    bf16, fp8 = precision_spaces(load_model("llama2-70b"), cluster, ("bf16", "fp8"))
    assert bf16.cluster is cluster and not bf16.left_out
    assert set(fp8.cluster.node_types) == {"H100"} and set(fp8.left_out) == {"A100", "A10G"}
    with pytest.raises(InputError, match="use_all"):
        precision_spaces(load_model("llama2-70b"), cluster, ("fp8",), use_all=True)


def test_search_ranks_fp8_and_bf16_plans_together_fp8_on_h100_only(runner):
    result = runner.invoke(main, ["search", "--model", "llama2-70b", "--cluster", "h100-a100-a10g", "--precision",
                                  "bf16,fp8", "--prune", "--top", "6"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["rank"])
    assert header[:2] == ["rank", "prec"]
    assert "note: fp8 plans leave out A100, A10G: GPU A100 has no FP8 tensor cores" in result.stdout


def test_search_output_names_the_fp8_plans(runner, tmp_path):
    out = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "llama2-70b", "--cluster", "h100-a100-a10g", "--precision",
                                  "bf16,fp8", "--prune", "--top", "6", "--output", str(out)])
    assert result.exit_code == 0, result.output
    plans = [Plan.model_validate(p) for p in json.loads(out.read_text())]
    fp8 = [p for p in plans if p.precision == "fp8"]
    assert fp8 and all(set(p.placement) == {"H100"} and p.fp8_recipe == "delayed" for p in fp8)
    assert any(p.precision is None for p in plans)  # bf16 plans state no precision: the model file's
    assert [p.rank for p in plans] == list(range(1, len(plans) + 1))
    # an fp8 plan estimates afresh from its file to the same step time
    rank = plans.index(fp8[0]) + 1
    again = runner.invoke(main, ["estimate", "--plan", str(out), "--rank", str(rank), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["step_time_s"] == pytest.approx(fp8[0].step_time_s, rel=1e-9)


def test_fp8_on_a_cluster_without_fp8_gpus_is_one_line(runner, tmp_path):
    cluster = tmp_path / "a100.toml"
    cluster.write_text('[cluster]\nname = "a100s"\n\n[[node_type]]\nname = "A100"\ngpu = "A100"\ngpus_per_node = 8\n'
                       'intra_node_bandwidth = "300 GB/s"\ninter_node_bandwidth = "200 Gbit/s"\n'
                       'price_per_hour_usd = 32.77\ncount = 4\n')
    result = runner.invoke(main, ["search", "--model", "llama2-7b", "--cluster", str(cluster), "--precision", "fp8"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "GPU A100 has no FP8 tensor cores" in lines[0]


# megatron-core's own advice about settings the test does not use (CUDA graphs, Transformer Engine)
@pytest.mark.filterwarnings("ignore::UserWarning:megatron.core.transformer.transformer_config")
def test_an_fp8_plan_emits_megatrons_fp8_flags_that_megatron_core_accepts(tmp_path):
    model = with_precision(load_model("llama2-7b"), "fp8", "tensorwise", True)
    cluster = load_cluster("h100-a100-a10g")
    plan = estimate(model, cluster, tp=2, dp=4, pp=1, mbs=1, gbs=32, placement=["H100"], layers_per_stage=[32])
    assert (plan.precision, plan.fp8_recipe, plan.fp8_param_gather) == ("fp8", "tensorwise", True)
    args = flag_values(megatron_args(render_plan(plan, load_model("llama2-7b"), cluster, SMOKE)["run_inter.sh"]))
    assert args["--fp8-format"] == ["hybrid"] and args["--fp8-recipe"] == ["tensorwise"]
    assert "--fp8-param-gather" in args and "--bf16" in args
    transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
    torch = pytest.importorskip("torch")
    config = transformer_config.TransformerConfig(
        num_layers=32, hidden_size=4096, num_attention_heads=32, tensor_model_parallel_size=2,
        pipeline_dtype=torch.bfloat16, bf16=True, sequence_parallel=True, fp8=args["--fp8-format"][0],
        fp8_recipe=args["--fp8-recipe"][0], fp8_param="--fp8-param-gather" in args)  # argument_utils.py's mapping
    assert (config.fp8, config.fp8_recipe, config.fp8_param) == ("hybrid", "tensorwise", True)


def test_fp8_param_gather_needs_the_distributed_optimizer():
    model = with_precision(load_model("llama2-7b"), "fp8", fp8_param_gather=True)
    with pytest.raises(InputError, match="fp8_param_gather"):
        estimate(model, load_cluster("h100-a100-a10g"), tp=2, dp=4, pp=1, mbs=1, gbs=32, placement=["H100"],
                 layers_per_stage=[32], distributed_optimizer=False)


def test_a_model_file_may_train_in_fp8(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[model]\nname = "m"\narchitecture = "decoder"\nnum_layers = 2\nhidden_size = 64\n'
                    'num_attention_heads = 4\nseq_length = 32\nvocab_size = 100\nglobal_batch_size = 8\n'
                    'precision = "fp8"\nfp8_recipe = "blockwise"\n')
    model = load_model(str(path))
    assert (model.precision, model.high_precision, model.fp8_recipe, model.fp8_param_gather) == ("fp8", "bf16",
                                                                                                 "blockwise", False)
    path.write_text(path.read_text().replace('precision = "fp8"', 'precision = "bf16"'))
    with pytest.raises(InputError, match="fp8_recipe"):
        load_model(str(path))


@pytest.mark.parametrize("args, named", [
    (["--precision", "int4"], "--precision int4"), (["--precision", "bf16,$(reboot)"], "--precision"),
    (["--fp8-recipe", "fast"], "--fp8-recipe"), (["--precision", "fp8", "--use-all"], "--use-all"),
    (["--precision", "fp8", "--fp8-param-gather", "--no-distributed-optimizer"], "--fp8-param-gather")])
def test_bad_precision_options_are_one_line(runner, args, named, tmp_path):
    out = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "llama2-7b", "--cluster", "h100-a100-a10g", "--output", str(out),
                                  *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:") and named in lines[0], result.stderr
    assert not out.exists()


def _record(precision_note: str = "", feasible: bool = True, step: float = 1.0) -> dict:
    return {"feasible": feasible, "step_time_s": step if feasible else None, "train_hours": step if feasible else None,
            "train_cost_usd": 2 * step if feasible else None, "plans_evaluated": 3, "out_of_memory": 1,
            "note": precision_note, "on_front": False}


def test_each_composition_takes_its_fastest_plan_of_any_precision():
    from fasop.market.pareto import best_of_precisions

    bf16 = [_record(step=2.0), _record(step=1.0), _record("no plan fits in memory (4 tried)", feasible=False)]
    fp8 = [_record(step=1.5), _record("fp8: GPU A100 has no FP8 tensor cores", feasible=False),
           _record("no plan fits in memory (4 tried)", feasible=False)]
    merged = best_of_precisions([bf16, fp8], ["bf16", "fp8"])
    assert [r["precision"] for r in merged] == ["fp8", "bf16", None]
    assert [r["step_time_s"] for r in merged[:2]] == [1.5, 1.0]
    assert [r["plans_evaluated"] for r in merged] == [6, 6, 6] and merged[0]["out_of_memory"] == 2
    assert merged[2]["note"] == "bf16: no plan fits in memory (4 tried); fp8: no plan fits in memory (4 tried)"
    assert [r["on_front"] for r in merged] == [False, True, False]  # 1.0 h for $2.0 beats 1.5 h for $3.0


def test_pareto_sweeps_both_precisions_fp8_only_without_gpus_lacking_it(runner, tmp_path):
    out = tmp_path / "front.csv"
    result = runner.invoke(main, ["pareto", "--model", "llama2-7b", "--cluster", "pareto-h100-a100-a10g", "--precision",
                                  "bf16,fp8", "--max-nodes", "H100=1", "--max-nodes", "A100=1", "--max-nodes", "A10G=0",
                                  "--output", str(out)])
    assert result.exit_code == 0, result.output
    from fasop.market.frontfile import read_front_csv

    records = read_front_csv(out)
    by_nodes = {(r["nodes_H100"], r["nodes_A100"]): r for r in records}
    assert by_nodes[(0, 1)]["precision"] == "bf16"  # A100 alone: no FP8
    assert by_nodes[(1, 0)]["precision"] == "fp8"  # H100 alone: FP8 is faster there
    assert by_nodes[(1, 1)]["precision"] == "bf16"  # FP8 cannot use the A100 node
    refused = runner.invoke(main, ["pareto", "--model", "llama2-7b", "--cluster", "pareto-h100-a100-a10g",
                                   "--precision", "fp8", "--rent"])
    assert refused.exit_code == 2 and "--precision" in refused.stderr


def test_a_gb200_nvl72_rack_plans_in_mxfp8():
    from fasop.search.precision import precision_spaces, search_precisions

    cluster = load_cluster("gb200-nvl72")
    spaces = precision_spaces(load_model("llama3-8b"), cluster, ("bf16", "fp8"), "mxfp8")
    profiles = [load_profiles(space.model, ["GB200"]) for space in spaces]
    result = search_precisions(spaces, profiles, keep=5)
    assert result.plans
    best = result.plans[0]
    assert (best.precision, best.fp8_recipe) == ("fp8", "mxfp8")
    assert set(best.placement) == {"GB200"} and best.tp <= 4  # tensor parallelism inside a tray
