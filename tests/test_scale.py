"""The scalable search: the placement subset against exhaustive search, sound pruning, several processes."""

import random

import numpy as np
import pytest
from hypothesis import given, settings

import fasop
from fasop.cluster import Cluster, Derating, NodeType, parse_bandwidth
from fasop.model import Model
from fasop.partition import lower_bounds, optimal_partitions
from fasop.placement import more_sequences_than, placement_unit, type_order
from fasop.search import search_plans
from test_partition import problems

SPEED = {"fast": 1.0, "mid": 2.0, "slow": 4.5}  # relative layer time
MEMORY_GIB = {"fast": 40.0, "mid": 24.0, "slow": 16.0}
NETWORK = {"fast": "100 Gbit/s", "mid": "50 Gbit/s", "slow": "25 Gbit/s"}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profiles")
    for gpu, slow in SPEED.items():
        rows = ["tp,mbs,kind,forward_s,backward_s"]
        for tp in (1, 2):
            for kind, base in (("embedding", 0.002), ("layer", 0.010), ("head", 0.006)):
                t = base * slow / tp**0.8
                rows.append(f"{tp},1,{kind},{t},{2 * t}")
        (folder / f"{gpu}.csv").write_text("\n".join(rows) + "\n")
    return str(folder)


def random_instance(rng: random.Random):
    layers = rng.choice([6, 8, 12])
    model = Model(name="m", architecture="decoder", encoder_num_layers=0, decoder_num_layers=layers, hidden_size=1024,
                  num_attention_heads=16, kv_channels=64, num_query_groups=16, ffn_hidden_size=4096,
                  encoder_seq_length=0, decoder_seq_length=1024, vocab_size=32000, precision="fp16",
                  global_batch_size=rng.choice([8, 16, 32]))
    gpus = rng.choice([2, 4])
    types = rng.sample(sorted(SPEED), rng.choice([2, 3]))
    counts = [1] * len(types)
    for _ in range(rng.randint(2, 16) - len(types)):
        counts[rng.randrange(len(types))] += 1
    nodes = {t: NodeType(t, t, gpus, rng.choice([MEMORY_GIB[t], MEMORY_GIB[t] / 8]), parse_bandwidth("100 GB/s", "test"),
                         parse_bandwidth(NETWORK[t], "test"), 1.0 + SPEED[t], n) for t, n in zip(types, counts)}
    return model, Cluster("random", nodes, Derating(), 1.0)


def exhaustive_is_affordable(cluster: Cluster, limit: int = 3000) -> bool:
    counts = tuple(cluster.node_types[n].count for n in type_order(cluster))
    return not more_sequences_than(counts, placement_unit(cluster.gpus_per_node, 1), limit)


def test_placement_subset_is_within_one_percent_of_exhaustive(profiles):
    rng = random.Random(11)
    tested = 0
    while tested < 12:
        model, cluster = random_instance(rng)
        if not exhaustive_is_affordable(cluster):
            continue
        try:
            exhaustive = search_plans(model, cluster, profiles_dir=profiles, placement_limit=10**9)
        except fasop.InputError:  # no plan can use this batch size on this many GPUs
            continue
        if not exhaustive.plans:
            continue
        subset = search_plans(model, cluster, profiles_dir=profiles, placement_limit=0)
        assert {p["placement_search"] for p in subset.plans} <= {"type-blocks"}
        assert subset.plans[0]["step_time_s"] <= 1.01 * exhaustive.plans[0]["step_time_s"]
        tested += 1


@settings(max_examples=200, deadline=None)
@given(problems())
def test_lower_bound_never_exceeds_the_optimum(batch):
    bound = lower_bounds(batch)
    _, value, feasible = optimal_partitions(batch)
    assert np.array_equal(np.isfinite(bound), feasible)
    assert (bound[feasible] <= value[feasible] * (1 + 1e-12)).all()


def test_pruned_search_keeps_the_best_plans():
    model, cluster = fasop.load_model("t5"), fasop.load_cluster("fasop-1xA100-7xA10")
    full = search_plans(model, cluster)
    kept = search_plans(model, cluster, keep=5)
    assert kept.pruned > 0 and kept.partitions_solved < full.partitions_solved
    assert [p["step_time_s"] for p in kept.plans] == [p["step_time_s"] for p in full.plans[:5]]


def test_several_processes_find_the_same_plans():
    model, cluster = fasop.load_model("gpt2-xl"), fasop.load_cluster("fasop-1xA100-7xA10")
    one = search_plans(model, cluster, workers=1)
    two = search_plans(model, cluster, workers=2)
    assert two.plans == one.plans
    assert (two.plans_evaluated, two.out_of_memory) == (one.plans_evaluated, one.out_of_memory)
