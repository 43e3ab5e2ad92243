"""The runs published outside NVIDIA (validation/independent-measurements.csv, scripts/validate_published.py): the
data against the publications' figures by hand, each row a valid plan with its published pipeline split, the
settings reaching the estimate, the report's targets, and refused rows in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fasop.errors import InputError
from fasop.search.spec import plan_spec


@pytest.fixture(scope="module")
def vp(validate_published):
    return validate_published


@pytest.fixture(scope="module")
def runs(vp):
    return {run.row: run for run in vp.read_parallel_runs(vp.INDEPENDENT_MEASUREMENTS, gathered=False)}


SOURCES = {"MegaScale (Jiang et al. 2024, ByteDance)": 8, "MT-NLG 530B (Smith et al. 2022, Microsoft and NVIDIA)": 3,
           "Zero Bubble Pipeline Parallelism (Qi et al. 2024, Sea AI Lab)": 12,
           "BigScience BLOOM (Megatron-DeepSpeed, Jean Zay)": 23, "FlagPerf (BAAI)": 12}


def test_the_set_holds_five_sources_and_says_where_each_run_comes_from(runs):
    by_source: dict[str, int] = {}
    for run in runs.values():
        by_source[run.source] = by_source.get(run.source, 0) + 1
        assert run.config_source and run.assumptions and run.raw_line is None, run.row
    assert by_source == SOURCES and len(runs) == 58


def test_published_figures_become_step_times_by_hand(runs):
    """A step time as published; samples per GPU per second: 24 micro-batches of 6 over 8 GPUs at 11.8 is 1.5254 s;
    tokens per GPU per second: 512 sequences of 8192 over 8 GPUs at 3698.7 is 141.75 s."""
    assert runs["176B, 384 GPUs, tp 4, pp 12, mbs 2 (production)"].measured_step_time_s == 104.70
    assert runs["1.5B, 8 GPUs, 24 micro-batches"].measured_step_time_s == pytest.approx(144 / (11.8 * 8))
    assert runs["8B, 8 A800, PP2DP4TP1 (the main table)"].measured_step_time_s == pytest.approx(
        512 * 8192 / (3698.7 * 8))
    assert runs["1.5B, 8 GPUs, 24 micro-batches"].measured_step_time_s == pytest.approx(1.5254, abs=1e-4)


def test_every_run_is_a_valid_plan_with_its_published_split(vp, runs):
    """tp cp dp pp fill the run's GPUs; a published split holds every layer, and BigScience's
    'type:transformer|embedding' partition gives the two embedding slots their own places: 72 slots of the 70-layer
    BLOOM over 12 stages are 6 each, the first and last stage one embedding and 5 layers."""
    for run in runs.values():
        model = vp.parallel_run_model(run)
        cluster, fields = vp.parallel_plan(run, model, vp.load_cluster(str(vp.DATA / run.cluster_file)))
        spec = plan_spec(model, cluster, **fields)
        assert spec.tp * spec.cp * spec.dp * spec.pp == run.gpus == cluster.num_gpus, run.row
        assert sum(spec.layers_per_stage) == model.num_layers, run.row
        if run.source.startswith("BigScience"):
            slots = [n + (i in (0, run.pp - 1)) for i, n in enumerate(spec.layers_per_stage)]
            assert len(set(slots)) == 1, run.row  # every stage the same number of slots
    assert runs["176B, 384 GPUs, tp 4, pp 12, mbs 2 (production)"].layers_per_stage == (5,) + (6,) * 10 + (5,)
    assert runs["28.3B, 32 GPUs, 96 micro-batches"].layers_per_stage == (1,) + (2,) * 30 + (1,)


def test_a_bloom_run_reaches_the_estimate_with_its_settings(vp, runs, monkeypatch):
    run = runs["176B, 288 GPUs, tp 2, pp 36, mbs 1"]
    model = vp.parallel_run_model(run)
    cluster = vp.load_cluster(str(vp.DATA / run.cluster_file))
    plan = vp.predict_parallel(run, model, cluster)
    assert (plan.tp, plan.dp, plan.pp, plan.mbs, plan.gbs) == (2, 4, 36, 1, 2048) and plan.fits_memory
    seen = {}
    monkeypatch.setattr(vp, "estimate", lambda *args, **kwargs: seen.update(kwargs))
    vp.predict_parallel(run, model, cluster)
    expected = {"recompute": "full", "sequence_parallel": False, "distributed_optimizer": True,
                "overlap_grad_reduce": False, "layers_per_stage": [1] + [2] * 34 + [1], "virtual_stages": 1}
    assert {key: seen[key] for key in expected} == expected


def test_the_report_holds_each_source_and_the_targets(vp, runs):
    results = vp.validate_parallel([runs["1.5B, 8 GPUs, 24 micro-batches"], runs["6.2B, 8 GPUs, 24 micro-batches"],
                                    runs["176B, 384 GPUs, tp 4, pp 12, mbs 2 (production)"]])
    text = vp.independent_report(results, results[:1])
    assert "### Zero Bubble Pipeline Parallelism (Qi et al. 2024, Sea AI Lab)" in text
    assert "| all runs published outside NVIDIA | 3 |" in text
    assert "Published outside NVIDIA (2 sources): 3 runs" in text
    assert "every run beyond the two papers): 4 runs" in text
    worst = max(abs(r.error) for r in results)
    assert f"worst {worst:.1%} (target <= 30%: {'met' if worst <= 0.30 else 'not met'})" in text


def test_the_independent_runs_widen_the_error_band(vp, runs):
    """Each run's ratio is in the band, under its source and table: the slowest run against its estimate is one of
    them (the 104-head 178B model, 1 / (1 - 0.360))."""
    results = vp.validate_parallel([runs["178B, 104 heads, tp 4, pp 12, mbs 2"]])
    band = vp.band_text(results, "2026-11-27")
    assert 'run = "BigScience BLOOM (Megatron-DeepSpeed, Jean Zay), Benchmarks before training' in band
    assert f"high = {round(results[0].measured_s / results[0].predicted_s, 4)!r}" in band
    assert results[0].measured_s / results[0].predicted_s == pytest.approx(1 / (1 + results[0].error))


def test_refused_rows_leave_one_line(vp, tmp_path):
    header, first = vp.INDEPENDENT_MEASUREMENTS.read_text().splitlines()[:2]
    path = tmp_path / "runs.csv"
    path.write_text(f"{header}\n{first.replace(',step_time_s,40.0,', ',samples_per_step,40.0,')}\n")
    with pytest.raises(InputError, match="line 2: published_metric"):
        vp.read_parallel_runs(path, gathered=False)
    with pytest.raises(InputError, match="expected the columns .*raw_line"):  # a gathered file names its raw line
        vp.read_parallel_runs(vp.INDEPENDENT_MEASUREMENTS)


def test_a_run_without_a_published_split_splits_evenly_or_is_refused(vp, runs):
    """stage_layers: the published split as given; without one Megatron-LM's even split (62 layers over 2 stages),
    and layers that do not divide over the stages (62 over 4) in one line naming the model file."""
    run = runs["28.3B, 32 GPUs, 96 micro-batches"]
    model = vp.parallel_run_model(run)
    assert vp.stage_layers(run, model) == [1] + [2] * 30 + [1]
    assert vp.stage_layers(replace(run, layers_per_stage=(), pp=2), model) == [31, 31]
    with pytest.raises(InputError, match="zb-gpt-28.3b.toml: 62 layers do not split evenly over 4 stages"):
        vp.stage_layers(replace(run, layers_per_stage=(), pp=4), model)
