-- Golden sets are declared per source (issue 17): a source names the file of (query, expected document) pairs that
-- its refreshes must keep finding, or none. Nothing defaults to the bundled samples' set any more.
-- The path is stored as declared: relative to the config file that declares the source, or absolute.
ALTER TABLE sources ADD COLUMN golden_set text;
