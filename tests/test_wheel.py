"""The built wheel installed into a fresh virtual environment outside the source tree finds its bundled data
and runs a search: package data read with importlib.resources, the console script, the dependencies declared.

Offline: the wheel is built without build isolation, and the new environment reaches the dependencies already
installed here through a path file (not their .pth files, so no editable install of this tree leaks in)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args, cwd, **kwargs) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, **kwargs)


def test_the_wheel_installed_elsewhere_runs_a_search(tmp_path):
    wheels = tmp_path / "wheels"
    built = run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "--no-index",
                 "-q", "-w", str(wheels)], cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("fasop-*.whl")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    here = [p for p in (*site.getsitepackages(), sysconfig.get_path("purelib")) if Path(p).is_dir()]
    (purelib / "dependencies-from-the-test-run.pth").write_text("\n".join(dict.fromkeys(here)) + "\n")
    installed = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                     str(wheel)], cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([str(python), "-c", "import fasop, fasop.inputs.bundled as b; print(fasop.__file__); "
                 "print(b.data_dir('models'))"], cwd=elsewhere)
    package_file, models = where.stdout.split()
    assert Path(package_file).is_relative_to(env_dir)
    assert Path(models).is_relative_to(Path(package_file).parent)  # package data, wherever the package is
    assert (Path(models) / "gpt2-xl.toml").is_file()
    search = run([str(env_dir / "bin" / "fasop"), "search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10",
                  "--top", "1"], cwd=elsewhere)
    assert search.returncode == 0, search.stderr
    assert "gpt2-xl on fasop-1xA100-7xA10: 32 GPUs" in search.stdout and "A100,A10*7" in search.stdout
