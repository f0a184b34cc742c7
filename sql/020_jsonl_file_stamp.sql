-- The JSONL file of a source as its last clean crawl opened it (issue 32: a no-op refresh of a JSONL source reads
-- nothing): device, inode, size, mtime and ctime (any write changes ctime, which no one sets back), the record size
-- limit and parser version it was read under, and how many live documents the crawl left. A crawl that opens the
-- file with the same stamp, while the source has no failure and every record's elements are current, knows each
-- record unchanged without reading a line. NULL: read the file (no clean crawl yet, or the last one failed somewhere).
ALTER TABLE sources ADD COLUMN file_stamp text;
