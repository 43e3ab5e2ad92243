"""scripts/kshot_study.py and the calibration of runs of several models on one cluster: each pool (Selene's, Jean
Zay's) is estimated as docs/validation.md estimates it, its draws file holds what the script computes (a few draws
recomputed, the others' selection and uncalibrated error checked), the doc's k-shot tables are made from them, and a
fit spanning models recovers known factors."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fasop.calibration.calibrate import HOST_PROBE, LOSS_SCALE, Calibration, Factor
from fasop.calibration.validate import mape_pct
from fasop.errors import ArgumentError

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "validation.md"


@pytest.fixture(scope="module")
def ks():
    sys.path.insert(0, str(ROOT / "scripts"))  # the script imports scripts/validate_published.py beside it
    try:
        yield importlib.import_module("kshot_study")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def pool(ks):
    return ks.pool()


@pytest.fixture(scope="module")
def draws(ks):
    return ks.read_draws(ks.SELENE.draws_file.read_text())


def test_the_pool_is_estimated_as_the_validation_tables_estimate_it(ks, pool):
    vp = ks.vp
    runs, cluster = [r for r in vp.read_runs() if r.cluster_file == "clusters/selene.toml"], vp.load_cluster(str(vp.CLUSTER))
    assert len(runs) == len(pool.sources) >= 18  # the published runs of the two papers, and any added on Selene
    models = [vp.load_model(str(vp.DATA / run.model_file)) for run in runs]
    assert len({m.name for m in models}) > 1  # runs of several models in one calibration
    np.testing.assert_allclose(pool.uncalibrated_s, [vp.predict(r, m, cluster).step_time_s for r, m in zip(runs, models)],
                               rtol=1e-12)
    np.testing.assert_allclose(pool.calibration.measured_s, [vp.measured_step_time_s(r, m) for r, m in zip(runs, models)],
                               rtol=1e-15)
    assert [f.name for f in pool.calibration.factors] == [
        "compute_time_scale.A100-80GB", "host_time_scale.A100-80GB", "bandwidth_scale.intra_node",
        "bandwidth_scale.inter_node"]


def test_the_draws_file_holds_every_draw_the_script_makes(ks, pool, draws):
    """Which runs each draw calibrates on, and the held-out error uncalibrated, for every draw (cheap: no fit)."""
    assert [(d.study, d.runs) for d in draws] == ks.studies(pool), \
        "validation/kshot-draws.csv is stale: python scripts/kshot_study.py --write docs/validation.md"
    n = len(pool.sources)
    for d in draws:
        held = [i for i in range(n) if i not in d.runs]
        assert f"{d.uncalibrated_pct:.3f}" == f"{mape_pct(pool.uncalibrated_s[held], pool.calibration.measured_s[held]):.3f}"


def test_recomputed_draws_are_the_files(ks, pool, draws):
    """The first draw of each study fitted afresh: the same factors and held-out error as the file gives."""
    names = ks.factor_names(pool)
    rows = ks.draws_text(draws, names).splitlines()[1:]
    assert rows == ks.SELENE.draws_file.read_text().splitlines()[1:]  # the file reads back to itself
    for study in dict.fromkeys(d.study for d in draws):
        i = next(i for i, d in enumerate(draws) if d.study == study)
        assert ks.draw_row(ks.score(pool, study, draws[i].runs), names) == ks.draw_row(draws[i], names)


def test_the_docs_table_is_made_from_the_draws_file(ks, pool, draws):
    text = DOC.read_text()
    start, end = ks.section(text, str(DOC))
    assert text[start:end] == "\n\n" + ks.table(draws, len(pool.sources), ks.host_move_pct(pool)) + "\n", \
        "docs/validation.md is stale: python scripts/kshot_study.py --write docs/validation.md"


@pytest.fixture(scope="module")
def jean_zay(ks):
    """BigScience's runs on Jean Zay (validation/independent-measurements.csv): the pool and its draws file."""
    return ks.pool(ks.JEAN_ZAY), ks.read_draws(ks.JEAN_ZAY.draws_file.read_text())


