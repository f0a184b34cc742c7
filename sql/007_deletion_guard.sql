-- Nothing lost by accident.
-- A crawl that would soft-delete more than this share of a source's live documents deletes nothing unless the
-- run is confirmed (`kb ingest --allow-deletions`); 1 lets any share go. Deletions are now made by
-- kb_soft_delete_documents (sql/functions/history.sql), which deletes exactly the documents the crawl found
-- missing, never those under a part of the source it could not read.
ALTER TABLE sources ADD COLUMN max_deletion_share double precision NOT NULL DEFAULT 0.5
    CHECK (max_deletion_share > 0 AND max_deletion_share <= 1);
DROP FUNCTION kb_soft_delete_missing(text, text[]);

-- Vectors that are not unit length (all zeros, NaN) were once accepted from embedding endpoints; they make
-- cosine scores NaN. Drop them so the embed stage computes them again (it now refuses such vectors).
DO $$
DECLARE
    vector_table text;
BEGIN
    FOR vector_table IN SELECT m.vector_table FROM embedding_models m WHERE m.state <> 'retired' LOOP
        EXECUTE format('DELETE FROM %I WHERE NOT (vector_norm(embedding) BETWEEN 0.99 AND 1.01)', vector_table);
    END LOOP;
END $$;
