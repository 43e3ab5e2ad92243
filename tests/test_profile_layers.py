"""`fasop profile layers` on the processor: the PyTorch units have the model's parameter counts, tp=2 shards
compute what tp=1 computes, the written profiles load into `fasop search`, and the profiled units add up to
the whole model's forward + backward."""

import importlib.util
import statistics
import subprocess
import sys
import time

import pytest

from fasop.cli import main
from fasop.inputs.model import load_model
from fasop.inputs.profiles import read_profile, required_kinds

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

# Shapes small enough for a quick test, each exercising other branches of fasop.profile.torchlayers. Vocabulary 1000
# pads to 1024 at tp 1 and 2 alike, so both degrees draw the same weights.
GPT = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 1000,
       "precision": "fp16"}
LLAMA = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 96, "seq_length": 16, "vocab_size": 1000, "tie_embeddings": False,
         "position_embedding": "rope", "normalization": "rmsnorm", "ffn_activation": "swiglu",
         "linear_bias": False, "dropout": False, "flash_attention": True, "precision": "bf16"}
BERT = {**GPT, "architecture": "encoder"}
T5 = {"architecture": "encoder-decoder", "num_layers": None, "seq_length": None, "encoder_num_layers": 2,
      "decoder_num_layers": 2, "encoder_seq_length": 16, "decoder_seq_length": 8, "hidden_size": 64,
      "num_attention_heads": 4, "kv_channels": 32, "ffn_hidden_size": 128, "vocab_size": 1000}
# Mixture-of-Experts: a dense then an MoE layer, experts with SwiGLU and biases (gpt-oss's), and multi-latent
# attention with compressed queries and shared experts (DeepSeek-V3's)
MIXTRAL = {**LLAMA, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "moe_layer_freq": [0, 1],
           "linear_bias": True}
DEEPSEEK = {**LLAMA, "num_query_groups": 4, "kv_channels": 16, "multi_latent_attention": True, "q_lora_rank": 32,
            "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "num_experts": 4,
            "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 32,
            "moe_layer_freq": [0, 1]}
SHAPES = {"gpt": GPT, "llama": LLAMA, "bert": BERT, "t5": T5, "mixtral": MIXTRAL, "deepseek": DEEPSEEK}

# Big enough that one forward + backward of the whole model takes tens of milliseconds on one core.
TIMED = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128, "vocab_size": 4000,
         "dropout": False}


def model_file(tiny, name, shape):
    return load_model(str(tiny(name, model=shape).model))


def test_fasop_cli_starts_without_torch():
    code = "import sys, fasop, fasop.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_profile_tolerates_the_memory_column_only(tmp_path, tiny):
    model = load_model(str(tiny().model))
    rows = "".join(f"1,1,{kind},0.001,0.002,4096\n" for kind in required_kinds(model))
    good = tmp_path / "good.csv"
    good.write_text("tp,mbs,kind,forward_s,backward_s,peak_memory_bytes\n" + rows)
    assert read_profile(good, model, "fast").time(1, "layer", 1) == (0.001, 0.002)
    bad = tmp_path / "bad.csv"
    bad.write_text("tp,mbs,kind,forward_s,backward_s,memory\n" + rows)
    with pytest.raises(Exception, match="expected the header"):
        read_profile(bad, model, "fast")


# -- the layers -----------------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("shape", SHAPES)
def test_units_have_the_model_files_parameter_counts(tiny, shape):
    import torch

    from fasop.profile.torchlayers import Group, build_unit

    model = model_file(tiny, shape, SHAPES[shape])
    counts = {kind: build_unit(model, kind, Group(), torch.float32, torch.device("cpu")).parameter_count()
              for kind in required_kinds(model)}
    assert counts["embedding"] == model.embedding_params(1)
    for kind in model.layer_kinds:
        if model.moe_layers(kind) < model.segment_layers[model.layer_kinds.index(kind)]:
            assert counts[kind] == model.unit_layer_params(kind)
        if model.moe_layers(kind):
            assert counts[f"moe_{kind}"] == model.unit_layer_params(kind, moe=True)
    assert counts["head"] == model.head_params(1, shares_stage_with_embedding=False)
    if model.is_encoder_decoder:
        assert counts["decoder_embedding"] == model.decoder_embedding_params(1)
    # the whole model: every layer once, the output layer shared with the word embedding when tied
    layers = {"layer", "encoder", "decoder", "moe_layer", "moe_encoder", "moe_decoder"}
    total = sum(counts[k] for k in required_kinds(model) if k not in layers)
    for n, kind in zip(model.segment_layers, model.layer_kinds):
        moe = model.moe_layers(kind)
        total += (n - moe) * counts.get(kind, 0) + moe * counts.get(f"moe_{kind}", 0)
    if model.tie_embeddings:
        total -= model.padded_vocab(1) * model.hidden_size * (2 if model.is_encoder_decoder else 1)
    assert total == model.total_params()


