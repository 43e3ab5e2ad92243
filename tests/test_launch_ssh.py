"""End to end: the emitted ssh and manual launches run a plan on real processes, node ranks as planned.

An OpenSSH server made for the test (host and user keys in a temporary directory) listens on 127.0.0.2,
127.0.0.3 and 127.0.0.4, three loopback "hosts" of one machine. A stand-in nvidia-smi reports the GPU of the
host an ssh session reached (an A10G on .2, H100s on .3 and .4), so run_inter.sh's node-type check runs as on
real nodes. The plan runs small, big, big (A10G, H100, H100); a checker replaces Megatron-LM's entry script:
it runs under the real torchrun on the CPU, joins torch.distributed with gloo, does one all-reduce and writes
its rank, node rank and host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_emit import fresh_plan, write_cluster

from fasop.cli import main

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
if SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
    pytest.skip("the OpenSSH server or client is not installed (scripts/install_sshd.sh installs them)",
                allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the loopback sshd needs root (it logs the test in as root)", allow_module_level=True)
pytest.importorskip("torch", reason="torch (CPU) is not installed (scripts/install_slurm.sh installs it)")

GPUS = {"127.0.0.2": "NVIDIA A10G", "127.0.0.3": "NVIDIA H100 80GB HBM3", "127.0.0.4": "NVIDIA H100 80GB HBM3"}
TYPE_OF = {"NVIDIA A10G": "small", "NVIDIA H100 80GB HBM3": "big"}
PLACEMENT = ["small", "big", "big"]
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
GPUS_PER_NODE = 2
WORLD = len(PLACEMENT) * GPUS_PER_NODE
START_TIMEOUT_S = 20  # sshd up and answering on every address
RUN_TIMEOUT_S = 180   # a launch of 6 CPU ranks, from start to exit
STOP_TIMEOUT_S = 60   # one node killed -> every process of the run gone

CHECKER = '''\
import json, os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
connection = os.environ.get("SSH_CONNECTION", "").split()
record = {
    "rank": rank, "world_size": world, "node_rank": int(os.environ["GROUP_RANK"]),
    "host": connection[2] if connection else None, "allreduce": value.item(), "pid": os.getpid(),
    "agent_pid": os.getppid(), "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]],
}
path = os.path.join(os.environ["FASOP_CHECK_DIR"], f"rank-{rank}.json")
with open(path + ".tmp", "w") as out:
    json.dump(record, out)
os.replace(path + ".tmp", path)
if os.environ.get("FASOP_CHECK_HOLD"):
    while True:  # until the launcher stops this node
        time.sleep(1)
dist.barrier()
dist.destroy_process_group()
'''

# Answers the query run_inter.sh makes with the GPU of the loopback address this ssh session reached.
FAKE_NVIDIA_SMI = '''\
#!/usr/bin/env bash
[[ "$*" == "--query-gpu=name --format=csv,noheader" ]] || { echo "unexpected query: $*" >&2; exit 6; }
read -r _ _ server _ <<< "${SSH_CONNECTION:-}"
grep -m 1 "^$server " "$(dirname "$0")/gpus" | cut -d " " -f 2-
'''


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LoopbackSshd:
    """sshd on 127.0.0.2-4 with keys of its own, in a temporary directory."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="fasop-sshd-"))
        for key in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fasop-test", "-f",
                            str(self.root / key)], check=True, capture_output=True, timeout=30)
        shutil.copy(self.root / "user_key.pub", self.root / "authorized_keys")
        self.port = free_port()
        host_key = (self.root / "host_key.pub").read_text().split()
        (self.root / "known_hosts").write_text(
            "".join(f"[{host}]:{self.port} {host_key[0]} {host_key[1]}\n" for host in HOSTS))
        config = [f"Port {self.port}", *[f"ListenAddress {host}" for host in HOSTS],
                  f"HostKey {self.root / 'host_key'}", f"PidFile {self.root / 'sshd.pid'}",
                  f"AuthorizedKeysFile {self.root / 'authorized_keys'}", "PermitRootLogin prohibit-password",
                  "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                  "MaxStartups 50"]
        (self.root / "sshd_config").write_text("\n".join(config) + "\n")
        self.options = ["-F", "/dev/null", "-p", str(self.port), "-i", str(self.root / "user_key"),
                        "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=yes",
                        "-o", f"UserKnownHostsFile={self.root / 'known_hosts'}", "-o", "GlobalKnownHostsFile=/dev/null",
                        "-o", "LogLevel=ERROR"]
        self.privsep = Path("/run/sshd")  # sshd refuses to start without its privilege-separation directory
        self.made_privsep = not self.privsep.exists()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.privsep.mkdir(mode=0o755, exist_ok=True)
        with open(self.root / "sshd.log", "w") as log:
            self.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.root / "sshd_config")],
                                            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        for host in HOSTS:
            while True:
                result = subprocess.run(["ssh", *self.options, "-o", "BatchMode=yes", host, "true"],
                                        capture_output=True, text=True, timeout=30)
                if result.returncode == 0:
                    break
                if self.process.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"the loopback sshd does not answer on {host}: {result.stderr.strip()}\n"
                                + (self.root / "sshd.log").read_text())
                time.sleep(0.3)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.made_privsep:
            shutil.rmtree(self.privsep, ignore_errors=True)