def test_the_jean_zay_pool_is_its_runs_as_validated_and_its_draws_file_is_current(ks, jean_zay):
    """The pool's estimates are validate_published's; every draw's selection and uncalibrated error are the file's,
    the first single-run draw fitted afresh gives the file's factors and error, and the doc's table is the file's."""
    vp, (pool, draws) = ks.vp, jean_zay
    runs = [r for r in vp.read_parallel_runs(vp.INDEPENDENT_MEASUREMENTS, gathered=False)
            if r.cluster_file == "clusters/jean-zay-a100.toml"]
    assert len(runs) == len(pool.sources) == 23
    cluster = vp.load_cluster(str(ks.JEAN_ZAY.cluster))
    np.testing.assert_allclose(pool.uncalibrated_s, [vp.predict_parallel(r, vp.parallel_run_model(r), cluster).step_time_s
                                                     for r in runs], rtol=1e-12)
    assert [(d.study, d.runs) for d in draws] == ks.studies(pool), \
        "validation/kshot-draws-jean-zay.csv is stale: python scripts/kshot_study.py --write docs/validation.md"
    for d in draws:
        held = [i for i in range(len(runs)) if i not in d.runs]
        assert f"{d.uncalibrated_pct:.3f}" == f"{mape_pct(pool.uncalibrated_s[held], pool.calibration.measured_s[held]):.3f}"
    names = ks.factor_names(pool)
    assert ks.draw_row(ks.score(pool, "k=1", draws[0].runs), names) == ks.draw_row(draws[0], names)
    text = DOC.read_text()
    start, end = ks.section(text, str(DOC), ks.JEAN_ZAY)
    assert text[start:end] == "\n\n" + ks.table(draws, len(runs), ks.host_move_pct(pool)) + "\n"


def test_subsets_every_one_when_few_else_distinct_seeded_draws(ks):
    assert ks.subsets(5, 1) == [(0,), (1,), (2,), (3,), (4,)]
    assert len(ks.subsets(5, 2, count=10)) == 10  # all C(5, 2) = 10
    drawn = ks.subsets(18, 5)
    assert len(drawn) == ks.DRAWS == len(set(drawn)) and drawn == ks.subsets(18, 5) == sorted(drawn)
    assert all(len(s) == 5 and len(set(s)) == 5 and max(s) < 18 for s in drawn)


def test_table_by_hand(ks):
    """Two draws per study: mean, median and worst of the calibrated errors, the draws made worse, and the
    verdicts; a k worse on average turns the first verdict to no, a rise with k the second (a per-source study
    counts for neither)."""
    def draw(study, runs, before, after, scale=1.1):
        return ks.Draw(study, runs, {"compute_time_scale.A": scale, "bandwidth_scale.intra_node": 1.0}, before, after)

    draws = [draw("k=1", (0,), 10.0, 4.0, 1.2), draw("k=1", (1,), 12.0, 14.0, 1.0),  # the second made worse
             draw("k=3", (0, 1, 2), 10.0, 5.0), draw("k=3", (1, 2, 3), 10.0, 3.0),
             draw("k=5", (0, 1, 2, 3, 4), 10.0, 2.0), draw("k=5", (1, 2, 3, 4, 5), 10.0, 2.0),
             draw("paper A", (0, 1, 2, 3), 10.0, 12.0)]  # worse, but not a k
    lines = ks.table(draws, 10).splitlines()
    assert lines[2] == "| 1 run | 2 | 9 | 11.0% | 9.0% | 9.0% | 14.0% | 1 | 1.100 (1.000 to 1.200) |"
    assert lines[3] == "| 3 runs | 2 | 7 | 10.0% | 4.0% | 4.0% | 5.0% | 0 | 1.100 (1.100 to 1.100) |"
    assert lines[5] == "| paper A | 1 | 6 | 10.0% | 12.0% | 12.0% | 12.0% | 1 | 1.100 (1.100 to 1.100) |"
    assert lines[-1] == ("Calibration lowers the mean held-out error at every k: yes. Mean held-out error falls "
                         "with k (9.00%, 4.00%, 2.00% for k = 1, 3, 5): yes.")
    worse = [replace(d, calibrated_pct=20.0) if d.runs == (0,) else d for d in draws]  # k=1: 17% against 11%
    assert ks.table(worse, 10).splitlines()[-1].startswith("Calibration lowers the mean held-out error at every "
                                                           "k: no.")
    flat = [replace(d, calibrated_pct=4.0) if d.study == "k=5" else d for d in draws]
    assert ks.table(flat, 10).splitlines()[-1].endswith("(9.00%, 4.00%, 4.00% for k = 1, 3, 5): no.")
    assert ks.table(flat, 10, 1.34).splitlines()[-1].endswith(
        "no. A host 10 times as slow per kernel moves no run by more than 1.3% (host_time_scale is fitted above 5%): "
        "it is never fitted.")
    assert ks.table(flat, 10, 7.0).splitlines()[-1].endswith("more than 7.0% (host_time_scale is fitted above 5%): "
                                                             "it is fitted.")


