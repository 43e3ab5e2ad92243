"""Where the bundled models, profiles and clusters live: the folders models/, profiles/ and clusters/ at the top of
the source tree, installed as the data packages fasop.<kind> (setup.cfg) and found with importlib.resources, so
that an editable install and a wheel find them wherever they are installed; a source tree run without installing
(PYTHONPATH) finds them beside the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fasop.errors import ArgumentError


def data_dir(kind: str) -> Path:
    """The bundled folder `kind` (models, profiles or clusters)."""
    try:
        # fasop is installed as plain files (never zipped: its data is read by path), so this is a real folder
        return Path(str(resources.files(f"fasop.{kind}")))
    except ModuleNotFoundError:  # a source tree on PYTHONPATH, not installed: the folder beside the package
        return Path(__file__).resolve().parents[2] / kind


def resolve(kind: str, name_or_path: str, suffix: str) -> Path:
    """A path as given if it exists or looks like a path, else the bundled `kind/<name><suffix>`."""
    if not name_or_path:  # Path("") is the current folder
        raise ArgumentError(kind[:-1], f"an empty name is no {kind[:-1]}: give a bundled name or a file")
    path = Path(name_or_path)
    if path.exists() or path.suffix == suffix or len(path.parts) > 1:
        return path
    return data_dir(kind) / f"{name_or_path}{suffix}"


def locate(kind: str, name_or_path: str, suffix: str, argument: str) -> tuple[Path, bool]:
    """(path, is_bundled) of a file given by path or by bundled name, the value of `argument`; an unknown name
    lists the known ones."""
    path = resolve(kind, name_or_path, suffix)
    is_bundled = path.parent == data_dir(kind)
    if is_bundled and not path.exists():
        known = ", ".join(names(kind, suffix))
        raise ArgumentError(argument, f"no such file or bundled {kind[:-1]} (bundled: {known})", name_or_path)
    return path, is_bundled


def names(kind: str, suffix: str) -> list[str]:
    return sorted(p.stem for p in data_dir(kind).glob(f"*{suffix}"))