def unit_results(model, group):
    """Output (or loss) and gradients of the inputs (the embeddings: of this rank's word rows) of every unit
    for one micro-batch of 2, dropout off."""
    import torch

    from fasop.profile.torchlayers import build_unit, output_gradient

    results = {}
    for kind in required_kinds(model):
        unit = build_unit(model, kind, group, torch.float32, torch.device("cpu"), seed=7)
        unit.module.eval()
        generator = torch.Generator().manual_seed(3)
        inputs = unit.make_inputs(2, generator)
        output = unit.module(*inputs)
        output.backward(output_gradient(output, generator))
        grads = [x.grad.numpy().copy() for x in inputs if x.requires_grad]
        if kind.endswith("embedding"):
            grads = [unit.module.word.grad.numpy().copy()]
        results[kind] = (output.detach().numpy().copy(), grads)
    return results


def report_unit_results(rank, tp, port, models, queue):
    """A spawned rank of the tp=2 check: rank 0 sends its results for each model."""
    import torch.distributed as dist

    from fasop.profile.torchlayers import Group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    results = {name: unit_results(model, Group(rank, tp)) for name, model in models.items()}
    dist.destroy_process_group()
    if rank == 0:
        queue.put(("results", results))


@needs_torch
def test_tensor_parallel_shards_compute_what_one_rank_computes(tiny):
    import numpy as np

    from fasop.profile.measure import spawn_ranks
    from fasop.profile.torchlayers import Group

    # GQA, SwiGLU, RMSNorm and rotary; cross-attention and the decoder embedding; BERT's head; experts with
    # biases; multi-latent attention with shared experts
    models = {shape: model_file(tiny, shape, SHAPES[shape]) for shape in ("llama", "t5", "bert", "mixtral", "deepseek")}
    received = []
    spawn_ranks(2, report_unit_results, (models,), received.append)
    (_, sharded), = received
    for shape, model in models.items():
        one, two = unit_results(model, Group()), sharded[shape]
        assert set(two) == set(one) == set(required_kinds(model))
        for kind, (output, grads) in one.items():
            np.testing.assert_allclose(two[kind][0], output, rtol=1e-5, atol=1e-5, err_msg=f"{shape} {kind}")
            assert len(two[kind][1]) == len(grads) and grads
            for mine, theirs in zip(grads, two[kind][1]):
                mine = mine[: len(theirs)]  # rank 0 holds the first half of the word embedding
                np.testing.assert_allclose(theirs, mine, rtol=1e-5, atol=1e-5, err_msg=f"{shape} {kind} grad")


def rank_one_dies(rank, tp, port, queue):
    if rank == 1:
        sys.exit(3)
    time.sleep(60)  # rank 0 would wait for rank 1 in its first collective


@needs_torch
def test_a_rank_that_dies_is_reported_and_the_others_ended():
    from fasop.profile.measure import MeasureError, spawn_ranks

    started = time.monotonic()
    with pytest.raises(MeasureError, match="rank 1 ended with exit code 3"):
        spawn_ranks(2, rank_one_dies, (), lambda message: None)
    assert time.monotonic() - started < 50  # not a speed check: rank 0 was ended, not left to sleep 60 s


