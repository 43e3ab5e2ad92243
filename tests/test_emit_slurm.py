"""End to end: the emitted sbatch.sh runs on a real Slurm, and every pipeline stage lands on its GPU type.

A Slurm controller and four slurmd ("big1", "big2" of GRES type big, "small1", "small2" of type small, two
stand-in GPUs each) run on this machine over loopback. The plan's placement starts with the slow type
(small, big, big, small). The emitted job starts a checker instead of Megatron-LM's pretrain_gpt.py (through
the entry-script option): it runs under the real torchrun on the CPU, joins torch.distributed with gloo, does
one all-reduce and writes its rank, node and arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_emit import flag_values, make_plan, write_cluster

from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.options import LaunchOptions
from fasop.launch.write import emit_plan
from fasop.plans import Plan

if shutil.which("slurmctld") is None:
    pytest.skip("slurmctld is not installed (scripts/install_slurm.sh installs Slurm)", allow_module_level=True)

NODES = {"big1": "big", "big2": "big", "small1": "small", "small2": "small"}
GPUS_PER_NODE = 2
START_TIMEOUT_S = 30     # controller and node daemons up, nodes idle
JOB_TIMEOUT_S = 150      # job submitted -> finished (the backfill scheduler starts it within about 30 s)

CHECKER = '''\
import json, os, socket, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
record = {
    "rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
    "node_rank": int(os.environ["GROUP_RANK"]), "node": os.environ.get("SLURMD_NODENAME"),
    "host": socket.gethostname(), "allreduce": value.item(), "argv": sys.argv[1:],
}
path = os.path.join(os.environ["FASOP_CHECK_DIR"], f"rank-{rank}.json")
with open(path + ".tmp", "w") as out:
    json.dump(record, out)
os.replace(path + ".tmp", path)
dist.barrier()
dist.destroy_process_group()
'''


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def slurm_conf(root: Path, ports: list[int]) -> str:
    host = socket.gethostname().split(".")[0]
    user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
    lines = [
        "ClusterName=fasoptest",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MinJobAge=600",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
    ]
    for (name, kind), port in zip(NODES.items(), ports[1:]):
        lines.append(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=4 "
                     f"RealMemory=2000 Gres=gpu:{kind}:{GPUS_PER_NODE} State=UNKNOWN")
    lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def run(args, env, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=30, **kwargs)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LoopbackSlurm:
    """slurmctld and one slurmd per node, all on 127.0.0.1, in a temporary directory."""

    def __init__(self):
        if os.geteuid() != 0:
            pytest.skip("the loopback Slurm needs root: slurmd, and mknod for the stand-in GPU devices")
        self.root = Path(tempfile.mkdtemp(prefix="fasop-slurm-"))  # short: slurmstepd puts sockets under it
        for sub in ("state", "log", "dev"):
            (self.root / sub).mkdir()
        gres = []
        for name, kind in NODES.items():
            (self.root / "spool" / name).mkdir(parents=True)
            for index in range(GPUS_PER_NODE):
                os.mknod(self.root / "dev" / f"{name}-gpu{index}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            gres.append(f"NodeName={name} Name=gpu Type={kind} File={self.root}/dev/{name}-gpu[0-{GPUS_PER_NODE - 1}]")
        ports = free_ports(1 + len(NODES))
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(slurm_conf(self.root, ports))
        (self.root / "gres.conf").write_text("\n".join(gres) + "\n")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for key in list(self.env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and key != "SLURM_CONF":
                del self.env[key]
        self.pids: list[int] = []

    def start(self) -> None:
        result = run(["slurmctld", "-f", str(self.conf), "-c", "-i"], self.env)
        assert result.returncode == 0, result.stderr + self.logs()
        self._remember(self.root / "slurmctld.pid")
        for name in NODES:
            result = run(["slurmd", "-f", str(self.conf), "-N", name], self.env)
            assert result.returncode == 0, result.stderr + self.logs()
            self._remember(self.root / f"slurmd-{name}.pid")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            states = run(["sinfo", "-h", "-N", "-o", "%N %t"], self.env).stdout.split()
            if sorted(states[1::2]) == ["idle"] * len(NODES):
                return
            assert time.monotonic() < deadline, f"nodes not idle after {START_TIMEOUT_S} s: {states}" + self.logs()
            time.sleep(0.5)

    def _remember(self, pidfile: Path) -> None:
        for _ in range(50):
            if pidfile.exists() and pidfile.read_text().strip():
                self.pids.append(int(pidfile.read_text().strip()))
                return
            time.sleep(0.1)

    def logs(self) -> str:
        text = []
        for path in sorted((self.root / "log").glob("*.log")):
            text.append(f"\n--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "".join(text)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=self.env, capture_output=True,
                       timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=30)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            time.sleep(0.5)
        for pid in self.pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def slurm():
    cluster = LoopbackSlurm()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_emitted_job_runs_every_stage_on_its_gpu_type(slurm, tmp_path):
    started = time.monotonic()
    model = load_model("gpt2-xl")
    cluster = load_cluster(str(write_cluster(tmp_path)))
    plan = make_plan(tp=1, dp=2, pp=4, mbs=2, gbs=64, placement=["small", "big", "big", "small"],
                     layers_per_stage=[10, 13, 14, 11])
    checker = tmp_path / "checker.py"
    checker.write_text(CHECKER)
    (master_port,) = free_ports(1)
    options = LaunchOptions(entry_script=str(checker), master_port=master_port, time_limit="5", smoke_test=True)
    out = tmp_path / "run"
    emit_plan(Plan.model_validate(plan), model, cluster, out, options)

    results = tmp_path / "results"
    results.mkdir()
    bin_dir = tmp_path / "bin"  # an nvidia-smi that names the GPU of the node type, for run_inter.sh's check
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/usr/bin/env bash\n[[ $SLURMD_NODENAME == big* ]] && echo "NVIDIA H100 80GB HBM3" '
                                        '|| echo "NVIDIA A10G"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**slurm.env, "FASOP_CHECK_DIR": str(results), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{slurm.env.get('PATH', '')}"}
    submitted = run(["sbatch", "--parsable", "sbatch.sh"], env, cwd=out)
    assert submitted.returncode == 0, submitted.stderr + slurm.logs()
    job = submitted.stdout.strip().split(";")[0]

    deadline = time.monotonic() + JOB_TIMEOUT_S
    while run(["squeue", "-h", "-j", job], env).stdout.strip():
        if time.monotonic() > deadline:
            pytest.fail(f"job {job} not finished after {JOB_TIMEOUT_S} s\n" + job_output(out, job) + slurm.logs())
        time.sleep(1)
    state = run(["scontrol", "show", "job", job], env).stdout
    records = [json.loads(p.read_text()) for p in sorted(results.glob("rank-*.json"))]
    detail = f"\n{state}\n{job_output(out, job)}{slurm.logs()}"
    assert state.count("JobState=COMPLETED") == 3 and "ExitCode=0:0" in state, detail  # 3 components, one job

    tp, dp, pp = plan["tp"], plan["dp"], plan["pp"]
    world = tp * dp * pp
    assert len(records) == world, detail
    assert sorted(r["rank"] for r in records) == list(range(world))
    assert all(r["world_size"] == world for r in records)
    assert all(r["allreduce"] == world * (world + 1) / 2 for r in records)

    for record in records:
        stage = record["rank"] // (tp * dp)
        node_rank = record["rank"] // GPUS_PER_NODE
        assert record["node_rank"] == node_rank
        # the GPU type the plan gave this stage: its first rank's node in placement order
        planned = plan["placement"][stage * tp * dp // GPUS_PER_NODE]
        assert NODES[record["node"]] == planned == plan["placement"][node_rank], record
    nodes = {r["node"] for r in records}
    assert len(nodes) == len(plan["placement"])  # one node per node rank, every node used once
    assert all(sum(r["node"] == n for r in records) == GPUS_PER_NODE for n in nodes)

    for record in records:
        args = flag_values(record["argv"])
        assert args["--tensor-model-parallel-size"] == [str(tp)]
        assert args["--pipeline-model-parallel-size"] == [str(pp)]
        assert args["--micro-batch-size"] == [str(plan["mbs"])]
        assert args["--global-batch-size"] == [str(plan["gbs"])]
        assert args["--num-layers"] == ["48"]
    check_layout(records[0]["argv"], plan)
    assert time.monotonic() - started < 170


def check_layout(argv: list[str], plan: dict) -> None:
    """The layout the job received, read by megatron-core when it is installed."""
    (text,) = flag_values(argv)["--pipeline-model-parallel-layout"]
    try:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError:
        stages = text.split("|")
        assert len(stages) == plan["pp"]
        return
    layout = PipelineParallelLayerLayout(text, plan["pp"])
    layout.validate_layer_layout(num_layers=sum(plan["layers_per_stage"]), mtp_num_layers=None)
    assert [row[0].count(LayerType.decoder) for row in layout.layout] == plan["layers_per_stage"]


def job_output(out: Path, job: str) -> str:
    text = []
    for name in (f"fasop-{job}.out", f"fasop-{job}.err"):
        path = out / name
        if path.exists():
            text.append(f"\n--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]))
    return "".join(text)
