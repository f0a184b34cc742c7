"""Citation validation: does each chunk an answer cites support the claim that cites it?

VALID: the chunk was in the retrieval set and its text is similar enough to the claim (cosine of the active
model's embeddings >= VALID_SIMILARITY). WEAK: retrieved, but less similar. INVALID: the chunk was not in the
retrieval set (or does not exist), so the answer cannot have used it.

Only live chunks of sources the caller may read exist here: any other chunk id is "unknown chunk" with no
similarity, exactly like an id that was never used, so the validator cannot be used to probe hidden text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

import numpy as np
import psycopg
from psycopg import sql

from pipelines.models.embedders import Embedder
from pipelines.retrieval.readable import DOCUMENTS, Readable
from pipelines.storage.vectors import vector_table

VALID_SIMILARITY = 0.5


@dataclass
class Citation:
    claim: str
    chunk_id: int
    status: str  # VALID | WEAK | INVALID
    similarity: float | None
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def validate_citations(conn: psycopg.Connection, embedder: Embedder, claims: list[dict], retrieved: list[int],
                       readable: Readable, threshold: float = VALID_SIMILARITY,
                       as_of: datetime | None = None) -> list[Citation]:
    """claims: [{"text": ..., "citations": [chunk_id, ...]}]; retrieved: the chunk ids the answer was given;
    readable: what the caller may read (pipelines/retrieval/readable.py); as_of: the time the answer reads the
    knowledge base at (cited chunks must have been valid then; None: live now)."""
    cited = sorted({int(c) for claim in claims for c in claim.get("citations", [])})
    rows = conn.execute(sql.SQL("SELECT c.chunk_id, v.embedding FROM chunks c JOIN {} v USING (text_hash)"
                                " JOIN documents d USING (document_id)"
                                " WHERE c.chunk_id = ANY(%(cited)s) AND {} AND CASE"
                                "   WHEN %(as_of)s::timestamptz IS NULL THEN c.valid_to IS NULL"
                                "   ELSE c.valid_from <= %(as_of)s AND (c.valid_to IS NULL OR c.valid_to > %(as_of)s)"
                                " END")
                        .format(vector_table(conn, embedder.model_key), DOCUMENTS),
                        {"cited": cited, **readable.params(), "as_of": as_of}).fetchall()
    vectors = {chunk_id: np.asarray(vector.to_numpy(), dtype=np.float32) for chunk_id, vector in rows}
    claim_vectors = embedder.embed([claim["text"] for claim in claims]) if claims else []
    allowed = set(retrieved)
    results = []
    for claim, claim_vector in zip(claims, claim_vectors):
        for chunk_id in claim.get("citations", []):
            chunk_id = int(chunk_id)
            if chunk_id not in allowed or chunk_id not in vectors:
                reason = "not in the retrieval set" if chunk_id in vectors or chunk_id not in allowed else "unknown chunk"
                results.append(Citation(claim["text"], chunk_id, "INVALID", None, reason))
                continue
            similarity = round(float(np.dot(claim_vector, vectors[chunk_id])), 4)
            status = "VALID" if similarity >= threshold else "WEAK"
            reason = f"similarity {similarity} {'>=' if status == 'VALID' else '<'} {threshold}"
            results.append(Citation(claim["text"], chunk_id, status, similarity, reason))
    return results
