-- Each chunk's lexemes computed once when it is published (issue 32, item 1). `chunks.lexical_length` was a generated
-- column: every insert computed the chunk's lexemes for it, then again in the lexical trigger for the postings, and
-- again for document frequency (a SciFact first ingest: 3 of its 12 s of publish). The trigger now computes them once
-- and takes the length from them (sql/functions/lexical.sql). Each posting of a chunk already carries its length, so
-- what read the column reads it there (kb_chunk_length): kb_lexical_apply when a chunk closes, reopens or goes,
-- search for the chunks it leaves out of a caller's statistics, a move between sources. A posting's length is capped at
-- 32,767 (smallint), and the source's total length now adds the same capped value: no chunk of a model that reads
-- 8,191 tokens or fewer comes near it.
ALTER TABLE chunks DROP COLUMN lexical_length;
