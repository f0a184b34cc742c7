"""Hybrid retrieval on the sample corpus: BM25 arm, RRF arithmetic, weights, classifier, filters, access lists."""

import math

import pytest

from pipelines.sources import add_source, declare
from pipelines.ingest import ingest
from pipelines.search import BM25_B, BM25_K1, RRF_K, Filters, lexical_weight_for, search
from pipelines.settings import SAMPLES_DIR, load_settings


@pytest.fixture
def kb(conn, embedder, samples_copy):
    add_source(conn, declare("samples", samples_copy), "tests")
    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl", groups=("staff",)), "tests")
    ingest(conn, embedder, load_settings())
    return conn


PUBLIC = "JOIN sources s USING (source_key) WHERE s.allowed_groups IS NULL"  # what an anonymous caller reads


def test_bm25_scores_match_the_formula_over_live_statistics(kb, embedder):
    hits = search(kb, embedder, "encoder cable replaced", 3, arm="lexical")
    n, total = kb.execute(f"SELECT sum(chunks)::float8, sum(total_length)::float8 FROM lexical_stats {PUBLIC}").fetchone()
    avg = total / n
    df = dict(kb.execute(f"SELECT term, sum(df)::float8 FROM lexical_terms {PUBLIC} GROUP BY term").fetchall())
    for hit in hits:
        tsv, length = kb.execute("SELECT search_tsv::text, lexical_length FROM chunks WHERE chunk_id = %s", (hit.chunk_id,)).fetchone()
        tf = {}
        for item in tsv.split(" "):
            lexeme, _, positions = item.rpartition(":")
            tf[lexeme.strip("'")] = len(positions.split(","))
        k1, b = BM25_K1, BM25_B
        expected = sum(math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5)) * tf[t] * (k1 + 1)
                       / (tf[t] + k1 * (1 - b + b * length / avg)) for t in ("encod", "cabl", "replac") if t in tf)
        assert hit.lexical_score == pytest.approx(expected, rel=1e-9)


def test_term_statistics_follow_every_publish(kb, embedder, samples_copy):
    per_source = ("FROM chunks c JOIN documents d USING (document_id) JOIN sources s USING (source_id)"
                  " WHERE c.valid_to IS NULL")

    def consistent():
        live = dict(kb.execute(f"SELECT s.source_key, (count(*), sum(c.lexical_length)) {per_source} GROUP BY 1").fetchall())
        assert dict(kb.execute("SELECT source_key, (chunks, total_length) FROM lexical_stats").fetchall()) == live
        recomputed = dict(kb.execute(f"SELECT (u.lexeme, s.source_key), count(*) {per_source.replace('WHERE', ', unnest(c.search_tsv) u WHERE')}"
                                     " GROUP BY 1").fetchall())
        stored = dict(kb.execute("SELECT (term, source_key), df FROM lexical_terms WHERE df > 0").fetchall())
        assert stored == recomputed

    consistent()
    (samples_copy / "ops/postgres-runbook.txt").unlink()
    policy = samples_copy / "handbook/leave-policy.md"
    policy.write_text(policy.read_text().replace("20 weeks", "26 weeks"))
    ingest(kb, embedder, load_settings())
    consistent()


@pytest.mark.parametrize("query, document", [
    ("HR-2024-047", "handbook/leave-policy.md"),
    ("AVX-041", "products/avx-series-manual.html"),
    ("42P07", "ops/postgres-runbook.txt"),
    ("max_wal_senders", "ops/postgres-runbook.txt"),
    ("SEC-2024-015", "security/access-control-standard.pdf"),
    ("INC0012345", "support/incident-INC0012345.eml"),
    ("WC-2024-0215", "products/warranty-claims.csv"),
    ("FIN-2023-009", "finance/expense-policy.docx"),
])
def test_exact_identifiers_are_found_by_the_hybrid_search(kb, embedder, query, document):
    hits = search(kb, embedder, query, 5)
    assert document in [h.document for h in hits]
    assert document in [h.document for h in search(kb, embedder, query, 2, arm="lexical")]


def test_fusion_is_weighted_reciprocal_rank_fusion(kb, embedder):
    weight = 0.3
    hits = search(kb, embedder, "how long do I have to submit expense claims", 8, lexical_weight=weight)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    for hit in hits:
        expected = ((1 - weight) / (RRF_K + hit.dense_rank) if hit.dense_rank else 0) + (
            weight / (RRF_K + hit.lexical_rank) if hit.lexical_rank else 0)
        assert hit.score == pytest.approx(expected)
    assert any(h.dense_rank and h.lexical_rank for h in hits)


def test_weight_extremes_follow_one_arm(kb, embedder):
    query = "replacing the cooling fan of a servo drive"
    dense = [h.chunk_id for h in search(kb, embedder, query, 5, arm="dense")]
    lexical = [h.chunk_id for h in search(kb, embedder, query, 5, arm="lexical")]
    assert [h.chunk_id for h in search(kb, embedder, query, 5, lexical_weight=0.0)] == dense
    assert [h.chunk_id for h in search(kb, embedder, query, 5, lexical_weight=1.0)] == lexical


def test_query_classifier():
    assert lexical_weight_for("AVX-039 fault") == 0.7
    assert lexical_weight_for("error 42P07") == 0.7
    assert lexical_weight_for("max_wal_senders") == 0.7
    assert lexical_weight_for("How do I request parental leave?") == 0.3
    assert lexical_weight_for("parental leave for adoptive parents") == 0.5
    assert lexical_weight_for("20 weeks of parental leave") == 0.5


