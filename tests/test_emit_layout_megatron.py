"""The emitted --pipeline-model-parallel-layout, read by megatron-core's own parser (CPU import only)."""

from __future__ import annotations

import pytest
from test_emit import SMOKE, flag_values, launchable, make_plan, megatron_args, write_cluster

from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.options import LaunchOptions
from fasop.launch.write import render_plan
from fasop.plans import Plan

layout_module = pytest.importorskip(
    "megatron.core.transformer.pipeline_parallel_layer_layout",
    reason="megatron-core is not importable (scripts/install_slurm.sh installs it)")
enums = pytest.importorskip("megatron.core.transformer.enums")
PipelineParallelLayerLayout = layout_module.PipelineParallelLayerLayout
LayerType = enums.LayerType

SPLITS = [
    # (tp, dp, pp, placement, layers per stage)
    (1, 2, 4, ["small", "big", "big", "small"], [10, 13, 14, 11]),
    (1, 2, 4, ["small", "big", "big", "small"], [13, 12, 12, 11]),  # fits the older form; layout forced
    (1, 2, 4, ["small", "big", "big", "small"], [0, 16, 16, 16]),   # embedding alone on the first stage
    (1, 2, 4, ["small", "big", "big", "small"], [1, 22, 24, 1]),
    (1, 1, 8, ["small", "big", "big", "small"], [3, 9, 9, 3, 3, 9, 9, 3]),
    (2, 1, 2, ["big", "big"], [47, 1]),
    (1, 4, 2, ["small", "big", "big", "small"], [20, 28]),
]


@pytest.mark.parametrize("tp, dp, pp, placement, layers", SPLITS)
def test_megatron_core_reads_the_layout(tmp_path, tp, dp, pp, placement, layers):
    model = load_model("gpt2-xl")
    cluster = load_cluster(str(write_cluster(tmp_path)))
    plan = launchable(tp=tp, dp=dp, pp=pp, placement=placement, layers_per_stage=layers, gbs=64, mbs=1)
    args = flag_values(megatron_args(render_plan(plan, model, cluster, LaunchOptions(smoke_test=True, pipeline_split="layout"))
                                     ["run_inter.sh"]))
    (text,) = args["--pipeline-model-parallel-layout"]
    assert args["--pipeline-model-parallel-size"] == [str(pp)]
    num_layers = int(args["--num-layers"][0])

    layout = PipelineParallelLayerLayout(text, pp)
    assert layout.virtual_pipeline_model_parallel_size == 1
    layout.validate_layer_layout(num_layers=num_layers, mtp_num_layers=None)
    assert layout.flatten_layout.count(LayerType.decoder) == model.num_layers == num_layers
    per_stage = [row[0].count(LayerType.decoder) for row in layout.layout]
    assert per_stage == layers
    offsets = [sum(layers[:s]) for s in range(pp)]
    assert [layout.get_layer_offset(pp_rank=s, vp_stage=0) for s in range(pp)] == offsets
    assert layout.layout[0][0][0] == LayerType.embedding
    assert layout.layout[-1][0][-1] == LayerType.loss


def test_layout_is_what_auto_picks_when_the_older_form_does_not_fit(tmp_path):
    model = load_model("gpt2-xl")
    cluster = load_cluster(str(write_cluster(tmp_path)))
    args = flag_values(megatron_args(render_plan(Plan.model_validate(make_plan()), model, cluster, SMOKE)["run_inter.sh"]))
    layout = PipelineParallelLayerLayout(args["--pipeline-model-parallel-layout"][0], 4)
    assert [row[0].count(LayerType.decoder) for row in layout.layout] == make_plan()["layers_per_stage"]


INTERLEAVED = [
    # (layers per stage, virtual stages, the flag fasop writes)
    ([10, 13, 14, 11], 2, "--pipeline-model-parallel-layout"),
    ([0, 16, 16, 16], 2, "--pipeline-model-parallel-layout"),  # the first stage's first chunk: the embedding alone
    ([12, 12, 12, 12], 2, "--num-virtual-stages-per-pipeline-rank"),  # every virtual stage holds 6 layers
    ([13, 11, 12, 12], 4, "--pipeline-model-parallel-layout"),
]


