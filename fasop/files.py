"""Input files are read with a size cap; output files are written whole or not at all, never over an input;
text from paths and names reaches an output's lines only through `comment_line` or `printable`."""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fasop.errors import ArgumentError, InputError

MIB = 2**20
# Largest input fasop reads, by kind (docs/formats.md): far above any real file, far below a memory problem.
TOML_LIMIT_BYTES = 1 * MIB
CSV_LIMIT_BYTES = 16 * MIB
PLANS_LIMIT_BYTES = 256 * MIB  # a plan list fasop reads back (it writes the best plans up to it) or a front file
LOG_LIMIT_BYTES = 256 * MIB  # a training log of a long run


def beside(named: str, base: Path) -> str:
    """A file that another file names (a plan's model file, a run's cluster): as named if it exists, else in
    folder `base` beside the naming file if it exists there, else as named (a bundled name, or a missing file
    that its reader will refuse)."""
    if Path(named).exists():
        return named
    candidate = base / named
    return str(candidate) if candidate.exists() else named


def read_text(path: str | os.PathLike, limit_bytes: int, missing: str = "file not found") -> str:
    """The UTF-8 text of a regular file of at most `limit_bytes`, without a leading byte-order mark; anything
    else is an InputError naming it.

    Devices, FIFOs and directories are refused before they are opened (reading /dev/zero never ends, opening a
    FIFO waits for a writer)."""
    where = str(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise InputError(where, "not a regular file")
        with open(path, "rb") as handle:
            data = handle.read(limit_bytes + 1)
    except FileNotFoundError:
        raise InputError(where, missing) from None
    except OSError as err:
        raise InputError(where, f"cannot be read ({err.strerror or err})") from None
    if len(data) > limit_bytes:
        raise InputError(where, f"larger than {limit_bytes // MIB} MiB, the most fasop reads from such a file")
    try:
        return data.decode("utf-8-sig")  # a byte-order mark, as spreadsheet programs write, is not text
    except UnicodeDecodeError as err:
        raise InputError(where, f"not UTF-8 text (byte {err.start})") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json.loads keeps the last of a key given twice)."""
    fields: dict[str, Any] = {}
    for key, value in pairs:
        if key in fields:
            raise ValueError(f"key {key!r} given twice in one object")
        fields[key] = value
    return fields


def read_json(path: str | os.PathLike, limit_bytes: int, what: str, missing: str = "file not found",
              parse_int: Callable[[str], Any] | None = None) -> Any:
    """The JSON value of a file read as read_text reads it; NaN, Infinity, a key given twice in one object and deep
    nesting are refused, naming the file and `what` it should have been. `parse_int`: json.loads' own."""
    where = str(path)
    text = read_text(path, limit_bytes, missing)
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_int=parse_int, object_pairs_hook=_distinct_keys)
    except json.JSONDecodeError as err:
        raise InputError(where, f"not {what}: not JSON ({err.msg} at line {err.lineno})") from None
    except ValueError as err:  # NaN, Infinity, a key given twice
        raise InputError(where, f"not {what}: {err}") from None
    except RecursionError:
        raise InputError(where, f"not {what}: JSON nested too deeply") from None


def check_finite(value: Any, where: str) -> None:
    """Refuse NaN and infinities anywhere in nested lists and dicts, naming the key (iterative: no depth limit)."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        key, item = todo.pop()
        if isinstance(item, dict):
            todo.extend((f"{key}.{k}" if key else str(k), v) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            todo.extend((f"{key}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            raise InputError(where, f"{key or 'value'} is {item}, not a finite number (an input value is out of range)")


def _same_file(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        first, second = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)  # hard links


def check_outputs(outputs: Iterable[tuple[str | os.PathLike, str]], inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse outputs, given as (path, option), that would replace an input of the same run or one another, that
    are directories or other files that are not regular (devices, pipes), or whose folder cannot hold them; a
    missing folder is fine (it is created)."""
    input_paths = [Path(p) for p in inputs]
    seen: list[tuple[Path, str]] = []
    for output, option in outputs:
        path = Path(output)
        where = f"{option} {path}"
        for given in input_paths:
            if _same_file(path, given):
                raise InputError(where, f"is an input of this run ({given}); choose another output file")
        for other, other_option in seen:
            if _same_file(path, other):
                raise InputError(where, f"is also the output of {other_option}")
        seen.append((path, option))
        if path.is_dir():
            raise InputError(where, "is a directory; expected a file name")
        if path.exists() and not path.is_file():  # --force would put a file in the place of a device or a pipe
            raise InputError(where, "exists and is not a regular file (a device, pipe or socket); expected a file name")
        folder = path.absolute().parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise InputError(where, f"cannot be created: {folder} is not a directory")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(where, f"cannot be written: no permission to write in {folder}")


@contextmanager
def pending_write(path: Path, content: str | bytes | Iterable[str], where: str | None = None) -> Iterator[None]:
    """Write `content` (text, bytes, or text in chunks, written as they come: a file too large to hold in memory
    as one text) beside `path` now and move it into place when the block ends without an error, so that a
    later step failing inside the block, or the chunks themselves, leave no output behind. Write failures are
    InputErrors naming `where`."""
    path = Path(path)
    where = where or str(path)
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(handle, "wb") as out:
            if isinstance(content, (str, bytes)):
                out.write(content.encode("utf-8") if isinstance(content, str) else content)
            else:
                for chunk in content:
                    out.write(chunk.encode("utf-8"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # the mode a plain open() would give, not mkstemp's private 0600
    except OSError as err:
        if temp is not None:
            os.unlink(temp)
        raise InputError(where, f"cannot be written ({err.strerror or err})") from None
    except BaseException:
        if temp is not None:
            os.unlink(temp)
        raise
    try:
        yield
    except BaseException:
        os.unlink(temp)
        raise
    try:
        os.replace(temp, path)
    except OSError as err:
        os.unlink(temp)
        raise InputError(where, f"cannot be written ({err.strerror or err})") from None


def write_atomically(path: Path, content: str | bytes | Iterable[str], where: str | None = None) -> None:
    """Write the whole file or nothing: a temporary file beside it is renamed into place."""
    with pending_write(path, content, where):
        pass


def comment_line(text: str) -> str:
    """`text` as one `# ...` line of a script, CSV or TOML file. A newline in a path or name would end the
    comment, and the rest would run as a shell command, end the #SBATCH directives or be read as a CSV row or
    TOML line; so it and every other character that str.isprintable refuses are escaped (one_line)."""
    return "# " + one_line(text)


def one_line(text: str) -> str:
    """`text` with every character that str.isprintable refuses (control characters, U+2028 and the other line
    breaks of str.splitlines) written as a Python escape (\\n, \\x1b, \\u2028): one line, shown as it is."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def printable(text: str, argument: str, what: str) -> str:
    """`text` when every character is printable, for a path written on a line that must stay one command
    (commands.txt); else an ArgumentError naming the argument that gave it and `what` the text is."""
    if not text.isprintable():
        bad = next(c for c in text if not c.isprintable())
        raise ArgumentError(argument, f"{what} {text!r} holds {bad!r}; expected printable characters (a newline or "
                                      "control character would split the command that names it)")
    return text
