"""Shell text: words quoted so that nothing expands at run time, variable assignments, bash arrays of flags.
(Comment lines of scripts come from fasop.files.comment_line, which the profile and calibration files share.)"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence


def quote(text: str) -> str:
    """One shell word holding exactly `text` (no expansion at run time)."""
    text = str(text)
    if "$" in text or "`" in text:  # double quotes with escapes read more plainly than '...$...' to linters
        return '"' + re.sub(r'([\\"$`])', r"\\\1", text) + '"'
    return shlex.quote(text)


def assignment(name: str, value: str) -> str:
    """`NAME=value` for a command's environment, the value quoted: a quoted whole (`'NAME=a b'`) is no
    assignment to the shell but the name of a command to run; a value starting with "=" is quoted too, as
    `NAME==x` reads like a comparison to linters."""
    word = quote(value)
    if word.startswith("="):  # unquoted, so of safe characters only
        word = f"'{word}'"
    return f"{name}={word}"


def bash_array(name: str, flags: Iterable[Sequence[str]]) -> str:
    lines = [f"{name}=("]
    lines += ["    " + " ".join(quote(part) for part in flag) for flag in flags]
    lines.append(")")
    return "\n".join(lines)


def group_flags(tokens: Sequence[str]) -> list[tuple[str, ...]]:
    """["--a", "1", "--b"] -> [("--a", "1"), ("--b",)]: one flag and its values per line."""
    groups: list[list[str]] = []
    for token in tokens:
        if not groups or token.startswith("-"):
            groups.append([token])
        else:
            groups[-1].append(token)
    return [tuple(g) for g in groups]

