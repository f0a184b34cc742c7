-- Access follows today's declarations through history and aliases, and a refresh is one snapshot (issue 27).
--
-- 1. A source is its declaration, not its name. `kb source remove` renames the source's row to `<name>~<key>`
--    (a name no declaration can take: `~` is not allowed in names), so its history keeps the readers it had and a
--    later declaration under the old name is a new source with no history and no recorded root. Documents and
--    failures follow the rename (ON UPDATE CASCADE); lexical statistics are keyed by source_key, which stays.
-- 2. source_coverage: which declared, restricted source governs which part of another source. A row (S, R, p) says
--    that S's documents at locator p or below p/ ('' = all of S) lie in R's folder, so a caller who may not read R
--    reads none of them, in any version, whatever S's own readers (pipelines/sources/overlaps.py keeps it from the
--    real folders: device, inode and mount, at every declaration and crawl).
-- 3. declared_hash: the kb.toml text a source was last applied from, so a run can say the file changed since.
-- 4. vanished_at: a document the last crawl did not find. Extract only marks it; the gated publish transaction
--    deletes it, with what it publishes, so a refresh is served whole or not at all.
-- 5. 'moved' versions: declaring a restricted source inside another one moves the documents under its folder, with
--    their history, to it (kb_move_documents).
-- 6. Lexical statistics over time: every change of a term's document frequency and posting count and of a
--    source's chunk count and length is kept per transaction, so an as-of read ranks with the statistics of the
--    versions live then. Backfilled here from the chunks' validity; sql/functions/lexical.sql keeps them.

ALTER TABLE documents DROP CONSTRAINT documents_source_id_fkey,
    ADD CONSTRAINT documents_source_id_fkey FOREIGN KEY (source_id) REFERENCES sources ON DELETE CASCADE ON UPDATE CASCADE;
ALTER TABLE failures DROP CONSTRAINT failures_source_id_fkey,
    ADD CONSTRAINT failures_source_id_fkey FOREIGN KEY (source_id) REFERENCES sources ON DELETE CASCADE ON UPDATE CASCADE;
UPDATE sources SET source_id = source_id || '~' || source_key WHERE removed_at IS NOT NULL;

CREATE TABLE source_coverage (
    source_id  text NOT NULL REFERENCES sources ON DELETE CASCADE ON UPDATE CASCADE,
    covered_by text NOT NULL REFERENCES sources ON DELETE CASCADE ON UPDATE CASCADE,
    prefix     text NOT NULL,               -- a locator, or a folder of locators; '' = every document
    PRIMARY KEY (source_id, covered_by, prefix)
);
-- What the declarations already say, from their paths' text (a restricted source declared inside a public one
-- before this migration left the public one's history of those files readable by all). The next declaration or
-- crawl decides again on what the folders really are (pipelines/sources/overlaps.py).
WITH paths AS (
    SELECT source_id, kind, removed_at IS NULL AND allowed_groups IS NOT NULL AS restricting,
           rtrim(CASE WHEN location LIKE '/%' OR declared_in IS NULL THEN location
                      ELSE regexp_replace(declared_in, '/[^/]*$', '') || '/' || location END, '/') AS path
    FROM sources
)
INSERT INTO source_coverage (source_id, covered_by, prefix)
SELECT s.source_id, r.source_id,
       CASE WHEN s.path = r.path OR s.path ^@ (r.path || '/') THEN '' ELSE substr(r.path, length(s.path) + 2) END
FROM paths r JOIN paths s ON s.source_id <> r.source_id
WHERE r.restricting
  AND (s.path = r.path OR s.path ^@ (r.path || '/') OR (s.kind = 'folder' AND r.path ^@ (s.path || '/')));

-- The documents of a source under a path prefix, found by a range of the C-ordered locator (search takes what a
-- caller may not read out of the statistics: sql/queries/hybrid_search.sql).
CREATE INDEX documents_by_path ON documents (source_id, (locator COLLATE "C"));

ALTER TABLE sources ADD COLUMN declared_hash text;
ALTER TABLE documents ADD COLUMN vanished_at timestamptz;

ALTER TABLE document_versions DROP CONSTRAINT document_versions_event_check,
    ADD CONSTRAINT document_versions_event_check CHECK (event IN ('published', 'deleted', 'moved'));

-- A term's change in the latest transaction that changed it waits on its row until a later one changes it again
-- (then it goes to lexical_terms_history): sql/functions/lexical.sql.
ALTER TABLE lexical_terms ADD COLUMN changed_at timestamptz, ADD COLUMN df_before bigint NOT NULL DEFAULT 0,
    ADD COLUMN postings_before bigint NOT NULL DEFAULT 0;
CREATE TABLE lexical_terms_history (
    term_key   int NOT NULL,                -- lexical_terms.term_key
    changed_at timestamptz NOT NULL,        -- the transaction's time, as chunks' valid_from and valid_to
    df         int NOT NULL,                -- the change of its document frequency then
    postings   int NOT NULL,                -- the change of its live postings then
    PRIMARY KEY (term_key, changed_at)
);
CREATE TABLE lexical_stats_history (
    source_key   int NOT NULL,
    changed_at   timestamptz NOT NULL,
    chunks       bigint NOT NULL,
    total_length bigint NOT NULL,
    PRIMARY KEY (source_key, changed_at)
);

INSERT INTO lexical_stats_history (source_key, changed_at, chunks, total_length)
SELECT s.source_key, e.at, sum(e.sign), sum(e.sign * c.lexical_length)
FROM chunks c JOIN documents d USING (document_id) JOIN sources s USING (source_id)
CROSS JOIN LATERAL (VALUES (c.valid_from, 1), (c.valid_to, -1)) AS e(at, sign)
WHERE e.at IS NOT NULL
GROUP BY 1, 2;

WITH body AS MATERIALIZED (  -- each chunk's own lexemes once (document frequency counts its text, not its title)
    SELECT c.chunk_id, u.lexeme FROM chunks c CROSS JOIN LATERAL unnest(tsvector_to_array(kb_lexemes(c.text))) AS u(lexeme)
)
INSERT INTO lexical_terms_history (term_key, changed_at, df, postings)
SELECT p.term_key, e.at, coalesce(sum(e.sign) FILTER (WHERE b.lexeme IS NOT NULL), 0), sum(e.sign)
FROM chunks c
JOIN lexical_postings_any p USING (chunk_id)
JOIN lexical_terms t ON t.term_key = p.term_key
LEFT JOIN body b ON b.chunk_id = c.chunk_id AND b.lexeme = t.term
CROSS JOIN LATERAL (VALUES (c.valid_from, 1), (c.valid_to, -1)) AS e(at, sign)
WHERE e.at IS NOT NULL
GROUP BY 1, 2;
