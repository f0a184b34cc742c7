"""Real documents come out clean (issue 29): text normalised for storage and queries alike, page furniture
dropped, words broken at line ends rejoined, false headings demoted; on a real typeset manual
(tests/data/manuals/libtasn1.pdf, a GNU manual typeset by pdfTeX) and on the rules' own cases."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from cli_runs import ingest, kb
from pipelines.answers.answer import _contexts
from pipelines.ingest.clean import clean, normalise, rejoin_broken_words
from pipelines.ingest.elements import Element
from pipelines.retrieval.responses import retrieve
from pipelines.retrieval.search import Filters, search

MANUAL = Path(__file__).parent / "data" / "manuals" / "libtasn1.pdf"


def test_text_is_normalised_where_meaning_is_kept():
    assert normalise("the IDL \ufb01le and the \ufb02ow of e\ufb03cient o\ufb00ers") == \
        "the IDL file and the flow of efficient offers"
    assert normalise("10\u00a0kg, \uff21\uff22\uff23-\uff11\uff12, co\u00adoperate, zero\u200bwidth") == \
        "10 kg, ABC-12, cooperate, zero\u200bwidth"  # a zero-width space separates Thai and Khmer words
    thai, korean, aleph = "\u0e19\u0e49\u0e33", "\u3131. \u3134.", "\u2135\u2080"
    assert (normalise(thai), normalise(korean), normalise(aleph)) == (thai, korean, aleph), "their own spelling"
    assert normalise("x\u00b2 + \u00bd, caf\u0065\u0301, na\u00efve \u00b4") == "x\u00b2 + \u00bd, caf\u00e9, na\u00efve \u00b4"


def test_words_broken_at_line_ends_are_rejoined_by_the_documents_own_vocabulary():
    def rejoined(*texts: str) -> list[str]:
        return [e.text for e in rejoin_broken_words([Element("NarrativeText", t) for t in texts])]

    assert rejoined("The inter-\nfaces and the dec- larations.") == ["The interfaces and the declarations."]
    assert rejoined("A well-\nknown rule.", "It is well-known.") == ["A well-known rule.", "It is well-known."]
    assert rejoined("Both pre- and post-processing.", "See RFC- 5280 and OP- TIONAL.", "OPTIONAL fields.") == [
        "Both pre- and post-processing.", "See RFC-5280 and OPTIONAL.", "OPTIONAL fields."]
    assert rejoined("A dual- encoder, Windows-\nbased, Gard- ner.", "Our dual-encoder is Windows-based.") == [
        "A dual-encoder, Windows-based, Gardner.", "Our dual-encoder is Windows-based."]
    assert rejoined("Our state-of-the-\nart model is end-to-\nend.", "It is state-of-the-art.") == [
        "Our state-of-the-art model is end-to-end.", "It is state-of-the-art."]
    assert rejoined("A 5-\nyear plan, steps 1-\n3, a NON-\nEXCLUSIVE licence, land- en tuinbouw, state- of-the-art.") == [
        "A 5-year plan, steps 1-3, a NON-EXCLUSIVE licence, land- en tuinbouw, state-of-the-art."]
    untouched = "Write to jane@my-\ncompany.com, see https://example.com/very-long-\npath or --no-\ncache-dir."
    assert rejoined(untouched) == [untouched]


def test_page_numbers_running_headers_and_false_headings_leave_a_pdf():
    words = ["okapi", "zebra", "lemur", "tapir", "quokka"]
    elements = [Element("Title", "Libtasn1", depth=0, page_number=1)]
    for page, word in enumerate(words, 1):
        elements += [Element("UncategorizedText", f"Libtasn1 Reference Manual {page}", page_number=page)] * (page > 1)
        elements += [Element("NarrativeText", f"{word} facts come first.", page_number=page),
                     Element("NarrativeText", f"The {word} section goes on without", page_number=page),
                     Element("UncategorizedText", str(page + 10), page_number=page)]
    elements[1:1] = [Element("Title", "2.1 ASN.1 syntax", depth=1, page_number=1),
                     Element("Title", "Version ::= INTEGER", depth=2, page_number=1),
                     Element("NarrativeText", "The longest name is an iden-", page_number=1),
                     Element("Title", "tifier.", depth=2, page_number=1)]
    cleaned = clean(elements, "pdf")
    texts = [e.text for e in cleaned]
    assert not any(t.startswith("Libtasn1 Reference Manual") or t.isdigit() for t in texts), texts
    assert [e.text for e in cleaned if e.category == "Title"] == ["Libtasn1", "2.1 ASN.1 syntax"]
    assert all(e.section_path == ["Libtasn1", "2.1 ASN.1 syntax"] for e in cleaned[1:]), cleaned
    assert "The longest name is an identifier." in texts, "a word broken across two elements is one again"
    assert "The okapi section goes on without zebra facts come first." in texts, "a sentence cut by a page break"
    markdown = [Element("Title", "Version ::= INTEGER", depth=0), Element("NarrativeText", "7")]
    assert [e.text for e in clean(markdown, "md")] == ["Version ::= INTEGER", "7"], "only PDFs' guesses are undone"


@pytest.fixture
def manual(settings, tmp_path):
    folder = tmp_path / "manuals"
    folder.mkdir()
    shutil.copy(MANUAL, folder / "libtasn1.pdf")
    kb("source", "add", "manuals", str(folder), "--public")
    ingest()
    return folder


def test_a_real_manual_comes_out_clean_and_results_name_their_page(manual, conn, embedder):
    chunks = conn.execute("SELECT text, section_path, page_number FROM chunks WHERE valid_to IS NULL"
                          " AND kind <> 'card'").fetchall()
    assert len(chunks) > 20
    text = "\n".join(t for t, _, _ in chunks)
    assert not re.findall(r"\b[a-z]+- [a-z]+", text), re.findall(r"\w+- \w+", text)[:10]
    assert "manipulation" in text and "identifier" in text and "manip-" not in text
    paths = {p for _, path, _ in chunks for p in path}
    assert {"2.1 ASN.1 syntax", "3.1 Invoking asn1Parser", "4.3 DER functions"} <= paths
    assert not paths & {"BEGIN", "END", "tifier.", "Version ::= INTEGER", "invalid:", "Others examples:"}, paths
    assert not [t for t, _, _ in chunks if re.search(r"(?m)^\d{1,3}$", t)], "no page number on a line of its own"
    assert all(page is not None for _, _, page in chunks)

    hits = search(conn, embedder, "asn1Parser reads the ASN.1 definitions file", 3, filters=Filters())
    assert hits and hits[0].page is not None and hits[0].document == "libtasn1.pdf"
    shown = kb("search", "asn1Parser reads the ASN.1 definitions file", "--k", "1")
    assert re.search(r"manuals:libtasn1\.pdf p\. \d+ > ", shown), shown
    assert re.search(r"^v1 .* \+\d+ -0 =0  p\. 1, 3-36$", kb("history", "manuals:libtasn1.pdf"), re.M)
    context = _contexts(conn, hits)[0]
    assert context.label() == f"[manuals:libtasn1.pdf p. {hits[0].page}, {' > '.join(hits[0].section_path)}]"


def test_a_ligature_in_a_document_or_a_query_is_the_letters_it_stands_for(settings, conn, embedder, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "idl.md").write_text("# The IDL compiler\n\nThe compiler reads one IDL \ufb01le at a time and writes"
                                   " the stubs of every interface it de\ufb01nes.\n")
    kb("source", "add", "docs", str(folder), "--public")
    ingest()
    for query in ("IDL file", "file", "\ufb01le"):
        found = search(conn, embedder, query, 3, arm="lexical", filters=Filters())
        assert found and "IDL file" in found[0].content, query
    plain, ligature = (retrieve(conn, settings, query, 3, arm="dense")[1] for query in ("IDL file", "IDL \ufb01le"))
    assert [h.dense_score for h in ligature] == [h.dense_score for h in plain]  # embedded as read, not as typed


def test_a_text_in_several_documents_fills_one_place_in_the_results(settings, conn, embedder, tmp_path):
    folder = tmp_path / "docs"
    (folder / "copy").mkdir(parents=True)
    policy = "# Okapi care\n\nFeed the okapi twice a day, with leaves from the north paddock.\n"
    (folder / "okapi.md").write_text(policy)
    (folder / "copy" / "okapi.md").write_text(policy)  # the same document under two paths
    (folder / "zebra.md").write_text("# Zebra care\n\nBrush the zebra every morning; never feed it okapi leaves.\n")
    kb("source", "add", "docs", str(folder), "--public")
    ingest()
    hits = search(conn, embedder, "how often to feed the okapi", 3, filters=Filters())
    assert [h.document for h in hits].count("okapi.md") + [h.document for h in hits].count("copy/okapi.md") == 1
    assert [c.split(" > ")[0] for c in hits[0].copies] in (["docs:copy/okapi.md"], ["docs:okapi.md"])
    assert "also in: docs:" in kb("search", "how often to feed the okapi", "--k", "3")
    every = search(conn, embedder, "how often to feed the okapi", 3, filters=Filters(duplicates=True))
    assert {h.document for h in every} == {"okapi.md", "copy/okapi.md", "zebra.md"}


def test_a_lead_in_sentence_stays_with_what_it_introduces():
    from pipelines.ingest.chunker import Chunker
    from pipelines.models.tokens import local_counter

    filler = " ".join(f"Sentence {n} says something about okapi habitats and their seasonal leaves." for n in range(24))
    code = "\n".join(f"markov_basis(ring, generators[{n}], options)" for n in range(12))
    for lead_in in ("Let us compute the Markov basis via the call", "The call is as follows:"):
        elements = [Element("Title", "Markov bases", depth=0), Element("NarrativeText", filler),
                    Element("NarrativeText", lead_in), Element("NarrativeText", code)]
        chunks = Chunker(local_counter()).chunk(elements, "Manual")
        assert len(chunks) > 1
        holding = [c.text for c in chunks if lead_in in c.text]
        assert holding and all("markov_basis(ring" in text for text in holding), [c.text[-120:] for c in chunks]


def test_a_heading_number_set_apart_by_the_parser_is_part_of_its_heading_again():
    elements = [Element("Title", "Dense Passage Retrieval", depth=0, page_number=1),
                Element("NarrativeText", "We show that retrieval can be dense.", page_number=1),
                Element("UncategorizedText", "1", page_number=1), Element("Title", "Introduction", depth=0, page_number=1),
                Element("NarrativeText", "Open-domain question answering is a task.", page_number=1),
                Element("UncategorizedText", "4.2", page_number=1),
                Element("Title", "Question Answering Datasets", depth=1, page_number=1),
                Element("NarrativeText", "We use five datasets.", page_number=1),
                Element("UncategorizedText", "4", page_number=1), Element("Title", "CARD32", depth=2, page_number=1)]
    cleaned = clean(elements, "pdf")
    assert [e.text for e in cleaned if e.category == "Title"][:3] == [
        "Dense Passage Retrieval", "1 Introduction", "4.2 Question Answering Datasets"]
    assert not any(e.text in ("1", "4.2") for e in cleaned)
    assert "4 CARD32" not in [e.text for e in cleaned], "a count before a type is not a heading's number"
    birds = [Element("NarrativeText", "Field notes.", page_number=1)]
    for page, animal in enumerate(["Birds", "Mammals", "Reptiles"], 2):
        birds += [Element("UncategorizedText", "Field guide", page_number=page),
                  Element("UncategorizedText", str(page), page_number=page),
                  Element("Title", animal, depth=0, page_number=page),
                  Element("NarrativeText", f"All about {animal.lower()}.", page_number=page)]
    assert [e.text for e in clean(birds, "pdf") if e.category == "Title"] == ["Birds", "Mammals", "Reptiles"]


def test_headings_that_read_as_headings_stay_in_numbered_and_unnumbered_documents():
    def titles(*texts: str) -> list[str]:
        elements = [e for t in texts for e in (Element("Title", t, depth=1, page_number=1),
                                                Element("NarrativeText", "Body.", page_number=1))]
        return [e.text for e in clean([Element("Title", "Doc", depth=0, page_number=1), *elements], "pdf")
                if e.category == "Title"][1:]

    paper = ["Abstract", "1 Introduction", "2 Method", "3 pH control", "3.1 mRNA stability", "Acknowledgements",
             "References", "BEGIN", "CARD32", "InstanceName Asn1Definition", "2.2 Late delivery incurs a penalty."]
    assert titles(*paper) == paper[:7]
    regulation = ["CHAPTER I General provisions", "Article 1 Subject-matter", "Article 2 Material scope", "§ 5 Fees"]
    assert titles(*regulation) == regulation
    faq = ["How do I reset my password?", "Key Performance Indicators (KPIs)", "iPhone setup", "where", "decl",
           "Version ::= INTEGER", "Let us compute the Markov basis via the call:"]
    assert titles(*faq) == faq[:3]


def test_a_page_break_joins_a_paragraph_but_never_a_heading_a_list_item_or_code_lines():
    elements = [Element("Title", "2 Install", depth=0, page_number=3),
                Element("NarrativeText", "Download it from https://example.com/download", page_number=3),
                Element("Title", "iOS configuration", depth=0, page_number=4),
                Element("NarrativeText", "for x in items:\n    process(x)", page_number=4),
                Element("NarrativeText", "if done:\n    cleanup()", page_number=5),
                Element("ListItem", "(i) the Licensor; or", page_number=5),
                Element("ListItem", "ii) the Licensee", page_number=6)]
    cleaned = clean(elements, "pdf")
    assert [e.text for e in cleaned] == ["2 Install", "Download it from https://example.com/download",
                                         "iOS configuration", "for x in items:\n    process(x)\nif done:\n    cleanup()",
                                         "(i) the Licensor; or", "ii) the Licensee"]
