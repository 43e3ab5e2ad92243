"""Reading TOML input files: each table's schema is a pydantic model, and every error becomes one line naming
the file, the field and what was expected."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, ValidationError, WrapValidator
from pydantic_core import core_schema

from fasop.errors import InputError
from fasop.files import TOML_LIMIT_BYTES, read_text
from fasop.inputs.names import NAME

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


class Table(BaseModel):
    """A TOML table: known fields only, each of exactly its TOML type (an integer field refuses "3", 3.5 and
    true), numbers finite. Schemas are built on first use: a command reads only some kinds of file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False, defer_build=True)


def _shown(value: Any) -> str:
    """A value as the file wrote it: true, 3.0, 'text' (for strings, quotes make a type error plain)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _expected_or_refuse(what: str, value: Any, handler: Callable[[Any], Any]) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(f"expected {what}, got {_shown(value)}") from None


def expected(what: str) -> WrapValidator:
    """Annotated metadata: any error of the field, its type included, reads `expected <what>, got <value>`."""
    return WrapValidator(partial(_expected_or_refuse, what))


@dataclass(frozen=True)
class Range:
    """Annotated metadata for an int or float field: from `low` (itself allowed only if `low_allowed`) to `high`,
    refused as `expected an integer from 1 to 1,024, got 0` or `expected a number > 0 and <= 100, got inf`."""

    low: float
    high: float
    low_allowed: bool = True

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        schema: Any = {**handler(source), "ge" if self.low_allowed else "gt": self.low, "le": self.high}
        if schema["type"] == "int":
            what = f"an integer from {self.low} to {self.high:,}"
        else:
            what = f"a number {'>=' if self.low_allowed else '>'} {self.low:g} and <= {self.high:g}"
        return core_schema.no_info_wrap_validator_function(partial(_expected_or_refuse, what), schema)


Text = Annotated[str, Field(min_length=1), expected("a non-empty string")]
Flag = Annotated[bool, expected("true or false")]

T = TypeVar("T", bound=Table)


def validated(schema: type[T], data: Any, file: str) -> T:
    """`data` read with `schema`; the first error (an unknown field before all others: it usually explains a
    missing one) becomes an InputError `<file>: <field path>: <what was expected>`."""
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        errors = sorted(err.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
        path = _field_path(data, errors[0]["loc"])  # empty for a check across fields
        raise InputError(f"{file}: {path}" if path else file, _problem(schema, errors[0])) from None


def _field_path(data: Any, loc: tuple[int | str, ...]) -> str:
    """`node_type.A100.count` for loc ('node_type', 0, 'count'): an entry of an array of tables is named by its
    `name` where that is a valid name, else by its index (`node_type[0].name`)."""
    path, node = "", data
    for key in loc:
        if isinstance(key, int):
            node = node[key] if isinstance(node, list) and key < len(node) else None
            name = node.get("name") if isinstance(node, dict) else None
            path += f".{name}" if isinstance(name, str) and NAME.fullmatch(name) else f"[{key}]"
        else:
            node = node.get(key) if isinstance(node, dict) else None
            path += f".{key}" if path else key
    return path


def _table_in(annotation: Any) -> type[Table] | None:
    """The Table type inside an annotation such as `list[GpuTable]` or `Optional[DeratingTable]`."""
    if isinstance(annotation, type) and issubclass(annotation, Table):
        return annotation
    return next(filter(None, map(_table_in, get_args(annotation))), None)


def _problem(schema: type[Table], error: Any) -> str:
    kind, loc = error["type"], error["loc"]
    if kind == "extra_forbidden":
        table: Any = schema
        for key in loc[:-1]:
            if isinstance(key, str):
                table = _table_in(table.model_fields[key].annotation)
        what = "table" if len(loc) == 1 and isinstance(error["input"], dict) else "field"
        return f"unknown {what} (known: {', '.join(sorted(table.model_fields))})"
    if kind == "missing":
        return "missing"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "finite_number":
        return f"expected a finite number, got {_shown(error['input'])}"
    if kind == "literal_error":
        return f"expected one of {error['ctx']['expected']}, got {_shown(error['input'])}"
    if kind in ("model_type", "dict_type"):
        return f"expected a table, got {_shown(error['input'])}"
    if kind in ("list_type", "too_short"):
        return f"expected one or more [[{loc[-1]}]] tables"
    return error["msg"]
