"""The chunker on hand-made element lists, with the real all-MiniLM-L6-v2 tokenizer."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.ingest.chunker import Chunker
from pipelines.ingest.elements import Element
from pipelines.ingest.enrich import context_title, embed_text
from pipelines.models.tokens import local_counter

SENTENCE = "The cooling fan of drive number {n} must be replaced after thirty thousand operating hours of service."


@pytest.fixture(scope="module")
def chunker():
    return Chunker(local_counter())


def section(title, depth, body, parents=()):
    path = [*parents, title]
    return [Element("Title", title, depth=depth, section_path=path)] + [
        Element("NarrativeText", text, section_path=path) for text in body]


def long_paragraph(sentences: int, start: int = 0) -> str:
    return " ".join(SENTENCE.format(n=start + i) for i in range(sentences))


def embedded_tokens(chunk, title):
    return local_counter().count([embed_text(title, chunk.section_path, chunk.text)])[0]


def test_short_sections_are_separate_chunks_with_their_heading_path(chunker):
    elements = (section("Leave policy", 0, ["Intro paragraph."])
                + section("Scope", 1, ["Applies to everyone."], ["Leave policy"])
                + section("Entitlements", 1, ["Twenty weeks.", "Eight weeks."], ["Leave policy"]))
    chunks = chunker.chunk(elements, "Leave policy")
    assert [c.text for c in chunks] == ["Intro paragraph.", "Applies to everyone.", "Twenty weeks.\n\nEight weeks."]
    assert chunks[2].section_path == ["Leave policy", "Entitlements"]


def test_long_section_splits_at_sentence_ends_with_overlap_and_never_exceeds_the_model_limit(chunker):
    title = "Maintenance manual"
    elements = section("Fans", 0, [long_paragraph(40)])
    chunks = chunker.chunk(elements, title)
    assert len(chunks) >= 3
    sentences = {SENTENCE.format(n=i) for i in range(40)}
    for chunk in chunks:
        assert embedded_tokens(chunk, title) <= 254  # 256 word pieces minus [CLS] and [SEP]
        pieces = [p.strip() + "." for p in chunk.text.split(".") if p.strip()]
        assert all(p in sentences for p in pieces), "a chunk was cut inside a sentence"
    for previous, following in zip(chunks, chunks[1:]):
        tail = [p.strip() + "." for p in previous.text.split(".") if p.strip()][-2:]
        assert following.text.startswith(tail[0]) or following.text.startswith(tail[1]), "no 1-2 sentence overlap"
        assert tail[1] in following.text
    covered = {p.strip() + "." for c in chunks for p in c.text.split(".") if p.strip()}
    assert covered == sentences, "text was lost between chunks"


def test_paragraph_boundaries_are_preferred_to_mid_paragraph_splits(chunker):
    paragraphs = [long_paragraph(6, start=10 * i) for i in range(4)]
    chunks = chunker.chunk(section("Fans", 0, paragraphs), "Manual")
    first = chunks[0].text
    assert first.endswith(paragraphs[0][-40:]) or first.endswith(paragraphs[1][-40:]), first[-80:]


def test_a_long_heading_trail_still_fits(chunker):
    parents = [f"Part {i} with a rather long and descriptive heading about servo drive maintenance" for i in range(8)]
    elements = section("Deepest section", 8, [long_paragraph(20)], parents)
    title = "A fairly long document title about the installation and maintenance of servo drives"
    for chunk in chunker.chunk(elements, title):
        assert embedded_tokens(chunk, title) <= 254


def test_table_that_fits_is_one_whole_chunk(chunker):
    html = "<table><tr><th>Code</th><th>Meaning</th></tr><tr><td>F-101</td><td>DC bus overvoltage</td></tr></table>"
    elements = section("Faults", 0, ["Before the table."]) + [
        Element("Table", "Code Meaning F-101 DC bus overvoltage", section_path=["Faults"], text_as_html=html),
        Element("NarrativeText", "After the table.", section_path=["Faults"])]
    chunks = chunker.chunk(elements, "Manual")
    assert [c.kind for c in chunks] == ["text", "table", "text"]
    assert chunks[1].text == "Code | Meaning\nF-101 | DC bus overvoltage"


def test_table_too_long_is_split_between_rows_with_the_header_repeated(chunker):
    rows = "".join(f"<tr><td>F-{i:03d}</td><td>{SENTENCE.format(n=i)}</td></tr>" for i in range(40))
    html = f"<table><tr><th>Code</th><th>Meaning</th></tr>{rows}</table>"
    chunks = chunker.chunk([Element("Table", "x", section_path=[], text_as_html=html)], "Faults")
    assert len(chunks) > 1
    for chunk in chunks:
        lines = chunk.text.split("\n")
        assert lines[0] == "Code | Meaning"
        assert all(line.startswith("F-") for line in lines[1:])
        assert embedded_tokens(chunk, "Faults") <= 254
    body = [line for c in chunks for line in c.text.split("\n")[1:]]
    assert len(body) == 40 and len(set(body)) == 40


class _Tallied:
    """The model's counter, tallying the characters it is given to tokenize."""

    def __init__(self):
        self.inner, self.characters = local_counter(), 0
        self.max_tokens, self.additive = self.inner.max_tokens, self.inner.additive

    def count(self, texts):
        self.characters += sum(map(len, texts))
        return self.inner.count(texts)

    def token_ends(self, text):
        self.characters += len(text)
        return self.inner.token_ends(text)


