-- Sources beyond a local disk (issue 28). An object store's prefix (kind 'objects': s3://, gs://, az://, any fsspec
-- URL; pipelines/sources/objects.py): each document keeps the tag its store gave it when it was last read (ETag,
-- hash, generation or version id), and a crawl reads again only the objects whose tag changed. A database table or
-- query (kind 'table': pipelines/sources/tables.py), whose declared columns are in table_spec: each document keeps
-- its row's version (updated_at or a version column), and a crawl fetches only the rows whose version changed.
-- version_tag is NULL for files and JSONL records, whose cheap check is size and mtime. upstream_asset: the Dagster
-- asset that produces a source (its key as "a/b"): the source refreshes when it materializes (assets/automation.py).
ALTER TABLE sources DROP CONSTRAINT sources_kind_check;
ALTER TABLE sources ADD CONSTRAINT sources_kind_check CHECK (kind IN ('folder', 'jsonl', 'objects', 'table'));
ALTER TABLE sources ADD COLUMN table_spec jsonb;
ALTER TABLE sources ADD COLUMN upstream_asset text;
ALTER TABLE documents ADD COLUMN version_tag text;
