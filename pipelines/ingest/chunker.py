"""Hierarchical chunking: sections first, then paragraphs, then sentences; never mid-sentence.

A chunk never spans two sections. A section that fits the budget is one chunk; a longer one is packed
paragraph by paragraph, and a paragraph that does not fit is packed sentence by sentence. Each chunk after
the first in a section repeats the previous chunk's last one or two sentences (overlap). Tables are chunks of
their own, kept whole when they fit and otherwise split between rows with the header row repeated. Text that
fits nowhere (a sentence or a row longer than the whole budget, a 300 KB token with no spaces) is cut between
words, or between tokens as the last resort, so that no chunk ever exceeds the budget. The work is linear in
the size of the document.

The budget is counted with the embedding model's tokenizer, on the text that is actually embedded
(the title/section prefix from `enrich.embed_prefix` included), so no chunk is ever truncated by the model.
"""

from __future__ import annotations

import unicodedata
from bisect import bisect_right
from dataclasses import dataclass, field
from html.parser import HTMLParser
from itertools import groupby

from pipelines.ingest.elements import Element
from pipelines.ingest.enrich import PREFIX_MAX_TOKENS, context_title, embed_prefix
from pipelines.ingest.sentences import sentences_at
from pipelines.models.tokens import TokenCounter

# 2: oversized text cut between tokens, titles bounded (context_title); 3: elements cleaned first (clean.py), and
# a lead-in sentence kept with the paragraph it introduces
# The Unicode version is part of it: another Python's unicodedata may normalise text (and queries) otherwise.
CHUNKER_VERSION = f"chunker-3+unicode-{unicodedata.unidata_version}"
OVERLAP_MAX_SENTENCES = 2
OVERLAP_MAX_FRACTION = 0.25  # overlap never takes more than this share of a chunk's budget


@dataclass
class ChunkDraft:
    kind: str  # "text" | "table"
    text: str
    section_path: list[str]
    page_number: int | None
    token_count: int = 0  # the counter's count of `text`


@dataclass
class _Sentence:
    text: str
    tokens: int
    paragraph: int
    page: int | None


@dataclass
class _Section:
    path: list[str]
    blocks: list[Element] = field(default_factory=list)


def _sections(elements: list[Element]) -> list[_Section]:
    """Group body elements under their heading path; a heading with no body of its own becomes body text."""
    sections: list[_Section] = []
    for index, element in enumerate(elements):
        if element.category == "Title":
            following = elements[index + 1] if index + 1 < len(elements) else None
            has_body = following is not None and (following.category != "Title" or (following.depth or 0) > (element.depth or 0))
            if has_body:
                continue
            element = Element("NarrativeText", element.text, None, element.page_number, element.section_path[:-1])
        if sections and sections[-1].path == element.section_path:
            sections[-1].blocks.append(element)
        else:
            sections.append(_Section(element.section_path, [element]))
    return sections


