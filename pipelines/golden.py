"""The retrieval-quality gate: hit@5 of a small golden set of (query, expected document) after each refresh."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg

from pipelines.search import Filters
from pipelines.service import run_search
from pipelines.settings import Settings


def golden_hit_rate(conn: psycopg.Connection, settings: Settings, path: Path, k: int = 5) -> dict:
    """Queries whose expected document (`source:locator`) is among the top-k documents. Queries about sources
    that are not in this knowledge base are skipped, so one golden file can serve several deployments. The gate
    reads as the operator: with every group a declared source names."""
    rows = conn.execute("SELECT source_id, allowed_groups FROM sources WHERE removed_at IS NULL").fetchall()
    sources = {source_id for source_id, _ in rows}
    every_group = sorted({group for _, groups in rows for group in groups or ()})
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    cases = [c for c in cases if c["document"].split(":", 1)[0] in sources]
    misses = []
    for case in cases:
        hits = run_search(conn, settings, case["query"], k, filters=Filters(groups=every_group))["chunks"]
        found = {f"{c['source']}:{c['document']}" for c in hits}
        if case["document"] not in found:
            misses.append(case)
    return {"queries": len(cases), "hit_rate": (len(cases) - len(misses)) / len(cases) if cases else 1.0,
            "misses": misses}
