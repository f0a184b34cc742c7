"""Sentence splitting for chunking: spaCy's rule-based sentencizer.

Chosen over unstructured's own `sent_tokenize` (spaCy's dependency parser), which runs about 30 ms per
abstract here against about 1 ms: chunking the 5,183 SciFact abstracts would take minutes instead of seconds.
The tokenizer's exception list keeps "e.g.", "Dr." and "U.S." inside their sentences.
"""

from __future__ import annotations

import sys
from functools import lru_cache

# Sentences ending in these are citations or references, not sentence ends: glue them to what follows.
_GLUE_SUFFIXES = ("et al.", "Fig.", "fig.", "cf.", "No.", "approx.", "vs.")
# Longer text is split in windows of about this many characters, each cut after a sentence end, a line break or a
# space: spaCy refuses a text over a million characters (a text file that is one paragraph), and its tokens take memory
# in proportion.
WINDOW_CHARS = 100_000


def import_spacy():
    """spaCy, imported without torch when torch is not loaded yet. spaCy's import pulls in thinc, which imports
    torch (1.5-5 s, most of `kb ask`'s time and of a parse worker's start) only to offer torch-backed models; the
    rule-based sentencizer and unstructured's small English model never use them. An `import torch` afterwards
    works as usual; only thinc's own torch support stays off in this process."""
    if "spacy" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` raise ImportError
        try:
            import spacy  # noqa: F401
        finally:
            del sys.modules["torch"]
    import spacy

    return spacy


@lru_cache(maxsize=1)
def _nlp():
    nlp = import_spacy().blank("en")
    nlp.add_pipe("sentencizer")
    return nlp


def sentences_at(text: str) -> list[tuple[str, int, int]]:
    """Each sentence of `text`, stripped, with the span of `text` it covers; a sentence glued to the one before it
    (_GLUE_SUFFIXES) is one sentence covering both spans, their texts joined by a space."""
    nlp = _nlp()
    sentences: list[tuple[str, int, int]] = []
    for offset, window in _windows(text):
        for sent in nlp.get_pipe("sentencizer")(nlp.tokenizer(window)).sents:  # nlp(window) without its size check
            piece = sent.text.strip()
            if not piece:
                continue
            end = offset + sent.end_char
            if sentences and sentences[-1][0].endswith(_GLUE_SUFFIXES):
                sentences[-1] = (f"{sentences[-1][0]} {piece}", sentences[-1][1], end)
            else:
                sentences.append((piece, offset + sent.start_char, end))
    return sentences


def _windows(text: str) -> list[tuple[int, str]]:
    """`text` as (offset, piece) of about WINDOW_CHARS each, never cut inside a word (so a cut is where every tokenizer
    cuts too): in a window's second half (_cut), else at the first line break or space past it."""
    windows, start = [], 0
    while len(text) - start > WINDOW_CHARS:
        end = start + WINDOW_CHARS
        cut = _cut(text, end - WINDOW_CHARS // 2, end)
        if cut < 0:
            cut = min((i for i in (text.find("\n", end), text.find(" ", end)) if i >= 0), default=len(text) - 1)
        windows.append((start, text[start:cut + 1]))
        start = cut + 1
    return windows + [(start, text[start:])]


def _cut(text: str, start: int, end: int) -> int:
    """In text[start:end]: the line break or space after its last sentence end, else its last line break, else its
    last space (hard-wrapped text has a line break in every sentence)."""
    sentence = max(text.rfind(f"{mark}{space}", start, end) for mark in ".?!" for space in " \n")
    if sentence >= 0:
        return sentence + 1
    line = text.rfind("\n", start, end)
    return line if line >= 0 else text.rfind(" ", start, end)


def split_sentences(text: str) -> list[str]:
    return [sentence for sentence, _, _ in sentences_at(text)]
