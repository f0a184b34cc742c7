-- Hybrid search in one round trip: a dense arm (pgvector HNSW, cosine) and a lexical arm (BM25 over the
-- postings in lexical_postings), each over-fetching n candidates under the same filters, fused with
-- weighted Reciprocal Rank Fusion: score = (1 - w) / (rrf_k + dense_rank) + w / (rrf_k + lexical_rank).
-- Every fused candidate then gets its exact score in both arms and the query terms it holds, for tie-breaking,
-- exact-identifier ordering and explanations (pipelines/search.py orders and cuts the result).
--
-- Filled in by pipelines/search.py: {vectors}, the active model's vector table; {filters}, a predicate over chunks
-- c and documents d (live or as-of rows, the sources the caller may read, format, dates, entities);
-- %(source_keys)s, the caller's readable sources. BM25's statistics (document frequencies, corpus size, average
-- length) are sums over those sources only, and postings are read per source, so documents the caller cannot read
-- change neither its scores nor its candidates. As of a time, the statistics are those of the versions live then
-- (lexical_terms_history, lexical_stats_history: sql/015), so history ranks as it ranked when it was live.
--
-- Three ways to find candidates, chosen by search.py:
-- * %(within)s set (a selective filter matched few chunks): both arms score exactly those chunks;
-- * %(posting_budget)s set: pruned BM25 (see `candidates`) and the HNSW index, live or as of a time;
-- * neither: exact BM25 over every posting of the query's terms and the HNSW index.
--
-- A chosen chunk's postings are read by its chunk index (as many rows as it has distinct terms): `p.term_key + 0`
-- keeps the planner, which expects a term's posting list to be short (most terms are rare), from scanning the
-- query term's whole list for that one chunk instead, a cost that grows with the corpus (4,000 rows a common term
-- on SciFact, read for each of 200 candidates: most of a search's time). Not for %(within)s, up to 20,000 chunks:
-- there the terms' lists are the shorter read (chunk by chunk, a filter matching all of SciFact took 3x longer).
WITH visible AS (
    SELECT unnest(%(source_keys)s::int[]) AS source_key
), query_terms AS (
    SELECT DISTINCT u.lexeme AS term FROM unnest(kb_lexemes(%(query)s)) AS u
), hidden_chunks AS MATERIALIZED (
    -- Chunks of readable sources under a part that a restricted source this caller may not read covers
    -- (pipelines/retrieval/readable.py; usually none: declaring such a source moves them to it). The statistics are
    -- kept per source, so these are taken out of them below: a caller's scores never count what it cannot read.
    SELECT c.chunk_id, c.text, kb_chunk_length(c.chunk_id) AS lexical_length
    FROM unnest(%(hidden_sources)s::text[], %(hidden_prefixes)s::text[]) AS h(source_id, prefix)
    JOIN documents d ON d.source_id = h.source_id
         AND (d.locator = h.prefix OR (d.locator COLLATE "C" >= h.prefix || '/' AND d.locator COLLATE "C" < h.prefix || '0'))
    JOIN chunks c ON c.document_id = d.document_id
    WHERE CASE WHEN %(as_of)s::timestamptz IS NULL THEN c.valid_to IS NULL
               ELSE c.valid_from <= %(as_of)s AND (c.valid_to IS NULL OR c.valid_to > %(as_of)s) END
), source_stats AS (
    SELECT s.chunks, s.total_length FROM lexical_stats s JOIN visible USING (source_key)
    WHERE %(as_of)s::timestamptz IS NULL
    UNION ALL
    SELECT h.chunks, h.total_length FROM lexical_stats_history h JOIN visible USING (source_key)
    WHERE h.changed_at <= %(as_of)s::timestamptz
    UNION ALL
    SELECT -count(*), -coalesce(sum(lexical_length), 0) FROM hidden_chunks
), corpus AS (
    SELECT greatest(coalesce(sum(s.chunks), 0), 1)::float8 AS n,
           greatest(coalesce(sum(s.total_length), 0)::float8 / greatest(coalesce(sum(s.chunks), 0), 1), 1) AS avg_length
    FROM source_stats s
), readable_terms AS MATERIALIZED (
    SELECT t.term, t.source_key, t.term_key, coalesce(past.df, t.df) AS df, coalesce(past.postings, t.postings) AS postings
    FROM lexical_terms t JOIN query_terms USING (term) JOIN visible USING (source_key)
    LEFT JOIN LATERAL kb_term_then(t, %(as_of)s::timestamptz) AS past ON %(as_of)s::timestamptz IS NOT NULL
), term_sources AS MATERIALIZED (
    SELECT t.term, t.source_key, t.term_key, t.df - coalesce(x.df, 0) AS df, t.postings - coalesce(x.postings, 0) AS postings
    FROM readable_terms t
    LEFT JOIN (
        SELECT p.term_key, count(*) AS postings,
               count(*) FILTER (WHERE r.term = ANY(tsvector_to_array(kb_lexemes(hc.text)))) AS df
        FROM hidden_chunks hc JOIN lexical_postings_any p USING (chunk_id) JOIN readable_terms r USING (term_key)
        GROUP BY p.term_key
    ) x USING (term_key)
), weights AS MATERIALIZED (
    -- idf from the document frequency in chunk texts (Lucene's form, never negative); with %(common_share)s set,
    -- terms in more than that share of the readable chunks are left out. A term is essential when it has the
    -- shortest posting list, or when it and all shorter ones together hold at most %(posting_budget)s postings
    -- (NULL: every term is essential, exact BM25).
    SELECT t.term, t.df, t.postings, ln(1 + (corpus.n - t.df + 0.5) / (t.df + 0.5)) AS idf,
           row_number() OVER (ORDER BY t.postings, t.term) = 1
           OR sum(t.postings) OVER (ORDER BY t.postings, t.term) <= coalesce(%(posting_budget)s, 'Infinity'::float8) AS essential
    FROM (SELECT term, sum(df) AS df, sum(postings) AS postings FROM term_sources GROUP BY term) t, corpus
    WHERE t.postings > 0 AND t.df <= coalesce(%(common_share)s, 1) * corpus.n
), dense AS MATERIALIZED (
    (SELECT c.chunk_id, v.embedding <=> %(vector)s AS distance
     FROM {vectors} v
     JOIN chunks c ON c.text_hash = v.text_hash
     JOIN documents d ON d.document_id = c.document_id
     WHERE %(within)s::bigint[] IS NULL AND {filters}
     ORDER BY v.embedding <=> %(vector)s
     LIMIT %(dense_n)s)
    UNION ALL
    (SELECT c.chunk_id, v.embedding <=> %(vector)s AS distance
     FROM unnest(%(within)s::bigint[]) AS w(chunk_id)
     JOIN chunks c USING (chunk_id)
     JOIN {vectors} v ON v.text_hash = c.text_hash
     ORDER BY 2
     LIMIT %(dense_n)s)
), dense_ranked AS (
    SELECT chunk_id, 1 - distance AS score, row_number() OVER (ORDER BY distance, chunk_id) AS rank FROM dense
), candidates AS MATERIALIZED (
    -- BM25 with MaxScore-style pruning: the essential terms' postings nominate candidates, each source's list
    -- read best-impact first (high tf, then short chunk: lexical_postings_impact) and cut at the source's share of
    -- the budget, so a query made only of common words reads a bounded prefix instead of a corpus-long list (as of
    -- a time, postings of chunks valid then, live and closed). The best candidates by this partial score are then completed with
    -- the other terms by probes of the chunk's postings. With every term essential and no cut, this is exact BM25.
    SELECT p.chunk_id,
           sum(w.idf * (p.tf * (%(bm25_k1)s + 1))
               / (p.tf + %(bm25_k1)s * (1 - %(bm25_b)s + %(bm25_b)s * p.length / corpus.avg_length)) ORDER BY w.term) AS score
    FROM weights w
    JOIN term_sources ts USING (term)
    CROSS JOIN LATERAL (
        -- live postings (today, or as of a time when some live chunk already existed: those written by then) merged
        -- in impact order with, as of a time, the postings of closed chunks valid then (lexical_postings_closed)
        (SELECT lp.chunk_id, lp.tf, lp.length FROM lexical_postings lp
         WHERE lp.term_key = ts.term_key
           AND (%(as_of)s::timestamptz IS NULL OR (%(live_at_as_of)s AND EXISTS (
                SELECT 1 FROM chunks c WHERE c.chunk_id = lp.chunk_id AND c.valid_from <= %(as_of)s)))
         ORDER BY lp.tf DESC, lp.length)
        UNION ALL
        (SELECT lp.chunk_id, lp.tf, lp.length FROM lexical_postings_closed lp
         WHERE lp.term_key = ts.term_key
           AND %(as_of)s::timestamptz IS NOT NULL AND EXISTS (
               SELECT 1 FROM chunks c WHERE c.chunk_id = lp.chunk_id AND c.valid_from <= %(as_of)s
                 AND c.valid_to > %(as_of)s)
         ORDER BY lp.tf DESC, lp.length)
        ORDER BY tf DESC, length
        LIMIT ceil(%(posting_budget)s * ts.postings::float8 / greatest(w.postings, 1))::bigint
    ) p
    CROSS JOIN corpus
    WHERE w.essential AND %(lexical_n)s > 0 AND %(within)s::bigint[] IS NULL
    GROUP BY p.chunk_id
    ORDER BY score DESC, p.chunk_id
    LIMIT %(rescore_n)s
), bm25 AS (
    -- Candidates completed with the other terms' scores (one probe of each postings table's chunk index per
    -- candidate and term; none when every term was essential), or the chunks %(within)s names, scored exactly by
    -- probes.
    SELECT s.chunk_id, s.score + coalesce((
        SELECT sum(w.idf * (p.tf * (%(bm25_k1)s + 1))
                   / (p.tf + %(bm25_k1)s * (1 - %(bm25_b)s + %(bm25_b)s * p.length / corpus.avg_length)) ORDER BY w.term)
        FROM weights w JOIN term_sources ts USING (term)
        JOIN lexical_postings_any p ON p.chunk_id = s.chunk_id AND p.term_key + 0 = ts.term_key CROSS JOIN corpus
        WHERE NOT w.essential), 0) AS score
    FROM candidates s
    UNION ALL
    SELECT x.chunk_id, sum(w.idf * (p.tf * (%(bm25_k1)s + 1))
                           / (p.tf + %(bm25_k1)s * (1 - %(bm25_b)s + %(bm25_b)s * p.length / corpus.avg_length)) ORDER BY w.term)
    FROM unnest(%(within)s::bigint[]) AS x(chunk_id)
    JOIN weights w ON %(lexical_n)s > 0
    JOIN term_sources ts USING (term)
    JOIN lexical_postings_any p ON p.chunk_id = x.chunk_id AND p.term_key = ts.term_key
    CROSS JOIN corpus
    GROUP BY x.chunk_id
), lexical AS MATERIALIZED (
    SELECT s.chunk_id, s.score
    FROM bm25 s
    JOIN chunks c ON c.chunk_id = s.chunk_id
    JOIN documents d ON d.document_id = c.document_id
    WHERE {filters} AND %(lexical_n)s > 0
    ORDER BY s.score DESC, s.chunk_id
    LIMIT %(lexical_n)s
), lexical_ranked AS (
    SELECT chunk_id, score, row_number() OVER (ORDER BY score DESC, chunk_id) AS rank FROM lexical
), fused AS (
    SELECT chunk_id, dr.rank AS dense_rank, lr.rank AS lexical_rank,
           coalesce((1 - %(lexical_weight)s) / (%(rrf_k)s + dr.rank), 0) AS dense_rrf,
           coalesce(%(lexical_weight)s / (%(rrf_k)s + lr.rank), 0) AS lexical_rrf
    FROM dense_ranked dr FULL OUTER JOIN lexical_ranked lr USING (chunk_id)
)
SELECT f.chunk_id, d.source_id, d.locator, d.title, c.section_path, c.text, c.entities, d.doc_format, d.doc_date,
       f.dense_rrf + f.lexical_rrf AS fused_score, f.dense_rank,
       CASE WHEN %(dense_n)s > 0 THEN 1 - (v.embedding <=> %(vector)s) END AS dense_score,
       f.lexical_rank,
       coalesce((SELECT sum(w.idf * (p.tf * (%(bm25_k1)s + 1))
                           / (p.tf + %(bm25_k1)s * (1 - %(bm25_b)s + %(bm25_b)s * p.length / corpus.avg_length)) ORDER BY w.term)
                 FROM weights w JOIN term_sources ts USING (term)
                 JOIN lexical_postings_any p ON p.chunk_id = f.chunk_id AND p.term_key + 0 = ts.term_key
                 CROSS JOIN corpus), 0) AS lexical_score,
       f.dense_rrf, f.lexical_rrf,
       ARRAY(SELECT ts.term FROM term_sources ts JOIN lexical_postings_any p ON p.chunk_id = f.chunk_id
             AND p.term_key + 0 = ts.term_key ORDER BY ts.term) AS matched_terms,
       ARRAY[]::text[] AS exact, false AS tie_broken, c.kind, c.question, c.source_chunk_id, c.page_number
FROM fused f
JOIN chunks c ON c.chunk_id = f.chunk_id
JOIN documents d ON d.document_id = c.document_id
LEFT JOIN {vectors} v ON v.text_hash = c.text_hash  -- a lexical hit needs no vector (it then has no dense score)
ORDER BY fused_score DESC, f.chunk_id
