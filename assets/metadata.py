"""Stage reports as Dagster metadata: counters, elapsed time and failures, visible on each materialization."""

import dagster as dg

from pipelines.report import StageReport


def report_metadata(report: StageReport, row_count_key: str | None = None) -> dict:
    metadata: dict = {name: dg.MetadataValue.int(int(value)) for name, value in report.counts.items()}
    metadata["elapsed_s"] = dg.MetadataValue.float(report.elapsed_s)
    if row_count_key is not None:
        metadata["dagster/row_count"] = dg.MetadataValue.int(int(report.counts[row_count_key]))
    if report.failures:
        metadata["failures"] = dg.MetadataValue.md("\n".join(f"- `{f.source_id}:{f.locator}`: {f.reason}" for f in report.failures))
    return metadata
