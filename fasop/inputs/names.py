"""Names read from input files (models, clusters, node types, GPUs).

These names reach emitted shell scripts and Slurm directives, profile file names and the lists of CSV files,
so they are held to a character set that none of those can misread.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import PlainValidator

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
NAME_RULE = "a name of 1 to 64 letters, digits, _ . + or -, starting with a letter or digit"


def _checked_name(value: Any) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(f"expected {NAME_RULE}, got {value!r}")
    return value


Name = Annotated[str, PlainValidator(_checked_name)]
"""A field of a fasop.tomlfile.Table holding a name."""
