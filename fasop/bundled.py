"""Where the bundled models, profiles, clusters and catalogue live.

In a source checkout they sit beside the package; a wheel install puts them under `<prefix>/share/fasop`.
"""

from __future__ import annotations

import sys
from pathlib import Path


def data_dir(kind: str) -> Path:
    """The bundled folder `kind` (models, profiles, clusters or catalogue)."""
    checkout = Path(__file__).resolve().parent.parent / kind
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "fasop" / kind


def resolve(kind: str, name_or_path: str, suffix: str) -> Path:
    """A path as given if it exists or looks like a path, else the bundled `kind/<name><suffix>`."""
    path = Path(name_or_path)
    if path.exists() or path.suffix == suffix or len(path.parts) > 1:
        return path
    return data_dir(kind) / f"{name_or_path}{suffix}"


def names(kind: str, suffix: str) -> list[str]:
    return sorted(p.stem for p in data_dir(kind).glob(f"*{suffix}"))
