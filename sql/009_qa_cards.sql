-- Q&A cards (issue 12): short question -> answer cards distilled from the corpus.
-- A card is a chunk of kind 'card' made from a source chunk of the same document, so it has everything a chunk
-- has: versions (valid_from/valid_to, as-of reads), access (its document's source), both search arms (postings,
-- a vector of its embedded text), history. Its text is the answer, its question is kept beside it, and it closes
-- when its source chunk closes. card_cache keeps what each generator made of a chunk's text, so a refresh or a
-- restored document gets its cards back without another model call.
ALTER TABLE chunks
    ADD COLUMN source_chunk_id bigint REFERENCES chunks ON DELETE CASCADE,  -- cards only: the chunk it came from
    ADD COLUMN question text,                                              -- cards only
    ADD COLUMN generator text;                                             -- cards only: FAQ rules, or model + prompt
CREATE INDEX chunks_cards_by_source ON chunks (source_chunk_id) WHERE source_chunk_id IS NOT NULL;

CREATE TABLE card_cache (
    generator  text NOT NULL,                  -- e.g. faq-rules-1, or chat:<model>:<prompt version>
    text_hash  text NOT NULL,                  -- the source chunk's embedded text
    cards      jsonb NOT NULL,                 -- [{"question": ..., "answer": ...}], possibly empty
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (generator, text_hash)
);

-- Which chunks each generator has looked at (with or without a card as the result), so that a chunk is asked about
-- once per generator and text, not on every refresh.
CREATE TABLE card_rounds (
    chunk_id  bigint NOT NULL REFERENCES chunks ON DELETE CASCADE,
    generator text NOT NULL,
    PRIMARY KEY (chunk_id, generator)
);
