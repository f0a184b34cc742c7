-- A lexical arm that works at every corpus size (issue 11).
-- A chunk's embedded text starts with its document title and section path. Those words still score for the chunk
-- (tf counts them), but a term's document frequency now counts only chunks whose own text holds it, so the
-- prefix no longer makes every word of a long document common. lexical_terms.postings counts every live posting
-- (prefix included): that is what a posting list costs to read, and what the pruning budget counts.
ALTER TABLE lexical_postings ADD COLUMN in_body boolean NOT NULL DEFAULT false;
UPDATE lexical_postings p SET in_body = true
FROM (SELECT c.chunk_id, u.lexeme FROM chunks c, unnest(kb_lexemes(c.text)) AS u) b
WHERE b.chunk_id = p.chunk_id AND b.lexeme = p.term;
ALTER TABLE lexical_postings ALTER COLUMN in_body DROP DEFAULT;

ALTER TABLE lexical_terms ADD COLUMN postings bigint NOT NULL DEFAULT 0;
TRUNCATE lexical_terms;
INSERT INTO lexical_terms (term, source_key, df, postings)
SELECT term, source_key, count(*) FILTER (WHERE in_body), count(*) FROM lexical_postings WHERE live GROUP BY 1, 2;
ALTER TABLE lexical_terms ALTER COLUMN postings DROP DEFAULT;
