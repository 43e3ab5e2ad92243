"""Paths and names in the files fasop writes: a newline or control character in a path is written escaped in
`#` comment lines (scripts, profile CSV and cluster TOML files, which still read back) and refused where it
would split a one-line command (commands.txt); environment assignments quote their value, not the whole."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest
from test_launchers import emit, plans  # noqa: F401 (fixture)
from test_validate_calibrate import measured  # noqa: F401 (fixture)

from fasop.cli import main
from fasop.files import comment_line
from fasop.inputs import bundled
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.inputs.profiles import load_profiles, read_profile
from fasop.inputs.tomlfile import tomllib
from fasop.profile.links import Fit, format_fragment

# Every character str.splitlines breaks at, and other controls; each would end a comment line.
BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x00", "\x1b", "\t"]
# A folder name that, written raw into a file's header, would add a CSV row, a TOML key and a shell command.
HOSTILE_DIR = "in\n1,1,layer,9,9\nPWNED = 1\ntouch PWNED\n"


def only_comments_before(text: str, first_data: str) -> bool:
    """Whether every line of `text` before the first that starts with `first_data` is a comment or blank."""
    lines = text.splitlines()
    header = lines[:next(i for i, line in enumerate(lines) if line.startswith(first_data))]
    return bool(header) and all(line.startswith("#") or not line for line in header)


@pytest.mark.parametrize("char", BREAKS)
def test_a_comment_line_stays_one_line_whatever_the_text_holds(char):
    line = comment_line(f"a{char}b")
    assert line.startswith("# a") and line.endswith("b") and line.isprintable()
    assert len(line.splitlines()) == 1
    assert tomllib.loads(f"{line}\nx = 1\n") == {"x": 1}  # TOML refuses control characters in comments


def test_a_comment_line_keeps_printable_text():
    assert comment_line("plan 1: A100 é, 40 GB/s") == "# plan 1: A100 é, 40 GB/s"


def test_the_synthetic_profile_header_escapes_a_model_path(runner, tmp_path):
    folder = tmp_path / HOSTILE_DIR
    folder.mkdir()
    model_path = folder / "gpt2 xl.toml"
    shutil.copy(bundled.resolve("models", "gpt2-xl", ".toml"), model_path)
    out = tmp_path / "A100.csv"
    result = runner.invoke(main, ["profile", "synth", "--model", str(model_path), "--gpu", "A100", "--tp", "1",
                                  "--mbs", "1,2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert only_comments_before(text, "tp,mbs,")
    assert not (tmp_path / "PWNED").exists()
    regenerate = next(line for line in text.splitlines() if line.startswith("# Regenerate: "))
    assert "in\\n1,1,layer,9,9\\nPWNED = 1\\ntouch PWNED\\n/gpt2 xl.toml'" in regenerate  # one shell word
    profile = read_profile(out, load_model(str(model_path)), "A100")  # reads back: the '#' lines are skipped
    assert profile.tensor_degrees == (1,) and profile.time(1, "layer", 1)[0] != 9


def test_a_measured_profile_header_escapes_its_command(tmp_path):
    pytest.importorskip("torch", reason="fasop.profile.measure needs torch")
    from fasop.profile.measure import Measured, format_measured

    model = load_model("gpt2-xl")
    rows = [Measured(1, 1, kind, 0.001, 0.002, None) for kind in ("embedding", "layer", "head")]
    path = tmp_path / "A100.csv"
    path.write_text(format_measured(rows, [f"Regenerate: fasop profile layers --out '{HOSTILE_DIR}/x.csv'",
                                           "fasop-profile: model=gpt2-xl gpu=A100"]))
    assert only_comments_before(path.read_text(), "tp,mbs,")
    assert read_profile(path, model, "A100").time(1, "layer", 1) == (0.001, 0.002)


def test_a_link_fragment_header_escapes_hosts_and_paths():
    fits = {"allreduce_intra_node": Fit(1e-5, 2e11, 0.01), "p2p_intra_node": Fit(1e-5, 1e11, 0.01)}
    text = format_fragment(fits, [f"Measured on {HOSTILE_DIR}", f"Command: fasop profile links --out '{HOSTILE_DIR}'"])
    assert tomllib.loads(text) == {"intra_node_bandwidth": "200.0000 GB/s"}  # no PWNED key


def test_calibrated_files_escape_the_measured_path_and_read_back(measured, runner):  # noqa: F811
    user, runs = measured
    hostile = runs.with_name(f"runs{HOSTILE_DIR}.csv")
    runs.rename(hostile)
    out, profiles_out = user.root / "calibrated.toml", user.root / "calibrated-profiles"
    result = runner.invoke(main, ["calibrate", "--measured", str(hostile), "--profiles", str(user.profiles),
                                  "--out", str(out), "--profiles-out", str(profiles_out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "PWNED" not in tomllib.loads(text)
    assert only_comments_before(text, "[cluster]")
    assert "runsin\\n1,1,layer,9,9\\nPWNED = 1" in text
    written, given = load_cluster(str(out)).node_types, load_cluster(str(user.cluster)).node_types
    # read back whole: the input's node types, their memory bandwidths divided by the fitted compute scales
    assert written == {n: replace(t, gpu_memory_bytes_per_s=written[n].gpu_memory_bytes_per_s) for n, t in given.items()}
    scaled = (profiles_out / "fast.csv").read_text()
    assert only_comments_before(scaled, "tp,mbs,")
    profiles = load_profiles(load_model(str(user.model)), ["fast", "slow"], str(profiles_out))
    assert profiles["fast"].time(1, "layer", 1)[0] != 9


# -- commands.txt and the printed hints ------------------------------------------------------------------


def test_a_run_directory_with_a_newline_is_refused_for_commands_txt(plans, runner):  # noqa: F811
    out = plans.parent / "run\ntouch PWNED"
    result = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--out", str(out), "--launcher", "manual",
                                  "--rendezvous", "file", "--rendezvous-file", "/shared/meet"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "expected printable characters" in lines[0], lines
    assert not out.exists() and sorted(p.name for p in plans.parent.iterdir()) == ["mixed.toml", "plans.json"]


def test_a_rendezvous_path_with_a_newline_is_refused(plans):  # noqa: F811
    result = emit(plans, "--launcher", "manual", "--rendezvous", "file", "--rendezvous-file", "/shared/a\nb")
    assert result.exit_code == 2 and "--rendezvous-file" in result.output and "'/shared/a\\nb'" in result.output
    assert not (plans.parent / "run").exists()


def test_the_printed_commands_quote_the_run_directory(plans, runner):  # noqa: F811
    out = plans.parent / "my run; touch PWNED"
    result = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--out", str(out)])
    assert result.exit_code == 0, result.output
    hint = result.stderr.strip().splitlines()[-1]
    assert hint == f"Submit with: cd '{out}' && sbatch sbatch.sh"
    check = subprocess.run(["sh", "-c", hint.removeprefix("Submit with: ").replace("sbatch ", "test -f ")],
                           cwd=plans.parent)
    assert check.returncode == 0 and not (plans.parent / "PWNED").exists()
    result = runner.invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--out", str(out), "--force",
                                  "--launcher", "ssh"])
    assert result.stderr.strip().splitlines()[-1] == f"Fill in '{out}/hosts', then run: bash '{out}/launch.sh'"
