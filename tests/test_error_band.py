"""The error band: clusters/catalogue/error-band.toml is what scripts/validate_published.py computes from the published
runs today (no drift), read back checked, and only widens answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fasop.errors import InputError
from fasop.inputs.errorband import ErrorBand, band_path, bundled_band, read_band

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script(validate_published):
    return validate_published


def test_the_bundled_band_is_what_the_script_computes(script):
    """The dense published runs: the two papers', NVIDIA's and those published outside NVIDIA."""
    independent = script.read_parallel_runs(script.INDEPENDENT_MEASUREMENTS, gathered=False)
    results = [*script.validate(script.read_runs()), *script.validate_parallel(independent)]
    text = band_path().read_text(encoding="utf-8")
    date = re.search(r'^date = "(\d{4}-\d{2}-\d{2})"$', text, re.MULTILINE)
    assert date, "the band file gives the date it was written"
    assert text == script.band_text(results, date.group(1)), \
        "stale: python scripts/validate_published.py --band clusters/catalogue/error-band.toml"
    ratios = [r.measured_s / r.predicted_s for r in results]
    band = bundled_band()
    assert band.runs == len(results) == 54 + 58
    assert band.low == pytest.approx(min(ratios), abs=1e-4) and band.high == pytest.approx(max(ratios), abs=1e-4)
    # from 3.0% too slow (Nemotron-4 15B, bf16, 16 H100s) to 36.0% too fast (BigScience's 178B model with 104 heads;
    # docs/validation.md)
    assert band.low == pytest.approx(1 / (1 + 0.030), abs=1e-3) and band.high == pytest.approx(1 / (1 - 0.360), abs=1e-3)


def test_band_arithmetic():
    band = ErrorBand(1.1, 1.3, 3, "somewhere")
    assert band.range_of(2.0) == "2.20-2.60"
    assert band.slow_margin == pytest.approx(0.3)
    assert ErrorBand(0.8, 0.95, 1, "x").slow_margin == 0  # estimates too slow: no margin is needed
    assert band.describe() == "measured runs took 1.10-1.30x the estimate (somewhere, 3 runs)"


@pytest.mark.parametrize("text, field", [
    ('low = 1.3\nhigh = 1.1\nsource = "s"\ndate = "d"\n[[runs]]\nrun = "a"\nratio = 1.2\n', "low"),
    ('low = 0\nhigh = 1.1\nsource = "s"\ndate = "d"\n[[runs]]\nrun = "a"\nratio = 1.2\n', "low"),
    ('low = 1.0\nhigh = 1.1\nsource = "s"\ndate = "d"\nruns = []\n', "runs"),
    ('low = 1.0\nsource = "s"\ndate = "d"\n[[runs]]\nrun = "a"\nratio = 1.2\n', "high"),
])
def test_a_broken_band_file_is_one_line_naming_the_field(tmp_path, text, field):
    path = tmp_path / "band.toml"
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        read_band(path)
    assert str(path) in str(caught.value) and field in str(caught.value) and "\n" not in str(caught.value)
