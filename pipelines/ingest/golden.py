"""The retrieval-quality gate: hit@5 of a small golden set of (query, expected document), checked on a refresh
before it is served.

Each source declares its own golden set (`golden_set` in kb.toml, or none: nothing defaults to the bundled
samples' set). The run checks it inside the publishing transaction (pipelines/ingest/run.py): search there sees
the new version, readers outside still see the old one, and a gate below its floor rolls the refresh back, so the
previous state keeps serving. Golden queries about other sources do not apply; a refresh that no golden query
applies to is reported as unchecked, never as passed.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg

from pipelines.retrieval.responses import run_search
from pipelines.retrieval.search import Filters
from pipelines.settings import Settings
from pipelines.sources.declarations import resolve_declared


class GateFailed(RuntimeError):
    """The golden set fell below its floor on a refresh; the refresh was not published."""

    def __init__(self, gate: dict):
        misses = "; ".join(f"{m['query']!r} -> {m['document']}" for m in gate["misses"][:5])
        super().__init__(f"the golden-set gate failed: hit@5 {gate['hit_rate']:.2f} is below the floor {gate['floor']:g}"
                         f" ({len(gate['misses'])} of {gate['queries']} golden queries missed: {misses}); the refresh"
                         " was rolled back and the previous version keeps serving")
        self.gate = gate


def golden_cases(path: str, source_id: str) -> list[dict]:
    """The cases of a golden set that are about this source: {"query", "document"} lines whose document is
    `source:locator` of this source, or a bare locator (which then means this source)."""
    cases = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        case = json.loads(line)
        owner, _, locator = case["document"].rpartition(":")
        if owner in ("", source_id):
            cases.append({"query": case["query"], "document": f"{source_id}:{locator}"})
    return cases


def golden_gate(conn: psycopg.Connection, settings: Settings, source_ids: list[str], k: int = 5) -> dict:
    """hit@5 of the golden queries these sources declare, searched as the operator (every group a declared source
    names). `applicable` is False when none of them declares a golden set (or its set holds no query about it)."""
    rows = conn.execute("SELECT source_id, allowed_groups, golden_set, declared_in FROM sources"
                        " WHERE removed_at IS NULL").fetchall()
    every_group = sorted({group for _, groups, _, _ in rows for group in groups or ()})
    sets = {source_id: str(resolve_declared(path, declared_in, source_id))
            for source_id, _, path, declared_in in rows if source_id in source_ids and path}
    cases = [case for source_id, path in sorted(sets.items()) for case in golden_cases(path, source_id)]
    misses = []
    for case in cases:
        hits = run_search(conn, settings, case["query"], k, filters=Filters(groups=every_group))["chunks"]
        if case["document"] not in {f"{c['source']}:{c['document']}" for c in hits}:
            misses.append(case)
    hit_rate = (len(cases) - len(misses)) / len(cases) if cases else None
    return {"applicable": bool(cases), "queries": len(cases), "hit_rate": hit_rate, "misses": misses,
            "floor": settings.golden_floor, "passed": bool(cases) and hit_rate >= settings.golden_floor,
            "golden_sets": sets}
