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
INVISIBLE = {"\u00ad": "", "\u2060": "", "\ufeff": ""}  # soft hyphen, word joiner, byte-order mark
# Compatibility characters that are the normal spelling of their script, or whose mapping changes the text's sense:
# Thai and Lao vowels (น้ำ), Lao ligatures, Hangul compatibility and half-width jamo (Korean list markers ㄱ. ㄴ.),
# the Hebrew-letter math symbols ℵ-ℸ (they would turn right-to-left). The zero-width space is kept too: Thai and
# Khmer separate words with it.
KEPT = {0x0E33, 0x0EB3, 0x0EDC, 0x0EDD, *range(0x3131, 0x318F), *range(0xFFA0, 0xFFDD), *range(0x2135, 0x2139)}


@cache
def _replacement(char: str) -> str | None:
    """What a character becomes, or None when it stays: an invisible one nothing, a compatibility form of the Basic
    Multilingual Plane that keeps its meaning its NFKC form. Looked up per distinct character and remembered, so no
    table of the whole plane is built at a process's first search (it took 0.2 s)."""
    if char in INVISIBLE:
        return INVISIBLE[char]
    code = ord(char)
    decomposition = unicodedata.decomposition(char)
    if code >= 0x10000 or code in KEPT or not decomposition.startswith("<"):
        return None
    tag, *points = decomposition.split()
    # A spacing accent (´ is a space and a combining acute) would leave a space behind: kept as it is.
    if tag not in KEEPS_MEANING or (points and points[0] == "0020" and len(points) > 1):
        return None
    return unicodedata.normalize("NFKC", char)


def normalise(text: str) -> str:
    """Text as kb stores, indexes, embeds and searches it: ligatures spelled out, typographic spaces plain, full-width
    letters ASCII, soft hyphens and word joiners gone, then composed (NFC). Queries get the same."""
    changes = {ord(char): new for char in set(text) if (new := _replacement(char)) is not None}
    return unicodedata.normalize("NFC", text.translate(changes) if changes else text)


ROMAN = r"(?=[ivxlcdm])m{0,3}(?:cm|cd|d?c{0,3})(?:xc|xl|l?x{0,3})(?:ix|iv|v?i{0,3})"  # "xiv", not "civil"
# A page's number alone: "16", "xiv" (front matter, lower case: "CV" or "MIX" are words), "Page 3 of 10", "3 / 10",
# "- 4 -". Not "24/7".
PAGE_NUMBER = re.compile(rf"(?:(?i:page)\s+)?(?:\d{{1,4}}|{ROMAN})(?:\s+(?i:of)\s+\d{{1,4}}|\s+/\s+\d{{1,4}})?"
                         r"|[-–—]\s*\d{1,4}\s*[-–—]")
EDGE = 2  # elements at each end of a page where running lines and page numbers sit
RUNNING_MIN_PAGES = 3  # a line at the edges of this many pages (and of a quarter of them) is a running header
SENTENCE_END = (".", "!", "?", ":", ";")
# "pre- and post-processing", "Vor- bzw. Nachteile", "land- en tuinbouw", "small- versus large-scale": the hyphen
# stays before a connecting word.
FUNCTION_WORDS = {"and", "or", "nor", "to", "through", "vs", "versus", "und", "oder", "bzw", "bis", "en", "of", "et",
                  "ou", "y", "o", "e", "och", "og", "eller", "i", "a"}
