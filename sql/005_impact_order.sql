-- Postings laid out for the pruned BM25 of sql/queries/hybrid_search.sql.
-- 1. A term's postings in impact order (high term frequency first, then short chunks), covering what BM25
--    reads, so the lexical arm takes the best prefix of a long posting list straight from the index. For a fixed
--    term BM25's contribution rises with tf and falls with length: ordering by tf first is exact within a tf
--    and a close approximation across them.
-- 2. The primary key becomes (chunk_id, term): completing a candidate's score is one probe per remaining term,
--    the triggers find a chunk's postings by its prefix (so the separate chunk index goes), and new chunks'
--    postings append at the end of the key instead of landing all over it.
CREATE INDEX lexical_postings_impact ON lexical_postings (term, tf DESC, length) INCLUDE (chunk_id, live);
ALTER TABLE lexical_postings DROP CONSTRAINT lexical_postings_pkey, ADD PRIMARY KEY (chunk_id, term);
DROP INDEX lexical_postings_chunk;
