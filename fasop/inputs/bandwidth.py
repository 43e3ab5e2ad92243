"""Bandwidths written with a unit ("40 Gbit/s", "230 GB/s"), read as bytes per second: the links of a cluster
file and the intra-node link of a GPU table."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

from fasop.errors import ArgumentError

# Units a bandwidth may be written in, as bytes per second per unit. "Gb/s" and "Gbps" are refused: one
# capital letter apart from "GB/s", they are the classic way to be wrong by 8x.
_BANDWIDTH_UNITS = {
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8,
    "B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "GiB/s": 2.0**30,
}
MIN_BANDWIDTH_BYTES_PER_S, MAX_BANDWIDTH_BYTES_PER_S = 1e3, 1e15
_BANDWIDTH = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def bandwidth_bytes_per_s(text: Any) -> float:
    """'40 Gbit/s' -> 5e9; anything else is a ValueError saying what was expected."""
    match = _BANDWIDTH.match(text) if isinstance(text, str) else None
    if not match or match.group(2) not in _BANDWIDTH_UNITS:
        units = ", ".join(_BANDWIDTH_UNITS)
        raise ValueError(f"expected a bandwidth such as \"40 Gbit/s\" or \"230 GB/s\" (units: {units}), got {text!r}")
    value = float(match.group(1)) * _BANDWIDTH_UNITS[match.group(2)]
    if not MIN_BANDWIDTH_BYTES_PER_S <= value <= MAX_BANDWIDTH_BYTES_PER_S:  # also refuses inf ("1e999 GB/s")
        raise ValueError(f"expected a bandwidth from 1 kB/s to 1 PB/s, got {text!r}")
    return value


def parse_bandwidth(text: Any, argument: str) -> float:
    """'40 Gbit/s' -> 5e9 (bytes per second), the value of `argument`; anything else is an ArgumentError naming it."""
    try:
        return bandwidth_bytes_per_s(text)
    except ValueError as err:
        raise ArgumentError(argument, str(err)) from None


Bandwidth = Annotated[float, BeforeValidator(bandwidth_bytes_per_s)]
"""A field of a fasop.inputs.tomlfile.Table written as a string with a unit, read as bytes per second."""