# A hyphenated chain (state-of-the-) broken at a hyphen, then the rest (of-the-art); never inside a URL, an e-mail
# address or a command-line option (a first part after "/", "@", "." or "-", a second before "@" or ".word").
BROKEN = re.compile(r"(?<![\w/@.-])((?:\w+-)*\w+)-([ \t]*\n\s*|[ \t]+)(\w+(?:-\w+)*)(?![\w@]|\.\w)")
# "2.1 ASN.1 syntax", "A.1 GNU ...", "Chapter 3", "Article 12", "§ 5": a section's number, then a word that is not
# all lower case ("3 pH control" is a heading, "2019 revenue grew" and "10 tips" are not); two digits a level at most.
NUMBERED = re.compile(r"(?:(?i:chapter|section|part|appendix|annex|article|schedule|clause|kapitel|artikel|"
                      r"abschnitt|chapitre|art\.)\s+\S|§\s*\d"
                      r"|(?:\d{1,2}(?:\.\d{1,2})*\.?|[A-Z](?:\.\d{1,2})+\.?|[IVXLC]{1,6}\.)\s+(?![a-z]+\b)\S)")
CODE = re.compile(r"[{}\[\]<>=;|$\\]|::")
LEADERS = re.compile(r"\.{4,}|(?:\. ){4,}")  # a table of contents' or an index's line: "Introduction ...... 3"


