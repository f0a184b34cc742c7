"""What a stage did: counters, failures and time, for the CLI summary and Dagster metadata alike."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from pipelines.failures import Failure


@dataclass
class StageReport:
    stage: str
    counts: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    elapsed_s: float = 0.0
    _started: float = field(default_factory=time.perf_counter, repr=False)

    def fail(self, failure: Failure) -> None:
        self.failures.append(failure)
        self.counts["failed"] += 1

    def finish(self) -> "StageReport":
        self.elapsed_s = round(time.perf_counter() - self._started, 3)
        return self

    def as_dict(self) -> dict:
        return {
            "stage": self.stage,
            **dict(self.counts),
            "elapsed_s": self.elapsed_s,
            "failures": [str(f) for f in self.failures],
        }
