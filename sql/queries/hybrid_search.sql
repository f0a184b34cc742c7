-- Hybrid search in one round trip: a dense arm (pgvector HNSW, cosine) and a lexical arm (BM25 over the
-- postings in lexical_postings), each over-fetching n candidates under the same filters, fused with
-- weighted Reciprocal Rank Fusion: score = (1 - w) / (rrf_k + dense_rank) + w / (rrf_k + lexical_rank).
-- {vectors} is the active model's vector table and {filters} a predicate over chunks c and documents d
-- (live or as-of rows, the sources the caller may read, format, dates, entities), both filled in by
-- pipelines/search.py, which also passes %(source_keys)s: the caller's readable sources. BM25's statistics
-- (document frequencies, corpus size, average length) are sums over those sources only, and postings are read
-- per source, so documents the caller cannot read change neither its scores nor its candidates.
WITH visible AS (
    SELECT unnest(%(source_keys)s::int[]) AS source_key
), query_terms AS (
    SELECT DISTINCT u.lexeme AS term FROM unnest(kb_lexemes(%(query)s)) AS u
), corpus AS (
    SELECT greatest(coalesce(sum(s.chunks), 0), 1)::float8 AS n,
           greatest(coalesce(sum(s.total_length), 0)::float8 / greatest(coalesce(sum(s.chunks), 0), 1), 1) AS avg_length
    FROM lexical_stats s JOIN visible USING (source_key)
), term_sources AS MATERIALIZED (
    SELECT t.term, t.source_key, t.df FROM lexical_terms t JOIN query_terms USING (term) JOIN visible USING (source_key)
), weights AS MATERIALIZED (
    -- Terms in more than half of the readable live chunks carry no evidence (their classic Robertson/Sparck Jones
    -- idf is <= 0) and are left out: otherwise every chunk that merely shares such a term would get a lexical rank.
    -- A term is essential when it is the rarest one, or when it and all rarer terms together have at most
    -- %(posting_budget)s postings (NULL: every term is essential, exact BM25).
    SELECT t.term, t.df, ln(1 + (corpus.n - t.df + 0.5) / (t.df + 0.5)) AS idf,
           row_number() OVER (ORDER BY t.df, t.term) = 1
           OR sum(t.df) OVER (ORDER BY t.df, t.term) <= coalesce(%(posting_budget)s, 'Infinity'::float8) AS essential
    FROM (SELECT term, sum(df) AS df FROM term_sources GROUP BY term) t, corpus
    WHERE t.df <= corpus.n / 2
), dense AS MATERIALIZED (
    SELECT c.chunk_id, v.embedding <=> %(vector)s AS distance
    FROM {vectors} v
    JOIN chunks c ON c.text_hash = v.text_hash
    JOIN documents d ON d.document_id = c.document_id
    WHERE {filters}
    ORDER BY v.embedding <=> %(vector)s
    LIMIT %(dense_n)s
), dense_ranked AS (
    SELECT chunk_id, 1 - distance AS score, row_number() OVER (ORDER BY distance, chunk_id) AS rank FROM dense
), candidates AS MATERIALIZED (
    -- BM25 with MaxScore-style pruning: the essential terms' postings nominate candidates, each source's list
    -- read best-impact first (high tf, then short chunk: lexical_postings_impact) and cut at the source's share of
    -- the budget, so a query made only of common words reads a bounded prefix instead of a corpus-long list. The
    -- best candidates by this partial score are then completed with the other terms by primary-key lookups. With
    -- every term essential and no cut (posting_budget NULL), this is exact BM25.
    SELECT p.chunk_id,
           sum(w.idf * (p.tf * (%(bm25_k1)s + 1))
               / (p.tf + %(bm25_k1)s * (1 - %(bm25_b)s + %(bm25_b)s * p.length / corpus.avg_length))) AS score
    FROM weights w
    JOIN term_sources ts USING (term)
    CROSS JOIN LATERAL (
        SELECT lp.chunk_id, lp.tf, lp.length FROM lexical_postings lp
        WHERE lp.term = w.term AND lp.source_key = ts.source_key AND (lp.live OR %(as_of)s::timestamptz IS NOT NULL)
        ORDER BY lp.tf DESC, lp.length
        LIMIT ceil(%(posting_budget)s * ts.df::float8 / greatest(w.df, 1))::bigint
    ) p
    CROSS JOIN corpus
    WHERE w.essential AND %(lexical_n)s > 0
    GROUP BY p.chunk_id
    ORDER BY score DESC, p.chunk_id
    LIMIT %(rescore_n)s
), lexical_scores AS MATERIALIZED (
    -- One primary-key probe (term, chunk) per candidate and remaining term; none when every term was essential.
    SELECT s.chunk_id, s.score + coalesce((
        SELECT sum(w.idf * (p.tf * (%(bm25_k1)s + 1))
                   / (p.tf + %(bm25_k1)s * (1 - %(bm25_b)s + %(bm25_b)s * p.length / corpus.avg_length)))
        FROM weights w JOIN lexical_postings p ON p.chunk_id = s.chunk_id AND p.term = w.term CROSS JOIN corpus
        WHERE NOT w.essential), 0) AS score
    FROM candidates s
), lexical AS MATERIALIZED (
    SELECT s.chunk_id, s.score
    FROM lexical_scores s
    JOIN chunks c ON c.chunk_id = s.chunk_id
    JOIN documents d ON d.document_id = c.document_id
    WHERE {filters}
    ORDER BY s.score DESC, s.chunk_id
    LIMIT %(lexical_n)s
), lexical_ranked AS (
    SELECT chunk_id, score, row_number() OVER (ORDER BY score DESC, chunk_id) AS rank FROM lexical
), fused AS (
    SELECT chunk_id, dr.rank AS dense_rank, dr.score AS dense_score, lr.rank AS lexical_rank, lr.score AS lexical_score,
           coalesce((1 - %(lexical_weight)s) / (%(rrf_k)s + dr.rank), 0)
           + coalesce(%(lexical_weight)s / (%(rrf_k)s + lr.rank), 0) AS fused_score
    FROM dense_ranked dr FULL OUTER JOIN lexical_ranked lr USING (chunk_id)
)
SELECT f.chunk_id, d.source_id, d.locator, d.title, c.section_path, c.text, c.entities, d.doc_format, d.doc_date,
       f.fused_score, f.dense_rank, f.dense_score, f.lexical_rank, f.lexical_score
FROM fused f
JOIN chunks c ON c.chunk_id = f.chunk_id
JOIN documents d ON d.document_id = c.document_id
ORDER BY f.fused_score DESC, f.chunk_id
LIMIT %(k)s