def clean(elements: list[Element], doc_format: str) -> list[Element]:
    """The document's elements, cleaned: every format is normalised; a PDF (the typeset format, with pages) also
    loses its page furniture, gets its broken words and sentences rejoined and its false headings demoted."""
    cleaned = [replace(e, text=normalise(e.text), section_path=[normalise(p) for p in e.section_path],
                       text_as_html=e.text_as_html and normalise(e.text_as_html)) for e in elements]
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
    type in a table the parser read as lines ("4", then "CARD32"), nor a number among the first elements of its page
    (where the page's own number sits, after a running header perhaps)."""
    out: list[Element] = []
    for element in elements:
        previous = out[-1] if out else None
        if (previous is not None and element.category == "Title" and previous.category != "Title"
                and previous.page_number == element.page_number and SECTION_NUMBER.fullmatch(previous.text.strip())
                and looks_like_heading(element.text, False) and not re.search(r"\d", element.text.split()[0])
                and len(out) > EDGE and all(e.page_number == previous.page_number for e in out[-EDGE - 1:])):
            out[-1] = replace(element, text=f"{previous.text.strip()} {element.text}")
            continue
        out.append(element)
    return out


def _edges(elements: list[Element], width: int) -> set[int]:
    """Indexes of the `width` elements at the top and at the bottom of each page."""
    pages: dict[int | None, list[int]] = {}
    for i, element in enumerate(elements):
        pages.setdefault(element.page_number, []).append(i)
    return {i for indexes in pages.values() for i in indexes[:width] + indexes[-width:]}


def _shape(text: str) -> str:
    """A running line without the page number at its start or end ("Chapter 2: Utilities 7" and "Chapter 2:
    Utilities 9" are one line; "Revenue: $12.4M, up 8%" and "$9.1M, up 15%" are not)."""
    line = " ".join(text.split()).lower()
    return re.sub(rf"^(?:{PAGE_NUMBER.pattern})\s+|\s+(?:{PAGE_NUMBER.pattern})$", "", line)


def drop_page_furniture(elements: list[Element]) -> list[Element]:
    """Without a page's number alone among the two elements at its top or bottom, nor a line repeated, page number
    aside, as the first or last element of several pages (running headers and footers). Titles and tables stay."""
    numbers, lines = _edges(elements, EDGE), _edges(elements, 1)
    pages = {e.page_number for e in elements}
    at_edges = Counter(shape for shape, page in {(_shape(elements[i].text), elements[i].page_number) for i in lines})
    running = {shape for shape, count in at_edges.items()
               if count >= RUNNING_MIN_PAGES and count * 4 >= len(pages) and len(shape) <= 120}
    return [e for i, e in enumerate(elements)
            if e.category in ("Title", "Table")
            or not (i in numbers and PAGE_NUMBER.fullmatch(e.text.strip()) or i in lines and _shape(e.text) in running)]


def rejoin_across_pages(elements: list[Element]) -> list[Element]:
    """A paragraph cut in two is one again: a body element that ends on a broken word ("iden-") and the next one
    that goes on in lower case (the parser may have taken it for a title); or, across a page break, a paragraph of
    one section that ends mid-sentence and the next page's first one that goes on in lower case (not a title, not
    a list item). Lines stay lines (code); the hyphen is left to rejoin_broken_words."""
    out: list[Element] = []
    for element in elements:
        previous = out[-1] if out else None
        if previous is None or "Table" in (previous.category, element.category) or previous.category == "Title" \
                or not element.text[:1].islower():
            out.append(element)
            continue
        broken = re.search(r"\w-$", previous.text)
        continued = (element.category not in ("Title", "ListItem") and previous.category != "ListItem"
                     and previous.page_number != element.page_number and previous.section_path == element.section_path
                     and not previous.text.endswith(SENTENCE_END))
        if broken or continued:
            glue = "\n" if broken or "\n" in previous.text + element.text else " "
            out[-1] = replace(previous, text=previous.text + glue + element.text)
            continue
        out.append(element)
    return out


def rejoin_broken_words(elements: list[Element]) -> list[Element]:
    """Words a line end broke ("inter-\\nfaces", "dec- larations": PDF text extraction writes a line end inside a
    line as a space) whole again. The document's own vocabulary decides: the joined word if the document uses it,
    the hyphenated compound if it uses that ("dual-encoder"). Else a hyphen stays, without the line end, where a
    compound is likelier: in a chain ("state-of-the-art", "end-to-end"), next to a number ("5-year", "1-3"), before
    an upper-case part or after an all-caps one ("NON-EXCLUSIVE"); and it stays as it is before a connecting word
    ("pre- and post-", "land- en tuinbouw"). Otherwise the word is joined ("manipulation", a name "Gardner": a
    typesetter breaks words far more often than after a compound's hyphen). URLs, e-mail addresses and options are
    left alone (BROKEN)."""
    words = Counter(word.lower() for e in elements for word in re.findall(r"\w+(?:-\w+)*", e.text))

    def join(match: re.Match) -> str:
        first, gap, second = match.groups()
        if words[(first + second).lower()]:
            return first + second
        if second.lower() in FUNCTION_WORDS:
            return match.group(0)
        hyphenated = f"{first}-{second}"
        if (words[hyphenated.lower()] or "-" in first + second or first[-1].isdigit() or second[0].isdigit()
                or not second.islower() or len(first) > 1 and first.isupper()):
            return hyphenated
        return first + second

    return [e if e.category == "Table" else replace(e, text=BROKEN.sub(join, e.text)) for e in elements]


def looks_like_heading(text: str, numbered_document: bool) -> bool:
    """Whether a title the parser found reads as a heading: not a contents line (dot leaders); numbered, at most 20
    words and no sentence end; else at most 12 words, no sentence end but a question mark, no code, its first word
    not all lower case. In a document that numbers its headings, an unnumbered one must read as a title: at most 6
    capitalised words ("References", "Table of Contents" stay; a grammar's "BEGIN", a type's "CARD32", an
    identifier's "InstanceName" go)."""
    words = text.split()
    if LEADERS.search(text) or not words or not any(ch.isalpha() for ch in text):
        return False
    if NUMBERED.match(text):
        return len(words) <= 20 and not text.endswith((".", ",", ";", ":"))
    if numbered_document:
        return len(words) <= 6 and all(_capitalised(word) or word in LINKING for word in words[1:]) \
            and _capitalised(words[0])
    return (len(words) <= 12 and not text.endswith((".", "!", ":", ";", ",")) and not CODE.search(text)
            and not words[0].islower())


LINKING = {"of", "and", "the", "for", "to", "in", "on", "a", "an", "with", "by", "&"}


def _capitalised(word: str) -> bool:
    """"References", "Über": a capital, then lower-case letters only (not "BEGIN", "InstanceName" or "CARD32")."""
    return word[:1].isupper() and (len(word) == 1 or word[1:].isalpha() and word[1:].islower())


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