def test_a_long_section_is_tokenized_once_and_its_chunks_counted_exactly():
    """The tokenizer was half of a first ingest's chunk stage: the text was read whole, then sentence by sentence,
    then chunk by chunk. The model's word pieces add up, so the chunker reads them once."""
    counter = _Tallied()
    paragraphs = [long_paragraph(30, start=30 * i) for i in range(3)]
    chunks = Chunker(counter).chunk(section("Fans", 0, paragraphs), "Manual")
    assert len(chunks) > 3
    assert counter.characters < 1.1 * sum(map(len, paragraphs))  # about 3.3x before
    assert [c.token_count for c in chunks] == local_counter().count([c.text for c in chunks])


def test_a_paragraph_of_over_a_million_characters_is_chunked_within_the_limit(chunker):
    """A text file that is one paragraph: spaCy refuses a text over a million characters, which stopped the run."""
    paragraph = " ".join(SENTENCE.format(n=n) for n in range(12_000))  # 1.2 million characters
    chunks = chunker.chunk(section("Log", 0, [paragraph]), "Dump")
    counted = local_counter().count([c.text for c in chunks])
    assert len(chunks) > 1_000 and max(counted) <= local_counter().max_tokens
    assert [c.token_count for c in chunks] == counted
    covered = {p.strip() + "." for c in chunks for p in c.text.split(".") if p.strip()}
    assert covered == {SENTENCE.format(n=n) for n in range(12_000)}, "text was lost between chunks"


def test_a_long_hard_wrapped_paragraph_is_read_in_windows_cut_between_sentences():
    from pipelines.ingest.sentences import WINDOW_CHARS, split_sentences

    line = "Replaced the cooling fan on unit {n} after the controller reported a\nstall during the night shift."
    paragraph = " ".join(line.format(n=n) for n in range(2 * WINDOW_CHARS // len(line) + 50))
    assert [s for s in split_sentences(paragraph) if not s.endswith("shift.")] == []


def test_heading_without_body_keeps_its_text(chunker):
    elements = [Element("Title", "Only a heading", depth=0, section_path=["Only a heading"]),
                Element("Title", "Another heading", depth=0, section_path=["Another heading"])]
    texts = [c.text for c in chunker.chunk(elements, "Doc")]
    assert texts == ["Only a heading\n\nAnother heading"]


class _Raw:
    """The shape of an unstructured element, for pipelines.ingest.parse.to_elements."""

    def __init__(self, category: str, text: str, depth: int):
        from types import SimpleNamespace

        self.category, self.text = category, text
        self.metadata = SimpleNamespace(category_depth=depth, page_number=None, text_as_html=None)


def _is_subsequence(needle: str, haystack: str) -> bool:
    it = iter(haystack)
    return all(char in it for char in needle)


# Arbitrary Unicode, prose long enough to need splitting, and runs without spaces (base64, long identifiers).
_WORDS = ["the", "fan", "Zebra-12", "naïve", "東京", "AVX-039", "e.g.", "α", "3.5", "(see", "table)", ".", "!", "?",
          "\n", "\n\n", "|", "x" * 40]
TEXTS = st.one_of(st.text(min_size=1, max_size=2500),
                  st.lists(st.sampled_from(_WORDS), min_size=1, max_size=900).map(" ".join),
                  st.text(alphabet="abcXYZ0189+/=-_.", min_size=200, max_size=6000))


@given(blocks=st.lists(st.tuples(st.sampled_from(["Title", "NarrativeText", "ListItem", "Table"]), TEXTS,
                                 st.integers(0, 3)), min_size=1, max_size=12),
       title=st.one_of(st.none(), st.text(max_size=200), TEXTS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_text_and_structure_chunk_within_the_limit_and_lose_nothing(chunker, blocks, title):
    from pipelines.ingest.parse import to_elements

    elements = to_elements([_Raw(*block) for block in blocks])
    chunks = chunker.chunk(elements, title)
    limit = local_counter().max_tokens
    embedded_title = context_title(local_counter(), title)  # the title as the enricher prepends it
    for chunk in chunks:
        assert local_counter().count([embed_text(embedded_title, chunk.section_path, chunk.text)])[0] <= limit
        assert chunk.token_count == local_counter().count([chunk.text])[0]  # read off the whole text's tokens
    body = "".join("".join(c.text.split()) for c in chunks)
    for element in elements:
        if element.category != "Title":
            assert _is_subsequence("".join(element.text.split()), body), "text was lost"
