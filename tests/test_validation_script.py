"""scripts/validate_published.py: Narayanan's FLOP conversion, one run's prediction against a hand computation,
the wiring of Megatron-LM options, refused inputs, and the generated block of docs/validation.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from fasop.cost.roofline import Rates, attention_core_share, attention_core_time_share, unit_work
from fasop.errors import InputError
from fasop.inputs.catalogue import load_gpu_spec
from fasop.profile.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "validation.md"


@pytest.fixture(scope="module")
def vp(validate_published):
    return validate_published


@pytest.fixture(scope="module")
def runs(vp):
    return {run.row: run for run in vp.read_runs()}


def test_narayanan_step_time_from_tflops_by_hand(vp, runs):
    """1.7B row: 96 x 512 x 2048 x 24 x 2304^2 = 12,824,703,626,379,264; times (1 + 2048 / 13824 + 51200 /
    884736) = 1 + 0.148148... + 0.057870... gives F = 1.54668e16 FLOPs; over 32 GPUs x 137 TFLOP/s: 3.5280 s."""
    run = runs["1.7B"]
    model = vp.load_model(str(vp.DATA / run.model_file))
    assert (run.gpus, run.gbs, run.measured_tflops_per_gpu) == (32, 512, 137)
    assert vp.narayanan_flops_per_step(model, run.gbs) == pytest.approx(12_824_703_626_379_264 * (1 + 2048 / 13824
                                                                                                  + 51200 / 884736))
    assert vp.measured_step_time_s(run, model) == pytest.approx(3.528018, rel=1e-6)
    korthikanti = runs["22B, full recomputation"]
    assert vp.measured_step_time_s(korthikanti, model) == 1.42  # measured directly, no conversion


@pytest.mark.parametrize("row", ["22B, full recomputation", "22B, selective recomputation + sequence parallelism"])
def test_one_run_against_a_hand_sum(vp, runs, row):
    """22B on one node (tp 8, pp 1, dp 1, one micro-batch of 4): the step is the embedding, 48 layers and the
    head, forward and backward, and each layer's recomputed forward: all of it under full recomputation, the
    attention core's share of its time under selective recomputation."""
    run = runs[row]
    model = vp.load_model(str(vp.DATA / run.model_file))
    spec = load_gpu_spec("A100-80GB")
    units = {r.kind: r for r in synthesize(model, spec, tps=[8], mbss=[4])}
    core = attention_core_time_share(unit_work(model, 8, 4)["layer"], 8, Rates.of(spec, model))
    assert 2.5 * attention_core_share(model, "layer") < core < 0.2  # the s x s softmax and dropout traffic
    share = 1.0 if run.recompute == "full" else core
    layer = units["layer"].forward_s * (1 + share) + units["layer"].backward_s
    by_hand = sum(units[k].forward_s + units[k].backward_s for k in ("embedding", "head")) + 48 * layer
    # then Adam's pass over the rank's parameters: 34 bytes each (docs/cost-model.md), at 2,039 GB/s
    params = (model.embedding_params(8) + 48 * model.layer_params("layer") / 8
              + model.head_params(8, shares_stage_with_embedding=True))
    plan = vp.predict(run, model, vp.load_cluster(str(vp.CLUSTER)))
    assert (plan.tp, plan.dp, plan.pp, plan.mbs, plan.layers_per_stage) == (8, 1, 1, 4, [48])
    assert plan.optimizer_s == pytest.approx(params * 34 / 2039e9, rel=1e-9)
    assert plan.step_time_s == pytest.approx(by_hand + plan.optimizer_s, rel=1e-9)


def test_the_runs_settings_reach_the_estimate(vp, runs, monkeypatch):
    seen = {}
    monkeypatch.setattr(vp, "estimate", lambda *args, **kwargs: seen.update(kwargs))
    run = runs["175B, selective recomputation + sequence parallelism"]
    vp.predict(run, vp.load_model(str(vp.DATA / run.model_file)), vp.load_cluster(str(vp.CLUSTER)))
    assert {key: seen[key] for key in ("recompute", "sequence_parallel", "virtual_stages", "overlap_grad_reduce",
                                       "distributed_optimizer", "layers_per_stage")} == {
        "recompute": "selective", "sequence_parallel": True, "virtual_stages": 3, "overlap_grad_reduce": False,
        "distributed_optimizer": False, "layers_per_stage": [12] * 8}


def test_doc_tables_are_the_scripts_output_and_rewriting_is_deterministic(vp, tmp_path, capsys):
    copy = tmp_path / "validation.md"
    copy.write_text(DOC.read_text())
    assert vp.main(["--write", str(copy)]) == 0
    first = copy.read_text()
    assert first == DOC.read_text(), "docs/validation.md is stale: python scripts/validate_published.py --write " \
                                     "docs/validation.md"
    printed = capsys.readouterr().out  # what the script prints is what it writes, one summary per table
    assert printed.count("Mean absolute error") == 3 and printed in first
    assert vp.main(["--write", str(copy)]) == 0
    assert copy.read_text() == first


def test_every_published_run_on_80_gb_gpus_fits_fasops_memory(vp, runs):
    """The papers' runs all ran on 80 GB A100s: a memory model that drops one of them over-counts."""
    papers = [run for run in runs.values() if run.cluster_file == "clusters/selene.toml"]
    assert len(papers) == 18
    results = vp.validate(papers)
    assert all(r.fits_memory for r in results), [r.run.row for r in results if not r.fits_memory]
    assert max(r.peak_memory_gib for r in results) < 80 * 1e9 / 2**30


def test_the_modelling_steps_add_one_thing_each_and_end_at_todays_synth(vp, runs):
    steps = vp.model_steps(load_gpu_spec("A100-80GB"))
    assert [(s.sm_count, bool(s.allreduce_busbw), shaped) for _, s, shaped in steps] == [
        (None, False, False), (None, False, True), (None, True, True), (108, True, True)]
    assert steps[-1][1] == load_gpu_spec("A100-80GB")
    # each step only slows the estimate of a selective run with tensor parallelism (the scores' softmax and
    # dropout rerun too, NCCL below nominal, waves part-empty)
    run = runs["175B, selective recomputation + sequence parallelism"]
    model, cluster = vp.load_model(str(vp.DATA / run.model_file)), vp.load_cluster(str(vp.CLUSTER))
    times = [vp.predict(run, model, cluster, spec, shaped).step_time_s for _, spec, shaped in steps]
    assert times[0] < times[1] < times[2] < times[3]


def test_refused_inputs_leave_one_line_and_no_change(vp, runs, tmp_path, capsys):
    doc = tmp_path / "no-markers.md"
    doc.write_text("# a page without the generated block\n")
    assert vp.main(["--write", str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected the markers" in err
    assert doc.read_text() == "# a page without the generated block\n"

    header, first = vp.MEASUREMENTS.read_text().splitlines()[:2]
    for broken, field in [(first.replace(",full,false,", ",partial,false,"), "recompute"),
                          (first.replace(",1.42,,", ",1.42,137,"), "exactly one of"),
                          (first.replace(",8,8,1,4,4,", ",8,8,1,4,0,"), "gbs"),
                          (first.replace(",8,8,1,4,4,", ",8,3,1,4,4,"), "tp x pp")]:
        csv = tmp_path / "runs.csv"
        csv.write_text(f"{header}\n{broken}\n")
        with pytest.raises(InputError, match=f"line 2.*{field}"):
            vp.read_runs(csv)
