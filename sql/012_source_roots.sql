-- The identity (device:inode) of each source's root folder, per host, recorded at its first crawl there
-- (pipelines/sources/files.py). A later crawl whose root is another folder (replaced, or a link to another folder)
-- is refused and reads and deletes nothing, until the operator confirms the new root.
ALTER TABLE sources ADD COLUMN root_identities jsonb NOT NULL DEFAULT '{}';
