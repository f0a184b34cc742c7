"""Recall@100 of the dense arm's HNSW search (ef_search as kb sets it) against exact search, on real vectors.

    KB_HOME=/tmp/kb-eval .venv/bin/python -m bench.dense_recall kb_eval_scifact ../shared/datasets/scifact

Uses a database that `kb eval` filled; the queries are the dataset's, embedded by the local model.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
from psycopg import sql

from pipelines.models.embedders import make_embedder
from pipelines.retrieval.search import EF_SEARCH, search
from pipelines.settings import load_settings
from pipelines.storage.database import connect, database_url, ensure_database
from pipelines.storage.vectors import model_tables


def main(dbname: str, dataset: Path, queries: int = 200) -> None:
    settings = load_settings()
    settings = dataclasses.replace(settings, database_url=ensure_database(database_url(settings), dbname))
    texts = [json.loads(line)["text"] for line in (dataset / "queries.jsonl").read_text().splitlines()][:queries]
    embedder = make_embedder(settings)
    vectors = embedder.embed(texts)
    with connect(settings) as conn:
        table = sql.Identifier(model_tables(conn)[embedder.model_key])
        rows = conn.execute(sql.SQL("SELECT c.chunk_id, v.embedding FROM chunks c JOIN {} v USING (text_hash)"
                                    " WHERE c.valid_to IS NULL").format(table)).fetchall()
        ids = np.array([r[0] for r in rows])
        matrix = np.stack([r[1].to_numpy() for r in rows]).astype(np.float32)
        recalls = []
        for text, vector in zip(texts, vectors):
            exact = set(ids[np.argsort(-(matrix @ vector))[:100]])
            # The same query vector for both: the int8 model's vectors move slightly with their batch.
            approx = {h.chunk_id for h in search(conn, embedder, text, 100, arm="dense", k_overfetch=100,
                                                 vector=vector)}
            recalls.append(len(exact & approx) / 100)
    print(json.dumps({"chunks": len(ids), "queries": len(texts), "ef_search": max(EF_SEARCH, 200),
                      "recall@100": round(float(np.mean(recalls)), 4), "min": min(recalls)}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
