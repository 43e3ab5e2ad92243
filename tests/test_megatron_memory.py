"""Memory as Megatron-LM allocates it, component by component, against hand computations: the model state per
parameter (gradient buffer dtype, distributed optimizer, the optimizer step's fp32 gradient copies), activations
with grouped-query attention and each FFN activation, the micro-batches in flight of the interleaved schedule
(against megatron-core's own warm-up count), and the Nemotron-4 340B run of validation/measurements.csv."""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fasop.cost.config import Config
from fasop.cost.memory import (
    GIB,
    bytes_per_param,
    layer_activation_bytes,
    layers_that_fit,
    main_gradient_bytes,
    stage_memory_gib,
)
from fasop.cost.pipeline import end_chunks_in_flight, in_flight
from fasop.errors import InputError
from fasop.inputs.model import Model, load_model

ROOT = Path(__file__).resolve().parents[1]


def small(**changes) -> Model:
    """h 64, 8 heads of 8 in 2 query groups (K and V 16 wide), FFN 256, sequence 32, no dropout, flash."""
    base = Model(name="small", architecture="decoder", encoder_num_layers=0, decoder_num_layers=4, hidden_size=64,
                 num_attention_heads=8, kv_channels=8, num_query_groups=2, ffn_hidden_size=256,
                 encoder_seq_length=0, decoder_seq_length=32, vocab_size=1024, tie_embeddings=False,
                 ffn_activation="squared-relu", flash_attention=True, dropout=False, linear_bias=False,
                 precision="bf16")
    return replace(base, **changes)


# -- model state ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision, in_bf16, held, step, held_sharded, step_sharded", [
    ("fp16", False, 16, 20, (4, 12), (4, 16)),   # fp16 weights and gradients; fp32 gradient copy at the step
    ("bf16", False, 18, 18, (6, 12), (6, 12)),   # bf16 weights, fp32 gradient buffer: no copy
    ("bf16", True, 16, 20, (4, 12), (4, 16)),    # --grad-reduce-in-bf16: as fp16
    ("fp32", False, 16, 16, (8, 8), (8, 8)),
])
def test_state_per_parameter_is_megatrons_table_at_the_step(precision, in_bf16, held, step, held_sharded,
                                                          step_sharded):
    """Megatron-LM's distributed-optimizer table (20, 18, 16 bytes; 4 + 16/d, 6 + 12/d, 8 + 8/d) is the state at
    the optimizer step; through the passes the fp32 copy of a lower-precision gradient buffer does not exist."""
    model = small(precision=precision, grad_reduce_in_bf16=in_bf16)
    assert bytes_per_param(model, 4, False) == held
    assert bytes_per_param(model, 4, False) + main_gradient_bytes(model, 4, False) == step
    kept, sharded = held_sharded
    assert bytes_per_param(model, 4, True) == kept + sharded / 4
    kept, sharded = step_sharded
    assert bytes_per_param(model, 4, True) + main_gradient_bytes(model, 4, True) == kept + sharded / 4


def test_grad_reduce_in_bf16_is_refused_outside_bf16(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[model]\nname = "m"\narchitecture = "decoder"\nnum_layers = 2\nseq_length = 8\n'
                    'hidden_size = 8\nnum_attention_heads = 2\nvocab_size = 16\nglobal_batch_size = 1\n'
                    'precision = "fp16"\ngrad_reduce_in_bf16 = true\n')
    with pytest.raises(InputError, match=r"grad_reduce_in_bf16.*bf16"):
        load_model(str(path))


# -- activations ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation, ffn_tensors", [("squared-relu", 2), ("gelu", 2), ("swiglu", 3)])
def test_layer_activations_with_gqa_and_each_ffn_activation(activation, ffn_tensors):
    """bf16, flash attention, no dropout: norm inputs 2 s h, QKV and fc1 inputs 2 s h, Q and the projection's
    input 2 s h, K and V at the query groups' width 2 s kv; squared ReLU keeps relu(x) and its square (pow saves
    relu's output, fc2 its input), GeLU its input and output, SwiGLU fc1's 2f output and the product."""
    model = small(ffn_activation=activation)
    s, h, kv, f = 32, 64, 16, 256
    by_hand = 2 * s * (2 * h + 2 * h + 2 * h + 2 * kv + ffn_tensors * f)
    assert layer_activation_bytes(model, "layer", 1, 1) == by_hand
    assert layer_activation_bytes(model, "layer", 3, 4, sequence_parallel=True, recompute="selective") \
        == 3 * by_hand / 4


