"""Cleaning: a document's parsed elements as a reader sees them, before they are chunked (issue 29).

Typeset files (PDFs above all) carry what a reader's eye skips and a search engine does not: ligature characters
(U+FB01 for "fi"), page numbers and running headers between two halves of a sentence, words broken at line ends
("inter-\\nfaces", "dec- larations"), and lines the parser took for headings (a formula's "where", a grammar rule).
The chunk stage cleans the stored elements before cutting them: the elements stay as parsed, so a better cleaner is
a new CHUNKER_VERSION that re-chunks stored documents without re-parsing them.

What the libraries do and where kb does more (unstructured 0.27):
- unstructured's partitioners already drop what they recognise as Header, Footer and PageNumber (parse.py skips
  those categories); in PDFs many running lines and page numbers come out as plain text, and are dropped here when
  they sit at a page's top or bottom (a bare page number; a line repeated at the edges of several pages).
- unstructured's `clean_ligatures` maps only the Latin ligature block, its `clean_extra_whitespace` and
  `replace_unicode_quotes` change text kb wants kept; `normalise` below is Unicode's own compatibility mapping
  (NFKC's table, from `unicodedata`) limited to the forms that keep meaning: ligatures, non-breaking and
  typographic spaces, full-width and half-width forms; not superscripts, fractions or math letters (x² stays x²).
- unstructured's `group_broken_paragraphs` joins lines of one paragraph; it neither rejoins hyphenated words nor
  decides between "inter-faces" and "interfaces". `rejoin_broken_words` decides by the document's own vocabulary.
- Heading detection is the parser's; `demote_false_headings` only takes back, in PDFs, the titles that do not look
  like that document's headings.
Every rule here is kb's own: each is a few lines over plain strings, and no library offers them for PDF elements.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import replace
from functools import cache

from pipelines.ingest.elements import Element, with_section_paths

# Compatibility forms that normalise without a change of meaning (Unicode decomposition tags).
KEEPS_MEANING = {"<compat>", "<noBreak>", "<wide>", "<narrow>", "<small>", "<vertical>", "<isolated>", "<initial>",
                 "<medial>", "<final>"}
INVISIBLE = {"\u00ad": "", "\u200b": "", "\u2060": "", "\ufeff": ""}  # soft hyphen, zero-width space and joiners


@cache
def _table() -> dict[int, str]:
    """code point -> replacement, built once from unicodedata (the Basic Multilingual Plane holds these forms)."""
    table: dict[int, str] = {ord(k): v for k, v in INVISIBLE.items()}
    for code in range(0x10000):
        decomposition = unicodedata.decomposition(chr(code))
        if not decomposition.startswith("<"):
            continue
        tag, *points = decomposition.split()
        mapped = unicodedata.normalize("NFKC", chr(code))
        # A spacing accent (´ is a space and a combining acute) would leave a space behind: kept as it is.
        if tag in KEEPS_MEANING and not (points and points[0] == "0020" and len(points) > 1):
            table[code] = mapped
    return table


def normalise(text: str) -> str:
    """Text as kb stores, indexes, embeds and searches it: ligatures spelled out, typographic spaces plain, full-width
    letters ASCII, soft hyphens and zero-width characters gone, then composed (NFC). Queries get the same."""
    return unicodedata.normalize("NFC", text.translate(_table()))


ROMAN = r"(?=[ivxlcdm])m{0,3}(?:cm|cd|d?c{0,3})(?:xc|xl|l?x{0,3})(?:ix|iv|v?i{0,3})"  # a real numeral: not "civil"
PAGE_NUMBER = re.compile(rf"(?:page\s+)?(?:\d{{1,4}}|{ROMAN})(?:\s*(?:of|/)\s*\d{{1,4}})?|[-–—]\s*\d{{1,4}}\s*[-–—]",
                         re.IGNORECASE)
EDGE = 2  # elements at each end of a page where running lines and page numbers sit
RUNNING_MIN_PAGES = 3  # a line at the edges of this many pages (and of a quarter of them) is a running header
SENTENCE_END = (".", "!", "?", ":", ";")
FUNCTION_WORDS = {"and", "or", "nor", "to", "und", "oder", "et", "ou"}  # "pre- and post-processing" keeps its hyphen
BROKEN = re.compile(r"(\w+)-(?:[ \t]*\n\s*|[ \t]+)(\w+)")
# "2.1 ASN.1 syntax", "A.1 GNU ...", "Chapter 3": a section's number, then a word that does not start in lower case
# (not "2019 revenue grew", not "10 tips"); at most two digits a level.
NUMBERED = re.compile(r"(?:(?i:chapter|section|part|appendix)\s+\S|\d{1,2}(?:\.\d{1,2})*\.?\s+(?![a-z])\S"
                      r"|[A-Z](?:\.\d{1,2})+\.?\s+(?![a-z])\S)")
CODE = re.compile(r"[{}()\[\]<>=;|$\\]|::")
LEADERS = re.compile(r"\.{4,}|(?:\. ){4,}")  # a table of contents' or an index's line: "Introduction ...... 3"


def clean(elements: list[Element], doc_format: str) -> list[Element]:
    """The document's elements, cleaned: every format is normalised; a PDF (the typeset format, with pages) also
    loses its page furniture, gets its broken words and sentences rejoined and its false headings demoted."""
    cleaned = [replace(e, text=normalise(e.text), section_path=[normalise(p) for p in e.section_path]) for e in elements]
    if doc_format != "pdf":
        return cleaned
    cleaned = join_split_numbers(cleaned)
    cleaned = drop_page_furniture(cleaned)
    cleaned = rejoin_across_pages(cleaned)
    cleaned = rejoin_broken_words(cleaned)
    return demote_false_headings(cleaned)


SECTION_NUMBER = re.compile(r"(?:\d{1,2}|[A-Z])(?:\.\d{1,2})*\.?")


def join_split_numbers(elements: list[Element]) -> list[Element]:
    """A heading whose number the parser set apart ("1", then the title "Introduction") is one heading again,
    "1 Introduction", before a bare number at a page's top could be taken for a page number. Not a count before a
    type in a table the parser read as lines ("4", then "CARD32")."""
    out: list[Element] = []
    for element in elements:
        previous = out[-1] if out else None
        if (previous is not None and element.category == "Title" and previous.category != "Title"
                and previous.page_number == element.page_number and SECTION_NUMBER.fullmatch(previous.text.strip())
                and looks_like_heading(element.text, False) and not re.search(r"\d", element.text.split()[0])):
            out[-1] = replace(element, text=f"{previous.text.strip()} {element.text}")
            continue
        out.append(element)
    return out


def _edges(elements: list[Element]) -> set[int]:
    """Indexes of the elements at the top or bottom of their page."""
    pages: dict[int | None, list[int]] = {}
    for i, element in enumerate(elements):
        pages.setdefault(element.page_number, []).append(i)
    return {i for indexes in pages.values() for i in indexes[:EDGE] + indexes[-EDGE:]}


def _shape(text: str) -> str:
    """A running line with its page number taken out ("Chapter 2  17" and "Chapter 2  19" are one line)."""
    return re.sub(r"\d+", "#", " ".join(text.split()).lower())


def drop_page_furniture(elements: list[Element]) -> list[Element]:
    """Without bare page numbers at a page's top or bottom, nor lines repeated at the edges of several pages."""
    edges = _edges(elements)
    pages = {e.page_number for e in elements}
    at_edges = Counter(shape for shape, page in {(_shape(elements[i].text), elements[i].page_number) for i in edges})
    running = {shape for shape, count in at_edges.items()
               if count >= RUNNING_MIN_PAGES and count * 4 >= len(pages) and len(shape) <= 120}
    return [e for i, e in enumerate(elements)
            if i not in edges or e.category == "Table"
            or not (PAGE_NUMBER.fullmatch(e.text.strip()) or _shape(e.text) in running)]


