-- The model table's HNSW index (cosine; pgvector defaults m 16, ef_construction 64). Built once after a big load,
-- in memory and with parallel workers, which is several times faster than growing it one insert at a time.
CREATE INDEX IF NOT EXISTS {index} ON {table} USING hnsw (embedding halfvec_cosine_ops);
