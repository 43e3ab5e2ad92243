"""Time FASOP's pareto sweep through the Python API.

FASOP's pareto mode (reference section 2.1) sweeps every mix of 0..8 A100 nodes and 0..8 A10 nodes of 8 GPUs
(80 compositions, up to 128 GPUs) for GPT-2 XL. This script runs the same sweep with fasop.market.pareto.sweep and
prints the wall time, the compositions, the plans evaluated, the slowest compositions and the Pareto front.

    python scripts/bench_pareto.py [--model gpt2-xl] [--cluster fasop-pareto] [--max-nodes A100=4 ...]
"""

from __future__ import annotations

import argparse
import sys
import time

from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.market.pareto import composition_label, compositions, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl")
    parser.add_argument("--cluster", default="fasop-pareto")
    parser.add_argument("--train-steps", type=int, default=10_000)
    parser.add_argument("--max-nodes", action="append", default=[], metavar="TYPE=N")
    parser.add_argument("--slowest", type=int, default=8, help="how many of the slowest compositions to list")
    args = parser.parse_args(argv)
    try:
        caps = {name: int(n) for name, _, n in (value.partition("=") for value in args.max_nodes)}
    except ValueError:
        parser.error("--max-nodes expects TYPE=N")
    try:
        model, cluster = load_model(args.model), load_cluster(args.cluster)
        todo = compositions(cluster, caps)
        stamps: list[float] = []
        started = time.perf_counter()
        records = sweep(model, cluster, todo, train_steps=args.train_steps,
                        progress=lambda done, total: stamps.append(time.perf_counter()))
        wall = time.perf_counter() - started
    except InputError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    seconds = [b - a for a, b in zip([started, *stamps[:-1]], stamps)]
    evaluated = sum(r["plans_evaluated"] for r in records)
    gpus = max(r["gpus"] for r in records)
    print(f"{model.name} on {cluster.name}: {len(records)} compositions (up to {gpus} GPUs), "
          f"{evaluated:,} plans evaluated, wall time {wall:.2f} s")
    print(f"\nslowest compositions ({sum(sorted(seconds)[-args.slowest:]) / wall:.0%} of the time):")
    for s, r in sorted(zip(seconds, records), key=lambda pair: -pair[0])[:args.slowest]:
        print(f"  {composition_label(r):>16}  {r['gpus']:>4} GPUs  {r['plans_evaluated']:>7,} plans  {s:8.2f} s")
    front = sorted((r for r in records if r["on_front"]), key=lambda r: r["train_hours"])
    print(f"\nPareto front ({len(front)} compositions, {args.train_steps:,} steps of {records[0]['gbs']} samples):")
    print(f"  {'composition':>16}  {'tp':>2} {'dp':>3} {'pp':>3} {'mbs':>3}  {'step s':>7}  {'samples/s':>9}  "
          f"{'run h':>7}  {'run $':>9}")
    for r in front:
        print(f"  {composition_label(r):>16}  {r['tp']:>2} {r['dp']:>3} {r['pp']:>3} {r['mbs']:>3}  {r['step_time_s']:7.4f}  "
              f"{r['throughput_samples_per_s']:9.1f}  {r['train_hours']:7.2f}  {r['train_cost_usd']:9,.0f}")
    missing = [composition_label(r) for r in records if not r["feasible"]]
    if missing:
        print(f"\nno plan fits: {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
