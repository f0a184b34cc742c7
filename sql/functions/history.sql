-- Version history: every publish or deletion of a document is a row in document_versions (sql/002).

CREATE OR REPLACE FUNCTION kb_record_version(p_document_id bigint, p_event text, p_hash text,
                                             p_added int, p_closed int, p_kept int) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO document_versions (document_id, version, event, content_hash, chunks_added, chunks_closed, chunks_kept)
    SELECT p_document_id, coalesce(max(version), 0) + 1, p_event, p_hash, p_added, p_closed, p_kept
    FROM document_versions WHERE document_id = p_document_id;
$$;

-- Soft-delete these live documents of a source: close their chunks, record the deletion in their history and
-- drop their current failures. Returns how many documents were deleted. Nothing is removed.
CREATE OR REPLACE FUNCTION kb_soft_delete_documents(p_source_id text, p_locators text[]) RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        UPDATE documents d SET deleted_at = now(), published_key = NULL
        WHERE d.source_id = p_source_id AND d.deleted_at IS NULL AND d.locator = ANY(p_locators)
        RETURNING d.document_id, d.locator, d.content_hash
    ), closed AS (
        UPDATE chunks c SET valid_to = now()
        FROM gone WHERE c.document_id = gone.document_id AND c.valid_to IS NULL
        RETURNING c.document_id
    ), forgotten AS (
        DELETE FROM failures f USING gone WHERE f.source_id = p_source_id AND f.locator = gone.locator
    ), logged AS (
        SELECT kb_record_version(g.document_id, 'deleted', g.content_hash, 0,
                                 (SELECT count(*)::int FROM closed WHERE closed.document_id = g.document_id), 0)
        FROM gone g
    )
    SELECT count(*)::integer FROM logged;
$$;
