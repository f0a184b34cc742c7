"""The retrieval-quality gate: hit@5 of a small golden set of (query, expected document), checked on a refresh
before it is served.

The publish stage runs the gate inside its transaction (pipelines/ingest.py): search there sees the new version,
readers outside still see the old one, and a gate below its floor rolls the refresh back, so the previous state
keeps serving. Golden queries about other sources do not apply; a refresh that no golden query applies to is
reported as unchecked, never as passed.
"""

from __future__ import annotations

import json

import psycopg

from pipelines.retrieval.responses import run_search
from pipelines.retrieval.search import Filters
from pipelines.settings import Settings


class GateFailed(RuntimeError):
    """The golden set fell below its floor on a refresh; the refresh was not published."""

    def __init__(self, gate: dict):
        misses = "; ".join(f"{m['query']!r} -> {m['document']}" for m in gate["misses"][:5])
        super().__init__(f"the golden-set gate failed: hit@5 {gate['hit_rate']:.2f} is below the floor {gate['floor']:g}"
                         f" ({len(gate['misses'])} of {gate['queries']} golden queries missed: {misses}); the refresh"
                         " was rolled back and the previous version keeps serving")
        self.gate = gate


def golden_gate(conn: psycopg.Connection, settings: Settings, source_ids: list[str] | None = None, k: int = 5) -> dict:
    """hit@5 of the golden queries about these sources (all declared sources when None), searched as the operator
    (every group a declared source names). `applicable` is False when no golden query is about them."""
    rows = conn.execute("SELECT source_id, allowed_groups FROM sources WHERE removed_at IS NULL").fetchall()
    sources = {source_id for source_id, _ in rows if source_ids is None or source_id in source_ids}
    every_group = sorted({group for _, groups in rows for group in groups or ()})
    path = settings.golden_set
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path and path.is_file() else []
    cases = [c for c in cases if c["document"].split(":", 1)[0] in sources]
    misses = []
    for case in cases:
        hits = run_search(conn, settings, case["query"], k, filters=Filters(groups=every_group))["chunks"]
        if case["document"] not in {f"{c['source']}:{c['document']}" for c in hits}:
            misses.append(case)
    hit_rate = (len(cases) - len(misses)) / len(cases) if cases else None
    return {"applicable": bool(cases), "queries": len(cases), "hit_rate": hit_rate, "misses": misses,
            "floor": settings.golden_floor, "passed": bool(cases) and hit_rate >= settings.golden_floor,
            "golden_set": str(path) if path else None}
