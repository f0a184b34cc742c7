-- Version history, staleness and the per-document audit trail.

-- One row per published version or deletion of a document: what changed, and when.
CREATE TABLE document_versions (
    document_id   bigint NOT NULL REFERENCES documents ON DELETE CASCADE,
    version       int NOT NULL,
    event         text NOT NULL CHECK (event IN ('published', 'deleted')),
    content_hash  text,
    recorded_at   timestamptz NOT NULL DEFAULT now(),
    chunks_added  int NOT NULL DEFAULT 0,
    chunks_closed int NOT NULL DEFAULT 0,
    chunks_kept   int NOT NULL DEFAULT 0,
    PRIMARY KEY (document_id, version)
);

-- Set by the staleness sweep when the document's source has not been crawled within its freshness window.
ALTER TABLE documents ADD COLUMN stale_since timestamptz;

-- As-of reads: which chunks were live at a time.
CREATE INDEX chunks_validity ON chunks (document_id, valid_from, valid_to);
CREATE INDEX chunks_closed ON chunks (valid_to) WHERE valid_to IS NOT NULL;

CREATE OR REPLACE FUNCTION kb_record_version(p_document_id bigint, p_event text, p_hash text,
                                             p_added int, p_closed int, p_kept int) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO document_versions (document_id, version, event, content_hash, chunks_added, chunks_closed, chunks_kept)
    SELECT p_document_id, coalesce(max(version), 0) + 1, p_event, p_hash, p_added, p_closed, p_kept
    FROM document_versions WHERE document_id = p_document_id;
$$;

-- Soft-delete the documents of a source that a complete crawl did not see, close their chunks and record
-- the deletion in their history. Returns how many documents were deleted. Nothing is removed.
CREATE OR REPLACE FUNCTION kb_soft_delete_missing(p_source_id text, p_seen text[]) RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        UPDATE documents d SET deleted_at = now(), published_key = NULL
        WHERE d.source_id = p_source_id AND d.deleted_at IS NULL AND d.locator NOT IN (SELECT unnest(p_seen))
        RETURNING d.document_id, d.content_hash
    ), closed AS (
        UPDATE chunks c SET valid_to = now()
        FROM gone WHERE c.document_id = gone.document_id AND c.valid_to IS NULL
        RETURNING c.document_id
    ), logged AS (
        SELECT kb_record_version(g.document_id, 'deleted', g.content_hash, 0,
                                 (SELECT count(*)::int FROM closed WHERE closed.document_id = g.document_id), 0)
        FROM gone g
    )
    SELECT count(*)::integer FROM logged;
$$;