# -- the command -------------------------------------------------------------------------------------------
@needs_torch
def test_cpu_profile_at_tp_1_and_2_loads_into_search(runner, tiny):
    t = tiny(model=GPT, profiles={"fast": None})
    out = t.profiles / "fast.csv"
    result = runner.invoke(main, ["profile", "layers", "--model", str(t.model), "--gpu", "fast", "--tp", "1,2",
                                  "--mbs", "1,2", "--device", "cpu", "--repeat", "2", "--warmup", "1",
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("Device: processor" in line and "torch " in line and "measured 20" in line for line in header)
    assert "tp,mbs,kind,forward_s,backward_s\n" in text  # no memory column on the processor
    model = load_model(str(t.model))
    profile = read_profile(out, model, "fast")
    assert profile.tensor_degrees == (1, 2)
    assert sorted(profile.curves) == sorted((tp, k) for tp in (1, 2) for k in required_kinds(model))
    searched = runner.invoke(main, ["search", *t.args()])
    assert searched.exit_code == 0, searched.output
    assert "fast" in searched.stdout and "step s" in searched.stdout


@needs_torch
def test_a_busy_hosts_floor_is_written_as_the_most_a_profile_reads(runner, tiny, monkeypatch):
    """A host too busy to launch a kernel in a millisecond still leaves a profile that reads back, and says so."""
    from fasop.inputs.profiles import MAX_KERNEL_LAUNCH_US
    from fasop.profile import measure

    monkeypatch.setattr(measure, "measure_host_floor", lambda model, settings: 13780.0)
    t = tiny(model=GPT, profiles={"fast": None})
    out = t.profiles / "fast.csv"
    result = runner.invoke(main, ["profile", "layers", "--model", str(t.model), "--gpu", "fast", "--tp", "1",
                                  "--mbs", "1", "--device", "cpu", "--repeat", "1", "--warmup", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "13,780 us per kernel" in result.stderr and f"written as {MAX_KERNEL_LAUNCH_US:g}" in result.stderr
    assert f"kernel_launch_us={MAX_KERNEL_LAUNCH_US:g}" in out.read_text()
    assert read_profile(out, load_model(str(t.model)), "fast").tensor_degrees == (1,)


@needs_torch
def test_a_processor_out_of_memory_is_a_size_that_does_not_fit(tiny, monkeypatch):
    """The processor's allocator fails with a RuntimeError in words; that size is reported as not fitting, as a
    GPU's out-of-memory error is, instead of ending the command with a traceback."""
    from fasop.profile import measure
    from fasop.profile.torchlayers import Group

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(measure, "build_unit", no_memory)
    reports = []
    model = load_model(str(tiny(model=GPT).model))
    measure.measure_rank(model, 1, (1, 2), measure.Settings("cpu", 1, 0), Group(), reports.append)
    assert reports == [("oom", 1)]
    monkeypatch.setattr(measure, "build_unit", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # any other failure is not taken for one
        measure.measure_rank(model, 1, (1,), measure.Settings("cpu", 1, 0), Group(), reports.append)


def whole_model_s(model, passes):
    """Median seconds of `passes` forward + backward passes of the whole model (micro-batch of 2)."""
    import torch

    from fasop.profile.torchlayers import Group, build_unit

    cpu = torch.device("cpu")
    embedding, head = (build_unit(model, kind, Group(), torch.float32, cpu) for kind in ("embedding", "head"))
    layers = [build_unit(model, "layer", Group(), torch.float32, cpu, seed=n).module for n in range(model.num_layers)]
    generator = torch.Generator().manual_seed(0)
    passes_s = []
    for _ in range(passes):
        ids, = embedding.make_inputs(2, generator)
        _, labels = head.make_inputs(2, generator)
        started = time.perf_counter()
        x = embedding.module(ids)
        for layer in layers:
            x = layer(x)
        head.module(x, labels).backward()
        passes_s.append(time.perf_counter() - started)
    return statistics.median(passes_s)


@needs_torch
def test_profiled_units_add_up_to_the_whole_model(runner, tiny):
    """Embedding + layers + head from the profile against the whole model timed as one forward + backward.

    The machine running the tests may be shared, so the profile and the whole-model timing alternate in
    rounds (whole, profile, whole) and each round compares times taken moments apart.
    """
    import torch

    t = tiny(model=TIMED)
    model = load_model(str(t.model))
    out = t.root / "measured.csv"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: less exposed to other work on the machine
    ratios = []
    try:
        whole_model_s(model, 2)  # warm-up
        for _ in range(5):
            before_s = whole_model_s(model, 3)
            result = runner.invoke(main, ["profile", "layers", "--model", str(t.model), "--gpu", "fast",
                                          "--mbs", "2", "--device", "cpu", "--repeat", "3", "--warmup", "1",
                                          "--out", str(out), "--force"])
            assert result.exit_code == 0, result.output
            after_s = whole_model_s(model, 3)
            profile = read_profile(out, model, "fast")
            units_s = sum(profile.step_s(1, kind, (2,))[0] * (model.num_layers if kind == "layer" else 1)
                          for kind in required_kinds(model))
            ratios.append(units_s / ((before_s + after_s) / 2))
    finally:
        torch.set_num_threads(threads)
    assert statistics.median(ratios) == pytest.approx(1.0, rel=0.25), ratios


@needs_torch
def test_bad_requests_get_one_line(runner, tiny, tmp_path):
    import torch

    t = tiny(model=GPT)
    base = ["profile", "layers", "--model", str(t.model), "--gpu", "fast", "--mbs", "1"]
    result = runner.invoke(main, [*base, "--tp", "3", "--device", "cpu", "--out", str(tmp_path / "a.csv")])
    assert result.exit_code == 2 and "--tp 3: must divide the model's num_attention_heads" in result.stderr
    existing = t.profiles / "fast.csv"
    result = runner.invoke(main, [*base, "--device", "cpu", "--out", str(existing)])
    assert result.exit_code == 2 and "already exists" in result.stderr
    if not torch.cuda.is_available():
        result = runner.invoke(main, [*base, "--device", "cuda", "--out", str(tmp_path / "b.csv")])
        assert result.exit_code == 2 and "sees no CUDA GPU" in result.stderr
    assert not (tmp_path / "a.csv").exists() and not (tmp_path / "b.csv").exists()


@pytest.mark.parametrize("model_name", ["gpt2-xl", "llama2-7b", "bert", "t5"])
def test_bundled_measured_profiles_load(model_name):
    """The H100 profiles measured with `fasop profile layers` carry a memory column and load like any other."""
    from fasop.inputs.bundled import data_dir

    model = load_model(model_name)
    path = data_dir("profiles") / model_name / "H100-measured.csv"
    profile = read_profile(path, model, "H100-measured")
    assert profile.tensor_degrees == (1,)
    header = path.read_text().splitlines()
    assert any(line.startswith("# Device: NVIDIA H100") and "driver 5" in line for line in header)
    assert "tp,mbs,kind,forward_s,backward_s,peak_memory_bytes" in header
