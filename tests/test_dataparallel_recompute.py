"""Activation recomputation of data-parallel plans (DDP, ZeRO, FSDP): memory and time by hand, the same as the
3D cost model's one stage at tp = pp = 1, the choice against evaluating each mode, and `fasop compare` saying
which one each strategy's best plan uses."""

import contextlib
import csv
import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import cluster_toml, model_toml, profile_csv
from hypothesis import given, settings
from hypothesis import strategies as st

import fasop
from fasop.cli import main
from fasop.errors import ArgumentError
from fasop.inputs.profiles import load_profiles
from fasop.launch.dataparallel import restate_dp_plan
from fasop.plans import load_plans
from fasop.search import dataparallel as dpl
from fasop.search.compare import compare, records, table

GIB = 2.0**30
# The tiny model (tests/conftest.py): 4 layers, s = 32, h = 64, a = 4, fp16, dropout, unfused attention, a
# vocabulary of 1000 padded to 1024. Per sample, in bytes: a layer keeps 34 s h + 5 a s^2 (Korthikanti et al.
# 2022, Table 2), its input 2 s h; the embedding its dropout mask, s h; the head its two inputs, 4 s h, and the
# fp32 logits, 4 s 1024.
S, H, A, LAYERS = 32, 64, 4, 4
WHOLE_LAYER, LAYER_INPUT = 34 * S * H + 5 * A * S * S, 2 * S * H
ENDS = S * H + 4 * S * H + 4 * S * 1024
# The tiny profiles at mbs 1 on the slow GPU (the fast one takes half): embedding 2 + 4 ms, layer 10 + 20 ms,
# head 4 + 8 ms; other sizes scale with the samples (no GPU spec to give the roofline's shape).
FORWARD_S = 0.002 + 4 * 0.010 + 0.004
STEP_S = 0.006 + 4 * 0.030 + 0.012


@pytest.fixture
def setup(tiny):
    def make(name="tiny", **kwargs):
        files = tiny(name, **kwargs)
        model, cluster = fasop.load_model(str(files.model)), fasop.load_cluster(str(files.cluster))
        return model, cluster, load_profiles(model, ["fast", "slow"], str(files.profiles)), files
    return make


def test_activations_per_sample_by_hand(setup):
    model, *_ = setup()
    assert dpl.activation_bytes_per_sample(model, "none") == ENDS + LAYERS * WHOLE_LAYER
    # full: every layer keeps its input; the one rebuilt in the backward holds all of its own besides
    assert dpl.activation_bytes_per_sample(model, "full") == ENDS + LAYERS * LAYER_INPUT + WHOLE_LAYER - LAYER_INPUT


@pytest.mark.parametrize("node_type, speed", [("slow", 1.0), ("fast", 0.5)])
def test_step_times_by_hand(setup, node_type, speed):
    """Full recomputation reruns every layer's forward (10 ms each at one sample) inside the backward pass."""
    model, cluster, profiles, _ = setup()
    sizes = (1, 2, 3)
    b = np.array(sizes)
    none_s, none_backward_s = dpl.whole_model_s(model, cluster, profiles, node_type, sizes, "none")
    full_s, full_backward_s = dpl.whole_model_s(model, cluster, profiles, node_type, sizes, "full")
    assert none_s == pytest.approx(speed * STEP_S * b, rel=1e-12)
    assert none_backward_s == pytest.approx(speed * (STEP_S - FORWARD_S) * b, rel=1e-12)
    assert full_s == pytest.approx(speed * (STEP_S + LAYERS * 0.010) * b, rel=1e-12)
    assert full_backward_s == pytest.approx(speed * (STEP_S - FORWARD_S + LAYERS * 0.010) * b, rel=1e-12)


