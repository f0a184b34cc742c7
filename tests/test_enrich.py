"""Enrichment (embedded text, entities) and content hashing."""

from pipelines.ingest.enrich import embed_text, extract_entities
from pipelines.ingest.hashing import hash_bytes, hash_file, hash_text


def test_entities_cover_codes_dates_emails_and_urls():
    text = ("Policy HR-2024-047 replaces HR-2021-012 for the AVX-039 drive (SKU-88412-B), error 42P07. "
            "Effective 2024-03-01, reviewed March 5, 2025 and 7 April 2025. Mail people-ops@acme.com or see "
            "https://hr.acme.com/leave. Nothing here: 2024, 10mg, A1, max_connections.")
    entities = extract_entities(text)
    assert entities["codes"] == ["42P07", "AVX-039", "HR-2021-012", "HR-2024-047", "SKU-88412-B"]
    assert entities["dates"] == ["2024-03-01", "2025-03-05", "2025-04-07"]
    assert entities["emails"] == ["people-ops@acme.com"]
    assert entities["urls"] == ["https://hr.acme.com/leave"]


def test_impossible_dates_are_not_entities():
    assert "dates" not in extract_entities("Build 2024-13-45 and February 30, 2024.")


def test_embedded_text_carries_title_and_section_path_without_repeating_the_title():
    assert embed_text("Leave policy", ["Leave policy", "Entitlements"], "Twenty weeks.") == (
        "Leave policy\nEntitlements\n\nTwenty weeks.")
    assert embed_text(None, [], "Bare text.") == "Bare text."


def test_hashes_are_stable_and_content_sensitive(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"hello" * 100_000)
    assert hash_file(str(path)) == (hash_bytes(b"hello" * 100_000), 500_000)
    assert hash_text("a") == hash_bytes(b"a") != hash_text("b")
    assert len(hash_text("a")) == 32  # 128 bits
