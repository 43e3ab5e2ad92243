"""How far fasop's approximations land from what they approximate.

    python scripts/measure_accuracy.py [--instances 200] [--seed 0]

1. The 1F1B closed form (docs/cost-model.md section 4) against the event simulation of tests/simulate.py:
   on the best plan of each of FASOP's six experiments, and on random stage sets (speeds 0.3x to 3x apart).
2. The placement subset that large searches use (type blocks and their rotations, docs/cost-model.md
   section 1) against exhaustive search, on random clusters of up to 16 nodes of up to 3 GPU types that are
   small enough to search exhaustively. tests/test_scale.py runs the same comparison on fewer instances.
3. The layer partition, optimal for the closed form, against the best partition under the exact step
   (docs/cost-model.md section 4.2), by brute force over every partition of the best plans of random clusters.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

import fasop
from fasop.cost.problem import PartitionBatch
from fasop.inputs.bandwidth import parse_bandwidth
from fasop.inputs.cluster import Cluster, Derating, NodeType
from fasop.inputs.model import Model
from fasop.search import search_plans
from fasop.search.estimate import plan_costs
from fasop.search.placement import more_sequences_than, placement_unit, type_order
from fasop.search.space import prepare

TESTS = Path(__file__).resolve().parents[1] / "tests"
EXPERIMENTS = [("gpt2-xl", "fasop-8xA10"), ("gpt2-xl", "fasop-1xA100-7xA10"), ("bert", "fasop-4xA10"),
               ("bert", "fasop-1xA100-3xA10"), ("t5", "fasop-8xA10"), ("t5", "fasop-1xA100-7xA10")]

# the random clusters' GPU types: relative layer time, memory and network
SPEED = {"fast": 1.0, "mid": 2.0, "slow": 4.5}
MEMORY_GIB = {"fast": 40.0, "mid": 24.0, "slow": 16.0}
NETWORK = {"fast": "100 Gbit/s", "mid": "50 Gbit/s", "slow": "25 Gbit/s"}
MEMORY_BANDWIDTH = {"fast": "1555 GB/s", "mid": "600 GB/s", "slow": "300 GB/s"}  # an A100, an A10, an L4


def write_profiles(folder: Path) -> None:
    """Profiles of the random clusters' GPU types, for the model of random_instance."""
    for gpu, slow in SPEED.items():
        rows = ["tp,mbs,kind,forward_s,backward_s"]
        for tp in (1, 2):
            for kind, base in (("embedding", 0.002), ("layer", 0.010), ("head", 0.006)):
                t = base * slow / tp**0.8
                rows.append(f"{tp},1,{kind},{t},{2 * t}")
        (folder / f"{gpu}.csv").write_text("\n".join(rows) + "\n")


def random_instance(rng: random.Random) -> tuple[Model, Cluster]:
    """A small decoder model on 2 to 16 nodes of 2 or 3 GPU types, some with little memory."""
    model = Model(name="m", architecture="decoder", encoder_num_layers=0, decoder_num_layers=rng.choice([6, 8, 12]),
                  hidden_size=1024, num_attention_heads=16, kv_channels=64, num_query_groups=16,
                  ffn_hidden_size=4096, encoder_seq_length=0, decoder_seq_length=1024, vocab_size=32000,
                  precision="fp16", global_batch_size=rng.choice([8, 16, 32]))
    gpus = rng.choice([2, 4])
    types = rng.sample(sorted(SPEED), rng.choice([2, 3]))
    counts = [1] * len(types)
    for _ in range(rng.randint(2, 16) - len(types)):
        counts[rng.randrange(len(types))] += 1
    nodes = {t: NodeType(t, t, gpus, rng.choice([MEMORY_GIB[t], MEMORY_GIB[t] / 8]), parse_bandwidth("100 GB/s", t),
                         parse_bandwidth(NETWORK[t], t), 1.0 + SPEED[t], n, parse_bandwidth(MEMORY_BANDWIDTH[t], t))
             for t, n in zip(types, counts)}
    return model, Cluster("random", nodes, Derating(), 1.0)


def subset_gap(model: Model, cluster: Cluster, profiles: str, limit: int = 3000) -> float | None:
    """Step time of the subset's best plan over the exhaustive best, minus one; None when the instance has
    more than `limit` node orders or no plan."""
    counts = tuple(cluster.node_types[n].count for n in type_order(cluster))
    if more_sequences_than(counts, placement_unit(cluster.gpus_per_node, 1), limit):
        return None
    try:
        exhaustive = search_plans(model, cluster, profiles_dir=profiles, placement_limit=10**9, workers=1)
    except fasop.InputError:  # no plan can use this batch size on this many GPUs
        return None
    if not exhaustive.plans:
        return None
    subset = search_plans(model, cluster, profiles_dir=profiles, placement_limit=0, workers=1)
    return subset.plans[0].step_time_s / exhaustive.plans[0].step_time_s - 1