@pytest.mark.parametrize("mbs", [1, 3])
def test_the_same_as_the_3d_model_at_tp_1_pp_1(setup, mbs):
    """The 3D cost model's plan of one stage at tp = 1 on the slow GPUs: its compute is the data-parallel
    group's at that micro-batch size, and what full recomputation takes off its memory is the same."""
    model, cluster, profiles, files = setup()
    model = replace(model, precision="bf16")  # no fp32 gradient copy at the optimizer step: the passes set the peak
    stages = {mode: fasop.estimate(model, cluster, tp=1, dp=2, pp=1, mbs=mbs, gbs=2 * mbs, placement=["slow"],
                                   layers_per_stage=[LAYERS], recompute=mode, profiles_dir=str(files.profiles)).stages[0]
              for mode in dpl.RECOMPUTE}
    for mode in dpl.RECOMPUTE:
        step_s, _ = dpl.whole_model_s(model, cluster, profiles, "slow", (mbs,), mode)
        assert stages[mode].compute_s == pytest.approx(step_s[0], rel=1e-12)
    saved = (dpl.activation_bytes_per_sample(model, "none") - dpl.activation_bytes_per_sample(model, "full")) * mbs
    assert (stages["none"].memory_gib - stages["full"].memory_gib) * GIB == pytest.approx(saved, rel=1e-9)
    assert saved == (LAYERS - 1) * (WHOLE_LAYER - LAYER_INPUT) * mbs


def _capacity_between(model, cluster, kind, low_bytes, high_bytes):
    """GPU memory (GiB) with room for the model state and one sample's activations `low_bytes` but not `high_bytes`."""
    state = dpl.state_bytes(model, kind, cluster.num_gpus) + dpl.gather_buffer_bytes(model, kind)
    return (state + (low_bytes + high_bytes) / 2) * cluster.memory_margin / GIB


def test_recomputation_gives_a_plan_where_none_fits(setup):
    model, cluster, *_ = setup()
    none, full = (dpl.activation_bytes_per_sample(model, mode) for mode in dpl.RECOMPUTE)
    memory = _capacity_between(model, cluster, "zero3", full, none)
    model, cluster, profiles, _ = setup("small", nodes={t: {"gpu_memory_gib": memory} for t in ("fast", "slow")})
    with pytest.raises(dpl.NoPlan, match=r"out of memory on .*for one sample$"):
        dpl.plan_row(model, cluster, profiles, "zero3", 8)
    row = dpl.best_plan_row(model, cluster, profiles, "zero3", 8)
    assert row.recompute == "full" and {t.micro_batch_size for t in row.per_type} == {1}
    with pytest.raises(dpl.NoPlan, match="for one sample with full recomputation"):
        dpl.best_plan_row(model, cluster, profiles, "ddp", 8)  # ddp's whole optimizer state does not fit


def test_no_recomputation_when_memory_allows(setup):
    """Recomputing only adds forwards: with room for every micro-batch size, the plan recomputes nothing."""
    model, cluster, profiles, _ = setup()
    row = dpl.best_plan_row(model, cluster, profiles, "ddp", 8)
    assert row.recompute == "none"
    assert row.record() == dpl.plan_row(model, cluster, profiles, "ddp", 8).record()


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    (root / "model.toml").write_text(model_toml())
    (root / "cluster.toml").write_text(cluster_toml())
    for gpu in ("fast", "slow"):
        (root / f"{gpu}.csv").write_text(profile_csv(gpu, (1,)))
    model, cluster = fasop.load_model(str(root / "model.toml")), fasop.load_cluster(str(root / "cluster.toml"))
    return model, cluster, load_profiles(model, ["fast", "slow"], str(root))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(dpl.KINDS), batch=st.integers(4, 40), even=st.booleans(), room=st.floats(0.0, 3.0),
       overlap=st.booleans())
