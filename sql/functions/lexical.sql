-- BM25 bookkeeping, kept current by triggers on `chunks` (created in sql/003 and sql/004).
--
-- Every chunk written adds one posting per lexeme of its embedded text (kb_chunk_lexemes), to lexical_postings when it is live and to
-- lexical_postings_closed when it is not; a posting names its term in the chunk's source by lexical_terms.term_key
-- (a row is created for a (term, source) pair the first time one is seen). A chunk that becomes live adds +1 to its
-- source's postings count of each of its lexemes and, for lexemes of its own text (not only of its title/section
-- prefix), +1 to the document frequency in lexical_terms, plus its length to the source's lexical_stats; a chunk
-- that stops being live subtracts the same and its postings move to lexical_postings_closed. Statistics are per
-- source so that search can sum them over the sources a caller may read (sql/queries/hybrid_search.sql). Every change
-- of them is also kept per transaction (lexical_terms_history, lexical_stats_history; sql/015), so an as-of read
-- ranks with the statistics of the versions live then. A term's change in the latest transaction that made one stays
-- on its lexical_terms row (df - df_before, postings - postings_before, at changed_at), and goes to its history the
-- first time a later transaction changes the term: one history row per term and transaction, written once, not one
-- upsert per statement (a publish changes each term in many statements).

-- A chunk's lexemes: its prefix's (title and section path) and its own text's, each read on its own, the text's
-- weighted A. A lexeme's positions count it in the embedded text (its tf); an A among its weights says the chunk's own
-- text holds it (document frequency counts those). Read on its own, a text that opens with "~" or ".." keeps them as
-- a query that opens with them does ("~/.pgpass"); read after the prefix's blank line, the parser drops them.
CREATE OR REPLACE FUNCTION kb_chunk_lexemes(prefix text, body text) RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT kb_lexemes(prefix) || setweight(kb_lexemes(body), 'A')
$$;

-- The length BM25 normalises by: every position of every lexeme.
CREATE OR REPLACE FUNCTION kb_lexemes_length(lexemes tsvector) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(sum(coalesce(array_length(u.positions, 1), 1)), 0)::int FROM unnest(lexemes) AS u
$$;

-- A chunk's length as BM25 normalises it (every position of every lexeme of its embedded text, at most 32,767), as
-- each of its postings, live or closed, carries it: one index probe. A chunk without a lexeme has no posting and
-- length 0.
CREATE OR REPLACE FUNCTION kb_chunk_length(p_chunk_id bigint) RETURNS int
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT length FROM lexical_postings_any WHERE chunk_id = p_chunk_id LIMIT 1), 0)
$$;

-- Adds changes to the statistics: per term (document frequency, postings) and per source (chunks, total length),
-- as parallel arrays. The callers below work out the changes, each the cheapest way it can.
CREATE OR REPLACE FUNCTION kb_lexical_add(term_keys int[], term_df bigint[], term_postings bigint[],
                                          source_keys int[], source_chunks bigint[], source_lengths bigint[])
RETURNS void LANGUAGE sql AS $$
    WITH delta AS (
        SELECT * FROM unnest(term_keys, term_df, term_postings) AS d(term_key, df, postings)
    ), terms AS (  -- a data-modifying CTE always runs to completion
        UPDATE lexical_terms t SET df = t.df + coalesce(d.df, 0), postings = t.postings + d.postings,
            df_before = CASE WHEN t.changed_at IS DISTINCT FROM now() THEN t.df ELSE t.df_before END,
            postings_before = CASE WHEN t.changed_at IS DISTINCT FROM now() THEN t.postings ELSE t.postings_before END,
            changed_at = now()
        FROM delta d WHERE t.term_key = d.term_key AND (d.postings <> 0 OR d.df <> 0)
        RETURNING WITH (OLD AS was) t.term_key, was.changed_at, was.df - was.df_before AS df,
            was.postings - was.postings_before AS postings
    ), flushed AS (  -- the change an earlier transaction left on the row goes to the history
        INSERT INTO lexical_terms_history AS h (term_key, changed_at, df, postings)
        SELECT term_key, changed_at, df, postings FROM terms WHERE changed_at <> now() AND (df <> 0 OR postings <> 0)
        ON CONFLICT (term_key, changed_at) DO UPDATE SET df = h.df + excluded.df, postings = h.postings + excluded.postings
    ), sources_delta AS (
        SELECT * FROM unnest(source_keys, source_chunks, source_lengths) AS s(source_key, chunks, total_length)
    ), sources_then AS (
        INSERT INTO lexical_stats_history AS h (source_key, changed_at, chunks, total_length)
        SELECT source_key, now(), chunks, total_length FROM sources_delta
        ON CONFLICT (source_key, changed_at) DO UPDATE
            SET chunks = h.chunks + excluded.chunks, total_length = h.total_length + excluded.total_length
    )
    INSERT INTO lexical_stats AS st (source_key, chunks, total_length)
    SELECT source_key, chunks, total_length FROM sources_delta
    ON CONFLICT (source_key) DO UPDATE
        SET chunks = st.chunks + excluded.chunks, total_length = st.total_length + excluded.total_length;
