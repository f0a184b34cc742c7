"""The retrieval-quality gate: hit@5 of a small golden set of (query, expected document), checked on a refresh
before it is served.

Each source declares its own golden set (`golden_set` in kb.toml, or none: nothing defaults to the bundled
samples' set). The run checks it inside the publishing transaction (pipelines/ingest/run.py): search there sees
the new version, readers outside still see the old one, and a gate below its floor rolls the refresh back, so the
previous state keeps serving. Each source is held to the floor on its own queries, so its outcome is the same
whichever sources share its run (a backfill of several). Golden queries about other sources do not apply; a
source that no golden query applies to is reported as unchecked.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg

from pipelines.settings import Settings
from pipelines.sources.declarations import DeclarationError, resolve_declared


class GateFailed(RuntimeError):
    """The golden set of a source fell below its floor on a refresh; the refresh was not published."""

    def __init__(self, gate: dict):
        below = "; ".join(f"{source_id}: hit@5 {own['hit_rate']:.2f} is below the floor {own['floor']:g}"
                          f" ({len(own['misses'])} of {own['queries']} golden queries missed: {_listed(own['misses'])})"
                          for source_id, own in gate["sources"].items() if own["applicable"] and not own["passed"])
        super().__init__(f"the golden-set gate failed on {below}; the refresh was rolled back and the previous version"
                         " keeps serving")
        self.gate = gate


def _listed(misses: list[dict]) -> str:
    return "; ".join(f"{m['query']!r} -> {m['document']}" for m in misses[:5])


def golden_cases(path: str, source_id: str) -> list[dict]:
    """The cases of a golden set that are about this source: {"query", "document"} lines whose document is
    `source:locator` of this source, or a bare locator (which then means this source). A set that cannot be read
    is the declaration's fault, not the refresh's: a DeclarationError that says so."""
    try:
        lines = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        located = [(case["query"], case["document"].rpartition(":")) for case in lines]
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DeclarationError(f"source {source_id!r}: its golden_set {path} cannot be read ({type(exc).__name__}:"
                               f" {exc}); fix golden_set in its declaration (kb.toml)") from exc
    return [{"query": query, "document": f"{source_id}:{locator}"}
            for query, (owner, _, locator) in located if owner in ("", source_id)]


def golden_gate(conn: psycopg.Connection, settings: Settings, source_ids: list[str], k: int = 5) -> dict:
    """hit@5 of the golden queries these sources declare, searched as the operator (every group a declared source
    names). `sources` holds each source's own result: `applicable` False when it declares no golden set (or its set
    holds no query about it), `passed` when its own hit@5 reaches the floor. The gate passes when every source it
    applies to passes; its counts are the sources' totals."""
    rows = conn.execute("SELECT source_id, allowed_groups, golden_set, declared_in FROM sources"
                        " WHERE removed_at IS NULL").fetchall()
    every_group = sorted({group for _, groups, _, _ in rows for group in groups or ()})
    sets = {source_id: str(resolve_declared(path, declared_in, source_id))
            for source_id, _, path, declared_in in rows if source_id in source_ids and path}
    own = {source_id: _hit_rate(conn, settings, golden_cases(sets[source_id], source_id) if source_id in sets else [],
                                every_group, k) for source_id in sorted(source_ids)}
    checked = [result for result in own.values() if result["applicable"]]
    queries, misses = sum(r["queries"] for r in checked), [m for r in checked for m in r["misses"]]
    return {"applicable": bool(checked), "queries": queries,
            "hit_rate": (queries - len(misses)) / queries if queries else None, "misses": misses,
            "floor": settings.golden_floor, "passed": bool(checked) and all(r["passed"] for r in checked),
            "golden_sets": sets, "sources": own}


def _hit_rate(conn: psycopg.Connection, settings: Settings, cases: list[dict], groups: list[str], k: int) -> dict:
    """One source's result, in the gate's own shape (so that whatever shows a gate shows it too)."""
    from pipelines.retrieval.responses import run_search  # search's imports only for a run that publishes
    from pipelines.retrieval.search import Filters

    misses = []
    for case in cases:
        hits = run_search(conn, settings, case["query"], k, filters=Filters(groups=groups))["chunks"]
        if case["document"] not in {f"{c['source']}:{c['document']}" for c in hits}:
            misses.append(case)
    hit_rate = (len(cases) - len(misses)) / len(cases) if cases else None
    return {"applicable": bool(cases), "queries": len(cases), "hit_rate": hit_rate, "misses": misses,
            "floor": settings.golden_floor, "passed": bool(cases) and hit_rate >= settings.golden_floor}
