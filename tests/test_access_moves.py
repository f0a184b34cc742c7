"""Moving documents between sources keeps every statistic consistent (issue 27, attacks of the hostile review that
held, kept as regression tests; tests/test_access_attacks.py has those that did not)."""

from __future__ import annotations

from test_access_attacks import QUERY, SECRET, found, holds_secret, kb, now, share  # noqa: F401 (share: a fixture)


CONSISTENCY = {
    "terms differ from a recount of the live postings": """
        WITH recount AS (
            SELECT p.term_key, count(*) AS postings,
                   count(*) FILTER (WHERE t.term = ANY(tsvector_to_array(kb_lexemes(c.text)))) AS df
            FROM lexical_postings p JOIN lexical_terms t USING (term_key) JOIN chunks c USING (chunk_id)
            GROUP BY 1)
        SELECT t.term_key, t.df, t.postings, r.df, r.postings FROM lexical_terms t FULL JOIN recount r USING (term_key)
        WHERE (coalesce(t.df, 0), coalesce(t.postings, 0)) <> (coalesce(r.df, 0), coalesce(r.postings, 0))""",
    "stats differ from a recount of the live chunks": """
        WITH recount AS (
            SELECT s.source_key, count(*) AS chunks, sum(kb_lexemes_length(kb_chunk_lexemes(c.embed_prefix, c.text))) AS total_length
            FROM chunks c JOIN documents d USING (document_id) JOIN sources s USING (source_id)
            WHERE c.valid_to IS NULL GROUP BY 1)
        SELECT * FROM lexical_stats l FULL JOIN recount r USING (source_key)
        WHERE (coalesce(l.chunks, 0), coalesce(l.total_length, 0)) <> (coalesce(r.chunks, 0), coalesce(r.total_length, 0))""",
    "a posting names a term of another source than its chunk's": """
        SELECT p.chunk_id, t.term FROM lexical_postings_any p JOIN lexical_terms t USING (term_key)
        JOIN chunks c USING (chunk_id) JOIN documents d USING (document_id) JOIN sources s USING (source_id)
        WHERE t.source_key <> s.source_key""",
    "terms history (and each term's latest change, still on its row) does not sum to the live terms": """
        SELECT t.term_key FROM lexical_terms t, kb_term_then(t, 'infinity') AS now
        WHERE (now.df, now.postings) <> (t.df, t.postings)""",
    "stats history does not sum to the live stats": """
        SELECT s.source_key FROM sources s LEFT JOIN lexical_stats l USING (source_key)
        LEFT JOIN lexical_stats_history h USING (source_key)
        GROUP BY s.source_key, l.chunks, l.total_length
        HAVING (coalesce(sum(h.chunks), 0), coalesce(sum(h.total_length), 0)) <> (coalesce(l.chunks, 0), coalesce(l.total_length, 0))""",
}
AS_OF = """
WITH recount AS (
    SELECT s.source_key, count(*) AS chunks FROM chunks c JOIN documents d USING (document_id) JOIN sources s USING (source_id)
    WHERE c.valid_from <= %(t)s AND (c.valid_to IS NULL OR c.valid_to > %(t)s) GROUP BY 1),
history AS (SELECT source_key, sum(chunks) AS chunks FROM lexical_stats_history WHERE changed_at <= %(t)s GROUP BY 1)
SELECT * FROM history h FULL JOIN recount r USING (source_key) WHERE coalesce(h.chunks, 0) <> coalesce(r.chunks, 0)
"""


def inconsistencies(conn, times=()) -> dict:
    found = {why: rows for why, query in CONSISTENCY.items() if (rows := conn.execute(query).fetchall())}
    for t in times:
        if rows := conn.execute(AS_OF, {"t": t}).fetchall():
            found[f"as of {t}"] = rows
    return found


def test_a_move_with_history_and_a_clash_keeps_every_statistic_consistent(conn, embedder, share, tmp_path):
    """Item 3 (kb_move_documents): after moves (one with closed versions, one where the new source already holds a
    locator), the live statistics equal a recount from chunks and postings, their history sums to them, and as of
    each past time it counts the chunks valid then under their current source."""
    kb("source", "add", "pub", str(share), "--public")
    kb("ingest")
    first = now(conn)
    (share / "hr" / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n\nRevised: paid in March.\n")
    (share / "hr" / "leave.md").write_text("# Leave\n\nLeave requests go to the HR desk.\n")
    kb("ingest")
    second = now(conn)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "leave.md").write_text("# Leave\n\nAn older leave policy kept by HR.\n")
    kb("source", "add", "hr", str(elsewhere), "--group", "hr")
    kb("ingest", "--source", "hr")
    third = now(conn)
    kb("source", "update", "hr", "--location", str(share / "hr"))  # moves pub's hr/*; hr already holds leave.md
    assert inconsistencies(conn, (first, second, third)) == {}
    kb("ingest", "--allow-deletions")
    assert inconsistencies(conn, (first, second, third, now(conn))) == {}
    assert not holds_secret(found(conn, embedder, QUERY, as_of=second, arm="lexical"))
    assert not holds_secret(found(conn, embedder, QUERY, as_of=first, arm="lexical"))


def test_nested_sources_declared_inner_first_and_three_levels_deep_hide_what_they_cover(conn, embedder, tmp_path):
    """Items 2-3: hr (inside team, inside pub) declared first, then pub, then team; every level reads only what its
    groups allow, live and as of the time everything was in pub."""
    pub = tmp_path / "pub"
    (pub / "team" / "hr").mkdir(parents=True)
    (pub / "canteen.md").write_text("# Canteen\n\nThe canteen serves okapi stew on Fridays.\n")
    (pub / "team" / "roadmap.md").write_text("# Roadmap\n\nThe quokka release ships in May.\n")
    (pub / "team" / "hr" / "bonus.md").write_text("# Bonus\n\nThe zebra bonus pool for directors is 4.2 million.\n")
    kb("source", "add", "hr", str(pub / "team" / "hr"), "--group", "hr")
    kb("source", "add", "pub", str(pub), "--public")
    kb("ingest")
    kb("source", "remove", "hr")
    kb("ingest", "--allow-deletions")  # pub now holds team/hr/bonus.md itself
    everything_public = now(conn)
    kb("source", "add", "hr", str(pub / "team" / "hr"), "--group", "hr")
    kb("source", "add", "team", str(pub / "team"), "--group", "eng", "--group", "hr")
    kb("ingest")
    for as_of in (None, everything_public):
        assert not holds_secret(found(conn, embedder, QUERY, as_of=as_of))
        assert not holds_secret(found(conn, embedder, QUERY, ["eng"], as_of=as_of))
        assert not any("quokka" in c for _, _, c in found(conn, embedder, "quokka release", as_of=as_of))
        assert any("quokka" in c for _, _, c in found(conn, embedder, "quokka release", ["eng"], as_of=as_of))
        assert holds_secret(found(conn, embedder, QUERY, ["hr"], as_of=as_of))
