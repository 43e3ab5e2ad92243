"""Library errors name the Python arguments that were given (`train_tokens=1e+30: ...`); the command line names
its options instead (`--train-tokens 1e+30: ...`), and no library message names an option of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fasop.cli import main
from fasop.cli.common import reports_input_errors
from fasop.cost.price import check_run_length
from fasop.errors import ArgumentError
from fasop.inputs.model import load_model
from fasop.market.pareto import check_limits
from fasop.profile.synth import synthesize

PACKAGE = Path(__file__).resolve().parents[1] / "fasop"
# The launch script renderers: Megatron-LM, Slurm and torchrun flags are what they write
RENDERERS = {"launch/megatron.py", "launch/slurm.py", "launch/torchrun.py", "launch/shell.py", "launch/startup.py"}
FLAG = re.compile(r"--[A-Za-z]")


# -- the command line maps arguments to its options ---------------------------------------------------------
SEARCH = ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10"]
SYNTH = ["profile", "synth", "--model", "gpt2-xl", "--gpu", "A100", "--out", "{tmp}/A100.csv"]


@pytest.mark.parametrize("args, line", [
    # train_tokens is --train-tokens spelled with underscores
    ([*SEARCH, "--train-tokens", "1e30"], "Error: --train-tokens 1e+30: expected a positive number of tokens up to 2^53"),
    # efficiency is both the option's parameter and its spelling
    ([*SYNTH, "--efficiency", "2"], "Error: --efficiency 2.0: expected a fraction of peak from 0.01 to 1"),
    # tps and budget_usd are the parameters of --tp and --budget
    ([*SYNTH, "--tp", "3"], "Error: --tp 3: must divide the model's num_attention_heads"),
    (["pareto", *SEARCH[1:], "--budget", "-5", "--train-steps", "10"],
     "Error: --budget: expected a number of dollars from 0.01 to 9.007e+13, got -5"),
])
def test_a_library_argument_error_names_the_option_that_gave_it(tmp_path, args, line):
    result = CliRunner().invoke(main, [arg.format(tmp=tmp_path) for arg in args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(line), result.stderr
    assert result.stderr.count("\n") == 1


def _run(command: click.Command, args: list[str]) -> str:
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2, result.output
    return result.stderr


def test_an_option_of_a_group_above_the_command_is_found_and_an_unknown_argument_stays_as_written():
    @click.group()
    @click.option("--layers", "layers_per_stage", default="1")
    def group(layers_per_stage):
        pass

    @group.command()
    @click.option("--other")
    @reports_input_errors
    def leaf(other):
        raise ArgumentError(other, "is wrong", 7)

    assert _run(group, ["leaf", "--other", "layers_per_stage"]) == "Error: --layers 7: is wrong\n"
    assert _run(group, ["leaf", "--other", "other"]) == "Error: --other 7: is wrong\n"
    assert _run(group, ["leaf", "--other", "layers"]) == "Error: --layers 7: is wrong\n"
    assert _run(group, ["leaf", "--other", "layer_count"]) == "Error: layer_count=7: is wrong\n"


# -- the library names its arguments -------------------------------------------------------------------------
def _error(call) -> ArgumentError:
    with pytest.raises(ArgumentError) as caught:
        call()
    assert not FLAG.search(str(caught.value)), str(caught.value)
    return caught.value


def test_the_same_errors_from_the_library_name_its_arguments():
    gpt2 = load_model("gpt2-xl")
    assert str(_error(lambda: check_run_length(None, 1e30))) == \
        "train_tokens=1e+30: expected a positive number of tokens up to 2^53"
    assert str(_error(lambda: synthesize(gpt2, "A100", tps=[1], mbss=[1], efficiency=2))) == \
        "efficiency=2: expected a fraction of peak from 0.01 to 1"
    assert str(_error(lambda: synthesize(gpt2, "A100", tps=[3], mbss=[1]))).startswith(
        "tps=3: must divide the model's num_attention_heads")
    assert str(_error(lambda: check_limits(budget_usd=-5))) == ("budget_usd: expected a number of dollars from 0.01 to "
                                                                "9.007e+13, got -5")
    assert str(_error(lambda: check_run_length(5, 1e6))) == "train_tokens: give either train_steps or train_tokens, not both"


# -- no library message names an option ----------------------------------------------------------------------
def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """InputError and every class of the package derived from it, however deep."""
    names = {"InputError"}
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    while True:
        derived = {c.name for c in classes if any(isinstance(b, ast.Name) and b.id in names for b in c.bases)}
        if derived <= names:
            return names
        names |= derived


def _texts(node: ast.expr) -> list[str]:
    """The literal text of a message expression: its string constants and the constant parts of its f-strings,
    through concatenations and conditional expressions."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [part for value in node.values for part in _texts(value)]
    if isinstance(node, ast.BinOp):
        return _texts(node.left) + _texts(node.right)
    if isinstance(node, ast.IfExp):
        return _texts(node.body) + _texts(node.orelse)
    return []


def _option_naming(trees: dict[Path, ast.Module]) -> list[str]:
    """'path:line: text' of every literal text of the where (argument) or problem of an InputError raised by
    `trees` that holds an option: two dashes and a letter."""
    classes = _error_classes(trees)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in classes:
                for message in node.args[:2]:
                    found += [f"{path}:{node.lineno}: {text!r}" for text in _texts(message) if FLAG.search(text)]
    return found


def test_the_check_finds_options_in_every_form_a_message_takes():
    source = '''
class ArgumentError(InputError):
    pass
class Mine(ArgumentError):
    pass
raise InputError("--tp", "fine")
raise ArgumentError("tps", f"use --tp {x}")
raise errors.InputError(where, "a" + ("b" if c else "pass --force"))
raise Mine("tps", "give --mbs")
raise InputError(where, "fine: -- alone, -1 and a-b are no options", "--third argument")
raise ValueError("--not an input error")
'''
    found = _option_naming({Path("example.py"): ast.parse(source)})
    assert [line.split(": ", 1)[1] for line in found] == ["'--tp'", "'use --tp '", "'pass --force'", "'give --mbs'"]


def test_no_library_message_names_an_option():
    """The command line names its options; the library names its arguments."""
    paths = [path.relative_to(PACKAGE) for path in sorted(PACKAGE.rglob("*.py"))]
    trees = {path: ast.parse((PACKAGE / path).read_text(encoding="utf-8")) for path in paths
             if path.parts[0] != "cli" and path.as_posix() not in RENDERERS}
    assert len(trees) > 50 and _error_classes(trees) >= {"InputError", "ArgumentError"}
    assert _option_naming(trees) == []
