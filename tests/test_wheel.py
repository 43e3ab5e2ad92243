"""The package as users install it finds every bundled model, profile and cluster by name and runs a search: a wheel
built from a clean copy of the tree (through its sdist) in a fresh virtual environment, the same wheel installed with
`pip install --user`, an editable install, and the tree run from PYTHONPATH without installing. The top-level folders
models/, profiles/ and clusters/ install as the data packages fasop.models, fasop.profiles and fasop.clusters
(setup.cfg), read with importlib.resources.

Offline: nothing is built in isolation or fetched, and each new environment reaches the dependencies already
installed here through a path file (not their .pth files, so no editable install of this tree leaks in)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("models", "profiles", "clusters")
# what the tree bundles, by the names commands take: models and clusters by stem, profiles as <model>/<gpu>
BUNDLED = {"models": sorted(p.stem for p in (ROOT / "models").glob("*.toml")),
           "clusters": sorted(p.stem for p in (ROOT / "clusters").glob("*.toml")),
           "profiles": sorted(f"{p.parent.name}/{p.stem}" for p in (ROOT / "profiles").glob("*/*.csv"))}
# Run by each installed fasop: loads every bundled model, cluster and profile by name, and says where it found them.
LOAD_EVERY_NAME = """
import importlib.util, json
import fasop
from fasop.inputs import bundled
from fasop.inputs.catalogue import load_gpu_specs
from fasop.inputs.profiles import load_profiles
found = {"models": bundled.names("models", ".toml"), "clusters": bundled.names("clusters", ".toml"), "profiles": []}
for name in found["models"]:
    fasop.load_model(name)
for name in found["clusters"]:
    fasop.load_cluster(name)
for name in found["models"]:
    gpus = sorted(p.stem for p in (bundled.data_dir("profiles") / name).glob("*.csv"))
    load_profiles(fasop.load_model(name), gpus)
    found["profiles"] += [f"{name}/{gpu}" for gpu in gpus]
print(json.dumps({"package": fasop.__file__, "gpus": len(load_gpu_specs()), "found": found,
                  "dirs": {kind: str(bundled.data_dir(kind)) for kind in found},
                  "imported": {kind: importlib.util.find_spec(f"fasop.{kind}") is not None for kind in found}}))
"""
SEARCH = ["search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10", "--top", "1"]


def run(args, cwd, extra_env=None, **kwargs) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONUSERBASE", "PYTHONNOUSERSITE")}
    return subprocess.run(args, cwd=cwd, env={**env, **(extra_env or {})}, capture_output=True, text=True, **kwargs)


def reach_dependencies(site_dir: Path) -> None:
    """A path file in `site_dir` that puts the site-packages of this test run on the path."""
    here = [p for p in (*site.getsitepackages(), sysconfig.get_path("purelib")) if Path(p).is_dir()]
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "dependencies-from-the-test-run.pth").write_text("\n".join(dict.fromkeys(here)) + "\n")


def fresh_env(env_dir: Path) -> Path:
    """A new virtual environment without pip that reaches the dependencies; its python."""
    venv.create(env_dir, with_pip=False)
    reach_dependencies(Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)})))
    return env_dir / "bin" / "python"


def pip(*args, cwd) -> None:
    done = run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "-q"], cwd=cwd)
    assert done.returncode == 0, done.stderr


def loads_every_name(python, cwd, extra_env=None) -> dict:
    done = run([str(python), "-c", LOAD_EVERY_NAME], cwd=cwd, extra_env=extra_env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["found"] == BUNDLED and report["gpus"] > 0
    return report


def searches(fasop, cwd, extra_env=None) -> None:
    done = run([str(fasop), *SEARCH], cwd=cwd, extra_env=extra_env)
    assert done.returncode == 0, done.stderr
    assert "gpt2-xl on fasop-1xA100-7xA10: 32 GPUs" in done.stdout and "A100,A10*7" in done.stdout


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A clean copy of the tree: no git state, environments, builds or caches."""
    copy = tmp_path_factory.mktemp("tree") / "fasop-src"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                              "__pycache__", ".*_cache", ".hypothesis"))
    return copy