@pytest.fixture(scope="module")
def sshd():
    server = LoopbackSshd()
    try:
        server.start()
        yield server
    finally:
        server.stop()


def run_processes(run_id: str) -> list[int]:
    """Processes of this machine whose environment holds FASOP_RUN_ID=run_id (a run's every process)."""
    marker = f"FASOP_RUN_ID={run_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return pids


def wait_until_gone(run_id: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (pids := run_processes(run_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return pids


class Run:
    """One emitted launch of the three-node plan, in its own directory; kills what it leaves behind."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        write_cluster(tmp_path)
        plan = fresh_plan(tmp_path, dp=2, pp=3, placement=PLACEMENT, layers_per_stage=[14, 17, 17])
        (tmp_path / "plans.json").write_text(json.dumps([plan]))
        (tmp_path / "checker.py").write_text(CHECKER)
        self.results = tmp_path / "results"
        self.results.mkdir()
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
        (bin_dir / "nvidia-smi").chmod(0o755)
        (bin_dir / "gpus").write_text("".join(f"{host} {name}\n" for host, name in GPUS.items()))
        self.master_port = free_port()
        self.run_id = f"test-{uuid.uuid4().hex[:12]}"
        self.env = {**os.environ, "FASOP_CHECK_DIR": str(self.results), "GLOO_SOCKET_IFNAME": "lo",
                    "OMP_NUM_THREADS": "1", "FASOP_RUN_ID": self.run_id,
                    "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def emit(self, *args: str) -> tuple[Path, str]:
        out = self.tmp / "run"
        result = CliRunner().invoke(main, ["emit", "--smoke-test", "--plans", str(self.tmp / "plans.json"), "--out", str(out),
                                           "--entry-script", str(self.tmp / "checker.py"),
                                           "--master-port", str(self.master_port), *args])
        assert result.exit_code == 0, result.output
        return out, result.output

    def hosts_file(self, hosts: list[str]) -> Path:
        path = self.tmp / "my-hosts"
        path.write_text("".join(f"{host} {node_type}\n" for host, node_type in zip(hosts, PLACEMENT)))
        return path

    def launch(self, out: Path, sshd: LoopbackSshd, wrapper: tuple[str, ...] = (), **env: str) -> subprocess.Popen:
        """launch.sh started with FASOP_RUN_ID set, as `wrapper` ARGV... if given (a shell, a timeout)."""
        env = {**self.env, "SSH_OPTS": " ".join(sshd.options),
               "FORWARD_ENV": "PATH FASOP_CHECK_DIR GLOO_SOCKET_IFNAME OMP_NUM_THREADS FASOP_CHECK_HOLD", **env}
        return subprocess.Popen([*wrapper, "bash", str(out / "launch.sh")], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def records(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.results.glob("rank-*.json"))]

    def cleanup(self) -> None:
        for pid in run_processes(self.run_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until_gone(self.run_id, 10)


@pytest.fixture
def run(tmp_path):
    launch = Run(tmp_path)
    try:
        yield launch
    finally:
        launch.cleanup()


def finish(process: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"launch.sh still running after {timeout_s} s\n{output}")
    return process.returncode, output


def logs(out: Path) -> str:
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("logs/*")))


def check_records(records: list[dict], hosts: list[str] | None) -> None:
    """Every rank ran once, node ranks follow the plan, the all-reduce summed every rank."""
    assert sorted(r["rank"] for r in records) == list(range(WORLD))
    assert all(r["world_size"] == WORLD for r in records)
    assert all(r["allreduce"] == WORLD * (WORLD + 1) / 2 for r in records)
    for record in records:
        assert record["node_rank"] == record["rank"] // GPUS_PER_NODE
        if hosts is not None:
            assert record["host"] == hosts[record["node_rank"]]
            assert TYPE_OF[GPUS[record["host"]]] == PLACEMENT[record["node_rank"]]


def test_ssh_launch_runs_every_rank_on_its_planned_host(sshd, run):
    out, _ = run.emit("--launcher", "ssh", "--hosts", str(run.hosts_file(HOSTS)))
    assert (out / "hosts").read_text().splitlines()[-3:] == [f"{h} {t}" for h, t in zip(HOSTS, PLACEMENT)]
    code, output = finish(run.launch(out, sshd), RUN_TIMEOUT_S)
    records = run.records()
    assert code == 0, output + logs(out)
    check_records(records, HOSTS)
    assert all(r["master"] == ["127.0.0.2", str(run.master_port)] for r in records)
    for rank, host in enumerate(HOSTS):  # each node's output in its own log
        log = (out / "logs" / f"{rank}-{host}.log").read_text()
        assert f"node rank {rank} of 3 (plan: {PLACEMENT[rank]})" in log
    assert wait_until_gone(run.run_id, STOP_TIMEOUT_S) == []


def test_ssh_launch_stops_every_node_when_one_dies(sshd, run):
    rendezvous = run.tmp / "shared" / "rendezvous"
    rendezvous.parent.mkdir()
    out, _ = run.emit("--launcher", "ssh", "--hosts", str(run.hosts_file(HOSTS)),
                      "--rendezvous", "file", "--rendezvous-file", str(rendezvous))
    process = run.launch(out, sshd, FASOP_CHECK_HOLD="1")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(list(run.results.glob("rank-*.json"))) < WORLD:  # every rank past its all-reduce, then holding
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail("the ranks did not all start\n" + process.communicate()[0] + logs(out))
        time.sleep(0.5)
    records = run.records()
    check_records(records, HOSTS)
    # the shared file told nodes 1 and 2 where node 0 listens; the run id keeps runs apart
    published = Path(f"{rendezvous}.{run.run_id}").read_text().split()
    assert published == ["127.0.0.2", str(run.master_port)]
    assert all(r["master"] == published for r in records)

    victim = next(r for r in records if r["node_rank"] == 1)
    os.kill(victim["agent_pid"], signal.SIGKILL)  # node rank 1's torchrun
    code, output = finish(process, STOP_TIMEOUT_S)
    assert code == 1, output  # launch.sh carries FASOP_RUN_ID, and stopping the run spares it
    assert "node rank 1 (127.0.0.3) failed" in output, output
    assert wait_until_gone(run.run_id, STOP_TIMEOUT_S) == [], output + logs(out)


def test_hosts_in_the_wrong_order_fail_fast(sshd, run):
    swapped = [HOSTS[1], HOSTS[0], HOSTS[2]]  # an H100 host where the plan has the A10G node, and back
    out, _ = run.emit("--launcher", "ssh", "--hosts", str(run.hosts_file(swapped)))
    code, output = finish(run.launch(out, sshd), RUN_TIMEOUT_S)
    assert code == 1, output
    log = (out / "logs" / f"0-{HOSTS[1]}.log").read_text()
    assert "has GPU 'NVIDIA H100 80GB HBM3', but the plan places a small node (A10G) at this rank" in log
    assert "check the order of the hosts" in log
    assert run.records() == []  # no rank started
    assert wait_until_gone(run.run_id, STOP_TIMEOUT_S) == [], output + logs(out)


def test_stopping_a_failed_run_spares_the_process_that_started_launch_sh(sshd, run):
    # A wrapper (a shell, a timeout, a scheduler step) with FASOP_RUN_ID in its environment, on a machine that
    # is also a host of the run: stopping the run must reach the nodes' processes only.
    swapped = [HOSTS[1], HOSTS[0], HOSTS[2]]  # node ranks 0 and 1 fail their node-type check at once
    out, _ = run.emit("--launcher", "ssh", "--hosts", str(run.hosts_file(swapped)))
    wrapper = ("bash", "-c", '"$@"; echo "wrapper: launch.sh exited with $?"', "wrapper")
    code, output = finish(run.launch(out, sshd, wrapper), RUN_TIMEOUT_S)
    assert code == 0, output  # the wrapper lived on (TERM would give -15)
    assert "launch.sh: stopping every node" in output and "wrapper: launch.sh exited with 1" in output, output
    assert wait_until_gone(run.run_id, STOP_TIMEOUT_S) == [], output + logs(out)


def test_manual_commands_run_the_plan(run):
    out, printed = run.emit("--launcher", "manual", "--hosts", str(run.hosts_file(HOSTS)))
    commands = [line for line in (out / "commands.txt").read_text().splitlines() if not line.startswith("#")]
    assert len(commands) == len(PLACEMENT)
    assert all(command in printed.splitlines() for command in commands)
    processes = []
    for rank, command in enumerate(commands):  # each node's shell, its GPU named by FASOP_GPU_NAME
        env = {**run.env, "FASOP_GPU_NAME": GPUS[HOSTS[rank]]}
        processes.append(subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs = [finish(p, RUN_TIMEOUT_S) for p in processes]
    assert [code for code, _ in outputs] == [0, 0, 0], "".join(text for _, text in outputs)
    records = run.records()
    check_records(records, None)
    assert all(r["master"] == ["127.0.0.2", str(run.master_port)] for r in records)
    assert all(f"node rank {rank} of 3 (plan: {PLACEMENT[rank]})" in text for rank, (_, text) in enumerate(outputs))