def test_filters_apply_inside_both_arms(kb, embedder):
    only_pdf = search(kb, embedder, "access and passwords", 5, filters=Filters(doc_format="pdf"))
    assert only_pdf and {h.doc_format for h in only_pdf} == {"pdf"}
    # A selective filter still fills k when enough chunks match it.
    html = search(kb, embedder, "parental leave", 5, filters=Filters(doc_format="html"))
    assert len(html) == 5 and {h.document for h in html} == {"products/avx-series-manual.html"}
    dated = search(kb, embedder, "policy", 10, filters=Filters(date_from=__import__("datetime").date(2024, 5, 1)))
    assert dated and all(h.doc_date >= __import__("datetime").date(2024, 5, 1) for h in dated)
    coded = search(kb, embedder, "what went wrong", 5, filters=Filters(entities={"codes": ["F-204"]}))
    assert coded and all("F-204" in h.entities["codes"] for h in coded)
    sourced = search(kb, embedder, "fault", 5, filters=Filters(source_id="samples"))
    assert {h.source for h in sourced} == {"samples"}


def test_access_lists_hide_documents_from_callers_outside_their_groups(kb, embedder):
    query = "How do I reset my VPN token?"
    anonymous = search(kb, embedder, query, 20)
    assert all(h.source != "faq" for h in anonymous)
    outsider = search(kb, embedder, query, 20, filters=Filters(groups=["contractors"]))
    assert all(h.source != "faq" for h in outsider)
    staff = search(kb, embedder, query, 3, filters=Filters(groups=["contractors", "staff"]))
    assert staff[0].source == "faq" and staff[0].document == "faq-001"


def test_identifier_set_where_the_dense_arm_is_weak(conn, embedder, tmp_path):
    """60 near-identical service notes that differ by their codes: the dense arm cannot tell AVX-039 from AVX-093,
    the hybrid search must put the right note in the top 5 for every code."""
    import json
    import random

    rng = random.Random(5)
    faults = ["encoder signal lost", "DC bus overvoltage", "drive overtemperature", "fan failure", "brake fault"]
    records = []
    for i in range(60):
        code, sku = f"AVX-{i:03d}", f"SKU-{rng.randint(10000, 99999)}-{rng.choice('ABC')}"
        records.append({"_id": f"note-{i}", "title": f"Service note for drive {code}",
                        "text": f"Drive {code} (spare part {sku}) reported {rng.choice(faults)}. Replace the part and "
                                f"record the intervention in the maintenance log."})
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    add_source(conn, declare("notes", path), "tests")
    ingest(conn, embedder, load_settings())

    def hit_at_5(arm):
        found = 0
        for record in records[::3]:
            code = record["text"].split()[1]
            found += record["_id"] in [h.document for h in search(conn, embedder, code, 5, arm=arm)]
        return found / len(records[::3])

    assert hit_at_5("hybrid") == 1.0
    assert hit_at_5("dense") < 0.8  # the reason the lexical arm exists


def test_lexical_pruning_bounds_the_work_and_keeps_scores_exact(kb, embedder, monkeypatch):
    """Beyond the posting budget only the rarest term nominates candidates (its best postings first); the other
    terms still complete each candidate's score, so every returned score is the exact BM25 score."""
    import pipelines.search as search_module

    query = "policy leave weeks approval manager"
    exact = {h.chunk_id: h.lexical_score for h in search(kb, embedder, query, 100, arm="lexical", k_overfetch=100)}
    df = dict(kb.execute(f"SELECT t.term, sum(t.df) FROM lexical_terms t JOIN unnest(kb_lexemes(%s)) u ON u.lexeme = t.term"
                         f" {PUBLIC} GROUP BY t.term", (query,)).fetchall())
    rarest = min(df, key=lambda t: (df[t], t))
    assert sum(df.values()) > 3 and df[rarest] >= 1, "the query must overflow a budget of 3 postings"

    monkeypatch.setattr(search_module, "POSTING_BUDGET", 3)
    pruned = search(kb, embedder, query, 100, arm="lexical", k_overfetch=100)
    assert 0 < len(pruned) <= 3
    for hit in pruned:
        assert hit.lexical_score == pytest.approx(exact[hit.chunk_id], rel=1e-9)
        tf = kb.execute("SELECT tf FROM lexical_postings WHERE term = %s AND chunk_id = %s", (rarest, hit.chunk_id)).fetchone()
        assert tf is not None, "candidates come from the rarest term's postings"

    # A narrowing filter turns pruning off: exact BM25 within the filter.
    filtered = search(kb, embedder, query, 100, arm="lexical", k_overfetch=100, filters=Filters(doc_format="md"))
    assert all(h.lexical_score == pytest.approx(exact[h.chunk_id], rel=1e-9) for h in filtered)
    assert len(filtered) > 3 and len(filtered) == kb.execute(
        "SELECT count(DISTINCT p.chunk_id) FROM lexical_postings p JOIN chunks c USING (chunk_id) JOIN documents d"
        " USING (document_id) WHERE p.live AND d.doc_format = 'md' AND p.term = ANY(%s)", (list(df),)).fetchone()[0]
