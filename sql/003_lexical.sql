-- The lexical arm: BM25 computed inside PostgreSQL.
--
-- Each chunk's lexemes are English-stemmed words plus its identifiers in a compact form (HR-2024-047 ->
-- hr2024047, max_wal_senders -> maxwalsenders), so that codes match exactly. Document frequencies and corpus
-- length statistics are maintained incrementally by triggers on `chunks`, so BM25's idf and length
-- normalisation are always those of the live corpus.

CREATE FUNCTION kb_identifiers(t text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(string_agg(lower(regexp_replace(m[1], '[^A-Za-z0-9]', '', 'g')), ' '), '')
    FROM regexp_matches(t, '([A-Za-z0-9]+(?:[-_./][A-Za-z0-9]+)+|[A-Za-z]+[0-9][A-Za-z0-9]*|[0-9]+[A-Za-z][A-Za-z0-9]*)', 'g') AS m
    WHERE m[1] ~ '[0-9_]'
$$;

CREATE FUNCTION kb_lexemes(t text) RETURNS tsvector
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT to_tsvector('english'::regconfig, t) || to_tsvector('simple'::regconfig, kb_identifiers(t))
$$;

-- Token count of a text as BM25 sees it (every position of every lexeme).
CREATE FUNCTION kb_lexical_length(t text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(sum(coalesce(array_length(u.positions, 1), 1)), 0)::int FROM unnest(kb_lexemes(t)) AS u
$$;

DROP INDEX chunks_search_tsv;
ALTER TABLE chunks DROP COLUMN search_tsv;
ALTER TABLE chunks ADD COLUMN search_tsv tsvector GENERATED ALWAYS AS (kb_lexemes(embed_text)) STORED;
ALTER TABLE chunks ADD COLUMN lexical_length int GENERATED ALWAYS AS (kb_lexical_length(embed_text)) STORED;
CREATE INDEX chunks_search_tsv ON chunks USING gin (search_tsv) WHERE valid_to IS NULL;

CREATE TABLE lexical_terms (
    term text PRIMARY KEY,
    df   bigint NOT NULL                   -- live chunks containing the term
);
CREATE TABLE lexical_stats (
    singleton    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    chunks       bigint NOT NULL,          -- live chunks
    total_length bigint NOT NULL           -- sum of their lexical_length
);
INSERT INTO lexical_stats
SELECT true, count(*), coalesce(sum(lexical_length), 0) FROM chunks WHERE valid_to IS NULL;
INSERT INTO lexical_terms
SELECT u.lexeme, count(*) FROM chunks c, unnest(c.search_tsv) AS u WHERE c.valid_to IS NULL GROUP BY u.lexeme;

-- Apply +1/-1 for chunks that became live / stopped being live in one statement.
CREATE FUNCTION kb_lexical_apply(entered bigint[], left_ bigint[]) RETURNS void
LANGUAGE sql AS $$
    WITH delta AS (
        SELECT u.lexeme AS term, sum(s.sign) AS df
        FROM (SELECT unnest(entered) AS chunk_id, 1 AS sign UNION ALL SELECT unnest(left_), -1) s
        JOIN chunks c USING (chunk_id), unnest(c.search_tsv) AS u
        GROUP BY u.lexeme
    ), upserted AS (  -- a data-modifying CTE always runs to completion
        INSERT INTO lexical_terms AS t (term, df) SELECT term, df FROM delta WHERE df <> 0
        ON CONFLICT (term) DO UPDATE SET df = t.df + excluded.df
    )
    UPDATE lexical_stats SET
        chunks = chunks + coalesce(array_length(entered, 1), 0) - coalesce(array_length(left_, 1), 0),
        total_length = total_length
            + coalesce((SELECT sum(lexical_length) FROM chunks WHERE chunk_id = ANY(entered)), 0)
            - coalesce((SELECT sum(lexical_length) FROM chunks WHERE chunk_id = ANY(left_)), 0);
$$;

CREATE FUNCTION kb_lexical_on_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kb_lexical_apply(ARRAY(SELECT chunk_id FROM new_rows WHERE valid_to IS NULL), '{}');
    RETURN NULL;
END $$;

CREATE FUNCTION kb_lexical_on_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kb_lexical_apply(
        ARRAY(SELECT n.chunk_id FROM new_rows n JOIN old_rows o USING (chunk_id)
              WHERE o.valid_to IS NOT NULL AND n.valid_to IS NULL),
        ARRAY(SELECT n.chunk_id FROM new_rows n JOIN old_rows o USING (chunk_id)
              WHERE o.valid_to IS NULL AND n.valid_to IS NOT NULL));
    RETURN NULL;
END $$;

CREATE TRIGGER chunks_lexical_insert AFTER INSERT ON chunks
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION kb_lexical_on_insert();
CREATE TRIGGER chunks_lexical_update AFTER UPDATE ON chunks
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION kb_lexical_on_update();

-- Deleting live chunks (a document removed for good) is rare; it is handled before the rows go.
CREATE FUNCTION kb_lexical_on_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.valid_to IS NULL THEN
        PERFORM kb_lexical_apply('{}', ARRAY[OLD.chunk_id]);
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER chunks_lexical_delete BEFORE DELETE ON chunks
    FOR EACH ROW EXECUTE FUNCTION kb_lexical_on_delete();

-- Filters: a document's date (from its own metadata) and the groups allowed to see it (NULL: everyone).
ALTER TABLE documents ADD COLUMN doc_date date;
ALTER TABLE documents ADD COLUMN allowed_groups text[];
ALTER TABLE sources ADD COLUMN allowed_groups text[];
CREATE INDEX documents_doc_date ON documents (doc_date);
