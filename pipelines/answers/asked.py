"""What a message asks (issue 31): the question in it, the situation around it, and whether it asks yes or no.

People write to a help desk in several sentences: who they are, what happened, then the question ("My contract
ends in May and I was off sick in March. Can I still claim the bonus?"). The whole message chooses the passage
(retrieval reads all of it: the situation names the case), but whether the documents answer is decided on the
question: the asker's own details (names, places, dates) are not in any document, and counting them as missing
evidence refused questions the documents answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipelines.ingest.sentences import split_sentences

# A question that asks yes or no opens with an auxiliary or modal verb ("Can I ...", "Is there ...", "Do we ..."),
# possibly after a connective ("And can I ...", "So does it ...").
_YES_NO = re.compile(r"^\W*(?:(?:and|but|so|also|then|now|please|ok|okay|well)\b[\s,]*)?"
                     r"(?:am|is|are|was|were|do|does|did|can|could|will|would|shall|should|may|might|must|have|has|"
                     r"had|need|isn't|aren't|wasn't|weren't|don't|doesn't|didn't|can't|couldn't|won't|wouldn't|"
                     r"shouldn't|haven't|hasn't)\b", re.I)
# The sentence before the question joins it when the question is short or points back ("Can I work from there?"
# needs the sentence that says where "there" is).
_LAST_CLAUSE = re.compile(r"[:;]\s|\s[-\u2013\u2014]+\s")
_WH = re.compile(r"\b(?:what|why|how|when|where|who|whom|whose|which)\b", re.I)
_SHORT_QUESTION_WORDS = 6
_POINTS_BACK = re.compile(r"\b(?:it|its|there|this|that|these|those|they|them|their|he|she|him|her|so|such)\b", re.I)


@dataclass(frozen=True)
class Asked:
    message: str  # everything the caller wrote (each sentence once): retrieval reads it
    question: str  # the question in it: its rare words must be in the contexts
    situation: str  # the rest ("" when the message is only the question)
    yes_no: bool  # the question asks yes or no
    focus: str = ""  # the question with the sentence it points back to: contexts and sentences are scored against it

    @property
    def kind(self) -> str:
        return "yes_no" if self.yes_no else "open"


def _asks_yes_or_no(question: str) -> bool:
    """The question opens with an auxiliary or modal verb, or its last clause after a colon or a dash does ("Fast
    foods - are they a risk for asthma?", "About my visa: can I work abroad?") and no wh-word asks anything in it
    ("What does 'fatal: could not read Username' mean?", "Error: can't connect, what now?" ask what)."""
    return bool(_YES_NO.match(question)
                or (_YES_NO.match(_LAST_CLAUSE.split(question)[-1]) and not _WH.search(question)))


def asked(message: str) -> Asked:
    """The question of a message: its last run of sentences ending in "?"; a message with no "?" is all question.
    The question's focus adds the sentence before it when the question is a few words or points back. A sentence
    said again is read once, where it is first said, in retrieval too: a question pasted three times embeds elsewhere
    than the question (its closest context's cosine fell from 0.78 to 0.62) and says nothing more. The question is
    still the run the message ends on, found before repeats are dropped ("Q1? Thanks. Q2? Thanks." asks Q2), and the
    situation is every other sentence ("Can I claim? I had a baby in March. Can I claim?")."""
    text = " ".join(message.split())
    said = split_sentences(text) if text else []
    distinct = list(dict.fromkeys(said))
    if len(distinct) < len(said):  # else the text as written ("day.sometimes" is one word to the embedder)
        text = " ".join(distinct)
    asking = [n for n, s in enumerate(said) if s.rstrip(" )\"'").endswith("?")]
    if len(distinct) < 2 or not asking:
        return Asked(text, text, "", _asks_yes_or_no(text), text)
    last = first = asking[-1]
    while first - 1 in asking:
        first -= 1
    run = list(dict.fromkeys(said[first:last + 1]))
    start = first - 1 if first > 0 and (len(said[first].split()) < _SHORT_QUESTION_WORDS
                                        or _POINTS_BACK.search(said[first])) else first
    situation = [s for s in dict.fromkeys(said[:first] + said[last + 1:]) if s not in run]
    return Asked(text, " ".join(run), " ".join(situation), any(_asks_yes_or_no(s) for s in run),
                 " ".join(said[start:first] + run))
