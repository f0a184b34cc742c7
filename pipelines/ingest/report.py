"""What a stage did: counters, failures and time, for the CLI summary and Dagster metadata alike."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict

from pipelines.ingest.failures import Failure


class StageReport:
    """Counters start at zero so that "nothing to do" still shows as 0 in the UI and the JSON."""

    def __init__(self, stage: str, counters: tuple[str, ...] = ()):
        self.stage = stage
        self.counts = Counter({name: 0 for name in (*counters, "failed")})
        self.failures: list[Failure] = []
        self.skipped: list[Failure] = []  # files passed over on purpose (an unsupported type): listed, not failed
        self.notes: dict = {}  # what else the stage found worth recording (the publish stage's gate)
        self.elapsed_s = 0.0
        self._started = time.perf_counter()

    def fail(self, failure: Failure) -> None:
        self.failures.append(failure)
        self.counts["failed"] += 1

    def skip(self, skipped: Failure) -> None:
        self.skipped.append(skipped)
        self.counts["skipped"] += 1

    def finish(self) -> "StageReport":
        self.elapsed_s = round(time.perf_counter() - self._started, 3)
        return self

    def as_dict(self) -> dict:
        """The report as stored on its run's `ingest_runs` row."""
        return {"counts": dict(self.counts), "elapsed_s": self.elapsed_s, "failures": [asdict(f) for f in self.failures],
                "skipped": [asdict(f) for f in self.skipped], "notes": self.notes}

    @classmethod
    def merged(cls, stage: str, reports: list["StageReport"]) -> "StageReport":
        """One report of a stage run in parts (a backfill's shards): counts, failures and time summed."""
        if len(reports) == 1:
            return reports[0]
        whole = cls(stage)
        for part in reports:
            whole.counts.update(part.counts)
            whole.failures += part.failures
            whole.skipped += part.skipped
            whole.elapsed_s += part.elapsed_s
            whole.notes.update(part.notes)
        return whole

    @classmethod
    def from_dict(cls, stage: str, data: dict) -> "StageReport":
        report = cls(stage)
        report.counts = Counter(data["counts"])
        report.failures = [Failure(**f) for f in data["failures"]]
        report.skipped = [Failure(**f) for f in data.get("skipped", [])]
        report.notes = data.get("notes", {})
        report.elapsed_s = data["elapsed_s"]
        return report


class Progress:
    """What a stage says while it runs: how much there is to do (once known) and how much is done. The CLI shows
    it as a bar with total, rate and ETA on a terminal and as a line at each stage's start and end otherwise; this
    base class shows nothing (Dagster, tests)."""

    def total(self, count: int) -> None:
        """`count` more items to do: a stage that learns its work in parts (one source at a time) calls it per part."""

    def advance(self, count: int = 1) -> None:
        pass

    def done(self, report: "StageReport") -> None:
        pass


NO_PROGRESS = Progress()