def test_refused_doc_leaves_one_line_and_no_change(ks, tmp_path, capsys):
    doc = tmp_path / "no-markers.md"
    doc.write_text("# a page without the k-shot block\n")
    before = ks.SELENE.draws_file.read_text()
    assert ks.main(["--write", str(doc)]) == 2  # refused before the study runs
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected the markers" in err
    assert doc.read_text() == "# a page without the k-shot block\n" and ks.SELENE.draws_file.read_text() == before


# -- the calibration library: runs of several models on one cluster ------------------------------------------

def test_a_fit_spanning_models_recovers_known_factors(pool):
    """Runs of three models measured at known factors (the estimates with them): the fit over them all finds
    the factors, and each run is estimated with its own model and profile."""
    cal = pool.calibration
    chosen = [0, 1, 2, 3, 8, 12]  # 22B on one node, 175B over 8 nodes, 1.7B data-parallel over 4, 39.1B
    hidden = {Factor("compute", "A100-80GB"): 1.25, Factor("bandwidth", "intra_node"): 0.8,
              Factor("bandwidth", "inter_node"): 0.4}
    truth = cal.predict(hidden, chosen)
    runs = [replace(cal.runs[i], measured_step_s=float(t)) for i, t in zip(chosen, truth)]
    fitting = Calibration(runs, [cal.settings[i] for i in chosen])
    assert len({s.model.name for s in fitting.settings}) == 4
    assert fitting.exercised() == list(hidden)
    fitted = fitting.fit(fitting.exercised(), list(range(len(runs))))
    for factor, value in hidden.items():
        assert fitted[factor] == pytest.approx(value, rel=0.02), factor.name
    one_model = Calibration(runs[:2], fitting.settings[0])  # the 22B pair, one setting as fasop calibrate passes it
    np.testing.assert_array_equal(one_model.predict(hidden), truth[:2])


def test_exercised_of_some_runs(pool):
    """The 22B runs fill one node with tensor parallelism alone: no pipeline send, no gradient reduction, so only
    the compute factor moves them; the pool as a whole depends on every factor but the host's: Megatron's kernels
    on these layers outlast a host ten times as slow per kernel as the catalogue's, to within the fit's noise."""
    cal = pool.calibration
    assert cal.exercised([0, 1]) == [Factor("compute", "A100-80GB")]
    host = Factor("host", "A100-80GB")
    assert cal.exercised() == [f for f in cal.factors if f != host]
    base = cal.predict(cal.unit())
    moved = np.abs(np.log(cal.predict({**cal.unit(), host: HOST_PROBE}) / base))
    assert 0 < moved.max() <= LOSS_SCALE


def test_settings_must_match_the_runs_and_share_a_cluster(pool):
    cal = pool.calibration
    with pytest.raises(ArgumentError, match="one setting per run"):
        Calibration(cal.runs[:2], cal.settings[:1])
    other = replace(cal.settings[1], cluster=replace(cal.settings[1].cluster, name="elsewhere"))
    with pytest.raises(ArgumentError, match="share one cluster"):
        Calibration(cal.runs[:2], [cal.settings[0], other])
