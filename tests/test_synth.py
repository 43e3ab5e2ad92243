"""Synthetic profiles (fasop.profile.synth, `fasop profile synth`) against FLOP and byte counts worked out by hand
from the layer shapes, and the bundled synthetic profiles against what the command regenerates."""

import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from fasop import load_model
from fasop.cli import main
from fasop.cost.memory import layer_activation_bytes
from fasop.errors import InputError
from fasop.inputs.model import Model
from fasop.inputs.profiles import load_profiles, read_profile
from fasop.profile import synth

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "fasop" / "data" / "profiles"

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
    assert synth.layer_forward_flops(model, "layer", mbs=1, tp=1) == expected
    costs = synth.unit_costs(model, tp=1, mbs=1)
    assert costs["layer"].forward_flops == expected
    assert costs["layer"].backward_flops == 2 * expected
    # per GPU of a tensor-parallel group, and linear in the micro-batch
    assert synth.unit_costs(model, tp=4, mbs=2)["layer"].forward_flops == 2 * expected / 4


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
    scores = 2 * b * heads * s * s * head_dim  # Q.K^T for every query head (shared K under GQA)
    context = 2 * b * heads * s * s * head_dim  # scores x V
    expected = matmuls + scores + context
    assert synth.layer_forward_flops(model, "layer", mbs=b, tp=1) == pytest.approx(expected, rel=1e-15)
    assert synth.unit_costs(model, tp=8, mbs=b)["layer"].forward_flops == pytest.approx(expected / 8, rel=1e-15)
    # about 15.1 TFLOP per layer for two sequences of 4096 tokens
    assert expected == pytest.approx(15.118e12, rel=1e-3)


def test_t5_decoder_layer_adds_cross_attention():
    model = load_model("t5")
    b, s_enc, s_dec, h, ffn, qa = 1, 512, 512, 1024, 3072, 32 * 128
    self_attention = 2 * b * s_dec * 4 * h * qa + 4 * b * s_dec * s_dec * qa
    cross = 2 * b * (s_dec * 2 * h * qa + s_enc * 2 * h * qa) + 4 * b * s_dec * s_enc * qa
    mlp = 2 * b * s_dec * 2 * h * ffn
    assert synth.layer_forward_flops(model, "decoder", mbs=1) == self_attention + cross + mlp
    encoder = 2 * b * s_enc * 4 * h * qa + 4 * b * s_enc**2 * qa + mlp
    assert synth.layer_forward_flops(model, "encoder", mbs=1) == encoder


def test_head_flops_are_the_logits_over_the_padded_vocabulary():
    model = load_model("gpt2-xl")
    assert model.padded_vocab(2) == 50432
    assert synth.unit_costs(model, tp=2, mbs=1)["head"].forward_flops == 2 * 1024 * 1600 * 50432 / 2
    assert synth.unit_costs(model, tp=2, mbs=1)["embedding"].forward_flops == 0


# -- times ------------------------------------------------------------------------------------------------
def test_compute_bound_layer_time_is_flops_over_achievable_peak():
    model = load_model("llama2-70b")
    rows = rows_by_key(synth.synthesize(model, spec("A100"), tps=[1], mbss=[1]))
    flops = synth.layer_forward_flops(model, "layer", mbs=1)
    expected = flops / (312e12 * 0.869)
    layer = rows[(1, 1, "layer")]
    assert layer.forward_s == pytest.approx(expected, rel=1e-12)
    assert layer.backward_s == pytest.approx(2 * expected, rel=1e-12)
    assert layer.forward_s == pytest.approx(27.88e-3, rel=1e-3)
    # --efficiency replaces the table's matmul_efficiency
    slower = rows_by_key(synth.synthesize(model, spec("A100"), tps=[1], mbss=[1], efficiency=0.5))
    assert slower[(1, 1, "layer")].forward_s == pytest.approx(flops / (312e12 * 0.5), rel=1e-12)


def test_gpt2_xl_layer_on_a100_and_the_measured_profile():
    """The roofline is a lower bound: FASOP measured 1.64 ms, the estimate is about 0.26 ms."""
    model = load_model("gpt2-xl")
    layer = rows_by_key(synth.synthesize(model, "A100", tps=[1], mbss=[1]))[(1, 1, "layer")]
    assert layer.forward_s == pytest.approx(69_625_446_400 / (312e12 * 0.869), rel=1e-12)
    measured = read_profile(PROFILES / "gpt2-xl" / "A100.csv", model, "A100").time(1, "layer", 1)[0]
    assert measured == pytest.approx(1.638e-3, rel=1e-3)
    assert 5 < measured / layer.forward_s < 8


