"""Time the integer program of stage-group plans (fasop/search/stageilp.py) on a bundled cluster, with fasop's own
cost model: for each pipeline depth, the program of the micro-batch and recompute mode with the lowest lower bound
(fasop.search.groupsearch.lower_bound_s), built from the stage options fasop search builds, solved by HiGHS on one
thread within the time limit; printed with its status, its proven relative gap and the plan.

The default is the issue's scale: llama2-70b, global batch 16,384, on h100-a100-a10g-l4 (512 nodes each of H100,
A100-40GB, A10G and L4: 16,384 GPUs).

    python scripts/bench_stage_ilp.py [--model llama2-70b] [--cluster h100-a100-a10g-l4] [--gbs 16384]
                                      [--stages 4 8 16] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import time

from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.search.groupsearch import programs
from fasop.search.space import prepare
from fasop.search.stageilp import _candidates, solve_stage_ilp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-70b")
    parser.add_argument("--cluster", default="h100-a100-a10g-l4")
    parser.add_argument("--gbs", type=int, default=16384, help="global batch size in sequences")
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for each solve")
    args = parser.parse_args(argv)
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    inputs = prepare(model, cluster, args.gbs)
    capacity = {name: node.count for name, node in cluster.node_types.items()}
    print(f"{model.name} on {cluster.name}: {cluster.num_nodes} nodes, global batch {inputs.gbs}")
    for stages in args.stages:
        started = time.perf_counter()
        cases = programs(inputs, stages)
        built = time.perf_counter() - started
        if not cases:
            print(f"P = {stages}: no options")
            continue
        bound, _, batch, mode, options = cases[0]
        binaries = sum(len(js) for js, _ in _candidates(options, model.num_layers, capacity, model.tie_embeddings))
        started = time.perf_counter()
        found = solve_stage_ilp(options, model.num_layers, inputs.gbs // batch, capacity,
                                same_degrees_first_last=model.tie_embeddings, time_limit_s=args.time_limit)
        solved = time.perf_counter() - started
        print(f"P = {stages}: {len(cases)} programs (micro-batch x recompute mode) built in {built:.2f} s; the one "
              f"of lowest bound ({bound:.3f} s): micro-batch {batch}, recompute {mode}, {options.count} options, "
              f"{binaries:,} binaries; solved in {solved:.2f} s")
        if found is None:
            print("  infeasible")
            continue
        kinds = [f"{options.node_type[j]} tp{options.tp[j]} dp{options.dp[j]}" for j in found.option]
        print(f"  {found.status}, F = {found.objective_s:.3f} s, bound {found.bound_s:.3f} s, gap {found.gap:.2%}; "
              f"layers {list(found.layers)}; {', '.join(kinds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
