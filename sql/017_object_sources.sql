-- Object-store sources (s3://, gs://, az://, any fsspec URL: pipelines/sources/objects.py). A document of one keeps
-- the tag its store gave it when it was last read (ETag, hash, generation or version id): a crawl reads again only
-- the objects whose tag changed. NULL for files and records, whose cheap check is size and mtime.
ALTER TABLE sources DROP CONSTRAINT sources_kind_check;
ALTER TABLE sources ADD CONSTRAINT sources_kind_check CHECK (kind IN ('folder', 'jsonl', 'objects'));
ALTER TABLE documents ADD COLUMN version_tag text;
