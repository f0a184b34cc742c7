-- Vectors of one embedding model, keyed by the hash of the embedded text: identical text is embedded once.
-- Half precision (halfvec, 2 bytes a dimension: half the bytes of float32 at the same recall; sql/013).
-- {table} and {dimensions} are composed by pipelines/storage/vectors.py (psycopg.sql) when a model is first used; its HNSW index
-- is sql/templates/vector_index.sql, kept apart because big loads build it after the rows are in.
CREATE TABLE IF NOT EXISTS {table} (
    text_hash text PRIMARY KEY,
    embedding halfvec({dimensions}) NOT NULL
);
