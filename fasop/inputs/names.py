"""Names read from input files (models, clusters, node types, GPUs).

These names reach emitted shell scripts and Slurm directives, profile file names and the lists of CSV files,
so they are held to a character set that none of those can misread.
"""

from __future__ import annotations

import re
from typing import Any

from fasop.errors import InputError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
NAME_RULE = "a name of 1 to 64 letters, digits, _ . + or -, starting with a letter or digit"


def check_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise InputError(where, f"expected {NAME_RULE}, got {value!r}")
    return value


def table_name(table: Any, key: str) -> str:
    """The name in field `key` of a `fasop.inputs.tomlfile.Table`, checked."""
    return check_name(table.str(key), table.where(key))
