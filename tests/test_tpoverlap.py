"""Tensor-parallel communication overlap (--tp-comm-overlap, fasop.cost.tpoverlap): the hidden time of a chunked
collective by hand and against an event-by-event pipeline, where plans may run it, that it never slows a plan the
search gives it, and the emitted flag as megatron-core reads it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli_search import invoke, ok
from test_emit import LLAMA_TOML, SMOKE, flag_values, launchable, megatron_args, write_cluster

from fasop.cost.config import Config
from fasop.cost.roofline import Rates, unit_times, unit_work
from fasop.cost.tpoverlap import bundled_figures, hidden_s, overlap_error, overlap_pays, pass_hidden_s
from fasop.errors import ArgumentError
from fasop.inputs.catalogue import merged_specs
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.write import render_plan
from fasop.search import estimate, search_plans
from fasop.search.space import prepare

durations = st.floats(min_value=1e-3, max_value=1e3)


def ring_exchange_events(comm_s: float, gemm_s: float, tp: int) -> float:
    """The ring-exchange all-gather run chunk by chunk: the local chunk's GEMM at once, chunk k's after its
    transfer (one after another, C / (tp - 1) each) and after chunk k - 1's GEMM."""
    arrived = gemm_done = 0.0
    for k in range(tp):
        if k:
            arrived += comm_s / (tp - 1)
        gemm_done = max(gemm_done, arrived) + gemm_s / tp
    return gemm_done


def pipeline_events(comm_s: float, gemm_s: float, chunks: int) -> float:
    """The pipelined reduce-scatter chunk by chunk: each GEMM chunk, then its collective after the previous one's."""
    gemm_done = comm_done = 0.0
    for _ in range(chunks):
        gemm_done += gemm_s / chunks
        comm_done = max(comm_done, gemm_done) + comm_s / chunks
    return comm_done


def test_hidden_time_by_hand():
    # ring of 4: exposed max(8, 2 + 8 / 4) = 8, so the whole all-gather (2) is hidden
    assert hidden_s(2.0, 8.0, ring=True, chunks=4) == pytest.approx(2.0)
    # ring of 2 with a long collective: exposed 10 + 4 / 2 = 12 of 14, hiding min(10, 4 (1 - 1/2)) = 2
    assert hidden_s(10.0, 4.0, ring=True, chunks=2) == pytest.approx(2.0)
    # pipeline of 4: exposed 8 + 2 / 4 = 8.5 of 10
    assert hidden_s(2.0, 8.0, ring=False, chunks=4) == pytest.approx(1.5)
    # the GEMM on fewer SMs, 1.25 times slower: exposed 10 + 0.5 = 10.5, slower than no overlap
    assert hidden_s(2.0, 8.0, ring=False, chunks=4, gemm_slowdown=1.25) == pytest.approx(-0.5)


@settings(max_examples=200, deadline=None)
@given(durations, durations, st.integers(2, 8), st.integers(2, 16))
def test_closed_forms_are_the_chunked_pipelines(comm_s, gemm_s, tp, chunks):
    ring = hidden_s(comm_s, gemm_s, ring=True, chunks=tp)
    assert ring == pytest.approx(comm_s + gemm_s - ring_exchange_events(comm_s, gemm_s, tp), rel=1e-9, abs=1e-9)
    assert -1e-9 <= ring <= min(comm_s, gemm_s) + 1e-9  # a ring exchange never slows, never hides more than both
    pipelined = hidden_s(comm_s, gemm_s, ring=False, chunks=chunks)
    assert pipelined == pytest.approx(comm_s + gemm_s - pipeline_events(comm_s, gemm_s, chunks), rel=1e-9, abs=1e-9)
    assert pipelined >= -1e-9


def test_figures_are_transformer_engines_defaults():
    figures = bundled_figures()
    assert (figures.pipeline_splits, figures.pipeline_sm_margin) == (4, 16)
    assert set(figures.gpus) <= set(merged_specs())  # names of the GPU table


def test_layer_hides_part_of_its_collectives():
    """On the H100's roofline the overlap hides some of each pass, never more than the collectives themselves."""
    model = load_model("llama2-7b")
    rates = Rates.of(merged_specs()["H100"], model)
    for tp in (2, 8):
        work = unit_work(model, tp, 1)[model.layer_kinds[0]]
        forward, backward = pass_hidden_s(work, tp, rates, bundled_figures())
        comm_s = (tp - 1) / tp * work.collectives[0] / rates.collective_bytes_per_s(work.collectives[0])
        assert 0 < forward <= 4 * comm_s and 0 < backward <= 2 * comm_s
        assert forward < unit_times(work, tp, rates)[0]


def test_not_offered_where_megatron_or_the_userbuffers_cannot_run_it():
    gpt2 = load_model("gpt2-xl")
    assert overlap_error(gpt2, 2, True, ("H100",)) is None
    assert "tp > 1" in overlap_error(gpt2, 1, False, ("H100",))
    assert "sequence parallelism" in overlap_error(gpt2, 2, False, ("H100",))
    assert "A10G" in overlap_error(gpt2, 2, True, ("A10G", "H100"))  # no NVLink domain
    assert "encoder-decoder" in overlap_error(load_model("t5"), 2, True, ("H100",))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """tiny-llama on 2 H100 and 2 A10G nodes of 2 GPUs (every profile synthesised)."""
    folder = tmp_path_factory.mktemp("mixed")
    (folder / "tiny-llama.toml").write_text(LLAMA_TOML)
    return folder, load_model(str(folder / "tiny-llama.toml")), load_cluster(str(write_cluster(folder)))


