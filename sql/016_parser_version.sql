-- The parser version that made each document's elements (pipelines/ingest/parse.py PARSER_VERSION: kb's parse
-- recipe and the installed unstructured), so that a new version re-parses stored documents as CHUNKER_VERSION
-- re-chunks them: files from their unchanged bytes at the parse stage, JSONL records at extract. NULL is unknown:
-- not parsed yet, or parsed before this column existed, so every document stored today is parsed once more by the
-- next refresh; one whose elements come out the same is neither re-chunked nor published again.
ALTER TABLE documents ADD COLUMN parser_version text;
