-- BM25 from an inverted index: one posting (term, chunk, term frequency, chunk length) per lexeme of a chunk.
-- Scoring then reads only the postings of the query's terms (cost: the sum of their document frequencies)
-- instead of every matching chunk's whole tsvector. Postings of closed chunks stay, flagged not live, so
-- as-of queries keep a lexical arm.

CREATE TABLE lexical_postings (
    term     text NOT NULL,
    chunk_id bigint NOT NULL,
    tf       int NOT NULL,
    length   int NOT NULL,                 -- the chunk's lexical_length, for length normalisation
    live     boolean NOT NULL,
    PRIMARY KEY (term, chunk_id)
);
CREATE INDEX lexical_postings_chunk ON lexical_postings (chunk_id);

INSERT INTO lexical_postings
SELECT u.lexeme, c.chunk_id, coalesce(array_length(u.positions, 1), 1), c.lexical_length, c.valid_to IS NULL
FROM chunks c, unnest(c.search_tsv) AS u;

CREATE OR REPLACE FUNCTION kb_lexical_on_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lexical_postings
    SELECT u.lexeme, n.chunk_id, coalesce(array_length(u.positions, 1), 1), n.lexical_length, n.valid_to IS NULL
    FROM new_rows n, unnest(n.search_tsv) AS u;
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

-- Deletes (retention purges of closed chunks, documents removed for good) drop their postings in one statement.
DROP TRIGGER chunks_lexical_delete ON chunks;
DROP FUNCTION kb_lexical_on_delete();
CREATE FUNCTION kb_lexical_before_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.valid_to IS NULL THEN
        PERFORM kb_lexical_apply('{}', ARRAY[OLD.chunk_id]);
    END IF;
    RETURN OLD;
END $$;
CREATE TRIGGER chunks_lexical_delete_live BEFORE DELETE ON chunks
    FOR EACH ROW WHEN (OLD.valid_to IS NULL) EXECUTE FUNCTION kb_lexical_before_delete();
CREATE FUNCTION kb_lexical_after_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM lexical_postings p USING old_rows o WHERE p.chunk_id = o.chunk_id;
    RETURN NULL;
END $$;
CREATE TRIGGER chunks_lexical_delete AFTER DELETE ON chunks
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION kb_lexical_after_delete();

-- Search no longer scans tsvectors; the GIN index stays for ad-hoc full-text queries and filters.