# -- micro-batches in flight ------------------------------------------------------------------------------
def megatron_warmup(pp: int, rank: int, v: int, m: int) -> int:
    """megatron-core's own count of warm-up forwards (model chunks) of an interleaved pipeline rank."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    comm = types.SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=v)
    return schedules.get_pp_rank_microbatches(m, v, pp, p2p_communicator=comm)[2]


@pytest.mark.parametrize("pp, v, m", [(8, 12, 16), (4, 2, 8), (8, 3, 64)])
def test_interleaved_first_stage_holds_megatrons_warmup_plus_one(pp, v, m):
    """The first stage's model chunks in flight: its warm-up forwards, then one more forward before the first
    backward (get_pp_rank_microbatches, schedules.py)."""
    assert in_flight(pp, np.array([m]), v)[0, 0] * v == megatron_warmup(pp, 0, v, m) + 1


def test_the_head_and_embedding_chunks_in_flight():
    """Plain 1F1B: the first stage holds min(pp, m) micro-batches, the last one. Interleaved: the head's chunk
    still one at a time; the embedding's chunk (pp 8, v 12, m 16) every micro-batch, for the first stage runs
    all 16 forwards of its first chunk (groups of 8) before the first backward reaches it."""
    assert end_chunks_in_flight(4, np.array([2, 16]), 1).tolist() == [[2, 1], [4, 1]]
    assert end_chunks_in_flight(8, np.array([16]), 12).tolist() == [[16, 1]]


@pytest.mark.parametrize("name, pp, v, m, mbs, none_gib, selective_gib", [
    ("gpt-22b", 1, 1, 1, 4, 59.25, 9.56), ("gpt-175b", 8, 3, 64, 1, 66.84, 12.35),
    ("gpt-530b", 35, 3, 280, 1, 114.02, 23.08), ("gpt-1t", 64, 1, 512, 1, 131.25, 26.56)])
def test_first_stage_layer_activations_are_korthikanti_figure_1(name, pp, v, m, mbs, none_gib, selective_gib):
    """Korthikanti et al. 2022, Figure 1: the first stage's activations at tp 8, without recomputation (no sequence
    parallelism) and with selective recomputation + sequence parallelism, of its layers for the micro-batches in
    flight (the figure leaves out the embedding's dropout mask and, at pp 1, the head and the scores rebuilt)."""
    model = load_model(str(ROOT / "validation" / "models" / f"{name}.toml"))
    layers = model.num_layers // pp
    for recompute, sp, figure in (("none", False, none_gib), ("selective", True, selective_gib)):
        config = Config(tp=8, dp=1, pp=pp, mbs=mbs, gbs=m * mbs, encoder_stages=0, distributed_optimizer=False,
                        virtual_stages=v, recompute=recompute, sequence_parallel=sp)
        if pp == 1:  # one stage holding the model: its layers are fixed, one micro-batch in flight
            held = layers * layer_activation_bytes(model, "layer", mbs, 8, sp, recompute) / GIB
        else:
            zero = (np.zeros(pp), np.zeros(pp))
            memory = stage_memory_gib(model, config, np.zeros(pp, dtype=int), zero, np.array([mbs]), np.array([m]))
            held = memory.layer_gib[0, 0] * layers
        assert held == pytest.approx(figure, rel=5e-3)


# -- a stage: passes and the optimizer step ---------------------------------------------------------------
def test_stage_memory_is_the_larger_of_the_passes_and_the_step():
    """pp 2, one GPU per stage (tp 1, dp 1), fp16, no recomputation, 4 micro-batches: stage 0 holds 2 of them.
    Per layer: P parameters at 16 bytes plus 2 micro-batches of activations A through the passes; P at 20 bytes
    at the step."""
    model = small(precision="fp16")
    config = Config(tp=1, dp=1, pp=2, mbs=1, gbs=4, encoder_stages=0, distributed_optimizer=False)
    p, a = model.layer_params("layer"), layer_activation_bytes(model, "layer", 1, 1)
    fixed_params = np.array([model.embedding_params(1), model.head_params(1, False)])
    memory = stage_memory_gib(model, config, np.zeros(2, dtype=int), (fixed_params, np.full(2, p)),
                              np.ones(1), np.array([4]))
    assert memory.layer_gib[0].tolist() == pytest.approx([(16 * p + 2 * a) / GIB, (16 * p + a) / GIB])
    assert memory.step_layer_gib[0].tolist() == pytest.approx([20 * p / GIB] * 2)
    n = np.array([[3.0, 3.0]])
    assert memory.at(n, np.zeros_like(n)) == pytest.approx(np.maximum(
        memory.fixed_gib + memory.layer_gib * 3, memory.step_fixed_gib + memory.step_layer_gib * 3))
    # short sequences: the step's 4 more bytes per parameter outweigh the activations, so it bounds the layers:
    # a usable memory between the passes' and the step's at 3 layers admits 2
    passes, step = memory.fixed_gib + memory.layer_gib * 3, memory.step_fixed_gib + memory.step_layer_gib * 3
    assert (passes < step).all()
    assert layers_that_fit(memory, (0.0, 0.0), (passes + step) / 2, whole=False).tolist() == [[2, 2]]
    assert layers_that_fit(memory, (0.0, 0.0), step, whole=False).tolist() == [[3, 3]]


# -- the Nemotron-4 340B run ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vp(validate_published):
    return validate_published


def test_nemotron_340b_first_stage_by_hand(vp):
    """tp 8, pp 8, dp 2, v 12, micro-batch 1, 16 micro-batches: the first stage holds 12 layers and the word
    embedding at 2 + 2 + 4/2 bytes per parameter (bf16 weights and gradients, NeMo's distributed Adam's bf16
    moments over dp 2 and no master weights), and 103 layer-micro-batches of activations (megatron-core's 102
    warm-up forwards of one-layer chunks, plus one): 32.25 + 25.65 = 57.90 GiB, which fits the H100. With
    Megatron-LM's default fp32 master weights and moments (2 + 2 + 12/2) it would be 79.40 GiB, and not fit."""
    run = next(r for r in vp.read_runs() if r.paper.startswith("NVIDIA dgxc-benchmarking"))
    model = load_model(str(vp.DATA / run.model_file))
    cluster = vp.load_cluster(str(vp.DATA / run.cluster_file))
    plan = vp.predict(run, model, cluster)
    params = 12 * model.layer_params("layer") / 8 + 256_000 * 18_432 / 8
    s, h, kv, f = 4096, 18_432, 8 * 192, 73_728
    layer = 2 * s * (6 * h + 2 * kv + 2 * f) / 8
    assert megatron_warmup(8, 0, 12, 16) == 102
    by_hand = (params * 6 + 103 * layer) / GIB
    assert by_hand == pytest.approx(57.90, abs=0.005)
    assert plan.stages[0].memory_gib == pytest.approx(by_hand, rel=1e-9)
    assert plan.peak_memory_gib == plan.stages[0].memory_gib
    assert plan.fits_memory is True
    default = replace(model, use_precision_aware_optimizer=False, main_params_dtype="fp32", exp_avg_dtype="fp32",
                      exp_avg_sq_dtype="fp32")
    plan = vp.predict(run, default, cluster)
    assert plan.stages[0].memory_gib == pytest.approx((params * 10 + 103 * layer) / GIB, rel=1e-9)
    assert plan.stages[0].memory_gib == pytest.approx(79.40, abs=0.005) and plan.fits_memory is False


# -- the optimizer's dtypes --------------------------------------------------------------------------------
@pytest.mark.parametrize("precision, fields, state, traffic", [
    ("bf16", {}, 12, 34),  # fp32 master weights and moments (ZeRO's K = 12)
    ("fp32", {}, 8, 32),  # the weights are the master copy
    # Transformer Engine's FusedAdam keeps the master weight as the 16 bits its bf16 weight lacks, and reads that
    # weight to rebuild it: 8 + 2; traffic 8 (fp32 gradient twice) + 2 (8 + 2) + 2 + 2
    ("bf16", {"use_precision_aware_optimizer": True}, 10, 32),
    ("fp8", {"use_precision_aware_optimizer": True}, 10, 32),  # bf16 weights outside the FP8 GEMMs
    ("fp8", {"use_precision_aware_optimizer": True, "fp8_param_gather": True}, 12, 34),  # FP8 weights: no remainder
    ("fp16", {"use_precision_aware_optimizer": True}, 12, 34),  # remainders need bf16 weights
    ("bf16", {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}, 6, 24),
    ("bf16", {"use_precision_aware_optimizer": True, "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "bf16",
              "main_params_dtype": "fp16"}, 5, 20),
    # no master copy: Adam updates the bf16 weights (reads and writes them) with bf16 moments: 8 + 2 (2 + 2 + 2)
    ("bf16", {"use_precision_aware_optimizer": True, "main_params_dtype": "none", "exp_avg_dtype": "bf16",
              "exp_avg_sq_dtype": "bf16"}, 4, 20),
])
def test_adams_state_and_traffic_by_hand(precision, fields, state, traffic):
    from fasop.cost.memory import optimizer_state_bytes, optimizer_traffic_bytes

    model = small(precision=precision, **fields)
    assert optimizer_state_bytes(model) == state
    assert optimizer_traffic_bytes(model) == traffic
    assert bytes_per_param(model, 4, True) == model.precision_bytes + (4 if precision in ("bf16", "fp8", "fp32")
                                                                       else 2) + state / 4


@pytest.mark.parametrize("line", ['exp_avg_dtype = "bf16"', 'main_params_dtype = "none"', 'exp_avg_sq_dtype = "fp8"'])
def test_lower_precision_optimizer_state_needs_the_precision_aware_optimizer(tmp_path, line):
    path = tmp_path / "m.toml"
    text = ('[model]\nname = "m"\narchitecture = "decoder"\nnum_layers = 2\nseq_length = 8\nhidden_size = 8\n'
            'num_attention_heads = 2\nvocab_size = 16\nglobal_batch_size = 1\n' + line + "\n")
    path.write_text(text)
    with pytest.raises(InputError, match=r"model\.\w+_dtype: other than \"fp32\" only with "
                                         r"use_precision_aware_optimizer = true"):
        load_model(str(path))
    path.write_text(text + "use_precision_aware_optimizer = true\n")
    assert load_model(str(path)).use_precision_aware_optimizer


@pytest.mark.parametrize("line", ['exp_avg_dtype = "int4"', 'main_params_dtype = "bf16"', 'exp_avg_sq_dtype = 2',
                                  'use_precision_aware_optimizer = "yes"'])
def test_an_optimizer_dtype_megatron_lm_lacks_is_refused_by_name(tmp_path, line):
    field = line.split()[0]
    aware = "" if field == "use_precision_aware_optimizer" else "use_precision_aware_optimizer = true\n"
    path = tmp_path / "m.toml"
    path.write_text('[model]\nname = "m"\narchitecture = "decoder"\nnum_layers = 2\nseq_length = 8\nhidden_size = 8\n'
                    'num_attention_heads = 2\nvocab_size = 16\nglobal_batch_size = 1\n' + aware + line + "\n")
    with pytest.raises(InputError, match=field):
        load_model(str(path))


def test_the_optimizers_dtypes_are_megatron_lms_flags_and_optimizer_config_fields():
    """Emitted as Megatron-LM's flags, which it copies into megatron-core's OptimizerConfig fields of the same
    names; no master copy is not a Megatron-LM option and is refused in one line."""
    import dataclasses

    from fasop.launch.megatron import _newer_model_flags

    model = small(use_precision_aware_optimizer=True, main_params_dtype="fp16", exp_avg_dtype="bf16",
                  exp_avg_sq_dtype="fp8")
    flags = [f for f in _newer_model_flags(model) if "optimizer" in f[0] or "dtype" in f[0]]
    assert flags == [("--use-precision-aware-optimizer",), ("--main-params-dtype", "fp16"), ("--exp-avg-dtype", "bf16"),
                     ("--exp-avg-sq-dtype", "fp8")]
    assert not [f for f in _newer_model_flags(small()) if "optimizer" in f[0] or "dtype" in f[0]]
    with pytest.raises(InputError, match="main_params_dtype.*NeMo"):
        _newer_model_flags(small(use_precision_aware_optimizer=True, main_params_dtype="none"))
    optimizer = pytest.importorskip("megatron.core.optimizer")
    names = {f.name for f in dataclasses.fields(optimizer.OptimizerConfig)}
    assert {flag[0][2:].replace("-", "_") for flag in flags} <= names


def test_megatron_lm_is_told_the_activation_and_the_gradient_dtype():
    """A plan emitted for the model runs what was estimated: Megatron-LM's --squared-relu, and
    --grad-reduce-in-bf16 (without it Megatron-LM reduces bf16 gradients in fp32)."""
    from fasop.launch.megatron import _newer_model_flags

    assert {("--squared-relu",), ("--grad-reduce-in-bf16",)} <= set(_newer_model_flags(small(grad_reduce_in_bf16=True)))
    plain = set(_newer_model_flags(small(ffn_activation="gelu")))
    assert not {("--squared-relu",), ("--grad-reduce-in-bf16",)} & plain