def test_the_choice_is_the_best_of_each_mode(tiny_inputs, kind, batch, even, room, overlap):
    """Brute force: best_plan_row is the fastest of plan_row in each mode (the first of equals), and has no
    plan only where no mode has one; GPU memory from one sample's activations under full recomputation to a
    few micro-batches without."""
    model, cluster, profiles = tiny_inputs
    full = dpl.activation_bytes_per_sample(model, "full")
    memory = _capacity_between(model, cluster, kind, full, full + 2 * room * dpl.activation_bytes_per_sample(model))
    cluster = replace(cluster, node_types={name: replace(t, gpu_memory_gib=memory)
                                           for name, t in cluster.node_types.items()})
    rows = []
    for mode in dpl.RECOMPUTE:
        with contextlib.suppress(dpl.NoPlan):
            rows.append(dpl.plan_row(model, cluster, profiles, kind, batch, even, overlap=overlap, recompute=mode))
    if not rows:
        with pytest.raises(dpl.NoPlan):
            dpl.best_plan_row(model, cluster, profiles, kind, batch, even, overlap)
        return
    best = dpl.best_plan_row(model, cluster, profiles, kind, batch, even, overlap)
    assert best.record() == min(rows, key=lambda row: row.step_time_s).record()
    assert best.step_time_s == min(row.step_time_s for row in rows)


def test_a_data_parallel_plan_takes_none_or_full(setup):
    model, cluster, profiles, _ = setup()
    with pytest.raises(ArgumentError, match=r"^recompute=selective: data-parallel plans take none or full"):
        dpl.plan_row(model, cluster, profiles, "ddp", 8, recompute="selective")


def test_emit_restates_a_recomputing_plan(setup):
    """A plan with full recomputation is estimated afresh as one (not stale), and without it differs."""
    model, cluster, *_ = setup()
    none, full = (dpl.activation_bytes_per_sample(model, mode) for mode in dpl.RECOMPUTE)
    memory = _capacity_between(model, cluster, "zero3", full, 3 * full)
    model, cluster, profiles, files = setup("small", nodes={t: {"gpu_memory_gib": memory} for t in ("fast", "slow")})
    plan = dpl.best_plan_row(model, cluster, profiles, "zero3", 8)
    assert plan.recompute == "full"
    same, warning = restate_dp_plan(plan, model, cluster, str(files.profiles))
    assert warning is None and same.record() == plan.record()
    plain = plan.model_copy(update={"recompute": "none"})
    with pytest.raises(fasop.InputError, match="stale plan|cannot be estimated afresh"):
        restate_dp_plan(plain, model, cluster, str(files.profiles))


def test_compare_names_the_recomputation_of_each_strategy(setup, tmp_path):
    model, cluster, *_ = setup()
    none, full = (dpl.activation_bytes_per_sample(model, mode) for mode in dpl.RECOMPUTE)
    memory = _capacity_between(model, cluster, "zero3", full, none)
    model, cluster, profiles, files = setup("small", nodes={t: {"gpu_memory_gib": memory} for t in ("fast", "slow")})
    families = compare(model, cluster, profiles)
    rows = {row["family"]: row for row in records(families)}
    assert rows["ZeRO-3 uneven"]["recompute"] == "full"
    assert rows["DDP uneven"]["recompute"] == "" and "with full recomputation" in rows["DDP uneven"]["no_plan_reason"]
    plans = {f.name: f.plan for f in families if f.plan is not None}
    assert all(rows[name]["recompute"] == (plan.recompute or "none") for name, plan in plans.items())
    lines = table(families).splitlines()
    assert lines[0].split()[-2:] == ["recompute", "plan"]
    zero3 = next(line for line in lines if line.startswith("ZeRO-3 uneven"))
    assert " full  " in zero3
    args = ["compare", *files.args("--output", str(tmp_path / "c.csv"), "--plans-out", str(tmp_path / "p.json"))]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    written = {row["family"]: row for row in csv.DictReader((tmp_path / "c.csv").open())}
    assert written["ZeRO-3 uneven"]["recompute"] == "full"
    assert {p.family: p.recompute for p in load_plans(tmp_path / "p.json")}["ZeRO-3 uneven"] == "full"
    assert json.loads((tmp_path / "p.json").read_text())


def test_compare_help_mentions_recomputation():
    result = CliRunner().invoke(main, ["compare", "--help"])
    assert result.exit_code == 0 and "checkpointed" in result.output
