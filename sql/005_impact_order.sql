-- Postings of a term in impact order (high term frequency first, then short chunks), covering what BM25 reads,
-- so the lexical arm can take the best prefix of a long posting list from the index without sorting it
-- (sql/queries/hybrid_search.sql). For a fixed term, BM25's contribution rises with tf and falls with length;
-- ordering by tf first is exact within a tf and a close approximation across them.
CREATE INDEX lexical_postings_impact ON lexical_postings (term, tf DESC, length) INCLUDE (chunk_id, live);