$$;

-- Chunks entering or leaving the live set, whose postings are already written: their changes are read back from the
-- postings, and document frequency from the lexemes of each chunk's own text.
CREATE OR REPLACE FUNCTION kb_lexical_apply(entered bigint[], left_ bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    term_keys int[]; term_df bigint[]; term_postings bigint[];
    source_keys int[]; source_chunks bigint[]; source_lengths bigint[];
BEGIN
    WITH moved AS (
        SELECT unnest(entered) AS chunk_id, 1 AS sign UNION ALL SELECT unnest(left_), -1
    ), changed AS MATERIALIZED (
        -- A chunk's source from its document, or, when the document row is already gone (a delete cascading
        -- from it), from its postings' terms; term counts need no source.
        SELECT m.chunk_id, m.sign, kb_chunk_length(m.chunk_id) AS lexical_length, c.text,
               coalesce(src.source_key, (SELECT k.source_key FROM lexical_postings_any p JOIN lexical_terms k USING (term_key)
                                         WHERE p.chunk_id = m.chunk_id LIMIT 1)) AS source_key
        FROM moved m
        JOIN chunks c USING (chunk_id)
        LEFT JOIN documents d USING (document_id)
        LEFT JOIN sources src USING (source_id)
    ), body AS MATERIALIZED (  -- the lexemes of each chunk's own text, computed once per chunk
        SELECT ch.chunk_id, u.lexeme FROM changed ch CROSS JOIN LATERAL unnest(tsvector_to_array(kb_lexemes(ch.text))) AS u(lexeme)
    ), delta AS (
        SELECT p.term_key, sum(ch.sign) FILTER (WHERE b.lexeme IS NOT NULL) AS df, sum(ch.sign) AS postings
        FROM changed ch
        JOIN lexical_postings_any p USING (chunk_id)
        JOIN lexical_terms t ON t.term_key = p.term_key
        LEFT JOIN body b ON b.chunk_id = ch.chunk_id AND b.lexeme = t.term
        GROUP BY p.term_key
    ), sources_delta AS (
        SELECT source_key, sum(sign) AS chunks, sum(sign * lexical_length) AS total_length FROM changed
        WHERE source_key IS NOT NULL GROUP BY source_key
    )
    SELECT t.keys, t.df, t.postings, s.keys, s.chunks, s.lengths
    INTO term_keys, term_df, term_postings, source_keys, source_chunks, source_lengths
    FROM (SELECT array_agg(term_key) AS keys, array_agg(df) AS df, array_agg(postings) AS postings FROM delta) t,
         (SELECT array_agg(source_key) AS keys, array_agg(chunks) AS chunks, array_agg(total_length) AS lengths
          FROM sources_delta) s;
    PERFORM kb_lexical_add(term_keys, term_df, term_postings, source_keys, source_chunks, source_lengths);
END $$;

CREATE OR REPLACE FUNCTION kb_lexical_on_insert() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    term_keys int[]; term_df bigint[]; term_postings bigint[];
    source_keys int[]; source_chunks bigint[]; source_lengths bigint[];
