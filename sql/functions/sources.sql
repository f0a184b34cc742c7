-- Moving documents between sources (sql/015): when a restricted source is declared inside another source's folder,
-- the documents the outer source holds under that folder become the inner source's, with every version, so that
-- from then on they are read, searched as of any time and counted in statistics as the inner source's
-- (pipelines/sources/declarations.py, pipelines/ingest/extract.py).
--
-- kb_move_documents(from, folder, to, into): the documents of `from` at `folder` or below it become `to`'s, at
-- `into` inside `to`'s folder ('' = its root; a mount can show a folder deep inside `to`'s) with the rest of their
-- path below it; a locator `to` already holds stays behind, soft-deleted (source_coverage keeps it unreadable to
-- callers outside `to`'s groups). Postings are re-keyed to `to`'s terms; live statistics leave one source for the
-- other; the statistics' history is rewritten as if the chunks had always been `to`'s, so an as-of read of either
-- source never counts the other's documents. Each moved document's history gets a 'moved' version. Returns how many
-- documents moved. Callers hold both sources' locks.
DROP FUNCTION IF EXISTS kb_move_documents(text, text, text);
CREATE OR REPLACE FUNCTION kb_move_documents(p_from text, p_folder text, p_to text, p_into text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    from_key int := (SELECT source_key FROM sources WHERE source_id = p_from);
    to_key int := (SELECT source_key FROM sources WHERE source_id = p_to);
    docs bigint[];
    moved bigint[];  -- every chunk of the moving documents, live or closed
    live bigint[];
    clashing text[];
BEGIN
    CREATE TEMP TABLE kb_moving ON COMMIT DROP AS
    SELECT d.document_id, d.locator,
           CASE WHEN d.locator = p_folder THEN p_into
                ELSE concat_ws('/', nullif(p_into, ''), substr(d.locator, length(p_folder) + 2)) END AS target
    FROM documents d
    WHERE d.source_id = p_from AND (d.locator = p_folder OR d.locator ^@ (p_folder || '/'));
    docs := ARRAY(SELECT m.document_id FROM kb_moving m
                  WHERE NOT EXISTS (SELECT 1 FROM documents t WHERE t.source_id = p_to AND t.locator = m.target));
    clashing := ARRAY(SELECT locator FROM kb_moving WHERE document_id <> ALL(docs));
    PERFORM kb_soft_delete_documents(p_from, clashing);
    IF cardinality(docs) = 0 THEN
        DROP TABLE kb_moving;
        RETURN 0;
    END IF;
    moved := ARRAY(SELECT chunk_id FROM chunks WHERE document_id = ANY(docs));
    live := ARRAY(SELECT chunk_id FROM chunks WHERE document_id = ANY(docs) AND valid_to IS NULL);

    PERFORM kb_lexical_apply('{}', live);  -- the live chunks leave `from`'s statistics...

    INSERT INTO lexical_terms AS t (term, source_key, df, postings)
    SELECT DISTINCT k.term, to_key, 0, 0
    FROM lexical_postings_any p JOIN lexical_terms k USING (term_key)
    WHERE p.chunk_id = ANY(moved) ORDER BY 1
    ON CONFLICT (term, source_key) DO NOTHING;
    CREATE TEMP TABLE kb_rekey ON COMMIT DROP AS
    SELECT k.term_key AS old_key, n.term_key AS new_key, k.term
    FROM lexical_terms k JOIN lexical_terms n ON n.term = k.term AND n.source_key = to_key
    WHERE k.source_key = from_key
      AND k.term_key IN (SELECT term_key FROM lexical_postings_any WHERE chunk_id = ANY(moved));

    -- The history as if these chunks had always been `to`'s: each one's span [valid_from, valid_to or now) leaves
    -- `from` and joins `to`. (For live chunks, kb_lexical_apply's rows at now() above and below net out with the
    -- span's end at now().)
    WITH spans AS MATERIALIZED (
        SELECT c.chunk_id, c.text, kb_chunk_length(c.chunk_id) AS lexical_length, e.at, e.sign
        FROM chunks c CROSS JOIN LATERAL (VALUES (c.valid_from, 1), (coalesce(c.valid_to, now()), -1)) AS e(at, sign)
        WHERE c.chunk_id = ANY(moved)
    ), stats AS (
        SELECT key, at, sum(sign) AS chunks, sum(sign * lexical_length) AS total_length
        FROM (SELECT from_key AS key, at, -sign AS sign, lexical_length FROM spans
              UNION ALL SELECT to_key, at, sign, lexical_length FROM spans) s
        GROUP BY key, at
    ), stats_written AS (
        INSERT INTO lexical_stats_history AS h (source_key, changed_at, chunks, total_length)
        SELECT key, at, chunks, total_length FROM stats
        ON CONFLICT (source_key, changed_at) DO UPDATE
            SET chunks = h.chunks + excluded.chunks, total_length = h.total_length + excluded.total_length
    ), body AS MATERIALIZED (
        SELECT c.chunk_id, u.lexeme FROM chunks c CROSS JOIN LATERAL unnest(tsvector_to_array(kb_lexemes(c.text))) AS u(lexeme)
        WHERE c.chunk_id = ANY(moved)
    ), terms AS (
        SELECT key, at, sum(sign) FILTER (WHERE in_body) AS df, sum(sign) AS postings
        FROM (SELECT r.old_key AS key, s.at, -s.sign AS sign, b.lexeme IS NOT NULL AS in_body
              FROM spans s JOIN lexical_postings_any p USING (chunk_id) JOIN kb_rekey r ON r.old_key = p.term_key
              LEFT JOIN body b ON b.chunk_id = s.chunk_id AND b.lexeme = r.term
              UNION ALL
              SELECT r.new_key, s.at, s.sign, b.lexeme IS NOT NULL
              FROM spans s JOIN lexical_postings_any p USING (chunk_id) JOIN kb_rekey r ON r.old_key = p.term_key
              LEFT JOIN body b ON b.chunk_id = s.chunk_id AND b.lexeme = r.term) t
        GROUP BY key, at
    )
    INSERT INTO lexical_terms_history AS h (term_key, changed_at, df, postings)
    SELECT key, at, coalesce(df, 0), postings FROM terms
    ON CONFLICT (term_key, changed_at) DO UPDATE SET df = h.df + excluded.df, postings = h.postings + excluded.postings;

    UPDATE lexical_postings p SET term_key = r.new_key FROM kb_rekey r
    WHERE p.chunk_id = ANY(moved) AND p.term_key = r.old_key;
    UPDATE lexical_postings_closed p SET term_key = r.new_key FROM kb_rekey r
    WHERE p.chunk_id = ANY(moved) AND p.term_key = r.old_key;

    DELETE FROM failures f USING documents d
    WHERE d.document_id = ANY(docs) AND f.source_id = p_from AND f.locator = d.locator;
    UPDATE documents d SET source_id = p_to, locator = m.target FROM kb_moving m
    WHERE d.document_id = m.document_id AND m.document_id = ANY(docs);
    DROP TABLE kb_moving;

    PERFORM kb_lexical_apply(live, '{}');  -- ...and join `to`'s
    PERFORM kb_record_version(d.document_id, 'moved', d.content_hash, 0, 0,
                              (SELECT count(*)::int FROM chunks c WHERE c.document_id = d.document_id AND c.valid_to IS NULL))
    FROM documents d WHERE d.document_id = ANY(docs);
    -- What netted out at now() (the live chunks' leaving and joining) is no change at all.
    DELETE FROM lexical_stats_history WHERE source_key IN (from_key, to_key) AND changed_at = now()
        AND chunks = 0 AND total_length = 0;
    DELETE FROM lexical_terms_history h USING kb_rekey r WHERE h.term_key IN (r.old_key, r.new_key)
        AND h.changed_at = now() AND h.df = 0 AND h.postings = 0;
    DROP TABLE kb_rekey;
    RETURN cardinality(docs);
END $$;
