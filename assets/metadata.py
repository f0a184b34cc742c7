"""What the UI shows of a stage: its counters, time and failures, the rows its asset holds, and small plots drawn
as markdown (a bar per value), which render everywhere without serving images. The same metadata goes with a
materialization whichever entry point ran the stage (a Dagster run, or `kb ingest` recorded in the instance)."""

from __future__ import annotations

import dagster as dg
import psycopg

from pipelines.ingest.flow import Stage
from pipelines.ingest.report import StageReport

BAR_WIDTH = 30


def report_metadata(report: StageReport) -> dict:
    metadata: dict = {name: dg.MetadataValue.int(int(value)) for name, value in report.counts.items()}
    metadata["elapsed_s"] = dg.MetadataValue.float(report.elapsed_s)
    if report.failures:
        metadata["failures"] = dg.MetadataValue.md("\n".join(f"- `{f.source_id}:{f.locator}`: {f.reason}" for f in report.failures))
    if report.skipped:
        metadata["skipped files"] = dg.MetadataValue.md("\n".join(f"- `{f.source_id}:{f.locator}`: {f.reason}" for f in report.skipped))
    return metadata


def stage_metadata(conn: psycopg.Connection, stage: Stage, report: StageReport, source_ids: list[str],
                   embedder, held: dict[str, int]) -> dict:
    """A stage's materialization metadata: counters, time, failures, the rows its asset holds for these sources
    (`held`, from rows_held, which the caller also needs per partition; dagster/row_count: their total, which a
    partition's own count replaces), the model for the embed stage, and for the gated stage the gate and the
    statistics."""
    from pipelines.storage.status import ingest_statistics

    metadata = {**report_metadata(report), "dagster/row_count": dg.MetadataValue.int(sum(held.values())),
                "sources": dg.MetadataValue.text(", ".join(source_ids))}
    if report.notes.get("sources"):  # the extract stage: what each source's crawl listed, read, knew unchanged
        from pipelines.storage.status import crawl_line

        metadata["crawls"] = dg.MetadataValue.md("\n".join(f"- `{source_id}`: {crawl_line(crawl)}"
                                                           for source_id, crawl in report.notes["sources"].items()))
    if report.notes.get("workers"):  # the parse stage: documents each worker parsed
        metadata["workers"] = dg.MetadataValue.json(report.notes["workers"])
    if report.notes.get("calibrations"):  # the calibrate stage: each scope fitted, or why not
        metadata["calibrations"] = dg.MetadataValue.json(report.notes["calibrations"])
    if stage.name == "embed":
        metadata["model"] = dg.MetadataValue.text(embedder.model_key)
    if stage.gated:
        metadata.update(statistics_metadata(ingest_statistics(conn, source_ids)))
        if report.notes.get("gate"):
            metadata.update({f"gate {k}": v for k, v in gate_metadata(report.notes["gate"]).items()})
    return metadata


def rows_held(conn: psycopg.Connection, stage: Stage, source_ids: list[str]) -> dict[str, int]:
    """The rows a stage's asset holds for each source: each partition's own dagster/row_count."""
    return {source_id: conn.execute(stage.holds, {"id": source_id}).fetchone()[0] for source_id in source_ids}


def gate_metadata(gate: dict) -> dict:
    return {"hit@5": dg.MetadataValue.float(gate["hit_rate"] if gate["hit_rate"] is not None else float("nan")),
            "queries": dg.MetadataValue.int(gate["queries"]), "floor": dg.MetadataValue.float(gate["floor"]),
            "misses": dg.MetadataValue.md("\n".join(f"- {m['query']} -> {m['document']}" for m in gate["misses"])
                                          or "none")}


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
