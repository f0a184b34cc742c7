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
    sentences: list[tuple[str, int, int]] = []
    for sent in _nlp()(text).sents:
        piece = sent.text.strip()
        if not piece:
            continue
        if sentences and sentences[-1][0].endswith(_GLUE_SUFFIXES):
            sentences[-1] = (f"{sentences[-1][0]} {piece}", sentences[-1][1], sent.end_char)
        else:
            sentences.append((piece, sent.start_char, sent.end_char))
    return sentences


def split_sentences(text: str) -> list[str]:
    return [sentence for sentence, _, _ in sentences_at(text)]
