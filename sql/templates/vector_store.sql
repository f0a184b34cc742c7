-- Vectors of one embedding model, keyed by the hash of the embedded text: identical text is embedded once.
-- {table} and {dimensions} are filled in by pipelines/vector_store.py when a model is first used.
CREATE TABLE IF NOT EXISTS {table} (
    text_hash text PRIMARY KEY,
    embedding vector({dimensions}) NOT NULL
);
CREATE INDEX IF NOT EXISTS {index} ON {table} USING hnsw (embedding vector_cosine_ops);
