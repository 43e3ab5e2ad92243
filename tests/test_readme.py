"""The README's examples are what the commands print: every `$ fasop ...` line with output under it is run on the
bundled inputs, in an empty folder, and its output compared line by line. A line `...` stands for any number of
lines; the seconds a command took are not compared."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from fasop.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
ELAPSED = re.compile(r"\bin \d+(\.\d+)? s\b")  # "397 plans evaluated in 0.34 s": the machine's speed, not fasop's


def shown_examples(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines shown under it) of every `$ fasop` line of a ``` block that shows output."""
    examples: list[tuple[str, list[str]]] = []
    fence: str | None = None  # the open block's language ("" for a plain block), None outside blocks
    shown: list[str] | None = None  # the lines of the block's last command; none before its first
    for line in text.splitlines():
        if line.startswith("```"):
            fence, shown = (line[3:] if fence is None else None), None
        elif fence == "" and line.startswith("$ "):
            shown = []
            examples.append((line[2:], shown))
        elif shown is not None:
            shown.append(line)
    return [(command, shown) for command, shown in examples if shown and command.startswith("fasop ")]


def pattern(shown: list[str]) -> re.Pattern:
    """The output the lines show: `...` any lines, each other line itself with its seconds masked."""
    parts = [r"(?:.*\n)*?" if line.strip() == "..." else re.escape(ELAPSED.sub("in <t> s", line)) + r"\n"
             for line in shown]
    return re.compile("".join(parts))


EXAMPLES = shown_examples(README.read_text(encoding="utf-8"))


@pytest.mark.parametrize("command, shown", [pytest.param(command, shown, id=command.split(" --cluster")[0])
                                            for command, shown in EXAMPLES])
def test_the_readme_shows_what_the_command_prints(tmp_path, monkeypatch, command, shown):
    monkeypatch.chdir(tmp_path)  # files the example writes (plans.json, charts) land here
    result = CliRunner().invoke(main, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
    printed = ELAPSED.sub("in <t> s", "\n".join(line.rstrip() for line in result.output.splitlines()) + "\n")
    matches = pattern(shown).fullmatch(printed) is not None
    assert matches, f"README.md is stale; `{command}` prints:\n{result.output}"


def test_the_examples_are_found():
    """Each kind of example the README shows is checked: two searches (the second with plans above the memory
    headroom), an estimate, a search in two precisions, an MoE search, both comparisons, the sweep."""
    commands = [command.split(" --")[0] for command, _ in EXAMPLES]
    assert commands == ["fasop search", "fasop search", "fasop estimate", "fasop search", "fasop search",
                        "fasop compare", "fasop compare", "fasop pareto"]
