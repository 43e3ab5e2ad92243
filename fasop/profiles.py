"""Layer-wise time profiles: seconds per unit (embedding, transformer layer, head) per GPU type, tensor
degree and micro-batch size, read from `profiles/<model>/<gpu>.csv`.

Between profiled micro-batch sizes times are interpolated linearly; beyond the largest (and below the
smallest) profiled size the nearest profiled time is scaled per sample.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fasop import bundled
from fasop.errors import InputError
from fasop.model import Model

COLUMNS = ("tp", "mbs", "kind", "forward_s", "backward_s")
MEMORY_COLUMN = "peak_memory_bytes"  # optional last column of measured profiles; the search does not read it


@dataclass(frozen=True)
class Curve:
    """Times of one (GPU, tensor degree, kind) at the profiled micro-batch sizes, ascending."""

    mbs: np.ndarray
    forward_s: np.ndarray
    backward_s: np.ndarray

    def at(self, mbs: int) -> tuple[float, float]:
        """(forward_s, backward_s) of one micro-batch of size `mbs`."""
        lo, hi = self.mbs[0], self.mbs[-1]
        if mbs <= lo or mbs >= hi:
            edge = 0 if mbs <= lo else -1
            scale = mbs / self.mbs[edge]
            return float(self.forward_s[edge] * scale), float(self.backward_s[edge] * scale)
        return (float(np.interp(mbs, self.mbs, self.forward_s)), float(np.interp(mbs, self.mbs, self.backward_s)))


@dataclass(frozen=True)
class GpuProfile:
    gpu: str
    file: str
    curves: dict[tuple[int, str], Curve]
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tensor_degrees(self) -> tuple[int, ...]:
        return tuple(sorted({tp for tp, _ in self.curves}))

    def time(self, tp: int, kind: str, mbs: int) -> tuple[float, float]:
        curve = self.curves.get((tp, kind))
        if curve is None:
            raise InputError(self.file, f"no rows for tp={tp} kind={kind}")
        return curve.at(mbs)

    def step_s(self, tp: int, kind: str, mbs_values: tuple[int, ...]) -> np.ndarray:
        """Forward + backward seconds of one unit for each micro-batch size (memoised: searches ask often)."""
        key = (tp, kind, mbs_values)
        if key not in self._memo:
            self._memo[key] = np.array([sum(self.time(tp, kind, b)) for b in mbs_values])
        return self._memo[key]


def required_kinds(model: Model) -> tuple[str, ...]:
    if model.is_encoder_decoder:
        return ("embedding", "encoder", "decoder_embedding", "decoder", "head")
    return ("embedding", "layer", "head")


def read_profile(path: Path, model: Model, gpu: str) -> GpuProfile:
    file = str(path)
    try:
        with open(path, newline="") as handle:
            lines = [line for line in handle if line.strip() and not line.lstrip().startswith("#")]
    except FileNotFoundError:
        raise InputError(file, f"no profile for GPU type {gpu} of model {model.name}") from None
    except UnicodeDecodeError:
        raise InputError(file, "not a text (UTF-8) CSV file") from None
    except OSError as err:
        raise InputError(file, f"cannot be read ({err.strerror})") from None
    reader = csv.DictReader(lines)
    if tuple(reader.fieldnames or ()) not in (COLUMNS, COLUMNS + (MEMORY_COLUMN,)):
        raise InputError(file, f"expected the header {','.join(COLUMNS)}[,{MEMORY_COLUMN}], "
                               f"got {','.join(reader.fieldnames or ())}")
    kinds = required_kinds(model)
    rows: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    for number, row in enumerate(reader, start=2):
        where = f"{file}: line {number}"
        try:
            tp, mbs = int(row["tp"]), int(row["mbs"])
            forward, backward = float(row["forward_s"]), float(row["backward_s"])
        except (TypeError, ValueError):
            raise InputError(where, "expected integers tp, mbs and numbers forward_s, backward_s") from None
        if tp < 1 or mbs < 1 or not 0 < forward < math.inf or not 0 < backward < math.inf:
            raise InputError(where, "expected tp >= 1, mbs >= 1 and positive, finite times")
        if row["kind"] not in kinds:
            raise InputError(where, f"kind {row['kind']!r} is not one of {', '.join(kinds)} ({model.architecture} model)")
        rows.setdefault((tp, row["kind"]), []).append((mbs, forward, backward))
    curves = {}
    for key, entries in rows.items():
        entries.sort()
        sizes = [e[0] for e in entries]
        if len(set(sizes)) != len(sizes):
            raise InputError(file, f"micro-batch size listed twice for tp={key[0]} kind={key[1]}")
        table = np.array(entries, dtype=float)
        curves[key] = Curve(table[:, 0], table[:, 1], table[:, 2])
    for tp in sorted({tp for tp, _ in curves}):
        missing = [k for k in kinds if (tp, k) not in curves]
        if missing:
            raise InputError(file, f"tp={tp} has no rows for kind {', '.join(missing)}")
    if not curves:
        raise InputError(file, "no profile rows")
    return GpuProfile(gpu, file, curves)


def load_profiles(model: Model, gpus: list[str], directory: str | None = None) -> dict[str, GpuProfile]:
    """Profiles of `model` for each GPU type, from `directory` (default: the bundled profiles/<model>)."""
    folder = Path(directory) if directory else bundled.data_dir("profiles") / model.name
    if not folder.is_dir():
        where = f"--profiles {directory}" if directory else f"model {model.name}"
        raise InputError(where, f"no profile directory {folder} (expected one <gpu>.csv per GPU type)")
    return {gpu: read_profile(folder / f"{gpu}.csv", model, gpu) for gpu in sorted(set(gpus))}
