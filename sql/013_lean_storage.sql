-- Storage a million chunks can afford (issue 21): the same search in about 40% fewer bytes per chunk
-- (bench/README.md, "Where the bytes go"). Three cuts, measured at equal recall:
--
-- 1. Vectors are half precision (pgvector's halfvec, 2 bytes a dimension) in their tables and HNSW indexes. Every
--    model's table is converted here, so one format serves, switches back and backfills; a model registered later
--    gets a halfvec table from sql/templates/vector_store.sql. Embedders still hand over float32: vector converts
--    to halfvec implicitly on insert and in `<=>`. An HNSW index is rebuilt only where there was one (a model
--    being built gets its index when it is activated).
-- 2. `chunks.search_tsv` goes with its GIN index: BM25 reads lexical_postings, nothing read the stored tsvector,
--    and the postings trigger computes the lexemes itself (sql/functions/lexical.sql). The table is rewritten
--    (CLUSTER on its key, the order rows were written in) so that existing rows give the column's bytes back.
-- 3. lexical_postings is rebuilt narrower: fixed-width columns first (no alignment padding), tf and length as
--    smallint (a tsvector keeps at most 256 positions per lexeme; lengths are capped at 32,767 lexemes, far above
--    any embedding model's input), and the impact-ordered index holds live postings only (closed ones have
--    lexical_postings_history), without the `live` flag both partial indexes imply. A chunk's postings are found
--    by a plain index on chunk_id instead of the (chunk_id, term) primary key: B-tree deduplication stores each
--    chunk id once for all its postings (about 8 bytes a posting instead of 35), and the postings, written
--    together, sit on one or two heap pages, which a probe for (chunk, term) filters by term. Nothing relied on
--    the key's uniqueness: a chunk's lexemes are distinct by construction.

DO $$
DECLARE
    model record;
    hnsw record;
    indexed boolean;
BEGIN
    FOR model IN SELECT m.vector_table, m.dimensions FROM embedding_models m
                 WHERE to_regclass(quote_ident(m.vector_table)) IS NOT NULL LOOP
        indexed := false;
        FOR hnsw IN SELECT i.indexrelid::regclass::text AS name FROM pg_index i
                    JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am a ON a.oid = c.relam
                    WHERE i.indrelid = quote_ident(model.vector_table)::regclass AND a.amname = 'hnsw' LOOP
            EXECUTE format('DROP INDEX %s', hnsw.name);
            indexed := true;
        END LOOP;
        EXECUTE format('ALTER TABLE %I ALTER COLUMN embedding TYPE halfvec(%s)', model.vector_table, model.dimensions);
        IF indexed THEN
            EXECUTE format('CREATE INDEX %I ON %I USING hnsw (embedding halfvec_cosine_ops)',
                           model.vector_table || '_hnsw', model.vector_table);
        END IF;
    END LOOP;
END $$;

DROP INDEX chunks_search_tsv;
ALTER TABLE chunks DROP COLUMN search_tsv;
CLUSTER chunks USING chunks_pkey;

CREATE TABLE lexical_postings_lean (
    chunk_id   bigint NOT NULL,
    source_key int NOT NULL,
    tf         smallint NOT NULL,
    length     smallint NOT NULL,          -- the chunk's lexical_length, at most 32,767
    live       boolean NOT NULL,
    in_body    boolean NOT NULL,
    term       text NOT NULL
);
INSERT INTO lexical_postings_lean (chunk_id, source_key, tf, length, live, in_body, term)
SELECT chunk_id, source_key, tf, least(length, 32767), live, in_body, term FROM lexical_postings
ORDER BY chunk_id, term;
DROP TABLE lexical_postings;
ALTER TABLE lexical_postings_lean RENAME TO lexical_postings;
CREATE INDEX lexical_postings_chunk ON lexical_postings (chunk_id);
CREATE INDEX lexical_postings_impact ON lexical_postings (term, source_key, tf DESC, length) INCLUDE (chunk_id)
    WHERE live;
CREATE INDEX lexical_postings_history ON lexical_postings (term, source_key, tf DESC, length) INCLUDE (chunk_id)
    WHERE NOT live;
ANALYZE lexical_postings;
