"""State files kb writes (under KB_HOME, and its caches) are replaced whole or not at all: the new bytes go to a
temporary file in the same folder, reach the disk (fsync), and are renamed over the old file, so a process killed
mid-write, a full disk or a power cut leaves the previous version, never an empty or half-written file. Readers
still treat what they find as possibly damaged (a file from an older kb, a copy from elsewhere) and rebuild it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace path's content with data, atomically and durably (the file keeps its permissions; a new one is 0644)."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
        os.chmod(temporary, mode)
        replace_durably(Path(temporary), path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def replace_durably(source: Path, target: Path) -> None:
    """Rename a finished file over target (same file system), its bytes and the rename both on disk when this
    returns."""
    with open(source, "rb") as written:
        os.fsync(written.fileno())
    os.replace(source, target)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
