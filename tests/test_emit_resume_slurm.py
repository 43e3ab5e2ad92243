"""End to end on a real Slurm: an emitted full run checkpoints, stops on the time-limit signal, requeues itself
and resumes from its checkpoint to the last iteration.

The loopback Slurm of tests/test_emit_slurm.py runs the job; its trainer is tests/standin_trainer.py (through
the entry-script option), which reads the Megatron-LM flags the job gives it. Slurm would send the signal
`stop_margin_s / 2` before the time limit (`#SBATCH --signal=B:USR1@...`); the test sends that same signal to
the batch shell at once (`scancel --signal=USR1 --batch`), so the test need not wait for a time limit, and
starts the requeued job without Slurm's two-minute delay.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from test_emit import make_plan, write_cluster
from test_emit_slurm import free_ports, job_output, run, slurm  # noqa: F401 (fixture)

from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.options import LaunchOptions
from fasop.launch.write import emit_plan
from fasop.plans import Plan

TRAINER = Path(__file__).with_name("standin_trainer.py")
TIMEOUT_S = 90


def wait_for(condition, what: str, detail) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} not after {TIMEOUT_S} s\n{detail()}"
        time.sleep(0.5)


def test_an_emitted_full_run_checkpoints_stops_on_the_signal_and_resumes(slurm, tmp_path):  # noqa: F811
    cluster = load_cluster(str(write_cluster(tmp_path)))
    plan = Plan.model_validate(make_plan(tp=1, dp=2, pp=2, mbs=2, gbs=64, placement=["small", "big"],
                                         layers_per_stage=[24, 24]))
    (master_port,) = free_ports(1)
    options = LaunchOptions(entry_script=str(TRAINER), master_port=master_port, time_limit="10", stop_margin_s=120,
                            train_iters=40, save_interval=10, data_path="/data/text_document",
                            tokenizer_type="GPT2BPETokenizer", vocab_file="/data/vocab.json",
                            merge_file="/data/merges.txt", training={"lr": "1e-4"}, gpus_per_node=2)
    out = tmp_path / "run"
    emit_plan(plan, load_model("gpt2-xl"), cluster, out, options)
    sbatch = (out / "sbatch.sh").read_text()
    assert "#SBATCH --signal=B:USR1@60" in sbatch and "#SBATCH --requeue" in sbatch

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/usr/bin/env bash\n[[ $SLURMD_NODENAME == big* ]] && echo "NVIDIA H100 80GB HBM3" '
                                        '|| echo "NVIDIA A10G"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**slurm.env, "OMP_NUM_THREADS": "1",
           "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{slurm.env.get('PATH', '')}"}
    submitted = run(["sbatch", "--parsable", "sbatch.sh"], env, cwd=out)
    assert submitted.returncode == 0, submitted.stderr + slurm.logs()
    job = submitted.stdout.strip().split(";")[0]
    checkpoints = out / "checkpoints"

    def detail() -> str:
        events = (checkpoints / "events.log").read_text() if (checkpoints / "events.log").exists() else ""
        return f"{events}\n{run(['scontrol', 'show', 'job', job], env).stdout}{job_output(out, job)}{slurm.logs()}"

    def saved() -> int:
        latest = checkpoints / "latest_checkpointed_iteration.txt"
        return int(latest.read_text()) if latest.exists() else 0

    wait_for(lambda: saved() >= 10, "a first checkpoint", detail)
    signalled = run(["scancel", "--signal=USR1", "--batch", job], env)
    assert signalled.returncode == 0, signalled.stderr
    # a requeued job waits two minutes (Slurm's own delay) before it may start again: start it now
    wait_for(lambda: "Restarts=1" in run(["scontrol", "show", "job", job], env).stdout, "the requeue", detail)
    # slurmd refuses a credential issued in the same second as the revocation of the job's last run
    time.sleep(2)
    for component in re.findall(r"^JobId=(\d+)", run(["scontrol", "show", "job", job], env).stdout, re.M):
        released = run(["scontrol", "update", f"JobId={component}", "StartTime=now"], env)
        assert released.returncode == 0, released.stderr
    wait_for(lambda: not run(["squeue", "-h", "-j", job], env).stdout.strip(), f"job {job} finished", detail)

    events = [json.loads(line) for line in (checkpoints / "events.log").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "signal", "start", "done"], detail()
    first, stopped, resumed, done = events
    assert first["iteration"] == 0 and first["restart"] == 0
    assert first["exit_duration_in_mins"] == 8 and first["save_interval"] == 10  # (10 min - 120 s) // 60
    assert 10 <= stopped["iteration"] < 40  # saved on the signal, short of the end
    assert resumed["iteration"] == stopped["iteration"] and resumed["restart"] == 1  # requeued, from the checkpoint
    assert done["iteration"] == 40 == saved()
    assert (checkpoints / f"iter_{stopped['iteration']:07d}").is_dir() and (checkpoints / "iter_0000040").is_dir()
    state = run(["scontrol", "show", "job", job], env).stdout
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, detail()
    log = (out / f"fasop-{job}.out").read_text()  # appended to across the requeue
    assert "requeueing the job to resume" in log and "training complete at iteration 40" in log, detail()