@pytest.mark.parametrize("layers, v, flag", INTERLEAVED)
def test_megatron_core_reads_the_interleaved_layout(tmp_path, layers, v, flag):
    model = load_model("gpt2-xl")
    cluster = load_cluster(str(write_cluster(tmp_path)))
    chunks = [layers[i] // v + (c < layers[i] % v) for c in range(v) for i in range(4)]  # virtual-stage order
    plan = launchable(tp=1, dp=2, pp=4, placement=["small", "big", "big", "small"], layers_per_stage=layers, gbs=64,
                      mbs=1, virtual_stages=v, layers_per_virtual_stage=chunks)
    args = flag_values(megatron_args(render_plan(plan, model, cluster, SMOKE)["run_inter.sh"]))
    # one of the two ways to give the virtual size, never both
    assert flag in args and len({"--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank"}
                                & set(args)) == 1
    if flag == "--num-virtual-stages-per-pipeline-rank":
        assert args[flag] == [str(v)] and int(args["--num-layers"][0]) == 4 * v * chunks[0]
        return
    layout = PipelineParallelLayerLayout(args[flag][0], 4)
    assert layout.virtual_pipeline_model_parallel_size == v
    layout.validate_layer_layout(num_layers=int(args["--num-layers"][0]), mtp_num_layers=None)
    assert [[chunk.count(LayerType.decoder) for chunk in row] for row in layout.layout] == \
        [[chunks[c * 4 + i] for c in range(v)] for i in range(4)]
    assert layout.layout[0][0][0] == LayerType.embedding and layout.layout[-1][-1][-1] == LayerType.loss


def test_an_interleaved_layout_that_is_not_the_even_split_is_refused(tmp_path):
    from fasop.errors import InputError

    model = load_model("gpt2-xl")
    cluster = load_cluster(str(write_cluster(tmp_path)))
    plan = launchable(tp=1, dp=2, pp=4, placement=["small", "big", "big", "small"], layers_per_stage=[12] * 4, gbs=64,
                      mbs=1, virtual_stages=2, layers_per_virtual_stage=[7, 6, 6, 6, 5, 6, 6, 6])
    with pytest.raises(InputError, match="layers_per_virtual_stage"):
        render_plan(plan, model, cluster, SMOKE)
    odd = launchable(tp=1, dp=2, pp=4, placement=["small", "big", "big", "small"], layers_per_stage=[12] * 4, gbs=36,
                     mbs=1, virtual_stages=2)  # 18 micro-batches: not a multiple of the 4 stages
    with pytest.raises(InputError, match="virtual_stages: 2: 18 micro-batches leave a last group of 2"):
        render_plan(odd, model, cluster, SMOKE)
transformer_config = pytest.importorskip("megatron.core.transformer.transformer_config")
torch = pytest.importorskip("torch")

RECOMPUTE = [
    # (tp, plan fields, flags expected in run_inter.sh)
    (2, {}, {"--sequence-parallel": []}),
    (1, {"recompute": "selective"}, {"--recompute-granularity": ["selective"]}),
    (2, {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1, "sequence_parallel": False},
     {"--recompute-granularity": ["full"], "--recompute-method": ["uniform"], "--recompute-num-layers": ["1"]}),
    (2, {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 5},
     {"--recompute-granularity": ["full"], "--recompute-method": ["block"], "--recompute-num-layers": ["5"],
      "--sequence-parallel": []}),
]


# megatron-core's own advice about settings the test does not use (CUDA graphs, Transformer Engine)
@pytest.mark.filterwarnings("ignore::UserWarning:megatron.core.transformer.transformer_config")
@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("tp, fields, expected", RECOMPUTE)
def test_megatron_core_accepts_recompute_sequence_parallel_and_attention_flags(tmp_path, tp, fields, expected, flash):
    """The emitted flags, read as Megatron-LM's argument parser converts them, make a TransformerConfig that
    megatron-core's own checks accept, with the plan's settings."""
    from dataclasses import replace

    model = replace(load_model("gpt2-xl"), flash_attention=flash)
    cluster = load_cluster(str(write_cluster(tmp_path)))
    pp = 8 // tp  # 4 nodes of 2 GPUs
    plan = launchable(tp=tp, dp=1, pp=pp, placement=["small", "big", "big", "small"], gbs=64, mbs=1,
                      layers_per_stage=[48 // pp] * pp, **fields)
    args = flag_values(megatron_args(render_plan(plan, model, cluster, SMOKE)["run_inter.sh"]))
    for flag, values in expected.items():
        assert args[flag] == values
    if fields.get("sequence_parallel") is False or tp == 1:
        assert "--sequence-parallel" not in args
    if fields.get("recompute", "none") == "none":
        assert not any(flag.startswith("--recompute") for flag in args)
    (backend,) = args["--attention-backend"]
    config = transformer_config.TransformerConfig(
        num_layers=int(args["--num-layers"][0]), hidden_size=int(args["--hidden-size"][0]),
        num_attention_heads=int(args["--num-attention-heads"][0]),
        tensor_model_parallel_size=int(args["--tensor-model-parallel-size"][0]),
        pipeline_model_parallel_size=int(args["--pipeline-model-parallel-size"][0]), pipeline_dtype=torch.float16,
        sequence_parallel="--sequence-parallel" in args,
        recompute_granularity=args.get("--recompute-granularity", [None])[0],
        recompute_method=args.get("--recompute-method", [None])[0],
        recompute_num_layers=int(args["--recompute-num-layers"][0]) if "--recompute-num-layers" in args else None,
        attention_backend=enums.AttnBackend[backend])  # arguments.py: type=lambda name: AttnBackend[name]
    assert config.recompute_granularity == fields.get("recompute")
    assert config.sequence_parallel == (tp > 1 and fields.get("sequence_parallel", True))
    assert config.attention_backend == (enums.AttnBackend.flash if flash else enums.AttnBackend.unfused)


def test_training_keys_are_megatron_cores_names():
    """Megatron-LM builds megatron-core's optimizer and transformer configs from its arguments of the same names:
    each [training] key but the warmup (a training-loop argument) is a field of one of them, and each decay style
    is one that megatron-core's scheduler runs."""
    import dataclasses
    import inspect
    import typing

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    from fasop.inputs.training import TrainingTable

    fields = {f.name for config in (OptimizerConfig, TransformerConfig) for f in dataclasses.fields(config)}
    keys = set(TrainingTable.model_fields) - {"source", "lr_decay_style", "lr_warmup_fraction", "lr_warmup_iters"}
    assert keys <= fields, keys - fields
    assert "lr_decay_style" in inspect.signature(OptimizerParamScheduler.__init__).parameters
    source = inspect.getsource(OptimizerParamScheduler)
    styles = typing.get_args(typing.get_args(TrainingTable.model_fields["lr_decay_style"].annotation)[0])
    assert styles and all(f"'{style}'" in source or f'"{style}"' in source for style in styles)
