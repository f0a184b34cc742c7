-- As-of reads without a probe per live posting (issue 11). Reading the knowledge base as it was at a time T, the
-- lexical arm used to walk each query term's postings best-impact first and probe the chunk of every one for its
-- validity; when few chunks were valid at T (T before most of today's chunks were written), it walked whole lists.
-- Now the postings of closed chunks (history) have an index of their own, read beside the live ones in impact
-- order; live postings are read only when some live chunk existed at T; and each probe reads a narrow index, not
-- the chunks table.
CREATE INDEX lexical_postings_history ON lexical_postings (term, source_key, tf DESC, length) INCLUDE (chunk_id)
    WHERE NOT live;
CREATE INDEX chunks_validity_by_id ON chunks (chunk_id) INCLUDE (valid_from, valid_to);
CREATE INDEX chunks_live_since ON chunks (valid_from) WHERE valid_to IS NULL;
