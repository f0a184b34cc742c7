-- Storage a million chunks can afford, second step (issue 21): the same search in about half the bytes per chunk
-- of sql/012 (bench/README.md, "Where the bytes go"). Postings are about 60% of a chunk's bytes, and a posting row
-- is mostly fixed cost (24 bytes of tuple header, 8-byte aligned), so the cut is in what a row must hold:
--
-- 1. A posting names its (term, source) by `lexical_terms.term_key`, an int, instead of the term's text and the
--    source key; search looks the query's terms up in lexical_terms first, as it already did for their statistics.
-- 2. Live and closed postings live in two tables, lexical_postings and lexical_postings_closed, instead of one with a
--    `live` flag (both impact indexes were partial on it anyway); a chunk that closes moves its postings across.
-- 3. `in_body` goes: a term's document frequency counts chunks whose own text (not only the title and section
--    prefix) holds it, and kb_lexical_apply now reads that from the chunk's text when the chunk enters or leaves the
--    live set (sql/functions/lexical.sql), which happens once per chunk version.
--    A row is then chunk_id, term_key, tf, length: 16 bytes of data, 40 with its header (was 52).
-- 4. `chunks.embed_text` is computed, not stored: it is always the title and section prefix followed by the chunk's
--    text, so chunks store `embed_prefix` and embed_text becomes a virtual generated column (embed_prefix || text).
--    Every reader keeps reading embed_text; writers write embed_prefix. The text was stored twice before.
--
-- term_key is an int: keys are drawn only for (term, source) pairs not seen before (2^31 of them is far beyond any
-- vocabulary times sources), never for every lexeme a batch upserts.

ALTER TABLE lexical_terms ADD COLUMN term_key int GENERATED ALWAYS AS IDENTITY;
-- Terms that only closed chunks hold still need a key (their postings serve as-of reads).
INSERT INTO lexical_terms (term, source_key, df, postings)
SELECT DISTINCT p.term, p.source_key, 0, 0 FROM lexical_postings p
WHERE NOT EXISTS (SELECT 1 FROM lexical_terms t WHERE t.term = p.term AND t.source_key = p.source_key);
ALTER TABLE lexical_terms ADD CONSTRAINT lexical_terms_term_key UNIQUE (term_key);
-- Document frequency as the triggers count it from now on: a live posting whose term is a lexeme of its chunk's
-- text as it is now. `in_body` was fixed when a posting was written, and publish could since change a kept chunk's
-- text (same embedded text, split differently): those counts would drift when the chunk leaves.
WITH counted AS (
    SELECT p.term, p.source_key, count(*) AS df
    FROM lexical_postings p
    JOIN (SELECT chunk_id, tsvector_to_array(kb_lexemes(text)) AS body FROM chunks WHERE valid_to IS NULL) b USING (chunk_id)
    WHERE p.live AND p.term = ANY(b.body)
    GROUP BY 1, 2
)
UPDATE lexical_terms t SET df = coalesce(c.df, 0)
FROM lexical_terms k LEFT JOIN counted c USING (term, source_key)
WHERE t.term_key = k.term_key AND t.df <> coalesce(c.df, 0);

CREATE TABLE lexical_postings_live (
    chunk_id bigint NOT NULL,
    term_key int NOT NULL,                 -- lexical_terms.term_key: the term in the chunk's source
    tf       smallint NOT NULL,
    length   smallint NOT NULL             -- the chunk's lexical_length, at most 32,767
);
CREATE TABLE lexical_postings_closed (LIKE lexical_postings_live);
INSERT INTO lexical_postings_live (chunk_id, term_key, tf, length)
SELECT p.chunk_id, t.term_key, p.tf, p.length FROM lexical_postings p JOIN lexical_terms t USING (term, source_key)
WHERE p.live ORDER BY p.chunk_id, t.term_key;
INSERT INTO lexical_postings_closed (chunk_id, term_key, tf, length)
SELECT p.chunk_id, t.term_key, p.tf, p.length FROM lexical_postings p JOIN lexical_terms t USING (term, source_key)
WHERE NOT p.live ORDER BY p.chunk_id, t.term_key;
DROP TABLE lexical_postings;
ALTER TABLE lexical_postings_live RENAME TO lexical_postings;
CREATE INDEX lexical_postings_impact ON lexical_postings (term_key, tf DESC, length) INCLUDE (chunk_id);
CREATE INDEX lexical_postings_chunk ON lexical_postings (chunk_id);
-- Closed postings serve as-of reads only. Their impact index holds no chunk id, so B-tree deduplication stores
-- each (term, tf, length) once with the list of its rows (about 7 bytes a posting instead of 28); an as-of read
-- takes chunk ids from the heap, a tenth of the live one's size.
CREATE INDEX lexical_postings_closed_impact ON lexical_postings_closed (term_key, tf DESC, length);
CREATE INDEX lexical_postings_closed_chunk ON lexical_postings_closed (chunk_id);
-- A chunk's postings, wherever they are: a chunk is live or closed, so its postings are in exactly one table.
CREATE VIEW lexical_postings_any AS
SELECT chunk_id, term_key, tf, length FROM lexical_postings
UNION ALL
SELECT chunk_id, term_key, tf, length FROM lexical_postings_closed;

-- embed_text -> embed_prefix. The update below changes no chunk's validity, so the lexical trigger has nothing to do.
ALTER TABLE chunks DISABLE TRIGGER chunks_lexical_update;
ALTER TABLE chunks ADD COLUMN embed_prefix text;
UPDATE chunks SET embed_prefix = left(embed_text, length(embed_text) - length(text))
WHERE right(embed_text, length(text)) = text;
ALTER TABLE chunks ENABLE TRIGGER chunks_lexical_update;
DO $$
DECLARE
    odd bigint := (SELECT count(*) FROM chunks WHERE embed_prefix IS NULL);
BEGIN
    IF odd > 0 THEN  -- never written by kb; refuse rather than lose what they embed
        RAISE EXCEPTION '% chunks have an embed_text that does not end with their text; nothing was changed', odd;
    END IF;
END $$;
ALTER TABLE chunks ALTER COLUMN embed_prefix SET NOT NULL;
ALTER TABLE chunks ALTER COLUMN lexical_length SET EXPRESSION AS (kb_lexical_length(embed_prefix || text));
ALTER TABLE chunks DROP COLUMN embed_text;
ALTER TABLE chunks ADD COLUMN embed_text text GENERATED ALWAYS AS (embed_prefix || text) VIRTUAL;
CLUSTER chunks USING chunks_pkey;  -- gives the dropped column's bytes back

-- Drafts keep the whole embedded text (the embed stage reads it); publish copies their prefix. One that does not end
-- with its text (never written by kb) has none, and publishing it fails on chunks' NOT NULL instead of storing a
-- wrong text under the right hash.
ALTER TABLE chunk_drafts ADD COLUMN embed_prefix text GENERATED ALWAYS AS (
    CASE WHEN right(embed_text, length(text)) = text THEN left(embed_text, length(embed_text) - length(text)) END) STORED;

ANALYZE lexical_terms, lexical_postings, lexical_postings_closed, chunks;
