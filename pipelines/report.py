"""What a stage did: counters, failures and time, for the CLI summary and Dagster metadata alike."""

from __future__ import annotations

import time
from collections import Counter

from pipelines.failures import Failure


class StageReport:
    """Counters start at zero so that "nothing to do" still shows as 0 in the UI and the JSON."""

    def __init__(self, stage: str, counters: tuple[str, ...] = ()):
        self.stage = stage
        self.counts = Counter({name: 0 for name in (*counters, "failed")})
        self.failures: list[Failure] = []
        self.elapsed_s = 0.0
        self._started = time.perf_counter()

    def fail(self, failure: Failure) -> None:
        self.failures.append(failure)
        self.counts["failed"] += 1

    def finish(self) -> "StageReport":
        self.elapsed_s = round(time.perf_counter() - self._started, 3)
        return self
