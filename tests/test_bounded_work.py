"""Work and memory bounded by the answer, not by the numbers of the input: the uneven batch split of 10**8
samples, data-parallel plans on a million nodes, the training runtime of such plans, and timelines of schedules
too large to see."""

import itertools
import json
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from fasop import estimate, load_cluster, load_model, runtime
from fasop.cli import main
from fasop.cost.communication import geometry
from fasop.cost.schedule import op_times
from fasop.errors import InputError
from fasop.inputs.profiles import load_profiles
from fasop.search import batchsplit, search_plans
from fasop.search import dataparallel as dpl
from fasop.search.compare import compare
from fasop.search.placement import type_order
from fasop.search.space import MAX_PLAN_GPUS
from fasop.timeline import MAX_OPERATIONS, plot_timeline


def _peak_mib(call):
    """What `call()` returns, and the most memory it held at once (MiB)."""
    tracemalloc.start()
    try:
        return call(), tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def bert():
    model, cluster = load_model("bert"), load_cluster("fasop-1xA100-3xA10")
    return model, cluster, load_profiles(model, ["A100", "A10"])


def test_split_of_1e8_samples_is_the_closed_form():
    """Micro-batches of b samples taking b c seconds (c a power of two) make a GPU's time c s exactly. 4 GPUs at
    0.25 s a sample and 12 at 1 s balance at B / 28 samples on each slow GPU, the fast ones taking the rest:
    the better of the two integers around it, a tie going to the later group, with kilobytes, not a table of
    the batch (which ran out of memory)."""
    batch = 10**8
    units = [np.arange(5) * 0.25, np.arange(5) * 1.0]
    got, peak = _peak_mib(lambda: batchsplit.best_split(units, [4, 12], batch))
    makespan, _, split = min((max(0.25 * ((batch - 12 * slow) // 4), float(slow)), -slow, [(batch - 12 * slow) // 4, slow])
                             for slow in (batch // 28, batch // 28 + 1))
    assert got == (makespan, split) == (3571429.0, [14285713, 3571429])
    assert peak < 1


def test_plan_row_of_1e8_samples_is_the_best_split_near_the_balance(bert):
    """The split of a real profile at 10**8 samples: no split within 300 samples per A100 of it ends sooner (nor
    as soon with more samples on the later group), in a few MiB."""
    model, cluster, profiles = bert
    batch = 10**8
    row, peak = _peak_mib(lambda: dpl.plan_row(model, cluster, profiles, "ddp", batch, overlap=False))
    assert peak < 16
    a10, a100 = row.per_type  # 12 and 4 GPUs, in the order of the split
    assert (a10.gpus, a100.gpus) == (12, 4) and 12 * a10.samples_per_gpu + 4 * a100.samples_per_gpu == batch
    units = [group.unit_s for group in dpl.groups(model, cluster, profiles, "ddp", batch)]
    nearby = []
    for s in range(a100.samples_per_gpu - 300, a100.samples_per_gpu + 301):
        if (batch - 4 * s) % 12 == 0:
            times = [batchsplit.step_times(u, np.array([n]))[0][0] for u, n in zip(units, [(batch - 4 * s) // 12, s])]
            nearby.append((max(times), -s))
    assert min(nearby) == (max(a10.compute_s, a100.compute_s), -a100.samples_per_gpu)


def test_split_refuses_in_one_line_beyond_its_step_limit(monkeypatch, bert):
    """GPU counts sharing no divisor leave the split to try sums one by one: it stops at its documented limit
    with the reason (the table of the batch never finished), which the plan row gives as why there is no plan."""
    monkeypatch.setattr(batchsplit, "SPLIT_STEPS", 1000)
    units = [np.arange(2) * c for c in (1.0, 1.1, 1.3)]
    with pytest.raises(batchsplit.SplitStepLimit, match=r"^the exact batch split over 999999, 999998, 7 GPUs needs "
                                                        r"more than 1000 steps \(its limit\)$"):
        batchsplit.best_split(units, [999999, 999998, 7], 10**8)
    monkeypatch.setattr(batchsplit, "SPLIT_STEPS", 0)
    with pytest.raises(dpl.NoPlan, match=r"^the exact batch split over 12, 4 GPUs needs more than 0 steps"):
        dpl.plan_row(*bert, "ddp", 64)


def _clusters():
    base = load_cluster("fasop-1xA100-3xA10")
    a100, a10 = base.node_types["A100"], base.node_types["A10"]
    slow = replace(base, derating=replace(base.derating, collective_intra_node=1.5, collective_inter_node=2.5),
                   node_types={"A100": replace(a100, inter_node_latency_s=3e-5), "A10": replace(a10, intra_node_latency_s=2e-5)})
    one_gpu = {n: replace(t, gpus_per_node=1) for n, t in base.node_types.items()}
    yield from (load_cluster(name) for name in ("fasop-1xA100-7xA10", "fasop-8xA10", "h100-a100-a10g"))
    yield from (base, slow, base.with_counts({"A10": 1}), replace(base, node_types=one_gpu),
                replace(base, node_types=one_gpu).with_counts({"A100": 1}))


@pytest.mark.parametrize("cluster", list(_clusters()), ids=lambda c: f"{c.name}-{c.num_nodes}x{c.gpus_per_node}")
def test_cluster_all_reduce_is_the_placements_taken_per_node_type(cluster):
    placement = tuple(name for name in type_order(cluster) for _ in range(cluster.node_types[name].count))
    geo = geometry(cluster, placement, 1, cluster.num_gpus, 1)
    assert dpl.allreduce_cost(cluster) == (float(geo.dp_allreduce_s_per_byte[0]), float(geo.dp_allreduce_latency_s[0]))


def test_a_million_nodes_cost_memory_by_node_type_not_by_node(bert):
    """A data-parallel plan on a million nodes holds its placement (one name per node) and little more: the
    cluster-wide all-reduce is costed per node type (the per-node geometry took hundreds of MiB)."""
    model, cluster, profiles = bert
    huge = cluster.with_counts({"A100": 500_000, "A10": 500_000})
    row, peak = _peak_mib(lambda: dpl.plan_row(model, huge, profiles, "zero1", 2 * huge.num_gpus))
    assert len(row.placement) == 10**6 and {t.samples_per_gpu for t in row.per_type} <= {1, 2, 3}
    assert peak < 40


def test_compare_on_a_million_nodes_answers_data_parallel_and_names_the_plan_limit(bert):
    """compare on a million nodes: the data-parallel strategies answer in little memory, and the pipeline and 3D
    strategies, whose rank geometry grows with the GPUs, say which limit they stop at (they took gigabytes)."""
    model, cluster, profiles = bert
    huge = cluster.with_counts({"A100": 500_000, "A10": 500_000})
    families, peak = _peak_mib(lambda: compare(model, huge, profiles, 2 * huge.num_gpus))
    assert [f.plan is not None for f in families[:4]] == [True] * 4
    assert all(f.plan is None and f"at most {MAX_PLAN_GPUS:,}" in f.reason for f in families[-2:])
    assert peak < 100


def test_a_search_beyond_the_plan_limit_is_one_line(bert):
    model, cluster, profiles = bert
    per_node = cluster.gpus_per_node
    with pytest.raises(InputError, match=f"at most {MAX_PLAN_GPUS:,}"):
        search_plans(model, cluster.with_counts({"A100": MAX_PLAN_GPUS // per_node, "A10": 1}), profiles=profiles)


def test_runtime_gives_each_rank_its_share_of_the_split(bert):
    """Rank r's samples are its node type's share of the split and follow those of ranks 0 .. r-1; a rank
    taking millions of samples a step holds no list of them."""
    model, cluster, profiles = bert
    plan = dpl.plan_row(model, cluster, profiles, "ddp", 10**8)
    runtime.check_plan(plan, "plan")
    by_type = {t.node_type: t for t in plan.per_type}
    ranks = range(runtime.world_size(plan))
    shares = [by_type[plan.placement[r // plan.gpus_per_node]] for r in ranks]
    assert runtime.rank_batches(plan) == [t.samples_per_gpu for t in shares]
    assert [runtime.rank_offset(plan, r) for r in ranks] == list(itertools.accumulate(runtime.rank_batches(plan),
                                                                                      initial=0))[:-1]
    assert sum(runtime.micro_batches(plan, 15)) == shares[15].samples_per_gpu
    pytest.importorskip("torch")
    sampler, peak = _peak_mib(lambda: runtime.UnevenBatchSampler(plan, 15, 10**8, seed=0))
    assert len(sampler) == len(runtime.micro_batches(plan, 15)) and peak < 1


def test_timeline_refuses_a_schedule_too_large_to_see_before_computing_it(tmp_path):
    """256 model chunks per stage (drawn for over two minutes before): one line naming the limit, no chart."""
    plan = estimate(load_model("gpt2-xl"), load_cluster("fasop-8xA10"), tp=1, dp=4, pp=8, mbs=1, placement=["A10"] * 8,
                    layers_per_stage=[6] * 8, virtual_stages=2)
    record = {**plan.record(), "rank": 1, "virtual_stages": 256}
    del record["layers_per_virtual_stage"]  # a file's own layout would disagree with the 256 chunks
    for stage in record["stages"]:
        stage["chunks"] = stage["chunks"][:1] * 256
    path, out = tmp_path / "plans.json", tmp_path / "timeline.png"
    path.write_text(json.dumps([record]))
    result = CliRunner().invoke(main, ["plot", "--plan", str(path), "--timeline", str(out)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "8 stages x 256 model chunks x 16 micro-batches make 65536 forwards and backwards; a timeline draws at " \
           f"most {MAX_OPERATIONS}" in result.output
    assert not out.exists()


def test_timeline_refuses_to_draw_more_than_its_limit(tmp_path):
    m = MAX_OPERATIONS // 4 + 1  # two stages: just past the limit
    times = op_times(np.ones((1, 2)), np.ones((1, 2)), np.zeros((1, 1)), m)
    with pytest.raises(InputError, match=f"^times: 2 stages x 1 model chunks x {m} micro-batches make "
                                         f"{4 * m} forwards and backwards; a timeline draws at most {MAX_OPERATIONS}$"):
        plot_timeline(times, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
