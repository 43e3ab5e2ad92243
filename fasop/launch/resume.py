"""How long an emitted run is and how it spans Slurm jobs: its iterations, checkpoint interval, when each job
stops before its time limit, and how many jobs the whole training takes.

A full run saves checkpoints into its checkpoint folder and loads the latest on start. Each Slurm job stops
before its time limit in two ways: Megatron-LM's `--exit-duration-in-mins` (it saves and exits once that many
minutes have passed, `stop_margin_s` before the limit; sbatch.sh sets FASOP_EXIT_DURATION_MIN, which
run_inter.sh turns into the flag, so that runs started over SSH or by hand, without a limit, go on), and,
should it still run `stop_margin_s / 2` before the limit, Slurm's signal (`--signal=B:USR1@...`), on which
sbatch.sh sends SIGTERM to the trainers, which save and exit (`--exit-signal-handler`). sbatch.sh then requeues
the job while the checkpoint is short of the last iteration and has advanced in this job (a job that saved
nothing new is not retried).
"""

from __future__ import annotations

import math
from typing import Any

from fasop.errors import ArgumentError
from fasop.inputs.errorband import ErrorBand
from fasop.launch.options import LaunchOptions, time_limit_s

SMOKE_TEST_ITERS = 50  # a smoke test's iterations unless train_iters says otherwise
SAVE_EVERY_S = 3600.0  # default checkpoint interval: about an hour of training
LATEST = "latest_checkpointed_iteration.txt"  # Megatron-LM's record of the last saved iteration
EXIT_DURATION_VARIABLE = "FASOP_EXIT_DURATION_MIN"


def train_iters(plan: Any, opts: LaunchOptions) -> int:
    """The run's iterations: train_iters if given, else the plan's train_steps (a full run) or a smoke test's."""
    if opts.train_iters is not None:
        return opts.train_iters
    if opts.smoke_test:
        return SMOKE_TEST_ITERS
    if plan.train_steps is None:
        raise ArgumentError("train_iters", "a full run needs its length: search with train_steps or train_tokens, "
                                           "give train_iters, or ask for a smoke_test")
    return plan.train_steps


def exit_duration_min(opts: LaunchOptions) -> int:
    """Megatron-LM's --exit-duration-in-mins: the time limit less the stop margin, in whole minutes."""
    minutes = (time_limit_s(opts.time_limit) - opts.stop_margin_s) // 60
    if minutes < 1:
        raise ArgumentError("time_limit", f"leaves no whole minute of training before the stop margin of "
                                          f"{opts.stop_margin_s} s; raise it or lower stop_margin_s", opts.time_limit)
    return minutes


def save_interval(plan: Any, opts: LaunchOptions, iters: int) -> int:
    """Iterations between checkpoints: save_interval, else about SAVE_EVERY_S of training, at most the run."""
    if opts.save_interval is not None:
        return opts.save_interval
    if not plan.step_time_s:
        raise ArgumentError("save_interval", "needed: the plan states no step_time_s to space checkpoints by")
    return max(1, min(iters, math.floor(SAVE_EVERY_S / plan.step_time_s)))


def run_notes(plan: Any, opts: LaunchOptions, band: ErrorBand) -> list[str]:
    """What the user must know about the run's length, for the script header and the terminal; the jobs it takes
    are counted at the estimate and at the slow end of the error `band` (the cluster's, fasop.inputs.errorband)."""
    iters = train_iters(plan, opts)
    if opts.smoke_test:
        return [f"smoke test: {iters} iterations" + ("" if opts.data_path else " on mock data") +
                ", no checkpoints; not the whole training"]
    notes = [f"full run: {iters} iterations, a checkpoint every {save_interval(plan, opts, iters)} in "
             f"{opts.checkpoint_dir}"]
    if plan.step_time_s:
        run_s = iters * plan.step_time_s
        per_job_s = exit_duration_min(opts) * 60
        jobs, slow_jobs = math.ceil(run_s / per_job_s), math.ceil(band.high * run_s / per_job_s)
        slow = f"{band.high * run_s / 3600:.1f} h at the error band's slow end ({band.high:.2f}x)"
        resumes = (f" of {per_job_s / 3600:.2f} h of training each; each job resumes from the latest checkpoint, and "
                   "sbatch.sh requeues itself until the last iteration")
        if jobs > 1:
            notes.append(f"warning: the estimated run of {run_s / 3600:.1f} h ({slow}) exceeds the time limit "
                         f"{opts.time_limit}: it takes {jobs} jobs ({slow_jobs} at the band's slow end){resumes}")
        elif slow_jobs > 1:
            notes.append(f"warning: the estimated run of {run_s / 3600:.1f} h fits the time limit {opts.time_limit} "
                         f"but not at {slow}: it may take {slow_jobs} jobs{resumes}")
    return notes
