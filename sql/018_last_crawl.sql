-- What a source's last crawl did (issue 28, item 6), for `kb status` and the Dagster asset metadata: how many
-- documents it listed, read, found unchanged (and how many of those it did not read at all, known unchanged by the
-- kind's cheap check: size and mtime, an ETag, a 304, a row's version), failed and marked deleted. One small jsonb
-- per source, replaced by each crawl; a crawl that saw nothing records {"blind": true}.
ALTER TABLE sources ADD COLUMN last_crawl jsonb;
