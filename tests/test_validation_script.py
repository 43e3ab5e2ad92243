"""scripts/validate_published.py: Narayanan's FLOP conversion, one run's prediction against a hand computation,
the wiring of Megatron-LM options, refused inputs, the generated blocks of docs/validation.md, and the MoE and
context-parallel runs of validation/moe-cp-measurements.csv: their data against the gathered rows, their plans,
and their estimates."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fasop.cost.roofline import Rates, attention_core_share, module_time_share, unit_work
from fasop.errors import InputError
from fasop.inputs.catalogue import load_gpu_spec
from fasop.profile.synth import synthesize
from fasop.search.spec import plan_spec

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "validation.md"
GATHERED = ROOT / "validation" / "moe-cp-runs.csv"  # the MoE and context-parallel runs as published


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
    core = module_time_share(unit_work(model, 8, 4)["layer"], 8, Rates.of(spec, model))
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


def _block(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) + len(begin):text.index(end)].strip("\n")


def test_doc_tables_are_the_scripts_output_and_rewriting_is_deterministic(vp, tmp_path, capsys):
    copy = tmp_path / "validation.md"
    copy.write_text(DOC.read_text())
    assert vp.main(["--write", str(copy)]) == 0
    first = copy.read_text()
    assert first == DOC.read_text(), "docs/validation.md is stale: python scripts/validate_published.py --write " \
                                     "docs/validation.md"
    printed = capsys.readouterr().out  # what the script prints is what it writes: the three generated blocks
    papers, moe_cp = _block(first, vp.BEGIN, vp.END), _block(first, vp.MOE_CP_BEGIN, vp.MOE_CP_END)
    independent = _block(first, vp.INDEPENDENT_BEGIN, vp.INDEPENDENT_END)
    assert papers.count("Mean absolute error") == 3  # one summary per table
    assert papers in printed and moe_cp in printed and independent in printed
    assert "All 62 runs from 4 sources" in moe_cp
    assert "Published outside NVIDIA (5 sources): 58 runs" in independent
    assert "every run beyond the two papers): 156 runs" in independent  # 36 dgxc-benchmarking + 62 + 58
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
    assert [(s.sm_count, bool(s.allreduce_busbw), bool(s.attention_tflops), shaped) for _, s, shaped in steps] == [
        (None, False, False, False), (None, False, False, True), (None, True, False, True), (108, True, False, True),
        (108, True, False, True), (108, True, False, True)]  # the A100 has no attention table nor sustained figures:
    assert steps[-1][1] == load_gpu_spec("A100-80GB")  # the last two steps change nothing there
    h100 = vp.model_steps(load_gpu_spec("H100"))
    assert not h100[-3][1].attention_tflops and h100[-1][1] == load_gpu_spec("H100")
    assert h100[-2][1].sustained_matmul_efficiency is None and h100[-2][1].attention_tflops
    assert h100[-1][1].sustained_matmul_efficiency is not None
    # each step only slows the estimate of a selective run with tensor parallelism (the scores' softmax and
    # dropout rerun too, NCCL below nominal, waves part-empty)
    run = runs["175B, selective recomputation + sequence parallelism"]
    model, cluster = vp.load_model(str(vp.DATA / run.model_file)), vp.load_cluster(str(vp.CLUSTER))
    times = [vp.predict(run, model, cluster, spec, shaped).step_time_s for _, spec, shaped in steps]
    assert times[0] < times[1] < times[2] < times[3] == times[4] == times[5]


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


# -- the MoE and context-parallel runs --------------------------------------------------------------------
@pytest.fixture(scope="module")
def parallel_runs(vp):
    return {run.row: run for run in vp.read_parallel_runs()}


def test_the_moe_cp_runs_parse_and_match_the_gathered_rows(vp, parallel_runs):
    """Every row is one of validation/moe-cp-runs.csv's, with its published plan and figure: the same GPUs, degrees,
    batch and sequence, and the step time the gathered file derived (to its two decimals)."""
    runs = list(parallel_runs.values())
    assert len(runs) == 62 and len({run.source for run in runs}) == 4
    assert sum(run.ep > 1 for run in runs) == 27 and sum(run.cp > 1 for run in runs) == 42
    gathered = dict(enumerate(csv.DictReader(GATHERED.read_text().splitlines()), start=2))
    assert len({run.raw_line for run in runs}) == len(runs)
    for run in runs:
        cells = gathered[run.raw_line]
        assert (run.gpus, run.tp, run.pp, run.cp, run.ep, run.mbs, run.gbs, run.seq_length) == tuple(
            int(cells[key]) for key in ("gpus", "tp", "pp", "cp", "ep", "mbs", "gbs", "seq_length")), run.row
        assert run.virtual_stages == int(cells["vp"] or 1), run.row
        assert run.precision == cells["precision"] and run.published_value == float(cells["measured_value"]), run.row
        assert abs(run.measured_step_time_s - float(cells["step_time_s"])) <= 0.005 + 1e-9, run.row
        assert cells["gpu"] in run.cluster_file.upper(), run.row  # H100 rows on dgx-h100, B200 rows on dgx-b200
        assert run.config_source, run.row
    # the two ways a step time is published: in seconds, and through tokens per second per GPU
    assert parallel_runs["Grok-1 314B, fp8, 512 GPUs"].measured_step_time_s == 16.9
    assert parallel_runs["Llama 3.1 405B, fp8, 1024 GPUs, 25.09"].measured_step_time_s == pytest.approx(
        512 * 8192 / (302 * 1024))


def test_every_moe_cp_run_is_a_valid_plan(vp, parallel_runs):
    """Every row's plan is one Megatron-LM runs and fasop accepts (plan_spec, no estimate): tp cp dp pp GPUs, experts
    divisible by ep, etp ep dividing tp cp dp, the layers split over the stages, the sequence over 2 cp."""
    for run in parallel_runs.values():
        model = vp.parallel_run_model(run)
        cluster, fields = vp.parallel_plan(run, model, vp.load_cluster(str(vp.DATA / run.cluster_file)))
        spec = plan_spec(model, cluster, **fields)
        assert spec.tp * spec.cp * spec.dp * spec.pp == run.gpus == cluster.num_gpus, run.row
        assert model.seq_length == run.seq_length and model.seq_length % (2 * run.cp) == 0, run.row
        assert (run.ep > 1) == model.is_moe, run.row  # every MoE row runs expert parallelism, no dense row does
        if model.is_moe:
            assert model.num_experts % spec.ep == 0 and (spec.tp * spec.cp * spec.dp) % (spec.etp * spec.ep) == 0
        assert sum(spec.layers_per_stage) == model.num_layers, run.row
        assert spec.sequence_parallel == (run.tp > 1), run.row


@pytest.mark.parametrize("row", ["Qwen3-235B-A22B, fp8, 256 GPUs, 26.04", "Llama 3.1 8B, bf16, 8 GPUs"])
def test_one_moe_and_one_cp_run_estimate_with_their_settings(vp, parallel_runs, row, monkeypatch):
    run = parallel_runs[row]
    model = vp.parallel_run_model(run)
    cluster = vp.load_cluster(str(vp.DATA / run.cluster_file))
    plan = vp.predict_parallel(run, model, cluster)
    assert plan.step_time_s is not None and plan.step_time_s > 0 and plan.fits_memory
    assert (plan.tp, plan.dp, plan.pp, plan.mbs, plan.gbs) == (run.tp, run.dp, run.pp, run.mbs, run.gbs)
    assert (plan.cp or 1, plan.ep or 1) == (run.cp, run.ep)
    seen = {}
    monkeypatch.setattr(vp, "estimate", lambda *args, **kwargs: seen.update(kwargs))
    vp.predict_parallel(run, model, cluster)
    expected = {"cp": run.cp, "ep": run.ep, "etp": run.etp, "virtual_stages": run.virtual_stages,
                "recompute": run.recompute, "sequence_parallel": run.tp > 1, "distributed_optimizer": True,
                "overlap_grad_reduce": True}
    assert {key: seen[key] for key in expected} == expected
    if run.ep > 1:  # Megatron-Bridge's split with the embedding and the loss counted as layers
        assert seen["layers_per_stage"] == [11, 12, 12, 12, 12, 12, 12, 11] and model.fp8
    else:
        assert seen["layers_per_stage"] == [32] and model.seq_length == 8192 and not model.fp8


def test_the_moe_cp_runs_stay_out_of_the_error_band(vp):
    band = vp.band_text(vp.validate(vp.read_runs()), "2026-11-27")
    assert band.count("[[runs]]") == len(vp.read_runs())
    assert "Megatron-Bridge" not in band and "Grok" not in band


def test_refused_moe_cp_rows_leave_one_line(vp, tmp_path):
    header, first = vp.MOE_CP_MEASUREMENTS.read_text().splitlines()[:2]
    assert ",tokens_per_s_per_gpu,302," in first and ",fp8,tensorwise,true," in first
    for broken, field in [(first.replace(",fp8,tensorwise,true,", ",fp8,,true,"), "precision"),
                          (first.replace(",fp8,tensorwise,true,", ",bf16,tensorwise,,"), "precision"),
                          (first.replace(",tokens_per_s_per_gpu,", ",tflops_per_gpu,"), "published_metric"),
                          (first.replace(",15 16 16 16 16 16 16 15,", ",15 16 16 16 16 16 31,"), "layers_per_stage"),
                          (first.replace(",15 16 16 16 16 16 16 15,", ",15 x,"), "layers_per_stage"),
                          (first.replace(",1024,8,8,2,1,,8,", ",1000,8,8,2,1,,8,"), "tp x cp x pp")]:
        assert broken != first
        path = tmp_path / "runs.csv"
        path.write_text(f"{header}\n{broken}\n")
        with pytest.raises(InputError, match=f"line 2.*{field}"):
            vp.read_parallel_runs(path)
