"""Hostile input at the command line: values that used to crash, exhaust memory, leave files behind or spread an
error over several lines, each now refused in one line with exit code 2 (or bounded)."""

from __future__ import annotations

import json
import os
import time

import click
import pytest
from conftest import llama_toml, one_line_error

from fasop.cli import main
from fasop.cli.common import MAX_ERROR_CHARS, reports_input_errors
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.search.spec import plan_spec


@pytest.fixture
def plans_file(runner, tmp_path):
    path = tmp_path / "plans.json"
    result = runner.invoke(main, ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10", "--top", "1",
                                  "--output", str(path)])
    assert result.exit_code == 0, result.output
    return path


def _with_first_plan(path, **fields):
    plans = json.loads(path.read_text())
    plans[0].update(fields)
    path.write_text(json.dumps([{key: value for key, value in plan.items() if value is not None} for plan in plans]))
    return path


@pytest.mark.parametrize("virtual_stages", [10**9, 2**53 - 1])
def test_a_plan_of_a_billion_model_chunks_is_refused_at_once(runner, plans_file, virtual_stages):
    """Each model chunk used to get its arrays before the count was checked: 7 GiB for 10**9 chunks. A plan file's
    chunk rows no longer match it; the plan's own check (plan_spec, which measured runs go through too) bounds it
    by the model's layers."""
    _with_first_plan(plans_file, virtual_stages=virtual_stages, layers_per_virtual_stage=None)
    started = time.monotonic()
    result = runner.invoke(main, ["estimate", "--plan", str(plans_file)])
    one_line_error(result, "virtual_stages")
    with pytest.raises(InputError, match="virtual_stages.*expected 1 to the model's 48 layers"):
        plan_spec(load_model("gpt2-xl"), load_cluster("fasop-1xA100-3xA10"), tp=1, dp=2, pp=2, mbs=1,
                  placement=["A10"] * 1, layers_per_stage=[24, 24], virtual_stages=virtual_stages)
    assert time.monotonic() - started < 20  # not a speed check: a refusal, not 8 TiB of chunks


def test_an_error_quoting_a_huge_value_stays_a_readable_line(runner):
    """However long what a message quotes, the line is cut where it stops being readable, and says so."""
    @click.command()
    @reports_input_errors
    def quoting():
        raise InputError("cell", f"expected a number, got {'9' * 100_000!r}")

    line = one_line_error(runner.invoke(quoting, []), "cell: expected a number")
    whole = len("cell: expected a number, got ''") + 100_000
    assert line == f"Error: {line[7:7 + MAX_ERROR_CHARS]}... ({whole - MAX_ERROR_CHARS:,} more characters)"


def test_an_error_naming_a_path_of_control_characters_stays_one_line(runner, tmp_path):
    """A folder named with a newline and a terminal's escape sequence: the error shows them escaped, on one line."""
    folder = tmp_path / "runs\n\x1b]0;x\x07"
    result = runner.invoke(main, ["validate", "--measured", str(folder / "missing.csv")])
    line = one_line_error(result, "runs\\n\\x1b]0;x\\x07")
    assert line.isprintable()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_force_does_not_put_a_file_in_place_of_a_pipe(runner, tmp_path):
    pipe = tmp_path / "out.csv"
    os.mkfifo(pipe)
    result = runner.invoke(main, ["profile", "synth", "--model", "gpt2-xl", "--gpu", "A100", "--out", str(pipe),
                                  "--force"])
    one_line_error(result, "not a regular file")
    assert pipe.is_fifo()


@pytest.mark.parametrize("options, fragment", [
    (["--mbs", "65537"], "micro-batch sizes from 1 to 65536"),
    (["--tp", "1", "--mbs", "99999999999999999999"], "micro-batch sizes from 1 to 65536"),
    (["--tp", "131072"], "tensor-parallel degrees from 1 to 65536"),
])
def test_profile_synth_writes_only_what_a_profile_reads(runner, tmp_path, options, fragment):
    out = tmp_path / "p.csv"
    result = runner.invoke(main, ["profile", "synth", "--model", "gpt2-xl", "--gpu", "A100", "--out", str(out), *options])
    one_line_error(result, fragment)
    assert not out.exists()


def test_profile_synth_refuses_a_pass_longer_than_a_profile_holds(runner, tmp_path):
    """A valid model at 16M tokens per sample takes hours per pass on the roofline: no profile holds that."""
    model = tmp_path / "long.toml"
    model.write_text(llama_toml(name="long", num_layers=2, hidden_size=1024, num_attention_heads=16,
                                seq_length=16777216, global_batch_size=8))
    out = tmp_path / "p.csv"
    result = runner.invoke(main, ["profile", "synth", "--model", str(model), "--gpu", "A100", "--tp", "1", "--mbs", "1",
                                  "--out", str(out)])
    one_line_error(result, "outside the 1e-12 to 3600 s a profile holds")
    assert not out.exists()


def test_output_and_emit_on_one_path_are_refused_before_the_search(runner, tmp_path):
    same = tmp_path / "e.json"
    result = runner.invoke(main, ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10", "--top", "1",
                                  "--output", str(same), "--emit", str(same), "--smoke-test"])
    one_line_error(result, "--output", "the folder --emit writes")
    assert not same.exists()


@pytest.mark.parametrize("args, fragment", [
    (["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10", "extra"], "unexpected extra argument"),
    (["estimate", "--output", "x.json"], "No such option"),
    (["serch"], "No such command"),
])
def test_usage_errors_are_one_line(runner, args, fragment):
    one_line_error(runner.invoke(main, args), fragment)


def test_notes_wait_for_the_result_so_an_error_stays_one_line(runner):
    """--seq-length beyond the model's is noted; the plan's bad cp is refused after it, in the one line alone."""
    args = ["estimate", "--model", "mixtral-8x7b", "--cluster", "h100-a100-a10g", "--tp", "2", "--dp", "8", "--pp",
            "2", "--mbs", "1", "--placement", "H100*4", "--layers", "16,16", "--seq-length", "4097", "--cp", "2"]
    one_line_error(runner.invoke(main, args), "cp")
    args[args.index("4097")], args[args.index("--cp") + 1] = "8192", "1"
    fine = runner.invoke(main, args)
    assert fine.exit_code in (0, 3), fine.output
    assert "--seq-length 8192 is beyond" in fine.stderr and fine.stderr.index("beyond") > 0


def test_a_models_training_table_is_named_for_its_own_conflict(tmp_path):
    model = tmp_path / "m.toml"
    model.write_text(llama_toml(name="m", num_layers=4, hidden_size=256, num_attention_heads=4, global_batch_size=8)
                     + "\n[training]\nlr = 1e-4\nlr_warmup_fraction = 0.01\nlr_warmup_iters = 100\n")
    from fasop.inputs.training import training_settings

    with pytest.raises(InputError) as err:
        training_settings(load_model(str(model)))
    assert err.value.where == f"{model}: training" and "gives both" in err.value.problem


def test_a_memory_headroom_of_almost_nothing_is_refused(runner):
    result = runner.invoke(main, ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10",
                                  "--memory-headroom", "5e-324"])
    one_line_error(result, "--memory-headroom")