class _TableRows(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self.rows:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def table_rows(element: Element) -> list[str]:
    """A table as one line per row (`cell | cell`), from its HTML when the parser kept it."""
    if element.text_as_html:
        parser = _TableRows()
        parser.feed(element.text_as_html)
        rows = [" | ".join(cells) for cells in parser.rows if any(cells)]
        if rows:
            return rows
    return [line for line in element.text.splitlines() if line.strip()] or [element.text]


class Chunker:
    def __init__(self, counter: TokenCounter):
        self.counter = counter

    def _budget(self, title: str | None, path: list[str]) -> int:
        prefix = embed_prefix(title, path)
        prefix_tokens = self.counter.count([prefix])[0] if prefix else 0
        # +2: the blank line and rounding at the prefix/text seam can merge or split one word piece.
        return self.counter.max_tokens - prefix_tokens - 2

    def chunk(self, elements: list[Element], title: str | None) -> list[ChunkDraft]:
        title = context_title(self.counter, title)
        chunks: list[ChunkDraft] = []
        for section in _sections(elements):
            path = _fit_path(self, title, section.path)
            budget = self._budget(title, path)
            for is_table, blocks in groupby(section.blocks, key=lambda e: e.category == "Table"):
                for block in blocks if is_table else [list(blocks)]:
                    if is_table:
                        chunks += self._table(block, path, budget)
                    else:
                        chunks += self._text(block, path, budget)
        return chunks

    def _table(self, table: Element, path: list[str], budget: int) -> list[ChunkDraft]:
        rows = table_rows(table)
        tokens = self.counter.count(rows)
        if sum(tokens) + len(rows) <= budget:
            return self._table_piece(rows, tokens, table, path, budget)
        pieces: list[ChunkDraft] = []
        current, counts = [rows[0]], [tokens[0]]  # the header row starts every piece
        for row, count in zip(rows[1:], tokens[1:]):
            if len(current) > 1 and sum(counts) + len(counts) + count + 1 > budget:
                pieces += self._table_piece(current, counts, table, path, budget)
                current, counts = [rows[0]], [tokens[0]]
            current.append(row)
            counts.append(count)
        return pieces + self._table_piece(current, counts, table, path, budget)

    def _table_piece(self, rows: list[str], counts: list[int], table: Element, path: list[str],
                     budget: int) -> list[ChunkDraft]:
        """Rows as one chunk, a row break counted as a token; cut between words when one row is too long."""
        text = "\n".join(rows)
        if sum(counts) + len(counts) > budget:
            return [ChunkDraft("table", piece, path, table.page_number, tokens)
                    for piece, tokens in self._hard_split(text, budget)]
        return [ChunkDraft("table", text, path, table.page_number, self._joined(text, counts))]

    def _split_oversized(self, draft: ChunkDraft, budget: int) -> list[ChunkDraft]:
        """Last resort for one row or sentence longer than the whole budget."""
        if draft.token_count <= budget:
            return [draft]
        return [ChunkDraft(draft.kind, text, draft.section_path, draft.page_number, tokens)
                for text, tokens in self._hard_split(draft.text, budget)]

    def _hard_split(self, text: str, budget: int) -> list[tuple[str, int]]:
        """(piece, tokens) cut from text in one pass over its tokens: each piece takes as many tokens as fit, cut
        back to the last space when one lies in its second half, else between tokens. A piece is tokenized again
        on its own (its first word piece may change there), so it is checked and shrunk until it fits."""
        ends = self.counter.token_ends(text)
        pieces: list[tuple[str, int]] = []
        start, first = 0, 0  # character offset and index of the first token not yet taken
        while first < len(ends):
            take = min(max(budget - 2, 1), len(ends) - first)
            while True:
                if first + take < len(ends):
                    cut = ends[first + take - 1]
                    space = text.rfind(" ", start, cut)
                    if space > start + (cut - start) // 2:
                        cut = space
                else:  # the last piece takes the rest, characters the tokenizer skips included
                    cut = len(text)
                piece = text[start:cut].strip()
                tokens = self.counter.count([piece])[0] if piece else 0
                if tokens <= budget or take == 1:
                    break
                take = max(1, take * 9 // 10)
            if piece:
                pieces.append((piece, tokens))
            start = cut
            while first < len(ends) and ends[first] <= cut:
                first += 1
        return pieces

    def _text(self, blocks: list[Element], path: list[str], budget: int) -> list[ChunkDraft]:
        paragraphs = [b.text for b in blocks]
        whole = "\n\n".join(paragraphs)
        # An additive counter tokenizes the text once: its sentences' counts are read off the whole's tokens.
        ends = self.counter.token_ends(whole) if self.counter.additive else None
        whole_tokens = len(ends) if ends is not None else self.counter.count([whole])[0]
        if whole_tokens <= budget:
            return [ChunkDraft("text", whole, path, blocks[0].page_number, whole_tokens)]
        sentences = self._sentences(blocks, ends)
        return self._pack(sentences, path, budget)

    def _sentences(self, blocks: list[Element], ends: list[int] | None) -> list[_Sentence]:
        """Each block's sentences with their counts: the tokens of the whole text (`ends`, blocks joined by a blank
        line) that end inside each sentence's span, else each sentence counted on its own."""
        texts, spans, owners = [], [], []
        offset = 0
        for index, block in enumerate(blocks):
            for sentence, start, end in sentences_at(block.text) or [(block.text, 0, len(block.text))]:
                texts.append(sentence)
                spans.append((offset + start, offset + end))
                owners.append((index, block.page_number))
            offset += len(block.text) + 2
        if ends is None:
            counts = self.counter.count(texts)
        else:
            counts = [bisect_right(ends, end) - bisect_right(ends, start) for start, end in spans]
        return [_Sentence(t, c, p, page) for t, c, (p, page) in zip(texts, counts, owners)]

    def _pack(self, sentences: list[_Sentence], path: list[str], budget: int) -> list[ChunkDraft]:
        chunks: list[ChunkDraft] = []
        current: list[_Sentence] = []
        fresh = 0  # sentences in `current` that are not overlap from the previous chunk
        paragraph_tokens: dict[int, int] = {}  # the tokens of each paragraph, summed once
        for sentence in sentences:
            paragraph_tokens[sentence.paragraph] = paragraph_tokens.get(sentence.paragraph, 0) + sentence.tokens + 1
        for index, sentence in enumerate(sentences):
            if current and fresh and _tokens(current) + sentence.tokens + 1 > budget:
                # A lead-in ("... via the call:") goes with what it introduces, not at the end of this chunk.
                carried = [current.pop()] if (fresh > 1 and _leads_in(current[-1], sentence)
                                              and current[-1].tokens + sentence.tokens + 2 <= budget) else []
                chunks.append(self._draft(current, path))
                current = _overlap(current, budget) + carried
                while current and _tokens(current) + sentence.tokens + 1 > budget:
                    current.pop(0)
                fresh = 1 if carried and current and current[-1] is carried[0] else 0
            current.append(sentence)
            fresh += 1
            # Prefer paragraph ends: close a well-filled chunk when the next paragraph would not fit whole.
            nxt = sentences[index + 1] if index + 1 < len(sentences) else None
            if (nxt is not None and nxt.paragraph != sentence.paragraph and _tokens(current) >= budget // 2
                    and not _leads_in(sentence, nxt)):
                if _tokens(current) + paragraph_tokens[nxt.paragraph] > budget:
                    chunks.append(self._draft(current, path))
                    current, fresh = _overlap(current, budget), 0
        if fresh:
            chunks.append(self._draft(current, path))
        return [piece for chunk in chunks for piece in self._split_oversized(chunk, budget)]

    def _draft(self, sentences: list[_Sentence], path: list[str]) -> ChunkDraft:
        parts = []
        for paragraph, group in groupby(sentences, key=lambda s: s.paragraph):
            parts.append(" ".join(s.text for s in group))
        text = "\n\n".join(parts)
        return ChunkDraft("text", text, path, sentences[0].page, self._joined(text, [s.tokens for s in sentences]))

    def _joined(self, text: str, counts: list[int]) -> int:
        """The count of `text`, made of pieces with these counts joined by whitespace."""
        return sum(counts) if self.counter.additive else self.counter.count([text])[0]


SENTENCE_ENDS = (".", "!", "?", "。", "！", "？", "।", "؟", "…")


def _leads_in(sentence: _Sentence, following: _Sentence) -> bool:
    """Whether a sentence introduces the paragraph that follows it: it ends its own paragraph with a colon, or with
    no sentence punctuation at all ("Let us compute the Markov basis via the call" before the call)."""
    text = sentence.text.rstrip().rstrip("\"'”’»)]")
    return following.paragraph != sentence.paragraph and (text.endswith(":") or not text.endswith(SENTENCE_ENDS))


def _tokens(sentences: list[_Sentence]) -> int:
    return sum(s.tokens + 1 for s in sentences)


def _overlap(previous: list[_Sentence], budget: int) -> list[_Sentence]:
    """The last one or two sentences of the previous chunk, if they are short enough to repeat."""
    limit = int(budget * OVERLAP_MAX_FRACTION)
    tail: list[_Sentence] = []
    for sentence in reversed(previous[-OVERLAP_MAX_SENTENCES:]):
        if _tokens(tail) + sentence.tokens + 1 > limit:
            break
        tail.insert(0, sentence)
    return tail


def _fit_path(chunker: Chunker, title: str | None, path: list[str]) -> list[str]:
    """Drop outer headings until the prefix fits PREFIX_MAX_TOKENS; the nearest heading matters most."""
    path = list(path)
    while path and chunker.counter.count([embed_prefix(title, path)])[0] > PREFIX_MAX_TOKENS:
        path = path[1:]
    return path