def test_memory_bound_branch_for_a_tiny_model():
    model = tiny_model()
    gpu = spec("A100")
    b, s, h, p, bandwidth = 1, 8, 64, 2, 1555e9
    rows = rows_by_key(synth.synthesize(model, gpu, tps=[1], mbss=[1]))
    weights = 4 * h * h + 2 * h * 256 + (h + 256 + 4 * h) + 2 * 2 * h  # matmuls, biases, two layernorms
    assert model.layer_params("layer") == weights
    forward_bytes = p * weights + p * b * s * h + layer_activation_bytes(model, "layer", 1, 1) + p * b * s * h
    flops = synth.layer_forward_flops(model, "layer", mbs=1)
    assert flops / (312e12 * 0.869) < forward_bytes / bandwidth  # memory-bound indeed
    assert rows[(1, 1, "layer")].forward_s == pytest.approx(forward_bytes / bandwidth, rel=1e-12)
    backward_bytes = forward_bytes + 8 * weights  # plus the fp32 main-gradient accumulation
    assert rows[(1, 1, "layer")].backward_s == pytest.approx(backward_bytes / bandwidth, rel=1e-12)
    # the embedding: rows read, output written, learned positions read, dropout mask written
    embedding_bytes = p * b * s * h + p * b * s * h + p * s * h + 1 * b * s * h
    assert rows[(1, 1, "embedding")].forward_s == pytest.approx(embedding_bytes / bandwidth, rel=1e-12)
    table = 128 * h + s * h  # padded vocabulary x h, and positions
    assert rows[(1, 1, "embedding")].backward_s == pytest.approx((embedding_bytes + 10 * table) / bandwidth, rel=1e-12)


def test_tensor_parallel_collectives_for_tp2():
    """tp=2 halves the FLOPs and adds 2 all-gathers + 2 reduce-scatters of b*s*h each way."""
    model = load_model("gpt2-xl")
    b, s, h, p = 1, 1024, 1600, 2
    rate = 312e12 * 0.869
    flops = synth.layer_forward_flops(model, "layer", mbs=1)
    for link_text, link in ((None, 300e9), ("100 GB/s", 100e9), ("400 Gbit/s", 50e9)):
        rows = rows_by_key(synth.synthesize(model, "A100", tps=[1, 2], mbss=[1], link_bandwidth=link_text))
        collective = 4 * (2 - 1) / 2 * b * s * h * p / link
        assert rows[(1, 1, "layer")].forward_s == pytest.approx(flops / rate, rel=1e-12)
        assert rows[(2, 1, "layer")].forward_s == pytest.approx(flops / 2 / rate + collective, rel=1e-12)
        assert rows[(2, 1, "layer")].backward_s == pytest.approx(2 * flops / 2 / rate + collective, rel=1e-12)
        assert rows[(1, 1, "layer")].backward_s == pytest.approx(2 * rows[(1, 1, "layer")].forward_s, rel=1e-12)
    # the A10G's PCIe link makes tensor parallelism costly
    a10g = rows_by_key(synth.synthesize(model, "A10G", tps=[1, 2], mbss=[1]))
    pcie = 4 * 0.5 * b * s * h * p / 31.5e9
    assert a10g[(2, 1, "layer")].forward_s == pytest.approx(flops / 2 / (70e12 * 0.70) + pcie, rel=1e-12)


def test_backward_does_twice_the_forward_flops_for_every_kind():
    for name in ("gpt2-xl", "bert", "t5", "llama3-8b"):
        model = load_model(name)
        for cost in synth.unit_costs(model, tp=2, mbs=4).values():
            assert cost.backward_flops == 2 * cost.forward_flops
            assert cost.backward_bytes > cost.forward_bytes


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
    assert err.value.where == "--gpu h100"
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
    with pytest.raises(InputError, match="--link-bandwidth"):
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
    assert "# Formula: forward_s = max(F / (peak x efficiency)" in text
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
