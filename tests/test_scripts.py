"""Every script under scripts/ runs: each answers --help (saying what it does, changing nothing), and the ones
that can run on a tiny input in a moment do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "scripts").glob("*.sh"))


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    command = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def summary(script: Path) -> str:
    """The first line of what the script says it does: its docstring's, or its first comment's."""
    text = script.read_text()
    return text.split('"""')[1].splitlines()[0] if script.suffix == ".py" else text.splitlines()[1].removeprefix("# ")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_script_answers_help(script):
    done = run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert " ".join(summary(script).split()) in " ".join(done.stdout.split()), done.stdout  # wrapped to the width


@pytest.mark.parametrize("script", [path for path in SCRIPTS if path.suffix == ".sh"], ids=lambda path: path.name)
def test_shell_scripts_parse(script):
    """--help leaves before bash reads the rest; `bash -n` reads it all without running it."""
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script, args, printed", [
    ("bench_schedule.py", ["--plans", "4", "--stages", "3", "--microbatches", "6", "--virtual", "1", "2", "--repeat", "1"],
     "event simulation:"),
    ("measure_limits.py", ["huge-gbs"], "huge-gbs: exit 2"),  # refused before any search
    ("plan_schema.py", ["--check"], ""),  # docs/formats.md is current: exit code 0
])
def test_scripts_run_on_tiny_inputs(script, args, printed):
    done = run(ROOT / "scripts" / script, *args)
    assert done.returncode == 0, done.stderr
    assert printed in done.stdout


def test_a_script_refuses_what_it_does_not_know():
    done = run(ROOT / "scripts" / "measure_limits.py", "no-such-case")
    assert done.returncode == 2 and "unknown case no-such-case" in done.stderr


def test_the_kernel_tables_of_validation_profiles_readme_are_the_reports():
    """The H100's kernel and power-limit tables there are what --report prints today from the measured files."""
    profiles = ROOT / "validation" / "profiles"
    done = run(ROOT / "scripts" / "measure_kernels.py", "--report", str(profiles / "H100-kernels.csv"),
               str(profiles / "H100-power-limit.csv"))
    assert done.returncode == 0, done.stderr
    assert "| GPT-3 175B, bf16, 128 GPUs |" in done.stdout
    assert done.stdout.strip() in (profiles / "README.md").read_text()
