"""Time the exact 1F1B schedule (fasop/cost/schedule.py) on many random heterogeneous plans at once.

Stage times are drawn 3x apart (backward twice the forward), sends up to a tenth of a forward; the same plans
run plain and interleaved. For scale, a few plans also go through the event simulation of tests/simulate.py.

    python scripts/bench_schedule.py [--plans 10000] [--stages 16] [--microbatches 64] [--virtual 1 2 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from fasop.cost.schedule import makespan_s, program

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=10_000)
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--virtual", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = parser.parse_args(argv)
    n, p, m = args.plans, args.stages, args.microbatches
    rng = np.random.default_rng(0)
    forward = rng.uniform(1e-3, 3e-3, (n, p))
    send = rng.uniform(0, 3e-4, (n, p - 1))
    wrap = rng.uniform(0, 3e-4, n)

    print(f"{n:,} plans x {p} stages x {m} micro-batches")
    for v in args.virtual:
        started = time.perf_counter()
        prog = program(p, m, v)
        built = time.perf_counter() - started
        best = np.inf
        for _ in range(args.repeat):
            started = time.perf_counter()
            makespan_s(forward / v, 2 * forward / v, send, m, virtual_stages=v, wrap_send_s=wrap)
            best = min(best, time.perf_counter() - started)
        print(f"  v = {v}: {prog.ops:,} operations in {len(prog.levels)} levels, graph built in {built:.3f} s; "
              f"all plans in {best:.3f} s ({best / n * 1e6:.1f} us a plan)")
    sys.path.insert(0, str(TESTS))  # the event simulation is a test oracle
    from simulate import simulate_1f1b

    sample = min(n, 20)
    started = time.perf_counter()
    for i in range(sample):
        simulate_1f1b(list(forward[i]), list(2 * forward[i]), list(send[i]) + [0.0], m)
    each = (time.perf_counter() - started) / sample
    print(f"  event simulation: {each * 1e3:.1f} ms a plan ({each * n:.0f} s for all plans)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
