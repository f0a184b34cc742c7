-- Sources beyond a local disk (issue 28). An object store's prefix (kind 'objects': s3://, gs://, az://, any fsspec
-- URL; pipelines/sources/objects.py): each document keeps the tag its store gave it when it was last read (ETag,
-- hash, generation or version id), and a crawl reads again only the objects whose tag changed. A database table or
-- query (kind 'table': pipelines/sources/tables.py), whose declared columns are in table_spec: each document keeps
-- its row's version (updated_at or a version column), and a crawl fetches only the rows whose version changed.
-- version_tag is NULL for files and JSONL records, whose cheap check is size and mtime. upstream_asset: the Dagster
-- asset that produces a source (its key as "a/b"): the source refreshes when it materializes (assets/automation.py).
ALTER TABLE sources DROP CONSTRAINT sources_kind_check;
ALTER TABLE sources ADD CONSTRAINT sources_kind_check CHECK (kind IN ('folder', 'jsonl', 'objects', 'table', 'web'));
ALTER TABLE sources ADD COLUMN table_spec jsonb;
ALTER TABLE sources ADD COLUMN upstream_asset text;
ALTER TABLE documents ADD COLUMN version_tag text;

-- A web site's pages below a URL (kind 'web': pipelines/sources/web.py). version_tag holds the validators a page came
-- with (ETag, Last-Modified) for the next crawl's conditional GET. A page may differ at every request, so the parse
-- stage reads the page as the crawl fetched it, kept here (and again when a new parser version re-parses it).
-- private_network: the site's host may resolve to private addresses (the company's own intranet).
ALTER TABLE sources ADD COLUMN private_network boolean NOT NULL DEFAULT false;
CREATE TABLE fetched_pages (
    document_id  bigint PRIMARY KEY REFERENCES documents ON DELETE CASCADE,
    content_hash text NOT NULL,
    body         bytea NOT NULL
);
