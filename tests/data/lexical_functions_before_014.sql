-- A snapshot, for tests only: sql/functions/lexical.sql as it was before sql/014 (commit 74959f8). The migration
-- tests build databases of older schemas with it (tests/test_migrations.py); today's functions write sql/014's
-- postings and cannot. Never applied by kb.
--
-- BM25 bookkeeping, kept current by triggers on `chunks` (created in sql/003 and sql/004).
--
-- Every chunk that becomes live adds one posting per lexeme of its embedded text to lexical_postings (flagged
-- in_body when the chunk's own text, not only its title/section prefix, holds the lexeme), +1 to its source's
-- postings count of each lexeme and, for in_body lexemes, +1 to the document frequency in lexical_terms, plus its
-- length to the source's lexical_stats; a chunk that stops being live subtracts the same. Statistics are per
-- source so that search can sum them over the sources a caller may read (sql/queries/hybrid_search.sql).

CREATE OR REPLACE FUNCTION kb_lexical_apply(entered bigint[], left_ bigint[]) RETURNS void
LANGUAGE sql AS $$
    WITH moved AS (
        SELECT unnest(entered) AS chunk_id, 1 AS sign UNION ALL SELECT unnest(left_), -1
    ), changed AS (
        SELECT m.sign, src.source_key, c.lexical_length
        FROM moved m
        JOIN chunks c USING (chunk_id)
        JOIN documents d USING (document_id)
        JOIN sources src USING (source_id)
    ), delta AS (
        SELECT p.source_key, p.term, sum(m.sign) FILTER (WHERE p.in_body) AS df, sum(m.sign) AS postings
        FROM moved m JOIN lexical_postings p USING (chunk_id)
        GROUP BY 1, 2
    ), terms AS (  -- a data-modifying CTE always runs to completion
        INSERT INTO lexical_terms AS t (term, source_key, df, postings)
        SELECT term, source_key, coalesce(df, 0), postings FROM delta WHERE postings <> 0
        ON CONFLICT (term, source_key) DO UPDATE SET df = t.df + excluded.df, postings = t.postings + excluded.postings
    )
    INSERT INTO lexical_stats AS st (source_key, chunks, total_length)
    SELECT source_key, sum(sign), sum(sign * lexical_length) FROM changed GROUP BY source_key
    ON CONFLICT (source_key) DO UPDATE
        SET chunks = st.chunks + excluded.chunks, total_length = st.total_length + excluded.total_length;
$$;

CREATE OR REPLACE FUNCTION kb_lexical_on_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The body's lexemes once per chunk: a plain LATERAL subquery is inlined and recomputed per posting
    -- (about 50 times a chunk, which made loads 6x slower).
    WITH body AS MATERIALIZED (
        SELECT n.chunk_id, tsvector_to_array(kb_lexemes(n.text)) AS lexemes FROM new_rows n
    )
    INSERT INTO lexical_postings (term, chunk_id, tf, length, live, source_key, in_body)
    SELECT u.lexeme, n.chunk_id, coalesce(array_length(u.positions, 1), 1), least(n.lexical_length, 32767),
           n.valid_to IS NULL, s.source_key, u.lexeme = ANY(b.lexemes)
    FROM new_rows n
    JOIN body b USING (chunk_id)
    JOIN documents d USING (document_id)
    JOIN sources s USING (source_id)
    CROSS JOIN LATERAL unnest(kb_lexemes(n.embed_text)) AS u;
    PERFORM kb_lexical_apply(ARRAY(SELECT chunk_id FROM new_rows WHERE valid_to IS NULL), '{}');
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION kb_lexical_on_update() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    entered bigint[] := ARRAY(SELECT n.chunk_id FROM new_rows n JOIN old_rows o USING (chunk_id)
                              WHERE o.valid_to IS NOT NULL AND n.valid_to IS NULL);
    left_ bigint[] := ARRAY(SELECT n.chunk_id FROM new_rows n JOIN old_rows o USING (chunk_id)
                            WHERE o.valid_to IS NULL AND n.valid_to IS NOT NULL);
BEGIN
    IF cardinality(entered) + cardinality(left_) > 0 THEN
        UPDATE lexical_postings SET live = (chunk_id = ANY(entered))
        WHERE chunk_id = ANY(entered) OR chunk_id = ANY(left_);
        PERFORM kb_lexical_apply(entered, left_);
    END IF;
    RETURN NULL;
END $$;

-- A live chunk deleted outright (not closed) leaves the statistics before its row goes.
CREATE OR REPLACE FUNCTION kb_lexical_before_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.valid_to IS NULL THEN
        PERFORM kb_lexical_apply('{}', ARRAY[OLD.chunk_id]);
    END IF;
    RETURN OLD;
END $$;

-- Deletes (retention purges of closed chunks) drop their postings in one statement.
CREATE OR REPLACE FUNCTION kb_lexical_after_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lexical_postings p USING old_rows o WHERE p.chunk_id = o.chunk_id;
    RETURN NULL;
END $$;
