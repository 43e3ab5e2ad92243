"""Long commands show a progress bar on a terminal and nothing in a pipe: each command runs as a real `fasop` process
whose stderr is a pseudo-terminal, then a pipe. The bar waits PROGRESS_DELAY_S before it shows (short runs stay
free of it); the processes here set it to 0, since the tiny inputs finish well within it."""

from __future__ import annotations

import importlib.util
import os
import pty
import re
import subprocess
import sys

import pytest

from fasop.cli.common import progress_bar

WITHOUT_DELAY = "import fasop.cli.common as common; common.PROGRESS_DELAY_S = 0.0; from fasop.cli import main; main()"
TIMEOUT_S = 120  # a hung process fails the test rather than the run


def fasop_stderr(args: list[str], cwd, terminal: bool) -> str:
    """The stderr of `fasop ARGS` run in its own process, on a pseudo-terminal or into a pipe; it must succeed."""
    command = [sys.executable, "-c", WITHOUT_DELAY, *map(str, args)]
    if not terminal:
        done = subprocess.run(command, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = pty.openpty()
    chunks = []
    with subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=follower) as process:
        os.close(follower)
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
        returncode = process.wait(timeout=TIMEOUT_S)
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    assert returncode == 0, text
    return text


def measured_runs(tiny) -> str:
    """Two runs on the fast node, a data-parallel and a pipeline plan, with made-up step times."""
    path = tiny.root / "runs.csv"
    path.write_text("run,model_file,cluster_file,gbs,mbs,tp,dp,pp,placement,layers_per_stage,measured_step_s\n"
                    "r1,model.toml,cluster.toml,8,1,1,2,1,fast,4,0.5\n"
                    "r2,model.toml,cluster.toml,8,1,1,1,2,fast,2 2,0.7\n")
    return str(path)


COMMANDS = {  # label of the bar: the command's arguments (given the tiny inputs)
    "searching": lambda t: ["search", *t.args()],
    "noise trials": lambda t: ["search", *t.args("--noise", "0.2", "--trials", "5")],
    "sweeping": lambda t: ["pareto", *t.args("--output", t.root / "front.csv")],
    "comparing": lambda t: ["compare", *t.args()],
    "estimating runs": lambda t: ["validate", "--measured", measured_runs(t), "--profiles", t.profiles],
    "fitting": lambda t: ["calibrate", "--measured", measured_runs(t), "--profiles", t.profiles,
                          "--out", t.root / "calibrated.toml"],
}


@pytest.mark.parametrize("label", sorted(COMMANDS))
def test_a_long_command_shows_its_bar_on_a_terminal_only(tiny, label):
    t = tiny()
    shown = fasop_stderr(COMMANDS[label](t), t.root, terminal=True)
    assert re.search(rf"{label}  \[#+\]  (\d+)/\1", shown), shown  # click's bar: label, full bar, all done of all
    for path in (t.root / "front.csv", t.root / "calibrated.toml"):
        path.unlink(missing_ok=True)
    piped = fasop_stderr(COMMANDS[label](t), t.root, terminal=False)
    assert label not in piped and "[" not in piped, piped


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_profile_layers_shows_its_bar_on_a_terminal_only(tiny):
    t = tiny(model={"num_layers": 2, "seq_length": 16})
    args = ["profile", "layers", "--model", t.model, "--gpu", "fast", "--tp", "1", "--mbs", "1,2", "--device", "cpu",
            "--repeat", "1", "--warmup", "0", "--out"]
    shown = fasop_stderr([*args, t.root / "shown.csv"], t.root, terminal=True)
    assert "measuring tiny  [" in shown and "2/2" in shown and "tp=1 mbs=2" in shown, shown
    piped = fasop_stderr([*args, t.root / "piped.csv"], t.root, terminal=False)
    assert "measuring" not in piped, piped


def test_the_bar_waits_for_long_work(monkeypatch, capsys):
    """Work that ends within PROGRESS_DELAY_S shows nothing even on a terminal (the delay is 1 s: the callbacks here
    come at once)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress_bar("quick") as progress:
        for done in range(1, 4):
            progress(done, 3)
    assert "quick" not in capsys.readouterr().err
