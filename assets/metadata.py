"""Stage reports and ingest statistics as Dagster metadata: counters, time, failures, and small plots drawn as
markdown (a bar per value), which the UI renders everywhere without serving images."""

import dagster as dg

from pipelines.ingest.report import StageReport

BAR_WIDTH = 30


def report_metadata(report: StageReport) -> dict:
    metadata: dict = {name: dg.MetadataValue.int(int(value)) for name, value in report.counts.items()}
    metadata["elapsed_s"] = dg.MetadataValue.float(report.elapsed_s)
    if report.failures:
        metadata["failures"] = dg.MetadataValue.md("\n".join(f"- `{f.source_id}:{f.locator}`: {f.reason}" for f in report.failures))
    return metadata


def bars(counts: dict, label: str) -> str:
    """A markdown table with a bar per row: a plot that renders in any markdown view."""
    top = max(counts.values(), default=0) or 1
    rows = [f"| {key} | {value} | {'█' * max(1, round(BAR_WIDTH * value / top)) if value else ''} |"
            for key, value in counts.items()]
    return "\n".join([f"| {label} | count | |", "|---|---|---|", *rows])


def histogram(values: list[int], bins: int = 8) -> dict[str, int]:
    if not values:
        return {}
    low, high = min(values), max(values)
    width = max(1, -(-(high - low + 1) // bins))
    counts: dict[str, int] = {}
    for start in range(low, high + 1, width):
        counts[f"{start}-{start + width - 1}"] = sum(start <= v < start + width for v in values)
    return counts


def statistics_metadata(statistics: dict) -> dict:
    return {
        "chunk_tokens": dg.MetadataValue.md(bars(histogram(statistics["chunk_tokens"]), "tokens per chunk")),
        "documents_per_format": dg.MetadataValue.md(bars(statistics["documents_per_format"], "format")),
        "failures_per_stage": dg.MetadataValue.md(bars(statistics["failures_per_stage"], "stage") if
                                                  statistics["failures_per_stage"] else "no failing documents"),
    }
