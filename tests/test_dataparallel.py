"""Data-parallel plans: the exact batch split, ZeRO memory against the paper, traffic, and `fasop compare`."""

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from fasop.cli import main
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.inputs.profiles import load_profiles
from fasop.plans import load_plans
from fasop.search import dataparallel as dpl
from fasop.search.batchsplit import best_split, step_times


def _brute_force(units, counts, batch):
    """The old way: every split, each group's time looked up in a table of step_times up to batch // count;
    the least makespan and, among its splits, the one whose later groups take the most samples."""
    times = [step_times(u, np.arange(batch // n + 1))[0] for u, n in zip(units, counts)]
    best = None
    for split in itertools.product(*(range(1, batch // n + 1) for n in counts)):
        if sum(n * s for n, s in zip(counts, split)) == batch:
            key = (max(t[s] for t, s in zip(times, split)), [-s for s in reversed(split)])
            best = key if best is None or key < best else best
    return None if best is None else (float(best[0]), [-s for s in reversed(best[1])])


units = st.lists(st.floats(0.01, 40.0), min_size=1, max_size=8).map(lambda v: np.array([0.0, *v]))
cases = st.integers(1, 3).flatmap(lambda k: st.tuples(
    st.lists(st.integers(1, 4), min_size=k, max_size=k), st.lists(units, min_size=k, max_size=k), st.integers(1, 40)))


@settings(max_examples=300, deadline=None)
@given(cases)
def test_best_split_is_the_brute_force_optimum(case):
    """Any micro-batch times, even ones where more samples take less time: the same makespan and split as
    trying every split."""
    counts, group_units, batch = case
    assert best_split(group_units, counts, batch) == _brute_force(group_units, counts, batch)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.01, 5.0), min_size=1, max_size=8), st.integers(0, 30))
def test_step_times_are_the_best_micro_batch_and_grow_with_the_samples(increments, samples):
    unit_s = np.concatenate([[0.0], np.cumsum(increments)])  # increasing in the micro-batch size
    time_s, size = step_times(unit_s, np.arange(samples + 1))
    for s in range(1, samples + 1):
        by_size = [(s // b) * unit_s[b] + unit_s[s % b] for b in range(1, len(unit_s))]
        assert time_s[s] == pytest.approx(min(by_size))
        assert by_size[size[s] - 1] == pytest.approx(min(by_size))
    assert np.all(np.diff(time_s) >= -1e-12)


@pytest.fixture(scope="module")
def setting():
    model, cluster = load_model("bert"), load_cluster("fasop-1xA100-3xA10")
    return model, cluster, load_profiles(model, ["A100", "A10"])


@pytest.mark.parametrize("kind", dpl.KINDS)
@pytest.mark.parametrize("gbs", [16, 32, 48, 64, 128, 256, 512])
def test_uneven_split_never_slower_than_even(setting, kind, gbs):
    model, cluster, profiles = setting
    uneven = dpl.plan_row(model, cluster, profiles, kind, gbs)
    even = dpl.plan_row(model, cluster, profiles, kind, gbs, even=True)
    assert uneven.step_time_s <= even.step_time_s * (1 + 1e-12)
    assert sum(t.gpus * t.samples_per_gpu for t in uneven.per_type) == gbs
    assert {t.samples_per_gpu for t in even.per_type} == {gbs // 16}


def test_uneven_split_gives_the_faster_gpus_more(setting):
    model, cluster, profiles = setting
    row = dpl.plan_row(model, cluster, profiles, "ddp", 256)
    samples = {t.gpu: t.samples_per_gpu for t in row.per_type}
    assert samples["A100"] > samples["A10"]
    assert row.step_time_s < dpl.plan_row(model, cluster, profiles, "ddp", 256, even=True).step_time_s


def test_zero_memory_matches_the_paper():
    # ZeRO (Rajbhandari et al. 2020), figure 1: 7.5B parameters, 64 GPUs, K = 12
    model = SimpleNamespace(total_params=lambda: 7.5e9, precision_bytes=2, precision="fp16", main_params_dtype="fp32",
                            exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32", use_precision_aware_optimizer=False)
    gb = {kind: dpl.state_bytes(model, kind, 64) / 1e9 for kind in dpl.KINDS}
    assert gb["ddp"] == pytest.approx(120)
    assert gb["zero1"] == pytest.approx(31.4, abs=0.05)
    assert gb["zero2"] == pytest.approx(16.6, abs=0.05)
    assert gb["zero3"] == pytest.approx(1.9, abs=0.05)


@pytest.mark.parametrize("kind,bytes_per_param", [("ddp", lambda n: 16), ("zero1", lambda n: 4 + 12 / n),
                                                  ("zero2", lambda n: 2 + 14 / n), ("zero3", lambda n: 16 / n)])
def test_plan_memory_is_state_plus_activations(setting, kind, bytes_per_param):
    model, cluster, profiles = setting
    row = dpl.plan_row(model, cluster, profiles, kind, 256)
    psi, n = model.total_params(), cluster.num_gpus
    for item in row.per_type:
        expected = (psi * bytes_per_param(n) + dpl.gather_buffer_bytes(model, kind)
                    + dpl.activation_bytes_per_sample(model) * item.micro_batch_size) / 2**30
        assert item.memory_gib == pytest.approx(expected, rel=1e-12)
        assert item.memory_gib * cluster.memory_margin <= item.memory_capacity_gib


def test_traffic_zero3_is_one_and_a_half_ddp(setting):
    model, cluster, profiles = setting
    comm = {kind: dpl.plan_row(model, cluster, profiles, kind, 256).dp_allreduce_s for kind in dpl.KINDS}
    assert comm["zero1"] == pytest.approx(comm["ddp"]) and comm["zero2"] == pytest.approx(comm["ddp"])
    assert comm["zero3"] == pytest.approx(1.5 * comm["ddp"])
    # hierarchical: 2 (4-1)/4 over 230 GB/s inside the A100 node is faster than 2 (4-1)/4 / 16 GB/s, and the
    # 4 nodes' 40 Gbit/s interfaces add 2 (4-1)/4 / 5e9; one all-reduce's latency on top
    per_byte = 1.5 / 16e9 + 1.5 / 5e9
    assert dpl.allreduce_cost(cluster)[0] == pytest.approx(per_byte)
    latency = dpl.allreduce_cost(cluster)[1]
    assert latency > 0
    assert comm["ddp"] == pytest.approx(per_byte * 2 * model.total_params() + latency)


def test_reasons_when_there_is_no_plan(setting):
    model, cluster, profiles = setting
    with pytest.raises(dpl.NoPlan, match="global batch 8 < 16 GPUs"):
        dpl.plan_row(model, cluster, profiles, "ddp", 8)
    with pytest.raises(dpl.NoPlan, match="not divisible by 16 GPUs"):
        dpl.plan_row(model, cluster, profiles, "ddp", 20, even=True)
    with pytest.raises(dpl.NoPlan, match="not a sum of per-type batches"):
        dpl.plan_row(model, cluster, profiles, "ddp", 18)  # 4 and 12 GPUs: sums are multiples of 4
    gpt = load_model("gpt2-xl")
    with pytest.raises(dpl.NoPlan, match="out of memory on A10"):
        dpl.plan_row(gpt, cluster, load_profiles(gpt, ["A100", "A10"]), "ddp", 64)


COMPARISONS = [(m, c) for m in ("gpt2-xl", "bert")
               for c in ("fasop-4xA10", "fasop-8xA10", "fasop-1xA100-3xA10", "fasop-1xA100-7xA10")]


@pytest.mark.parametrize("model,cluster", COMPARISONS + [("gpt2-xl", "h100-a100-a10g")])
def test_compare_runs_on_the_bundled_clusters(model, cluster):
    result = CliRunner().invoke(main, ["compare", "--model", model, "--cluster", cluster])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 + 7
    assert lines[-1].startswith("3D (best)") and "no plan" not in lines[-1]


def test_compare_bert_on_three_types_with_synthesised_profiles(tmp_path):
    runner = CliRunner()
    for gpu in ("H100", "A10G"):
        result = runner.invoke(main, ["profile", "synth", "--model", "bert", "--gpu", gpu, "--tp", "1,2,4,8",
                                      "--out", str(tmp_path / f"{gpu}.csv")])
        assert result.exit_code == 0, result.output
    (tmp_path / "A100.csv").write_text(Path(load_profiles(load_model("bert"), ["A100"])["A100"].file).read_text())
    result = runner.invoke(main, ["compare", "--model", "bert", "--cluster", "h100-a100-a10g", "--gbs", "4096",
                                  "--profiles", str(tmp_path)])
    assert result.exit_code == 0, result.output
    ddp = next(line for line in result.output.splitlines() if line.startswith("DDP uneven"))
    assert "H100:" in ddp and "no plan" not in ddp


def test_compare_writes_table_plans_and_chart(tmp_path):
    out = [tmp_path / "c.csv", tmp_path / "plans.json", tmp_path / "c.png"]
    result = CliRunner().invoke(main, ["compare", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-7xA10",
                                       "--output", str(out[0]), "--plans-out", str(out[1]), "--chart", str(out[2])])
    assert result.exit_code == 0, result.output
    table = out[0].read_text().splitlines()
    assert len(table) == 8 and table[1].startswith("DDP even,,,") and "out of memory on A10" in table[1]
    plans = load_plans(out[1])
    assert [p.rank for p in plans] == [1, 2, 3, 4]  # the best 3D plan is also the best with tp = 1
    assert plans[0].family == "pipeline (tp=1); 3D (best)"
    assert {p.kind for p in plans} == {"3d", "zero1", "zero2", "zero3"}
    assert [p.step_time_s for p in plans] == sorted(p.step_time_s for p in plans)
    assert out[2].read_bytes()[:4] == b"\x89PNG"


def test_compare_no_overlap_reaches_every_plan(tmp_path):
    rows = {}
    for flag in ("--overlap", "--no-overlap"):
        out = tmp_path / f"{flag}.json"
        result = CliRunner().invoke(main, ["compare", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", flag,
                                           "--plans-out", str(out)])
        assert result.exit_code == 0, result.output
        rows[flag] = {p.family: p for p in load_plans(out)}
    assert set(rows["--overlap"]) == set(rows["--no-overlap"])
    for family, plan in rows["--no-overlap"].items():
        assert plan.overlap_grad_reduce is False
        assert plan.step_time_s >= rows["--overlap"][family].step_time_s * (1 - 1e-12)
        if plan.kind != "3d":
            assert plan.step_time_s == pytest.approx(plan.compute_s + plan.dp_allreduce_s + plan.optimizer_s)


def test_compare_refuses_bad_outputs_before_writing(tmp_path):
    result = CliRunner().invoke(main, ["compare", "--model", "bert", "--cluster", "fasop-4xA10",
                                       "--output", str(tmp_path / "c.csv"), "--plans-out", str(tmp_path / "p.csv")])
    assert result.exit_code == 2 and "--plans-out" in result.output and "ending in .json" in result.output
    assert not list(tmp_path.iterdir())


def test_emit_launches_a_data_parallel_plan_and_refuses_a_stale_one(tmp_path):
    from fasop import runtime

    runner = CliRunner()
    plans_file = tmp_path / "plans.json"
    result = runner.invoke(main, ["compare", "--model", "bert", "--cluster", "fasop-1xA100-3xA10", "--plans-out",
                                  str(plans_file)])
    assert result.exit_code == 0, result.output
    plans = json.loads(plans_file.read_text())
    rank = next(p["rank"] for p in plans if p["kind"] == "ddp" and p["batch_split"] == "uneven")
    result = runner.invoke(main, ["emit", "--plans", str(plans_file), "--rank", str(rank), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    run_inter = (tmp_path / "run" / "run_inter.sh").read_text()
    assert 'torchrun "${DISTRIBUTED_ARGS[@]}" "$ENTRY_SCRIPT" \\\n    --plan "$RUN_DIR/plan.json"' in run_inter
    sbatch = (tmp_path / "run" / "sbatch.sh").read_text()
    assert "#SBATCH hetjob" in sbatch and "--gres=gpu:a100:4" in sbatch
    plan = runtime.load_plan(tmp_path / "run" / "plan.json")
    assert sum(runtime.rank_batches(plan)) == 256 and len(runtime.rank_batches(plan)) == 16
    stale = [dict(p) for p in plans]
    item = next(p for p in stale if p["rank"] == rank)
    item["step_time_s"] *= 0.5
    plans_file.write_text(json.dumps(stale))
    result = runner.invoke(main, ["emit", "--plans", str(plans_file), "--rank", str(rank), "--out", str(tmp_path / "r2")])
    assert result.exit_code == 2 and "stale plan: step_time_s" in result.output
    assert not (tmp_path / "r2").exists()


def test_plan_files_refuse_an_unknown_kind(tmp_path):
    from fasop.errors import InputError

    plan = {"rank": 1, "gbs": 8, "mbs": 1, "tp": 1, "dp": 8, "pp": 1, "placement": ["A10"], "layers_per_stage": [2]}
    path = tmp_path / "plans.json"
    path.write_text(json.dumps([{**plan, "kind": "fsdp"}]))
    with pytest.raises(InputError, match="kind: expected one of '3d', 'stage-groups', 'ddp', 'zero1', 'zero2' or "
                                         "'zero3', got 'fsdp'"):
        load_plans(path)
    path.write_text(json.dumps([plan]))  # plans written before kinds existed are 3D plans
    assert load_plans(path)[0].gbs == 8


@pytest.mark.parametrize("gbs", [0, 2**53 + 1])
def test_compare_refuses_a_bad_batch(gbs):
    result = CliRunner().invoke(main, ["compare", "--model", "bert", "--cluster", "fasop-4xA10", "--gbs", str(gbs)])
    assert result.exit_code == 2 and result.output.startswith("Error: --gbs: expected a global batch size from 1 to ")
    assert len(result.output.strip().splitlines()) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 5.0)), min_size=1, max_size=4),
       st.floats(0.0, 8.0), st.integers(1, 12))
def test_reduction_end_is_the_bucket_chain(types, reduce_s, buckets):
    """Bucket k is ready when every type has computed it (its last backward produces gradients evenly) and is
    reduced after bucket k - 1: the chain, walked bucket by bucket."""
    computed = np.array([c + b for c, b in types])  # each type's backward ends after it starts
    backward = np.array([b for _, b in types])
    end = 0.0
    for k in range(1, buckets + 1):
        ready = max(c - b + k * b / buckets for c, b in zip(computed, backward))
        end = max(end, ready) + reduce_s / buckets
    assert dpl.reduction_end_s(computed, backward, reduce_s, buckets) == pytest.approx(end, rel=1e-12, abs=1e-12)
    # never before the last bucket after the slowest type, nor after the whole reduction after it
    assert computed.max() + reduce_s / buckets - 1e-12 <= end <= computed.max() + reduce_s + 1e-12


@pytest.mark.parametrize("kind", dpl.KINDS)
def test_step_is_compute_then_traffic_then_the_optimizer_step(setting, kind):
    """Without overlap: the slowest GPU's compute, all of the traffic, then the optimizer step of the slowest
    memory (the A10's 600 GB/s): 34 bytes per parameter of the whole model (ddp) or of a 1/16 shard."""
    model, cluster, profiles = setting
    row = dpl.plan_row(model, cluster, profiles, kind, 256, overlap=False)
    shard = 1 if kind == "ddp" else 16
    assert row.optimizer_s == pytest.approx(model.total_params() / shard * 34 / 600e9, rel=1e-12)
    assert row.step_time_s == pytest.approx(row.compute_s + row.dp_allreduce_s + row.optimizer_s, rel=1e-12)
    assert row.dp_exposed_s == pytest.approx(row.dp_allreduce_s, rel=1e-12) and row.overlap_grad_reduce is False


@pytest.mark.parametrize("kind", dpl.KINDS)
def test_overlap_hides_part_of_the_reduction_and_never_more(setting, kind):
    """With overlap the step is never slower than without it, nor faster than with free gradient reduction;
    at least one bucket of the reduction and all the parameter all-gathers stay exposed."""
    model, cluster, profiles = setting
    plain = dpl.plan_row(model, cluster, profiles, kind, 256, overlap=False)
    row = dpl.plan_row(model, cluster, profiles, kind, 256)
    reduce = row.dp_allreduce_s * dpl.reduce_share(kind)
    buckets = -(-model.total_params() * 2 // dpl.BUCKET_BYTES)
    assert row.overlap_grad_reduce is True and buckets > 1
    assert row.step_time_s <= plain.step_time_s * (1 + 1e-12)
    free = row.compute_s + row.dp_allreduce_s - reduce + row.optimizer_s
    assert free + reduce / buckets <= row.step_time_s * (1 + 1e-12)
    assert row.step_time_s < plain.step_time_s  # bert's backward is long enough to hide some of it
