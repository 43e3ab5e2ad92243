"""The error band of step-time estimates: how much longer measured runs took than fasop estimated them, as the
ratios measured / estimated of the fastest and the slowest run (low, high).

The bundled band, clusters/catalogue/error-band.toml, is written by scripts/validate_published.py from the
published Megatron-LM runs of docs/validation.md; a cluster file that `fasop calibrate` wrote carries the band
of the user's own runs after the fit instead (its `[cluster.error_band]` table), which then takes precedence.
The band only widens an answer (a range of step times and run lengths, the margin of a deadline or budget); it
never changes an estimate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field

from fasop.errors import InputError
from fasop.inputs import bundled
from fasop.inputs.tomlfile import Range, Table, read_toml, validated

BAND_FILE = "clusters/catalogue/error-band.toml"  # the bundled band, named by its place in the source tree
MAX_RATIO = 100.0  # measured / estimated beyond this is a broken measurement, not an error band

Ratio = Annotated[float, Range(0.0, MAX_RATIO, low_allowed=False)]


class BandRun(Table):
    run: str  # which measured run
    ratio: Ratio  # its measured / estimated step time


class BandFile(Table):
    low: Ratio
    high: Ratio
    source: str
    date: str
    runs: list[BandRun] = Field(min_length=1)


class BandTable(Table):
    """A calibrated cluster file's `[cluster.error_band]`: the band of the user's own runs (fasop calibrate)."""

    low: Ratio
    high: Ratio
    runs: Annotated[int, Range(1, 10**6)]
    source: str
    date: str = ""


@dataclass(frozen=True)
class ErrorBand:
    """Measured / estimated step time of the fastest (`low`) and the slowest (`high`) run of `runs`."""

    low: float
    high: float
    runs: int
    source: str  # where the runs and their comparison are documented

    @property
    def slow_margin(self) -> float:
        """The fraction the slowest run took beyond its estimate: the default margin of deadlines and budgets."""
        return max(0.0, self.high - 1.0)

    def describe(self) -> str:
        """'measured runs took 0.97-1.56x the estimate (docs/validation.md, 112 runs)'."""
        return f"measured runs took {self.low:.2f}-{self.high:.2f}x the estimate ({self.source}, {self.runs} runs)"

    def range_of(self, value: float, fmt: str = "{:.2f}") -> str:
        """`value` (an estimate of seconds, hours or dollars) stretched over the band: '1.21-1.45'."""
        return f"{fmt.format(value * self.low)}-{fmt.format(value * self.high)}"


def band_path() -> Path:
    return bundled.data_dir("clusters") / "catalogue" / "error-band.toml"


def _ordered(low: float, high: float, where: str) -> None:
    if low > high:
        raise InputError(f"{where}low", f"expected at most high ({high:g}), got {low:g}")


def read_band(path: Path) -> ErrorBand:
    """The band of a band file (the bundled one: band_path()), checked: low <= high, one line naming the field if not."""
    data = validated(BandFile, read_toml(path), str(path))
    _ordered(data.low, data.high, f"{path}: ")
    return ErrorBand(data.low, data.high, len(data.runs), data.source)


def table_band(table: BandTable, where: str) -> ErrorBand:
    """The band of a cluster file's `[cluster.error_band]` table; `where` prefixes the field in errors."""
    _ordered(table.low, table.high, where)
    return ErrorBand(table.low, table.high, table.runs, table.source)


def bundled_band() -> ErrorBand:
    """The band of the published runs (docs/validation.md)."""
    return read_band(band_path())


def band_of(own: ErrorBand | None) -> ErrorBand:
    """The band a cluster's answers carry: its own (a calibrated cluster file's), else the published runs'."""
    return bundled_band() if own is None else own
