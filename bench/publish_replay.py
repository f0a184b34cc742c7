"""The publish stage alone, replayed on a store a first ingest built (issue 32, item 1).

    .venv/bin/python -m bench.first_ingest ../shared/datasets/scifact/corpus.jsonl --home /tmp/kb-bench-first
    .venv/bin/python -m bench.publish_replay /tmp/kb-bench-first --home /tmp/kb-bench-publish --runs 3

Copies the knowledge base in the first home to --home (its server stopped first: `kb stop`), turns the copy's chunks
back into drafts (their vectors stay, keyed by text hash) and empties its chunks and BM25 tables. Each run then
publishes every draft with `publish_ready`, as the ingest's publish stage does, inside one transaction that is rolled
back, so that every run starts from the same state; the tables are vacuumed before each run (a rolled-back run leaves
dead rows and index entries behind, which slowed each next run by about a second here). To compare two versions of
the SQL, run the same command from two checkouts on two copies, alternating.

Writes bench/results/publish_replay.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

from bench.report import write_results

TABLES = ("chunks, lexical_postings, lexical_postings_closed, lexical_terms, lexical_terms_history, lexical_stats,"
          " lexical_stats_history")
DRAFTED = ("document_id, ordinal, kind, text, section_path, page_number, token_count, embed_text, text_hash, entities,"
           " enrich_version")


class RolledBack(Exception):
    """Raised inside the run's transaction to roll it back."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("built", type=Path, help="the home of a first ingest (bench.first_ingest --home)")
    parser.add_argument("--home", type=Path, required=True, help="where the copy goes (replaced)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    shutil.rmtree(args.home, ignore_errors=True)
    # cp -a keeps the files' owner: the embedded server runs as a user of its own when kb runs as root.
    subprocess.run(["cp", "-a", str(args.built), str(args.home)], check=True)
    shutil.rmtree(args.home / "run", ignore_errors=True)  # the first home's server state, not the copy's
    os.environ["KB_HOME"] = str(args.home)

    from pipelines.ingest.publish import publish_ready
    from pipelines.settings import load_settings
    from pipelines.storage.database import connect, upgrade_schema

    settings = load_settings()
    upgrade_schema(settings)  # the copy gets this checkout's schema: it is this checkout's SQL that is timed
    with connect(settings) as conn:
        with conn.transaction():
            conn.execute(f"INSERT INTO chunk_drafts (build_key, {DRAFTED})"
                         f" SELECT 'replay', {DRAFTED} FROM chunks WHERE valid_to IS NULL AND kind <> 'card'")
            conn.execute(f"TRUNCATE {TABLES} CASCADE")
            conn.execute("UPDATE documents SET published_key = NULL")
        seconds, counts = [], {}
        for _ in range(args.runs):
            conn.execute(f"VACUUM ANALYZE {TABLES}, documents, chunk_drafts")
            started = time.perf_counter()
            try:
                with conn.transaction():
                    counts = dict(publish_ready(conn).counts)
                    seconds.append(round(time.perf_counter() - started, 2))
                    raise RolledBack
            except RolledBack:
                pass
    print(f"publish of {counts.get('chunks_inserted')} chunks ({counts.get('documents')} documents): {seconds} s")
    write_results("publish_replay", {"built": str(args.built), "seconds": seconds, "counts": counts})


if __name__ == "__main__":
    main()
