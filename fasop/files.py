"""Output files are written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write the whole file or nothing: a temporary file beside it is renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w", newline="") as out:
            out.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # the mode a plain open() would give, not mkstemp's private 0600
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