@pytest.fixture(scope="module")
def wheel(tree, tmp_path_factory) -> Path:
    """The wheel built from the sdist of the clean copy, as `python -m build` would, without build isolation."""
    out = tmp_path_factory.mktemp("dist")
    sdist = run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                 "print(build_meta.build_sdist(sys.argv[1]))", str(out)], cwd=tree)
    assert sdist.returncode == 0, sdist.stderr
    pip("wheel", str(out / sdist.stdout.split()[-1]), "--no-build-isolation", "-w", str(out), cwd=out)
    (built,) = out.glob("fasop-*.whl")
    return built


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def test_the_wheel_holds_every_module_and_bundled_file_under_fasop(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "fasop").rglob("*.py")}
    data = {f"fasop/{p.relative_to(ROOT)}" for kind in KINDS for p in (ROOT / kind).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert modules <= names and data <= names
    assert {name.split("/")[0] for name in names} == {"fasop", "fasop-0.1.0.dist-info"}  # nothing else on the path


def test_the_wheel_installed_elsewhere_finds_every_bundled_name_and_runs_a_search(wheel, tmp_path, elsewhere):
    python = fresh_env(tmp_path / "env")
    pip("--python", str(python), "install", str(wheel), cwd=tmp_path)
    report = loads_every_name(python, elsewhere)
    package = Path(report["package"]).parent
    assert package.is_relative_to(tmp_path / "env") and all(report["imported"].values())
    assert all(Path(report["dirs"][kind]) == package / kind for kind in KINDS)  # package data, wherever it is
    searches(tmp_path / "env" / "bin" / "fasop", elsewhere)


def test_the_wheel_installed_with_pip_user_finds_every_bundled_name_and_runs_a_search(wheel, tmp_path, elsewhere):
    python = getattr(sys, "_base_executable", sys.executable)  # a virtual environment has no user site
    user = {"HOME": str(tmp_path / "home"), "PYTHONUSERBASE": str(tmp_path / "userbase")}
    user_site = run([python, "-c", "import site; print(site.getusersitepackages())"], cwd=tmp_path, extra_env=user)
    reach_dependencies(Path(user_site.stdout.strip()))
    # the flag only lets an installer-managed interpreter write into the temporary user base
    installed = run([sys.executable, "-m", "pip", "--python", python, "install", "--user", "--break-system-packages",
                     "--no-deps", "--no-index", "--no-warn-script-location", "-q", str(wheel)], cwd=tmp_path,
                    extra_env=user)
    assert installed.returncode == 0, installed.stderr
    report = loads_every_name(python, elsewhere, user)
    package = Path(report["package"]).parent
    assert package.is_relative_to(tmp_path / "userbase") and all(report["imported"].values())
    assert all(Path(report["dirs"][kind]) == package / kind for kind in KINDS)
    searches(tmp_path / "userbase" / "bin" / "fasop", elsewhere, user)


def test_an_editable_install_and_the_tree_on_pythonpath_find_the_top_level_folders(tree, tmp_path, elsewhere):
    python = fresh_env(tmp_path / "env")
    on_path = loads_every_name(python, elsewhere, {"PYTHONPATH": str(tree)})  # not installed: beside the package
    assert Path(on_path["package"]).is_relative_to(tree) and not any(on_path["imported"].values())
    pip("--python", str(python), "install", "--no-build-isolation", "-e", str(tree), cwd=tmp_path)
    editable = loads_every_name(python, elsewhere)
    assert Path(editable["package"]).is_relative_to(tree) and all(editable["imported"].values())
    assert editable["dirs"] == on_path["dirs"] == {kind: str(tree / kind) for kind in KINDS}
    searches(tmp_path / "env" / "bin" / "fasop", elsewhere)
