"""The launchers without a network: run_inter.sh's node-type check and file rendezvous, the hosts file, the
emitted launch.sh and commands.txt (the SSH runs themselves are in test_launch_ssh.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_emit import SMOKE, cluster, fake_torchrun, fresh_plan, gpt2, make_plan, write_cluster  # noqa: F401 (fixtures)

from fasop.cli import main
from fasop.errors import InputError
from fasop.launch.launchers import read_hosts
from fasop.launch.write import render_plan
from fasop.plans import Plan


def run_inter(tmp_path: Path, cluster, gpt2, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "run_inter.sh"
    if not script.exists():
        plan = Plan.model_validate(make_plan())  # small big big small
        script.write_text(render_plan(plan, gpt2, cluster, SMOKE)["run_inter.sh"])
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        fake_torchrun(tmp_path)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args")}
    return subprocess.run(["bash", str(script)], env={**base, **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("rank, reported, ok", [
    ("0", "NVIDIA A10G", True),
    ("1", "NVIDIA H100 80GB HBM3", True),
    ("1", "NVIDIA H100-SXM5-80GB\nNVIDIA H100-SXM5-80GB", True),
    ("0", "NVIDIA H100 80GB HBM3", False),            # the wrong type at this rank
    ("1", "NVIDIA H1000", False),                      # a longer word is another GPU
    ("1", "NVIDIA H100 80GB HBM3\nNVIDIA A10G", False),  # every GPU of the node counts
    ("0", "", False),
])
def test_the_node_type_check(tmp_path, cluster, gpt2, rank, reported, ok):
    result = run_inter(tmp_path, cluster, gpt2, NODE_RANK=rank, MASTER_ADDR="h", FASOP_GPU_NAME=reported)
    if ok:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 1 and not (tmp_path / "args").exists()  # torchrun never started
    if reported:
        assert "check the order of the hosts (node types in node-rank order: small big big small)" in result.stderr
    else:
        assert "nvidia-smi is missing or failed" in result.stderr  # an empty override reads nvidia-smi


def test_the_node_type_check_asks_nvidia_smi(tmp_path, cluster, gpt2):
    fake_torchrun(tmp_path)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text('#!/usr/bin/env bash\n[[ "$*" == "--query-gpu=name --format=csv,noheader" ]] || exit 9\n'
                   'echo "NVIDIA A10"\n')
    smi.chmod(0o755)
    result = run_inter(tmp_path, cluster, gpt2, NODE_RANK="0", MASTER_ADDR="h")
    assert result.returncode == 1 and "has GPU 'NVIDIA A10', but the plan places a small node (A10G)" in result.stderr
    smi.write_text("#!/usr/bin/env bash\nexit 1\n")
    result = run_inter(tmp_path, cluster, gpt2, NODE_RANK="0", MASTER_ADDR="h")
    assert result.returncode == 1 and "set FASOP_GPU_NAME" in result.stderr


def test_file_rendezvous_tells_the_other_nodes_where_node_0_listens(tmp_path, cluster, gpt2):
    shared = tmp_path / "shared" / "meet"
    shared.parent.mkdir()
    common = {"FASOP_RENDEZVOUS": f"file://{shared}", "FASOP_RUN_ID": "r1", "MASTER_PORT": "7100"}
    result = run_inter(tmp_path, cluster, gpt2, NODE_RANK="1", FASOP_GPU_NAME="H100",
                       FASOP_RENDEZVOUS_TIMEOUT_S="0", **common)
    assert result.returncode == 1 and f"no rendezvous file {shared}.r1 from node rank 0" in result.stderr
    result = run_inter(tmp_path, cluster, gpt2, NODE_RANK="0", FASOP_GPU_NAME="A10G", **common)
    assert result.returncode == 0, result.stderr
    assert (Path(f"{shared}.r1")).read_text() == f"{socket.gethostname()} 7100\n"  # no MASTER_ADDR: its host name
    assert sorted(p.name for p in shared.parent.iterdir()) == ["meet.r1"]
    (Path(f"{shared}.r1")).write_text("10.9.8.7 7200\n")
    result = run_inter(tmp_path, cluster, gpt2, NODE_RANK="2", FASOP_GPU_NAME="H100", MASTER_ADDR="ignored", **common)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv[argv.index("--master_addr") + 1:argv.index("--master_port") + 2] == ["10.9.8.7", "--master_port", "7200"]
    result = run_inter(tmp_path, cluster, gpt2, NODE_RANK="2", FASOP_GPU_NAME="H100", FASOP_RENDEZVOUS="nfs://x")
    assert result.returncode == 1 and "expected tcp or file:///PATH" in result.stderr


@pytest.fixture
def plans(tmp_path) -> Path:
    write_cluster(tmp_path)
    plan = fresh_plan(tmp_path, dp=2, pp=3, placement=["small", "big", "big"], layers_per_stage=[14, 17, 17])
    path = tmp_path / "plans.json"
    path.write_text(json.dumps([plan]))
    return path


def emit(plans: Path, *args: str):
    return CliRunner().invoke(main, ["emit", "--smoke-test", "--plans", str(plans), "--out", str(plans.parent / "run"),
                                        *args])


@pytest.mark.parametrize("text, fragment", [
    ("a small\nb big\n", "lists 2 hosts, the plan has 3 nodes"),
    ("a small\nb big\nc small\n", "line 3: node type small, but the plan places big at node rank 2"),
    ("a small\nb big\nc big\nd big\n", "line 4: more hosts than the plan's 3 nodes"),
    ("a small\nb big extra\nc big\n", "line 2: expected 'HOST NODE_TYPE'"),
    ("a small\n-oProxyCommand=x big\nc big\n", "line 2: host '-oProxyCommand=x': expected [USER@]NAME"),
    ("a small\n$(id) big\nc big\n", "line 2: host '$(id)': expected"),
    ("<host-0> small\nb big\nc big\n", "line 1: host '<host-0>'"),
    # one machine twice, however written: its node ranks would share its GPUs
    ("a small\nb big\nb big\n", "line 3: host b is on line 2 too; every node rank needs a machine of its own"),
    ("alice@ws-1.lab small\n# spare\nb big\nbob@WS-1.lab big\n", "line 4: host bob@WS-1.lab is on line 1 too"),
])
def test_hosts_files_that_do_not_fit_the_plan_are_one_line_errors(plans, text, fragment):
    hosts = plans.parent / "hosts.txt"
    hosts.write_text(text)
    result = emit(plans, "--launcher", "ssh", "--hosts", str(hosts))
    assert result.exit_code == 2 and fragment in result.output and "Traceback" not in result.output
    assert not (plans.parent / "run").exists()


def test_read_hosts_skips_comments_and_keeps_users(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the lab\n\nalice@ws-1.lab small  # the old one\nfe80::1 big\n")
    assert read_hosts(str(path), ["small", "big"]) == ["alice@ws-1.lab", "fe80::1"]
    with pytest.raises(InputError, match="line 4: more hosts than the plan's 1 nodes"):
        read_hosts(str(path), ["small"])
    with pytest.raises(InputError, match="lists 2 hosts, the plan has 3 nodes"):
        read_hosts(str(path), ["small", "big", "big"])


@pytest.mark.parametrize("args, fragment", [
    (["--rendezvous", "file"], "--rendezvous file: applies to the ssh and manual launchers"),
    (["--hosts", "h"], "--hosts: applies to the ssh and manual launchers (--launcher)"),
    (["--launcher", "ssh", "--rendezvous", "file"], "--rendezvous file: needs the path of a file on a file system "
                                                    "every node sees (--rendezvous-file)"),
    (["--launcher", "ssh", "--rendezvous", "file", "--rendezvous-file", "shared/x"],
     "--rendezvous-file: expected an absolute path"),
    (["--launcher", "ssh", "--rendezvous-file", "/shared/x"], "--rendezvous-file: applies to a file rendezvous only"),
    (["--launcher", "manual"], "--launcher manual: a TCP rendezvous needs the first node's address"),
])
def test_launcher_options_that_do_not_go_together(plans, args, fragment):
    result = emit(plans, *args)
    assert result.exit_code == 2 and fragment in result.output


def test_ssh_launch_files(plans):
    result = emit(plans, "--launcher", "ssh")
    assert result.exit_code == 0, result.output
    run = plans.parent / "run"
    assert sorted(p.name for p in run.iterdir()) == ["hosts", "launch.sh", "plan.json", "run_inter.sh"]
    assert os.access(run / "launch.sh", os.X_OK)
    assert (run / "hosts").read_text().splitlines()[-3:] == ["<host-0> small", "<host-1> big", "<host-2> big"]
    # the placeholders are refused before anything starts
    result = subprocess.run(["bash", str(run / "launch.sh")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "line 4: host '<host-0>'" in result.stderr
    assert not (run / "logs").exists()
    if shutil.which("shellcheck"):
        check = subprocess.run(["shellcheck", "--severity=style", str(run / "launch.sh"), str(run / "run_inter.sh")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout


def test_launch_sh_refuses_a_machine_listed_twice_in_an_edited_hosts_file(plans):
    result = emit(plans, "--launcher", "ssh")
    assert result.exit_code == 0, result.output
    run = plans.parent / "run"
    (run / "hosts").write_text("node-a small\nnode-b big\nroot@Node-A big\n")
    result = subprocess.run(["bash", str(run / "launch.sh")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"launch.sh: {run}/hosts: line 3: host root@Node-A is on line 1 too; every node "
                                     "rank needs a machine of its own (on one machine for tests, use loopback aliases "
                                     "such as 127.0.0.2 and 127.0.0.3)")
    assert not (run / "logs").exists()


def test_manual_commands_with_a_file_rendezvous(plans):
    result = emit(plans, "--launcher", "manual", "--rendezvous", "file", "--rendezvous-file", "/shared/fasop meet")
    assert result.exit_code == 0, result.output
    lines = (plans.parent / "run" / "commands.txt").read_text().splitlines()
    commands = [line for line in lines if not line.startswith("#")]
    run_dir = str((plans.parent / "run").absolute())
    # the value is quoted, not the whole assignment (which the shell would run as a command's name)
    assert commands == [f"cd {run_dir} && NODE_RANK={rank} MASTER_PORT=6000 FASOP_RENDEZVOUS='file:///shared/fasop meet'"
                        " bash run_inter.sh" for rank in range(3)]
    assert "(node rank 0 first)" in lines[1]
    (plans.parent / "run" / "run_inter.sh").write_text('echo "$NODE_RANK|$FASOP_RENDEZVOUS"\n')  # a stand-in
    result = subprocess.run(["sh", "-c", commands[2]], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout == "2|file:///shared/fasop meet\n", result.stderr
