"""Citation validation: does each chunk an answer cites support the claim that cites it?

VALID: the chunk was in the retrieval set and its text is similar enough to the claim (cosine of the active
model's embeddings >= VALID_SIMILARITY). WEAK: retrieved, but less similar. INVALID: the chunk was not in the
retrieval set (or does not exist), so the answer cannot have used it.

Only live chunks of sources the caller may read exist here: any other chunk id is "unknown chunk" with no
similarity, exactly like an id that was never used, so the validator cannot be used to probe hidden text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import psycopg
from psycopg import sql

from pipelines.models.embedders import Embedder
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
                       readable_sources: list[str], threshold: float = VALID_SIMILARITY) -> list[Citation]:
    """claims: [{"text": ..., "citations": [chunk_id, ...]}]; retrieved: the chunk ids the answer was given;
    readable_sources: the sources the caller may read."""
    cited = sorted({int(c) for claim in claims for c in claim.get("citations", [])})
    rows = conn.execute(sql.SQL("SELECT c.chunk_id, v.embedding FROM chunks c JOIN {} v USING (text_hash)"
                                " JOIN documents d USING (document_id)"
                                " WHERE c.chunk_id = ANY(%s) AND c.valid_to IS NULL AND d.source_id = ANY(%s)")
                        .format(vector_table(conn, embedder.model_key)), (cited, readable_sources)).fetchall()
    vectors = {chunk_id: np.asarray(vector.to_numpy()) for chunk_id, vector in rows}
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
