"""A deadline for a child process that a test reads until it ends (through a pipe or a terminal)."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def killed_after(process: subprocess.Popen, seconds: float = 600) -> Iterator[subprocess.Popen]:
    """Kills `process` if it still runs after `seconds`, which ends its output, and then fails the test: a hung
    command costs its test, never the whole suite (and a test that kills the process itself cannot mistake this
    kill for its own)."""
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        process.kill()

    timer = threading.Timer(seconds, kill)
    timer.start()
    try:
        yield process
    finally:
        timer.cancel()
    assert not fired.is_set(), f"{process.args} ran past {seconds:g} s and was killed"