def rejoin_across_pages(elements: list[Element]) -> list[Element]:
    """A paragraph cut in two is one again: a body element that ends on a broken word ("iden-") and the next one
    that goes on in lower case (the parser may have taken it for a title); or, across a page break, one that ends
    mid-sentence and the next page's first one that goes on in lower case. The hyphen is left to
    rejoin_broken_words."""
    out: list[Element] = []
    for element in elements:
        previous = out[-1] if out else None
        if (previous is not None and previous.category not in ("Table", "Title") and element.category != "Table"
                and element.text[:1].islower()
                and (re.search(r"\w-$", previous.text) or (previous.page_number != element.page_number
                                                            and not previous.text.endswith(SENTENCE_END)))):
            glue = "\n" if previous.text.endswith("-") else " "
            out[-1] = replace(previous, text=previous.text + glue + element.text)
            continue
        out.append(element)
    return out


def rejoin_broken_words(elements: list[Element]) -> list[Element]:
    """Words a line end broke ("inter-\\nfaces", "dec- larations") whole again. The document's own vocabulary
    decides: the joined word if the document uses it, the hyphenated compound if it uses that, else joined (a
    typesetter breaks words far more often than it breaks a line after a compound's hyphen); never before a
    function word ("pre- and post-processing")."""
    words = Counter(word.lower() for e in elements for word in re.findall(r"\w+(?:-\w+)*", e.text))

    def join(match: re.Match) -> str:
        first, second = match.group(1), match.group(2)
        if words[(first + second).lower()]:
            return first + second
        if second.lower() in FUNCTION_WORDS or not (second[:1].islower() or first.isupper() and second.isupper()):
            return match.group(0)  # a capital after the hyphen: a name or a new sentence, not a word's second half
        return f"{first}-{second}" if words[f"{first}-{second}".lower()] else first + second

    return [e if e.category == "Table" else replace(e, text=BROKEN.sub(join, e.text)) for e in elements]


def looks_like_heading(text: str, numbered_document: bool) -> bool:
    """Whether a title the parser found reads as a heading: not a contents line (dot leaders); short, no sentence
    punctuation at its end, no code, not starting in lower case; in a document that numbers its headings,
    numbered."""
    if LEADERS.search(text):
        return False
    if NUMBERED.match(text):
        return not text.endswith((",", ";"))
    if numbered_document:
        return False
    words = text.split()
    return (0 < len(words) <= 12 and not text.endswith(SENTENCE_END + (",",)) and not CODE.search(text)
            and not text[:1].islower() and any(ch.isalpha() for ch in text))


def demote_false_headings(elements: list[Element]) -> list[Element]:
    """Titles that do not look like the document's headings become body text, and the section paths are drawn
    again from the headings that remain. The first title (the document's own) always stays. A document numbers its
    headings when at least three of its titles are numbered."""
    titles = [i for i, e in enumerate(elements) if e.category == "Title"]
    numbered = sum(bool(NUMBERED.match(elements[i].text)) for i in titles) >= 3
    false = {i for i in titles[1:] if not looks_like_heading(elements[i].text, numbered)}
    if not false:
        return elements
    return with_section_paths([replace(e, category="NarrativeText", depth=None) if i in false else e
                               for i, e in enumerate(elements)])