BEGIN
    -- Each chunk's lexemes once (kb_chunk_lexemes; a plain LATERAL subquery would be inlined and recomputed per
    -- use): one tsvector gives each lexeme's count and whether the chunk's own text holds it. A (term, source) pair new to
    -- lexical_terms gets its key here; one a concurrent writer added meanwhile is found by the no-op update, which
    -- returns it. The new chunks' changes to the statistics are counted from these rows, not read back.
    WITH vectors AS MATERIALIZED (
        SELECT n.chunk_id, n.valid_to IS NULL AS live, s.source_key,
               kb_chunk_lexemes(n.embed_prefix, n.text) AS lexemes
        FROM new_rows n
        JOIN documents d USING (document_id)
        JOIN sources s USING (source_id)
    ), sized AS MATERIALIZED (  -- a chunk's length, as its postings hold it
        SELECT v.*, least(kb_lexemes_length(v.lexemes), 32767) AS length FROM vectors v
    ), lexemes AS MATERIALIZED (
        SELECT z.chunk_id, z.live, z.source_key, z.length,
               u.lexeme, coalesce(array_length(u.positions, 1), 1) AS tf, 'A' = ANY(u.weights) AS in_body
        FROM sized z CROSS JOIN LATERAL unnest(z.lexemes) AS u
    ), pairs AS MATERIALIZED (
        SELECT DISTINCT lexeme AS term, source_key FROM lexemes
    ), known AS (
        SELECT t.term, t.source_key, t.term_key FROM lexical_terms t JOIN pairs USING (term, source_key)
    ), added AS (
        INSERT INTO lexical_terms AS t (term, source_key, df, postings)
        SELECT p.term, p.source_key, 0, 0 FROM pairs p
        WHERE NOT EXISTS (SELECT 1 FROM lexical_terms k WHERE k.term = p.term AND k.source_key = p.source_key)
        ORDER BY 1, 2
        ON CONFLICT (term, source_key) DO UPDATE SET df = t.df
        RETURNING t.term, t.source_key, t.term_key
    ), keyed AS MATERIALIZED (
        SELECT l.chunk_id, l.live, k.term_key, l.tf, l.length, l.in_body
        FROM lexemes l JOIN (SELECT * FROM known UNION ALL SELECT * FROM added) k
            ON k.term = l.lexeme AND k.source_key = l.source_key
    ), closed AS (
        INSERT INTO lexical_postings_closed (chunk_id, term_key, tf, length)
        SELECT chunk_id, term_key, tf, length FROM keyed WHERE NOT live ORDER BY chunk_id
    ), live AS (
        -- In chunk order: a chunk's postings share heap pages (one or two per probe) and its key in the chunk index.
        INSERT INTO lexical_postings (chunk_id, term_key, tf, length)
        SELECT chunk_id, term_key, tf, length FROM keyed WHERE live ORDER BY chunk_id
    )
    SELECT t.keys, t.df, t.postings, s.keys, s.chunks, s.lengths
    INTO term_keys, term_df, term_postings, source_keys, source_chunks, source_lengths
    FROM (SELECT array_agg(term_key) AS keys, array_agg(df) AS df, array_agg(postings) AS postings
          FROM (SELECT term_key, count(*) FILTER (WHERE in_body) AS df, count(*) AS postings FROM keyed WHERE live
                GROUP BY term_key) d) t,
         (SELECT array_agg(source_key) AS keys, array_agg(chunks) AS chunks, array_agg(total_length) AS lengths
          FROM (SELECT source_key, count(*) AS chunks, sum(length) AS total_length FROM sized WHERE live
                GROUP BY source_key) c) s;
    PERFORM kb_lexical_add(term_keys, term_df, term_postings, source_keys, source_chunks, source_lengths);
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
        WITH reopened AS (DELETE FROM lexical_postings_closed WHERE chunk_id = ANY(entered) RETURNING *)
        INSERT INTO lexical_postings (chunk_id, term_key, tf, length)
        SELECT chunk_id, term_key, tf, length FROM reopened;
        WITH closed AS (DELETE FROM lexical_postings WHERE chunk_id = ANY(left_) RETURNING *)
        INSERT INTO lexical_postings_closed (chunk_id, term_key, tf, length)
        SELECT chunk_id, term_key, tf, length FROM closed;
        PERFORM kb_lexical_apply(entered, left_);
    END IF;
    -- A live chunk kept with the same embedded text split differently between prefix and text (publish updates
    -- both): its postings stand, but document frequency counts the lexemes of its own text, so move those counts.
    WITH d AS MATERIALIZED (
        SELECT p.term_key, sum(r.sign) AS df
        FROM (SELECT n.chunk_id, n.text, 1 AS sign FROM new_rows n JOIN old_rows o USING (chunk_id)
              WHERE n.valid_to IS NULL AND o.valid_to IS NULL AND n.text <> o.text
              UNION ALL
              SELECT o.chunk_id, o.text, -1 FROM new_rows n JOIN old_rows o USING (chunk_id)
              WHERE n.valid_to IS NULL AND o.valid_to IS NULL AND n.text <> o.text) r
        CROSS JOIN LATERAL unnest(tsvector_to_array(kb_lexemes(r.text))) AS u(lexeme)
        JOIN lexical_postings p ON p.chunk_id = r.chunk_id
        JOIN lexical_terms k ON k.term_key = p.term_key AND k.term = u.lexeme
        GROUP BY p.term_key
        HAVING sum(r.sign) <> 0
    ), terms AS (
        UPDATE lexical_terms t SET df = t.df + d.df,
            df_before = CASE WHEN t.changed_at IS DISTINCT FROM now() THEN t.df ELSE t.df_before END,
            postings_before = CASE WHEN t.changed_at IS DISTINCT FROM now() THEN t.postings ELSE t.postings_before END,
            changed_at = now()
        FROM d WHERE t.term_key = d.term_key
        RETURNING WITH (OLD AS was) t.term_key, was.changed_at, was.df - was.df_before AS df,
            was.postings - was.postings_before AS postings
    )
    INSERT INTO lexical_terms_history AS h (term_key, changed_at, df, postings)  -- as kb_lexical_add does
    SELECT term_key, changed_at, df, postings FROM terms WHERE changed_at <> now() AND (df <> 0 OR postings <> 0)
    ON CONFLICT (term_key, changed_at) DO UPDATE SET df = h.df + excluded.df, postings = h.postings + excluded.postings;
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

