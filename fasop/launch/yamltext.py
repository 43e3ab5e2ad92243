"""YAML text of plain data (nested dicts, lists and scalars), the same text for the same data: block mappings,
flow lists of scalars, block lists of anything else; a string is written bare only when it is a word that no
YAML 1.1 or 1.2 reader takes for another type, else double-quoted. No YAML library is a dependency, and
FlagScale's configs (fasop.launch.flagscale) are plain data."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_.+-]*")
# Words YAML 1.1 readers (PyYAML, OmegaConf) take for booleans or null
_RESERVED = {"true", "false", "yes", "no", "on", "off", "y", "n", "null"}
INDENT = "  "


def scalar(value: Any) -> str:
    """One scalar (or an empty collection) in flow style."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
        return repr(value)
    if isinstance(value, str):
        if _BARE.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return json.dumps(value)  # a JSON string is a YAML double-quoted scalar with the same escapes
    if isinstance(value, Mapping) and not value:
        return "{}"
    if isinstance(value, (list, tuple)) and all(_is_scalar(item) for item in value):
        return "[" + ", ".join(scalar(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as a YAML scalar")


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _flow(value: Any) -> bool:
    """Whether `value` goes on its key's line."""
    return not (isinstance(value, Mapping) and value) and not (
        isinstance(value, (list, tuple)) and not all(_is_scalar(item) for item in value))


def _lines(value: Mapping[str, Any] | Sequence[Any], depth: int) -> list[str]:
    pad = INDENT * depth
    lines: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if _flow(item):
                lines.append(f"{pad}{scalar(str(key))}: {scalar(item)}")
            else:
                lines += [f"{pad}{scalar(str(key))}:", *_lines(item, depth + 1)]
        return lines
    for item in value:
        if _flow(item):
            lines.append(f"{pad}- {scalar(item)}")
        else:  # the item's first line after the dash, the rest under it
            inner = _lines(item, depth + 1)
            lines += [f"{pad}- {inner[0].lstrip()}", *inner[1:]]
    return lines


def yaml_text(data: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    """The document of mapping `data`, after the `# ...` lines of `header`."""
    return "\n".join([*header, *_lines(data, 0)]) + "\n"
