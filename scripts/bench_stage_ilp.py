"""Time the integer program of stage-group plans (fasop/search/stageilp.py) on synthetic heterogeneous clusters.

The instance: a 70B-like model (80 layers, hidden 8192, sequence 4096), m micro-batches of a global micro-batch
of 32 sequences, on 512 nodes of 8 GPUs of four types (H100, A100-80GB, A10G, L4: speed, memory and links from
the GPU catalogue, inter-node bandwidth assumed below). Options: every node type, tp in {1, 2, 4, 8}, dp a power
of two up to the global micro-batch and the type's GPUs, with and without full recomputation; whole nodes.
Costs are affine in the stage's layers (compute at the catalogue's matmul efficiency, tensor-parallel traffic on
the node's link, sends and gradient reduction between nodes, the optimizer at memory bandwidth); the most layers
per stage follow from weights, distributed-optimizer state and 1F1B's in-flight activations.

    python scripts/bench_stage_ilp.py [--stages 4 8 16] [--microbatches 64] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fasop.inputs.catalogue import load_gpu_specs
from fasop.search.stageilp import StageOptions, _candidates, _program, solve_stage_ilp

# the synthetic cluster: GPU type -> (nodes, assumed inter-node bytes/s of one node)
CLUSTER = {"H100": (64, 400e9), "A100-80GB": (128, 50e9), "A10G": (160, 12.5e9), "L4": (160, 12.5e9)}
GPUS_PER_NODE = 8
LAYERS, HIDDEN, SEQUENCE, VOCABULARY = 80, 8192, 4096, 32000
GLOBAL_MICROBATCH = 32  # sequences of one micro-batch across the data-parallel replicas
LAYER_PARAMS = 12 * HIDDEN**2
USABLE_MEMORY = 0.9  # of each GPU's memory, after the allocator and framework overhead below
OVERHEAD_BYTES = 3 * 2**30


def instance(stages: int, microbatches: int) -> tuple[StageOptions, dict[str, int]]:
    specs = load_gpu_specs()
    rows = []
    for gpu, (nodes, node_bytes_per_s) in CLUSTER.items():
        for tp in (1, 2, 4, 8):
            dp = 1
            while dp <= GLOBAL_MICROBATCH and tp * dp <= nodes * GPUS_PER_NODE:
                rows += [(gpu, specs[gpu], node_bytes_per_s, tp, dp, recompute) for recompute in (False, True)]
                dp *= 2
    position = np.arange(stages)[:, None]
    first, last = position == 0, position == stages - 1
    table = {key: np.array([row[k] for row in rows]) for k, key in enumerate(("gpu", "spec", "node_bw", "tp", "dp", "recompute"))}
    tp, dp, recompute = table["tp"], table["dp"], table["recompute"]
    flops_per_s = np.array([spec.dense_bf16_tflops * 1e12 * spec.matmul_efficiency for spec in table["spec"]])
    link = np.array([spec.link_bytes_per_s for spec in table["spec"]])
    hbm = np.array([spec.memory_bandwidth_gb_per_s * 1e9 for spec in table["spec"]])
    memory = np.array([spec.memory_gib * 2**30 for spec in table["spec"]])
    gpu_bw = table["node_bw"] / GPUS_PER_NODE
    batch = GLOBAL_MICROBATCH / dp
    hidden_bytes = SEQUENCE * batch * HIDDEN * 2  # one bf16 activation of the micro-batch
    layer_s = (6 * LAYER_PARAMS * SEQUENCE * batch * np.where(recompute, 4 / 3, 1) / tp / flops_per_s
               + 8 * (tp - 1) / tp * hidden_bytes / link)  # sequence-parallel gathers and scatters
    head_s = 6 * HIDDEN * VOCABULARY * SEQUENCE * batch / tp / flops_per_s
    send_s = 2 * hidden_bytes / tp / gpu_bw
    fixed_s = np.where(last, head_s, 0) + np.where(last, 0, send_s)
    reduce_bw = np.where(tp * dp <= GPUS_PER_NODE, link, gpu_bw)
    tail_layer_s = np.ones((stages, 1)) * (4 * LAYER_PARAMS / tp * 2 * (dp - 1) / dp / reduce_bw
                                           + LAYER_PARAMS / tp / dp * 16 * 2 / hbm)  # gradients out, optimizer step
    embedding_params = VOCABULARY * HIDDEN / tp
    tail_fixed_s = 0.02 + np.where(first | last, embedding_params * 4 / reduce_bw, 0)
    in_flight = np.minimum(microbatches, stages - position)
    state_bytes = LAYER_PARAMS / tp * (6 + 12 / dp)
    activation_bytes = np.where(recompute, 2, 34) * hidden_bytes / 2 / tp
    free = (USABLE_MEMORY * memory - OVERHEAD_BYTES - np.where(recompute, 34 * hidden_bytes / 2 / tp, 0)
            - np.where(first | last, embedding_params * (6 + 12 / dp), 0)  # embedding or head
            - np.where(last, SEQUENCE * batch * VOCABULARY * 4 / tp, 0))  # logits
    hi = np.floor(np.maximum(free, 0) / (state_bytes + in_flight * activation_bytes)).astype(int)
    options = StageOptions(
        node_type=tuple(table["gpu"].tolist()), tp=tp, dp=dp, nodes=-(-tp * dp // GPUS_PER_NODE),
        sum_fixed_s=fixed_s, layer_s=np.broadcast_to(layer_s, (stages, len(rows))).copy(), period_fixed_s=fixed_s,
        tail_fixed_s=np.broadcast_to(tail_fixed_s, (stages, len(rows))).copy(), tail_layer_s=tail_layer_s,
        lo=np.ones(stages, dtype=int), hi=hi)
    return options, {gpu: nodes for gpu, (nodes, _) in CLUSTER.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for each solve")
    args = parser.parse_args(argv)
    for stages in args.stages:
        options, capacity = instance(stages, args.microbatches)
        in_range = np.clip(np.minimum(options.hi, LAYERS) - options.lo[:, None] + 1, 0, None).sum()
        started = time.perf_counter()
        candidates = _candidates(options, LAYERS, capacity, tied=False)
        _program(options, candidates, LAYERS, args.microbatches, capacity, tied=False)
        built = time.perf_counter() - started
        started = time.perf_counter()
        found = solve_stage_ilp(options, LAYERS, args.microbatches, capacity, time_limit_s=args.time_limit)
        total = time.perf_counter() - started
        binaries = sum(len(js) for js, _ in candidates)
        print(f"P = {stages}: {options.count} options, {in_range:,} (position, option, layers) that fit in memory, "
              f"{binaries:,} binaries; build {built:.2f} s, solve {total - built:.2f} s (build and solve {total:.2f} s)")
        if found is None:
            print("  infeasible")
            continue
        kinds = [f"{options.node_type[j]} tp{options.tp[j]} dp{options.dp[j]}" for j in found.option]
        print(f"  {found.status}, F = {found.objective_s:.3f} s, bound {found.bound_s:.3f} s, gap {found.gap:.2%}; "
              f"layers {list(found.layers)}; {', '.join(kinds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