-- Deletes (retention purges of closed chunks) drop their postings in one statement per table.
CREATE OR REPLACE FUNCTION kb_lexical_after_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lexical_postings p USING old_rows o WHERE p.chunk_id = o.chunk_id;
    DELETE FROM lexical_postings_closed p USING old_rows o WHERE p.chunk_id = o.chunk_id;
    RETURN NULL;
END $$;

-- A term's document frequency and postings as of a time: its history up to then, and its latest change if it was
-- made by then (still on its row; see kb_lexical_add).
CREATE OR REPLACE FUNCTION kb_term_then(t lexical_terms, p_as_of timestamptz, OUT df bigint, OUT postings bigint)
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(h.df), 0) + CASE WHEN t.changed_at <= p_as_of THEN t.df - t.df_before ELSE 0 END,
           coalesce(sum(h.postings), 0) + CASE WHEN t.changed_at <= p_as_of THEN t.postings - t.postings_before ELSE 0 END
    FROM lexical_terms_history h WHERE h.term_key = t.term_key AND h.changed_at <= p_as_of;
$$;

-- The statistics the query classifier and the answer layer weigh a query's words with, over some sources, live or
-- as of a time (then from the statistics' history, so a read of the past weighs words as they were weighed then).
CREATE OR REPLACE FUNCTION kb_term_stats(p_terms text[], p_source_keys int[], p_as_of timestamptz)
RETURNS TABLE (term text, df bigint, postings bigint) LANGUAGE sql STABLE AS $$
    SELECT t.term, sum(coalesce(past.df, t.df))::bigint, sum(coalesce(past.postings, t.postings))::bigint
    FROM lexical_terms t
    LEFT JOIN LATERAL kb_term_then(t, p_as_of) AS past ON p_as_of IS NOT NULL
    WHERE t.term = ANY(p_terms) AND t.source_key = ANY(p_source_keys)
    GROUP BY t.term;
$$;

CREATE OR REPLACE FUNCTION kb_readable_chunks(p_source_keys int[], p_as_of timestamptz) RETURNS float8
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(chunks), 0)::float8 FROM (
        SELECT chunks FROM lexical_stats WHERE source_key = ANY(p_source_keys) AND p_as_of IS NULL
        UNION ALL
        SELECT chunks FROM lexical_stats_history WHERE source_key = ANY(p_source_keys) AND changed_at <= p_as_of
    ) s;
$$;
