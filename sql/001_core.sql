-- kb core schema: sources -> documents -> elements -> chunk_drafts -> chunks, with vectors per model.
-- Each stage reads the previous stage's table and writes its own, so any stage can be re-run alone.

CREATE EXTENSION IF NOT EXISTS vector;

-- A configured place documents come from: a folder (with globs) or a JSONL file of records.
CREATE TABLE sources (
    source_id       text PRIMARY KEY,
    kind            text NOT NULL CHECK (kind IN ('folder', 'jsonl')),
    location        text NOT NULL,
    include_globs   text[] NOT NULL DEFAULT '{}',
    exclude_globs   text[] NOT NULL DEFAULT '{}',
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_crawled_at timestamptz
);

-- One row per document identity (a file path or a record id within a source); the latest crawl of it.
CREATE TABLE documents (
    document_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_id     text NOT NULL REFERENCES sources ON DELETE CASCADE,
    locator       text NOT NULL,            -- path relative to the source folder, or the record's _id
    doc_format    text NOT NULL,            -- pdf, html, md, txt, docx, pptx, xlsx, csv, eml, record
    size_bytes    bigint NOT NULL,
    mtime         timestamptz,
    content_hash  text NOT NULL,            -- xxh3-128 of the bytes (or of the record) as last crawled
    title         text,
    metadata      jsonb NOT NULL DEFAULT '{}',  -- author, dates and other file metadata
    parsed_hash   text,                     -- content_hash whose elements are stored
    published_key text,                     -- content_hash/chunker/enricher/model of the live chunks
    deleted_at    timestamptz,
    UNIQUE (source_id, locator)
);

-- The parser's output, kept so that re-chunking never re-parses files.
CREATE TABLE elements (
    document_id  bigint NOT NULL REFERENCES documents ON DELETE CASCADE,
    seq          int NOT NULL,
    category     text NOT NULL,             -- unstructured's category: Title, NarrativeText, Table, ...
    text         text NOT NULL,
    depth        int,                       -- heading depth for Title elements
    page_number  int,
    section_path text[] NOT NULL DEFAULT '{}',
    text_as_html text,
    PRIMARY KEY (document_id, seq)
);

-- Chunks of a new document version, built and enriched but not yet visible to search.
CREATE TABLE chunk_drafts (
    document_id    bigint NOT NULL REFERENCES documents ON DELETE CASCADE,
    ordinal        int NOT NULL,
    build_key      text NOT NULL,           -- content_hash/chunker version the draft was built from
    kind           text NOT NULL CHECK (kind IN ('text', 'table')),
    text           text NOT NULL,
    section_path   text[] NOT NULL,
    page_number    int,
    token_count    int NOT NULL,            -- model tokens of text; of embed_text once enriched
    embed_text     text,                    -- set by enrichment: titles + section path + text
    text_hash      text,                    -- xxh3-128 of embed_text: the embedding cache key
    entities       jsonb,
    enrich_version text,
    PRIMARY KEY (document_id, ordinal)
);

-- Published chunks, current and closed. Search reads rows with valid_to IS NULL.
CREATE TABLE chunks (
    chunk_id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    document_id     bigint NOT NULL REFERENCES documents ON DELETE CASCADE,
    ordinal         int NOT NULL,
    kind            text NOT NULL,
    text            text NOT NULL,
    embed_text      text NOT NULL,
    text_hash       text NOT NULL,
    section_path    text[] NOT NULL,
    page_number     int,
    token_count     int NOT NULL,           -- model tokens of embed_text: never above the model's limit
    entities        jsonb NOT NULL DEFAULT '{}',
    chunker_version text NOT NULL,
    enrich_version  text NOT NULL,
    valid_from      timestamptz NOT NULL DEFAULT now(),
    valid_to        timestamptz,
    search_tsv      tsvector GENERATED ALWAYS AS (to_tsvector('english', embed_text)) STORED
);
CREATE INDEX chunks_current_by_document ON chunks (document_id, ordinal) WHERE valid_to IS NULL;
CREATE INDEX chunks_text_hash ON chunks (text_hash);
CREATE INDEX chunks_search_tsv ON chunks USING gin (search_tsv) WHERE valid_to IS NULL;
CREATE INDEX chunks_entities ON chunks USING gin (entities jsonb_path_ops) WHERE valid_to IS NULL;

-- Embedding models and the table that holds each one's vectors (see sql/templates/vector_store.sql).
CREATE TABLE embedding_models (
    model_key    text PRIMARY KEY,          -- e.g. local:all-MiniLM-L6-v2:384
    dimensions   int NOT NULL,
    vector_table text NOT NULL UNIQUE,
    state        text NOT NULL CHECK (state IN ('building', 'active', 'retired')),
    created_at   timestamptz NOT NULL DEFAULT now(),
    activated_at timestamptz
);

-- The current failure of a file or record, cleared when it next succeeds.
CREATE TABLE failures (
    source_id    text NOT NULL REFERENCES sources ON DELETE CASCADE,
    locator      text NOT NULL,
    stage        text NOT NULL,
    reason       text NOT NULL,
    content_hash text,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_id, locator)
);

-- One row per ingest run, with its counters, for `kb status` and audits.
CREATE TABLE ingest_runs (
    run_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    sources     text[] NOT NULL,
    counters    jsonb NOT NULL DEFAULT '{}'
);

-- Soft-delete the documents of a source that a complete crawl did not see, and close their chunks.
-- Returns how many documents were deleted. History stays: nothing is removed.
CREATE FUNCTION kb_soft_delete_missing(p_source_id text, p_seen text[]) RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        UPDATE documents d SET deleted_at = now(), published_key = NULL
        WHERE d.source_id = p_source_id AND d.deleted_at IS NULL AND d.locator NOT IN (SELECT unnest(p_seen))
        RETURNING d.document_id
    ), closed AS (
        UPDATE chunks c SET valid_to = now()
        FROM gone WHERE c.document_id = gone.document_id AND c.valid_to IS NULL
        RETURNING 1
    )
    SELECT count(*)::integer FROM gone;
$$;
