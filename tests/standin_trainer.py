"""A stand-in for Megatron-LM's pretrain_gpt.py in the real-Slurm test (tests/test_emit_resume_slurm.py).

It reads the flags of an emitted full run as Megatron-LM does (--train-iters, --save, --load, --save-interval,
--exit-signal-handler, --exit-duration-in-mins), "trains" by sleeping per iteration, saves checkpoints the way
Megatron-LM names them (iter_0000010/ and latest_checkpointed_iteration.txt in --save), saves and exits on
SIGTERM, and on start resumes from the latest checkpoint in --load. Rank 0 saves and appends what happened to
events.log in the checkpoint folder, one JSON object a line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

STEP_S = float(os.environ.get("FASOP_STANDIN_STEP_S", "0.2"))
LATEST = "latest_checkpointed_iteration.txt"


def saved_iteration(folder: Path) -> int:
    try:
        return int((folder / LATEST).read_text())
    except (OSError, ValueError):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--save-interval", type=int)
    parser.add_argument("--exit-signal-handler", action="store_true")
    parser.add_argument("--exit-duration-in-mins", type=int)
    args, _ = parser.parse_known_args()
    rank = int(os.environ.get("RANK", "0"))
    stop = []
    if args.exit_signal_handler:
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))

    def event(kind: str, iteration: int) -> None:
        if rank == 0:
            record = {"event": kind, "iteration": iteration, "job": os.environ.get("SLURM_JOB_ID"),
                      "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                      "exit_duration_in_mins": args.exit_duration_in_mins, "save_interval": args.save_interval}
            with open(args.save / "events.log", "a") as log:
                log.write(json.dumps(record) + "\n")

    def save(iteration: int) -> None:
        if rank == 0 and saved_iteration(args.save) != iteration:
            (args.save / f"iter_{iteration:07d}").mkdir(parents=True, exist_ok=True)
            (args.save / f"{LATEST}.tmp").write_text(str(iteration))
            os.replace(args.save / f"{LATEST}.tmp", args.save / LATEST)

    args.save.mkdir(parents=True, exist_ok=True)
    iteration = saved_iteration(args.load) if args.load else 0
    event("start", iteration)
    started = time.monotonic()
    while iteration < args.train_iters:
        time.sleep(STEP_S)
        iteration += 1
        if args.save_interval and iteration % args.save_interval == 0:
            save(iteration)
        timed_out = args.exit_duration_in_mins and time.monotonic() - started > 60 * args.exit_duration_in_mins
        if stop or timed_out:
            save(iteration)
            event("signal" if stop else "exit-duration", iteration)
            sys.exit(0)
    save(iteration)
    event("done", iteration)


if __name__ == "__main__":
    main()