def closed_form(compute_s: np.ndarray, send_s: np.ndarray, m: int) -> float:
    """fasop's own pipeline time of stages with these times: one layer per stage in a partition problem."""
    p = len(compute_s)
    exchange = np.zeros(p)
    exchange[1:] += send_s
    exchange[:-1] += send_s
    one = np.ones((1, p), dtype=int)
    batch = PartitionBatch(np.zeros(p, dtype=int), np.array([p]), one, one, compute_s[None, :], exchange[None, :],
                           np.zeros((1, p)), np.zeros((1, p)), np.array([m]), np.array([2 * send_s.sum()]))
    return float(batch.objective(one)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=200, help="random clusters compared with exhaustive search")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sys.path.insert(0, str(TESTS))  # the event simulation is a test oracle
    from simulate import simulate_1f1b

    print("1F1B closed form against the event simulation (closed / simulated - 1)")
    for model_name, cluster_name in EXPERIMENTS:
        plan = search_plans(fasop.load_model(model_name), fasop.load_cluster(cluster_name)).plans[0]
        compute = np.array([s.compute_s for s in plan.stages])
        forward = np.array([s.forward_s for s in plan.stages])
        boundary = np.array([s.send_s for s in plan.stages[:-1]])
        sim = simulate_1f1b(list(forward), list(compute - forward), list(boundary) + [0.0], plan.num_microbatches)
        closed = closed_form(compute, boundary, plan.num_microbatches)
        exact = (f"its exact pipeline time: {plan.pipeline_time_s / sim - 1:+.1e}" if plan.virtual_stages == 1 else
                 f"interleaved over {plan.virtual_stages} chunks, {plan.pipeline_time_s / sim - 1:+.2%}")
        print(f"  best plan of {model_name} on {cluster_name}: {closed / sim - 1:+.2%} ({exact})")
    gaps = []
    for _ in range(args.instances):
        p, m = rng.randint(1, 8), rng.randint(1, 16)
        compute = np.array([rng.uniform(0.3, 3.0) for _ in range(p)])
        send = np.array([rng.uniform(0.0, 0.5) for _ in range(p - 1)])
        sim = simulate_1f1b(list(compute / 3), list(2 * compute / 3), list(send) + [0.0], m)
        gaps.append(closed_form(compute, send, m) / sim - 1)
    print(f"  {args.instances} random stage sets: mean {np.mean(gaps):+.2%}, worst {max(gaps):+.2%}, "
          f"never below the simulation: {min(gaps) >= -1e-12}")

    print("placement subset against exhaustive search (subset best / exhaustive best - 1)")
    with tempfile.TemporaryDirectory() as folder:
        write_profiles(Path(folder))
        gaps, tried = [], 0
        while len(gaps) < args.instances:
            tried += 1
            gap = subset_gap(*random_instance(rng), folder)
            if gap is not None:
                gaps.append(gap)
    print(f"  {len(gaps)} random clusters (of {tried} drawn; the rest too large to search exhaustively or without "
          f"a plan): mean {np.mean(gaps):+.3%}, worst {max(gaps):+.3%}, within 1%: {sum(g <= 0.01 for g in gaps)}")

    print("closed-form partition against the best partition under the exact step (found / best - 1)")
    with tempfile.TemporaryDirectory() as folder:
        write_profiles(Path(folder))
        gaps = []
        while len(gaps) < args.instances:
            gaps += partition_gaps(*random_instance(rng), folder)
    print(f"  {len(gaps)} plans (the 3 best of random clusters, 2 to 4 stages): mean {np.mean(gaps):+.3%}, "
          f"worst {max(gaps):+.3%}, optimal: {sum(g <= 1e-12 for g in gaps)}")


def partition_gaps(model: Model, cluster: Cluster, profiles: str) -> list[float]:
    """For the 3 best plans of 2 to 4 stages: exact step of the partition found over the best exact step of any
    partition, minus one."""
    try:
        plans = search_plans(model, cluster, profiles_dir=profiles, workers=1).plans
    except fasop.InputError:
        return []
    inputs = prepare(model, cluster, profiles_dir=profiles)
    gaps = []
    for plan in [p for p in plans if 2 <= p.pp <= 4][:3]:
        costs, _ = plan_costs(model, cluster, inputs.profiles, plan)
        splits = np.array([c for c in itertools.product(range(model.num_layers + 1), repeat=plan.pp)
                           if sum(c) == model.num_layers])
        splits = splits[((splits >= costs.problem.lo[0]) & (splits <= costs.problem.hi[0])).all(-1)]
        steps = costs.schedule.take(np.zeros(len(splits), dtype=int)).step_terms(splits)["step_time_s"]
        gaps.append(plan.step_time_s / steps.min() - 1)
    return gaps


if __name__ == "__main__":
    main()
