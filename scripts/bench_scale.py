"""Planning at scale: Llama-2-70B (or another model) on 1,024 GPUs of three types, with synthesised profiles.

    python scripts/bench_scale.py [--model NAME] [--workers N] [--keep K]
    python scripts/bench_scale.py --model deepseek-v3 --keep 5 --workers 1   # experts: tp, ep, etp and pp

The cluster is clusters/h100-a100-a10g.toml (32 H100, 64 A100 and 32 A10G nodes of 8 GPUs); llama2-70b's profiles
are profiles/llama2-70b/{H100,A100,A10G}.csv, written by `fasop profile synth` (each file says how to
regenerate it), another model's are synthesised the same way. Prints the wall time (start-up excluded, loading
included), the plans evaluated and the best plan. Placements are searched as type blocks (a heuristic,
docs/cost-model.md section 1).
"""

from __future__ import annotations

import argparse
import time

import fasop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-70b", help="a bundled model (default: llama2-70b)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: fasop's choice)")
    parser.add_argument("--keep", type=int, default=None,
                        help="evaluate only what can be among the best K plans (sound pruning); default: every plan")
    args = parser.parse_args()
    started = time.perf_counter()
    model, cluster = fasop.load_model(args.model), fasop.load_cluster("h100-a100-a10g")
    result = fasop.search_plans(model, cluster, workers=args.workers, keep=args.keep)
    elapsed = time.perf_counter() - started
    best = result.plans[0]
    print(f"{model.name} ({model.num_layers} layers, global batch {best.gbs}, sequence {model.seq_length}) on "
          f"{cluster.name}: {cluster.num_gpus} GPUs in {cluster.num_nodes} nodes")
    print(f"wall time {elapsed:.1f} s; {result.plans_evaluated} plans evaluated, {result.partitions_solved} layer "
          f"partitions solved, {result.pruned} pruned by bound, {result.out_of_memory} out of memory")
    stages = [s.gpu for s in best.stages]
    experts = f" ep={best.ep} etp={best.etp}" if best.ep is not None else ""
    print(f"best: tp={best.tp} dp={best.dp} pp={best.pp}{experts} mbs={best.mbs} step {best.step_time_s:.3f} s "
          f"({best.throughput_samples_per_s:.1f} samples/s, {best.tokens_per_s:,.0f} tokens/s), "
          f"peak memory {best.peak_memory_gib:.1f} GiB, ${best.cost_per_hour_usd:,.0f}/h")
    print(f"  stages: {' '.join(f'{g}:{n}' for g, n in zip(stages, best.layers_per_stage))} "
          f"(placement search: {best.placement_search})")


if __name__ == "__main__":
    main()