def test_search_turns_it_on_only_where_allowed(mixed):
    _, model, cluster = mixed
    plans = search_plans(model, cluster).plans
    for plan in plans:
        gpus = {cluster.node_types[name].gpu for name in plan.placement}
        assert bool(plan.tp_comm_overlap) == (plan.tp > 1 and bool(plan.sequence_parallel) and gpus == {"H100"}), plan
    assert any(plan.tp_comm_overlap for plan in plans)
    assert not any(plan.tp_comm_overlap for plan in search_plans(model, cluster, tp_comm_overlap=False).plans)
    assert not any(plan.tp_comm_overlap for plan in search_plans(model, cluster, sequence_parallel=False).plans)


@settings(max_examples=15, deadline=None)
@given(tp=st.sampled_from([2]), mbs=st.sampled_from([1, 2, 4, 8]), recompute=st.sampled_from(["none", "full"]),
       layers=st.integers(1, 7))
def test_never_slower_where_the_search_turns_it_on(mixed, tp, mbs, recompute, layers):
    _, model, cluster = mixed
    inputs = prepare(model, cluster.with_counts({"big": 2}))
    shape = dict(tp=tp, dp=1, pp=2, mbs=mbs, placement=["big", "big"], layers_per_stage=[layers, 8 - layers],
                 recompute=recompute)
    assert overlap_pays(model, inputs.profiles, tp, (mbs,))
    off = estimate(model, cluster, **shape)
    on = estimate(model, cluster, **shape, tp_comm_overlap=True)
    assert on.tp_comm_overlap and not off.tp_comm_overlap
    assert on.step_time_s < off.step_time_s
    assert all(a.compute_s < b.compute_s for a, b in zip(on.stages or [], off.stages or []))
    assert on.stages[0].memory_gib == off.stages[0].memory_gib  # userbuffers' memory is not charged


def test_estimate_refuses_it_where_not_allowed(mixed):
    _, model, cluster = mixed
    shape = dict(dp=2, pp=2, mbs=1, layers_per_stage=[4, 4], tp_comm_overlap=True)
    with pytest.raises(ArgumentError, match="tp_comm_overlap.*A10G"):
        estimate(model, cluster, tp=2, dp=1, pp=2, mbs=1, placement=["small", "small"], layers_per_stage=[4, 4],
                 tp_comm_overlap=True)
    with pytest.raises(ArgumentError, match="tp_comm_overlap.*tp > 1"):
        estimate(model, cluster, tp=1, placement=["big", "big"], **shape)
    with pytest.raises(ArgumentError, match="tp_comm_overlap.*sequence parallelism"):
        estimate(model, cluster, tp=2, placement=["big", "big"], sequence_parallel=False,
                 **{**shape, "dp": 1})


def test_estimate_option_and_help(mixed):
    folder, _, _ = mixed
    runner = CliRunner()
    base = ["estimate", "--model", folder / "tiny-llama.toml", "--cluster", folder / "mixed.toml", "--tp", "2",
            "--dp", "1", "--pp", "2", "--mbs", "1", "--placement", "big,big", "--layers", "4,4", "--json"]
    off, on = (invoke(runner, base + flag) for flag in ([], ["--tp-comm-overlap"]))
    ok(off), ok(on)
    off_plan, on_plan = json.loads(off.stdout), json.loads(on.stdout)
    assert ("tp_comm_overlap" not in off_plan, on_plan["tp_comm_overlap"]) == (True, True)
    assert on_plan["step_time_s"] < off_plan["step_time_s"]
    refused = invoke(runner, [*base[:-4], "small,small", "--layers", "4,4", "--tp-comm-overlap"])
    assert refused.exit_code == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines()[-1].startswith("Error: --tp-comm-overlap: not modelled on A10G")
    help_text = invoke(runner, ["estimate", "--help"]).output
    assert "--tp-comm-overlap / --no-tp-comm-overlap" in help_text


def test_search_option_and_help(mixed):
    folder, _, _ = mixed
    runner = CliRunner()
    out = folder / "plans.json"
    ok(invoke(runner, ["search", "--model", folder / "tiny-llama.toml", "--cluster", folder / "mixed.toml",
                       "--no-tp-comm-overlap", "--output", out, "--force"]))
    assert not any("tp_comm_overlap" in plan for plan in json.loads(out.read_text()))
    assert "--no-tp-comm-overlap" in invoke(runner, ["search", "--help"]).output


def test_emitted_flag_and_megatron_core_reads_it(tmp_path):
    model = load_model("gpt2-xl")
    cluster = load_cluster(str(write_cluster(tmp_path)))
    plan = launchable(tp=2, dp=1, pp=2, placement=["big", "big"], layers_per_stage=[24, 24], gbs=64, mbs=1,
                      tp_comm_overlap=True)
    args = flag_values(megatron_args(render_plan(plan, model, cluster, SMOKE)["run_inter.sh"]))
    assert args["--tp-comm-overlap"] == [] and args["--sequence-parallel"] == []
    plain = launchable(tp=2, dp=1, pp=2, placement=["big", "big"], layers_per_stage=[24, 24], gbs=64, mbs=1)
    assert "--tp-comm-overlap" not in flag_values(megatron_args(render_plan(plain, model, cluster, SMOKE)["run_inter.sh"]))
    assert Config(2, 1, 2, 1, 64, 0, True, tp_comm_overlap=True).tp_comm_overlap
    config_module = pytest.importorskip("megatron.core.transformer.transformer_config",
                                        reason="megatron-core is not importable")
    # Megatron-LM's --tp-comm-overlap becomes the field of the same name of megatron-core's config
    assert "tp_comm_overlap" in {f.name for f in dataclasses.fields(config_module.TransformerConfig)}
