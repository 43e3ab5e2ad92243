"""Reading TOML input files with errors that name the file and the field."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from fasop.errors import InputError
from fasop.files import TOML_LIMIT_BYTES, read_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def read_toml(path: Path) -> dict[str, Any]:
    text = read_text(path, TOML_LIMIT_BYTES)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputError(str(path), f"not valid TOML ({err})") from None
    except RecursionError:
        raise InputError(str(path), "not valid TOML (nested too deeply)") from None


class Table:
    """A TOML table whose typed getters raise InputError naming `file: table.field`."""

    def __init__(self, data: Any, file: str, prefix: str):
        if not isinstance(data, dict):
            raise InputError(f"{file}: {prefix}", "expected a table")
        self.data, self.file, self.prefix = data, file, prefix

    def where(self, key: str) -> str:
        return f"{self.file}: {self.prefix}.{key}"

    def _get(self, key: str, default: Any, required: bool) -> Any:
        if key in self.data:
            return self.data[key]
        if required:
            raise InputError(self.where(key), "missing")
        return default

    def str(self, key: str, default: str | None = None, choices: tuple[str, ...] | None = None,
            required: bool = True) -> str:
        if key not in self.data and (default is not None or not required):
            return default
        value = self._get(key, default, True)
        if not isinstance(value, str) or not value:
            raise InputError(self.where(key), f"expected a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise InputError(self.where(key), f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def int(self, key: str, default: int | None = None, minimum: int = 1, maximum: int = 2**31 - 1) -> int:
        value = self._get(key, default, default is None)
        expected = f"expected an integer from {minimum} to {maximum:,}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(self.where(key), f"{expected}, got {value!r}")
        if not minimum <= value <= maximum:
            raise InputError(self.where(key), f"{expected}, got {value}")
        return value

    def float(self, key: str, default: float | None = None, minimum: float = 0.0,
              strict: bool = True, maximum: float = 1e6) -> float:
        """A finite number above `minimum` (at `minimum` too unless `strict`) and at most `maximum`."""
        value = self._get(key, default, default is None)
        bound = ">" if strict else ">="
        expected = f"expected a number {bound} {minimum:g} and <= {maximum:g}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(self.where(key), f"{expected}, got {value!r}")
        if value < minimum or (strict and value == minimum) or value > maximum:
            raise InputError(self.where(key), f"{expected}, got {value:g}")
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool:
        value = self._get(key, default, default is None)
        if not isinstance(value, bool):
            raise InputError(self.where(key), f"expected true or false, got {value!r}")
        return value

    def reject_unknown(self, known: set[str]) -> None:
        for key in self.data:
            if key not in known:
                raise InputError(self.where(key), f"unknown field (known: {', '.join(sorted(known))})")
