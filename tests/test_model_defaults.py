"""Defaults filled into a model file: the reader records which fields that change the estimate a file leaves
out, the command line says so once, after its result, and the bundled models name every one."""

import pytest
from click.testing import CliRunner

import fasop
from fasop.cli import main
from fasop.inputs import bundled
from fasop.inputs.model import ASSUMED_FIELDS, ModelTable

# The optional fields that do not count: where the shape comes from, the shape's own defaults (they follow from
# the fields given) and Megatron-LM's vocabulary padding; the layers and sequence lengths one architecture or the
# other needs.
NOT_ASSUMED = {"source", "kv_channels", "num_query_groups", "ffn_hidden_size", "make_vocab_size_divisible_by",
               "num_layers", "seq_length", "encoder_num_layers", "decoder_num_layers", "encoder_seq_length",
               "decoder_seq_length", "grad_reduce_in_bf16", "fp8_recipe", "fp8_param_gather",
               "use_precision_aware_optimizer", "main_params_dtype", "exp_avg_dtype",
               "exp_avg_sq_dtype",  # Megatron-LM's own defaults; and a dense model's, without MLA:
               "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_layer_freq", "moe_capacity_factor", "moe_load_imbalance", "multi_latent_attention", "q_lora_rank",
               "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}
LEFT_OUT = {"flash_attention": None, "dropout": None, "position_embedding": None, "linear_bias": None}
NOTE = ("note: {file} leaves out fields that change the estimate; taking position_embedding = \"learned\", "
        "flash_attention = false, dropout = true, linear_bias = true (docs/formats.md)")


def test_every_optional_field_is_assumed_or_implied():
    optional = {name for name, info in ModelTable.model_fields.items() if not info.is_required()}
    assert set(ASSUMED_FIELDS) == optional - NOT_ASSUMED


def test_the_reader_records_what_it_filled_in_and_prints_nothing(tiny, capsys):
    files = tiny(model=LEFT_OUT)
    model = fasop.load_model(str(files.model))
    assert model.defaulted == ("position_embedding", "flash_attention", "dropout", "linear_bias")
    assert model.defaults_taken() == {"position_embedding": "learned", "flash_attention": False, "dropout": True,
                                      "linear_bias": True}
    assert capsys.readouterr() == ("", "")


def test_a_complete_file_fills_in_nothing(tiny):
    assert fasop.load_model(str(tiny().model)).defaulted == ()


@pytest.mark.parametrize("name", sorted(path.stem for path in bundled.data_dir("models").glob("*.toml")))
def test_the_bundled_models_name_every_assumed_field(name):
    assert fasop.load_model(name).defaulted == ()


@pytest.mark.parametrize("command", ["search", "compare", "estimate"])
def test_the_command_line_notes_the_defaults_once(tiny, tmp_path, command):
    files = tiny(model=LEFT_OUT)
    extra = {"search": ["--output", str(tmp_path / "plans.json")], "compare": [],
             "estimate": ["--tp", "1", "--dp", "2", "--pp", "1", "--mbs", "1", "--placement", "fast",
                          "--layers", "4"]}[command]
    result = CliRunner().invoke(main, [command, *files.args(*extra)])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [NOTE.format(file=files.model)]


def test_no_note_for_a_complete_file(tiny, tmp_path):
    result = CliRunner().invoke(main, ["search", *tiny().args("--output", str(tmp_path / "plans.json"))])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_no_note_for_a_bundled_model():
    result = CliRunner().invoke(main, ["compare", "--model", "bert", "--cluster", "fasop-4xA10"])
    assert result.exit_code == 0, result.output
    assert "leaves out" not in result.stderr


def test_an_error_stays_one_line(tiny):
    """The note comes once the result is shown: bad input still ends with its one line."""
    files = tiny(model=LEFT_OUT, profiles={"slow": None})
    result = CliRunner().invoke(main, ["search", *files.args()])
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("Error: ")


def test_profile_synth_notes_the_defaults(tiny, tmp_path):
    files = tiny(model=LEFT_OUT)
    result = CliRunner().invoke(main, ["profile", "synth", "--model", str(files.model), "--gpu", "A100", "--tp", "1,2",
                                       "--out", str(tmp_path / "A100.csv")])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [NOTE.format(file=files.model)]
