"""A parse task for the time-limit test: it never returns on the leave policy, as a parser caught in a loop would.
It lives in its own module so that spawned parse workers can import it."""

import threading

from pipelines.ingest.parse import _parse_task


def parse_unless_stuck(task: tuple):
    if task[1] == "handbook/leave-policy.md":  # (its bytes, locator, format, limits, parser version)
        threading.Event().wait()
    return _parse_task(task)
