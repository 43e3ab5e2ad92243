"""Answers the search can be trusted with: every plan holds every layer, a pruned search returns exactly the
full search's best plans, and work stays bounded by the answer rather than by the input's numbers."""


import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from fasop.cli.tables import format_table
from fasop.errors import ArgumentError, InputError
from fasop.inputs.cluster import Cluster, Derating, NodeType
from fasop.inputs.model import Model
from fasop.inputs.profiles import Curve, GpuProfile
from fasop.market.pareto import MAX_COMPOSITIONS, compositions
from fasop.plans import PRINTED_DECIMALS
from fasop.search import evaluation, search_plans
from fasop.search.engine import SORT_KEYS
from fasop.search.placement import SUBSET_NODES, placements
from fasop.search.space import MAX_GLOBAL_BATCH, divisors

GPUS = ("g0", "g1", "g2")
KINDS = ("embedding", "layer", "head", "encoder", "decoder_embedding", "decoder")


def model_of(architecture: str, layers: int, gbs: int) -> Model:
    encoder, decoder = {"decoder": (0, layers), "encoder": (layers, 0),
                        "encoder-decoder": (layers // 2, layers - layers // 2)}[architecture]
    return Model(name="m", architecture=architecture, encoder_num_layers=encoder, decoder_num_layers=decoder,
                 hidden_size=256, num_attention_heads=8, kv_channels=32, num_query_groups=8, ffn_hidden_size=1024,
                 encoder_seq_length=128 if encoder else 0, decoder_seq_length=128 if decoder else 0,
                 vocab_size=4000, precision="fp16", global_batch_size=gbs)


def profile_of(gpu: str, speed: float) -> GpuProfile:
    """Round times (so that plans tie) at tp 1 and 2, micro-batch sizes 1 and 4."""
    base = {"embedding": 0.002, "layer": 0.01, "head": 0.004, "encoder": 0.01, "decoder_embedding": 0.002,
            "decoder": 0.015}
    curves = {}
    for tp in (1, 2):
        for kind, t in base.items():
            step = t * speed / tp
            curves[tp, kind] = Curve(np.array([1, 4]), np.array([step, 3 * step]), np.array([2 * step, 6 * step]))
    return GpuProfile(gpu, f"{gpu}.csv", curves)


def cluster_of(types: list[tuple[str, int, float, float]], gpus_per_node: int) -> Cluster:
    """types: (gpu, count, memory GiB, price) per node type; bandwidths in round numbers."""
    nodes = {f"n{i}": NodeType(f"n{i}", gpu, gpus_per_node, memory, 50e9, 12.5e9, price, count, 1e12)
             for i, (gpu, count, memory, price) in enumerate(types)}
    return Cluster("c", nodes, Derating(), 1.0)


@st.composite
def instances(draw):
    architecture = draw(st.sampled_from(["decoder", "encoder", "encoder-decoder"]))
    model = model_of(architecture, draw(st.integers(2, 8)), draw(st.sampled_from([4, 8, 16, 24])))
    # node types may share a GPU, memory and price: symmetric placements then tie in step time and cost
    types = [(draw(st.sampled_from(GPUS)), draw(st.integers(1, 3)), draw(st.sampled_from([0.05, 0.2, 16.0])),
              draw(st.sampled_from([1.0, 2.0]))) for _ in range(draw(st.integers(1, 3)))]
    cluster = cluster_of(types, draw(st.sampled_from([1, 2])))
    profiles = {gpu: profile_of(gpu, speed) for gpu, speed in zip(GPUS, (1.0, 2.0, 2.0))}
    return model, cluster, profiles


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(["time", "cost"]))
def test_pruned_search_returns_the_full_searchs_best(instance, sort):
    model, cluster, profiles = instance
    try:
        # on every node: the subsets' searches are pruned the same way, each on its own (tests/test_idle_nodes.py)
        full = search_plans(model, cluster, profiles=profiles, sort=sort, workers=1, use_all=True).plans
    except InputError:  # no plan can use the batch size on these GPUs
        reject()
    for plan in full:
        assert sum(plan.layers_per_stage) == model.num_layers
    for keep in (1, 2, 3, 5):
        # the threshold also tightens after every single problem: soundness may not depend on the chunk size
        for chunk in (1, evaluation.PRUNE_CHUNK):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(evaluation, "PRUNE_CHUNK", chunk)
                pruned = search_plans(model, cluster, profiles=profiles, sort=sort, keep=keep, workers=1,
                                      use_all=True).plans
            assert pruned == full[:keep]
        # places: every plan of the first `keep` ranking values as printed, so the table is the full search's
        placed = search_plans(model, cluster, profiles=profiles, sort=sort, places=keep, workers=1, use_all=True).plans
        assert not full or format_table(placed, keep) == format_table(full, keep)
        printed = sorted({round(getattr(plan, SORT_KEYS[sort]), PRINTED_DECIMALS[SORT_KEYS[sort]]) for plan in full})
        assert placed == [plan for plan in full
                          if round(getattr(plan, SORT_KEYS[sort]), PRINTED_DECIMALS[SORT_KEYS[sort]]) in printed[:keep]]


def test_a_cut_of_places_keeps_every_plan_that_prints_as_one_of_its_values():
    """Three values as printed, 1.0000, 1.0001 and 2.0000: the ties, the values that round to the same figure, are
    kept together, and the threshold is the last value that prints as the last place."""
    ranked = [1.0, 1.0, 1.00004, 1.00012, 1.00014, 2.0, 3.0]
    cut = evaluation.Cut(2, 4)
    assert cut.kept(ranked, lambda value: (value,)) == [1.0, 1.0, 1.00004, 1.00012, 1.00014]
    assert cut.places(ranked, lambda value: (value,)) == 4
    assert cut.threshold([np.array(ranked)]) == pytest.approx(1.00015)
    assert evaluation.Cut(5, 4).threshold([np.array(ranked[:3])]) == np.inf  # fewer values than places
    # the leading elements of a value rank first: a flagged plan is a place of its own
    flagged = [(False, 1.0), (False, 1.00001), (True, 1.0), (True, 5.0)]
    assert cut.kept(flagged, lambda value: value) == flagged[:3]
    assert evaluation.Cut(2).kept(ranked, lambda value: (value,)) == [1.0, 1.0]  # without decimals: plans


@pytest.mark.parametrize("arguments, named", [({"keep": 0}, "keep=0"), ({"places": -1}, "places=-1"),
                                               ({"keep": 2.5}, "keep=2.5"), ({"places": True}, "places=True"),
                                               ({"keep": 2, "places": 2}, "places"), ({"sort": "speed"}, "sort=speed")])
def test_bad_cuts_and_sorts_are_refused_before_any_search(arguments, named):
    model, profiles = model_of("decoder", 4, 8), {"g0": profile_of("g0", 1.0)}
    with pytest.raises(ArgumentError, match=named):
        search_plans(model, cluster_of([("g0", 2, 16.0, 1.0)], 2), profiles=profiles, **arguments)


def test_divisors_of_large_numbers():
    assert divisors(1) == [1]
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(10**10) == sorted(d for d in {2**a * 5**b for a in range(11) for b in range(11)})
    prime = 2**31 - 1  # a Mersenne prime: no divisor below its square root
    assert divisors(prime) == [1, prime]
    for n in range(1, 200):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_huge_global_batch_is_refused_with_its_limit():
    model, profiles = model_of("decoder", 4, 8), {"g0": profile_of("g0", 1.0)}
    cluster = cluster_of([("g0", 2, 16.0, 1.0)], 2)
    with pytest.raises(InputError, match=f"{MAX_GLOBAL_BATCH:,}"):
        search_plans(model, cluster, MAX_GLOBAL_BATCH + 1, profiles=profiles)


def test_large_global_batch_is_answered():
    """10^10 samples: 121 divisors, a handful of micro-batch sizes that fit, one plan per size that fits."""
    model, profiles = model_of("decoder", 4, 8), {"g0": profile_of("g0", 1.0)}
    cluster = cluster_of([("g0", 2, 16.0, 1.0)], 2)
    plans = search_plans(model, cluster, 10**10, profiles=profiles).plans
    assert plans and all(p.num_microbatches * p.dp * p.mbs == 10**10 for p in plans)


def test_many_nodes_of_one_type_have_one_placement():
    """Nodes of one type can be ordered one way only; enumerating them must not recurse once per node."""
    cluster = cluster_of([("g0", 5000, 16.0, 1.0)], 1)
    assert placements(cluster, 1, 100) == ([("n0",) * 5000], True)


def test_many_node_types_give_a_bounded_placement_subset():
    """Twelve types of hundreds of nodes: 12! type orders and every rotation would not fit in memory."""
    types = [(GPUS[i % 3], 400 + i, 16.0, 1.0) for i in range(12)]
    nodes, exhaustive = placements(cluster_of(types, 1), 2, 100)
    total = sum(count for _, count, _, _ in types)
    assert not exhaustive and len(nodes) > 0 and len(nodes) * total <= SUBSET_NODES
    assert all(sorted(p) == sorted(f"n{i}" for i, (_, count, _, _) in enumerate(types) for _ in range(count))
               for p in nodes)


def test_sweeping_many_node_types_is_refused_with_its_limit():
    """Twelve types of 100 nodes: 101^12 - 1 compositions; --max-nodes brings the sweep within the limit."""
    cluster = cluster_of([(GPUS[i % 3], 100, 16.0, 1.0) for i in range(12)], 1)
    with pytest.raises(InputError, match=f"compositions to sweep, more than the limit of {MAX_COMPOSITIONS:,}"):
        compositions(cluster)
    caps = dict.fromkeys(cluster.node_types, 1)
    assert len(compositions(cluster, caps)) == 2**12 - 1
