"""Answers that hold on documents and questions unlike SQuAD (issue 31): the refusal calibrated on the knowledge
base itself per embedding model, messages that carry a situation, yes/no questions, and a newcomer's own FAQ."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from fake_openai import FakeOpenAI, scripted_chat
from test_answers import kb, with_chat

from pipelines.answers.answer import Context, _extract, answer_question, gather, weigh
from pipelines.answers.asked import asked
from pipelines.answers.calibration import CEILING_DOCUMENTS, DEFAULT, MIN_CHUNKS, Calibration, Probe, current, fit
from pipelines.answers.evidence import Candidate, states_what_is_sought
from pipelines.ingest.run import ingest
from pipelines.retrieval.search import Filters, embed_query
from pipelines.storage.database import connect
from pipelines.sources.declarations import add_source, declare

NEWCOMER_FAQ = Path(__file__).parent / "data" / "newcomer-faq" / "faq.jsonl"


@pytest.fixture
def newcomer_kb(conn, embedder, settings):
    add_source(conn, declare("faq", NEWCOMER_FAQ), "tests")
    summary = ingest(conn, embedder, settings)
    return conn, summary


def test_a_message_is_split_into_its_question_and_its_situation():
    message = asked("My contract ends in May and I was off sick in March. Can I still claim the bonus?")
    assert message.question == "Can I still claim the bonus?" and message.yes_no
    assert message.situation == "My contract ends in May and I was off sick in March."
    # a question that points back takes the sentence it points to into its focus, not into its words
    there = asked("My partner lives in Lisbon. How long can I work from there?")
    assert there.question == "How long can I work from there?" and not there.yes_no
    assert there.focus == "My partner lives in Lisbon. How long can I work from there?"
    alone = asked("On-call phone number?")
    assert (alone.question, alone.situation, alone.yes_no) == ("On-call phone number?", "", False)
    assert asked("Tell me the deadline for filing.").situation == ""  # no "?": all of it is the question
    # a sentence said again is read once; the question is still the run the message ends on, after its situation
    again = asked("Can I claim? I had a baby in March. Can I claim?")
    assert (again.message, again.question, again.situation, again.focus) == (
        "Can I claim? I had a baby in March.", "Can I claim?", "I had a baby in March.",
        "I had a baby in March. Can I claim?")
    thanks = asked("What is the parking fee? Thanks. How many vacation days do I get? Thanks.")
    assert thanks.question == "How many vacation days do I get?"  # not both: the repeat kept them apart
    written = asked("He loses weight day by day.sometimes he faints. What  to do?")  # none repeated: as written
    assert written.message == "He loses weight day by day.sometimes he faints. What to do?"
    assert asked("What does git log -S do? What does git log -s do?").question.count("git log") == 2


def test_the_refresh_calibrates_on_the_knowledge_base_and_says_so(newcomer_kb, embedder, settings):
    conn, summary = newcomer_kb
    stage = next(s for s in summary.stages if s.stage == "calibrate")
    assert stage.counts["fitted"] == 1 and stage.notes["calibrations"][0]["scope"] == "public"
    calibration = current(conn, embedder.model_key, [])
    assert calibration.origin == "knowledge base" and calibration.chunks == 25
    report = calibration.report
    assert report["probes"]["answerable"] == report["probes"]["left_out"] > 0
    # every probe is one the fit weighs: each costs a retrieval and its contexts' sentence embeddings (issue 32)
    assert stage.counts["probes"] == report["probes"]["answerable"] + report["probes"]["left_out"]
    assert conn.execute("SELECT count(*) FROM answer_probes WHERE kind NOT IN ('answerable', 'left_out')"
                        ).fetchone()[0] == 0
    # the pairs differ only by their document being there: the fit tells most of them apart
    assert report["answered"]["answerable"] >= 0.7 and report["refused"]["left_out"] >= 0.7
    again = next(s for s in ingest(conn, embedder, settings).stages if s.stage == "calibrate")
    assert again.counts["fitted"] == 0  # nothing changed, nothing refitted
    assert current(conn, embedder.model_key, []).fitted_at == calibration.fitted_at
    # the left-out ceiling: the closest any question about a document left out came
    left_out = [f[0] for (f,) in conn.execute("SELECT features FROM answer_probes WHERE kind = 'left_out'")]
    assert calibration.left_out_ceiling == report["left_out_ceiling"] == max(left_out) and 0 < max(left_out) < 1
    assert stage.notes["calibrations"][0]["left_out_ceiling"] == max(left_out)
    shown = kb("status").output
    assert (f"answers at confidence {calibration.answer_at} or a closest context's similarity above"
            f" {max(left_out):.4f}, fitted") in shown, shown
    assert " on 25 chunks (Q&A cards aside); " in shown  # a source's line counts its cards too (the hostile pass)


def _weighed(similarity: float, calibration: Calibration) -> dict:
    """weigh() of one context at this cosine to the question, holding none of its words, with no sentence scored."""
    context = Context(1, 1, "faq:faq-001", "", "Remote work is allowed from any EU country.", similarity)
    return weigh([context], [], [], [], calibration)


def test_a_context_closer_than_any_left_out_question_came_answers_though_no_sentence_does():
    """The confidence weighs whether a sentence answers; a question about a topic as a whole finds its passage closer
    than any question about a missing document came in the calibration (the left-out ceiling), and is answered."""
    fitted = Calibration(DEFAULT.weights, 0.55, "knowledge base", left_out_ceiling=0.7)
    above, below = _weighed(0.75, fitted), _weighed(0.65, fitted)
    assert above["confidence"] < 0.55 and above["answers"]
    assert above["why"].startswith("answered: the closest context's similarity 0.7500 is above any that a question"
                                   " about a document the knowledge base lacks reached in its calibration (0.7000)")
    assert not below["answers"] and "too weak" in below["why"]
    assert not _weighed(0.7, fitted)["answers"]  # the ceiling itself was reached by a left-out question
    assert not _weighed(0.95, DEFAULT)["answers"]  # the default weights have no probes, so no ceiling
    assert not _weighed(0.70004, fitted)["answers"]  # compared as the probes' cosines are stored: to 4 places


def test_the_reason_never_rounds_a_confidence_across_its_threshold():
    """A refused question's reason said "confidence 0.50 < 0.5" (it was 0.496; the hostile review's find): shown to
    two places, the confidence is cut, not rounded."""
    just_under = Calibration((math.log(0.496 / 0.504), 0.0, 0.0, 0.0, 0.0), 0.5, "knowledge base")
    refused = _weighed(0.3, just_under)
    assert not refused["answers"] and "confidence 0.49 < 0.5 (" in refused["why"], refused["why"]
    answered = _weighed(0.3, Calibration((0.0, 0.0, 0.0, 0.0, 0.0), 0.5, "knowledge base"))
    assert answered["answers"] and "confidence 0.50 >= 0.5 (" in answered["why"], answered["why"]


def _probes(kind: str, documents: int, dense: float, per_document: int = 4) -> list[Probe]:
    """Probes of `documents` documents, their features as a fit reads them (dense first), spread a little."""
    return [Probe(n, "s", f"doc-{n % documents}", kind, "What?", [dense - 0.01 * (n % 5), 0.5, 0.5, 4.0])
            for n in range(documents * per_document)]


def test_the_left_out_ceiling_stands_on_left_out_questions_that_found_another_document():
    """In a scope of one document a left-out probe finds nothing (cosine 0): a ceiling of 0 would answer every
    question. Too few documents left out say nothing of a missing document on a topic the knowledge base holds."""
    answerable = _probes("answerable", 12, 0.8)
    assert fit(answerable + _probes("left_out", 12, 0.6))[1]["left_out_ceiling"] == 0.6
    assert fit(answerable + _probes("left_out", CEILING_DOCUMENTS - 1, 0.6))[1]["left_out_ceiling"] is None
    assert fit(answerable + _probes("left_out", 12, 0.0))[1]["left_out_ceiling"] is None  # one document: nothing found
    assert fit(answerable)[1]["left_out_ceiling"] is None


def test_a_hyde_passage_is_never_compared_with_the_ceiling(newcomer_kb, embedder, settings):
    """With HyDE the contexts' cosines are to a passage a chat model wrote, on topic even when the documents lack
    the answer; the ceiling was measured on questions. A ceiling of 0 answers anything, except through HyDE."""
    conn, _ = newcomer_kb
    anything = replace(current(conn, embedder.model_key, []), left_out_ceiling=0.0)
    question = "Can I bring my dog to the office?"
    vector = embed_query(embedder, question)
    passage = embed_query(embedder, "Dogs are welcome in the office on Fridays if they are vaccinated.")
    weighed = {hyde: gather(conn, settings, embedder, asked(question), 5, mode="qa_first", filters=Filters(),
                            rerank=False, calibration=anything, message_vector=vector,
                            vector=passage if hyde else None).found for hyde in (False, True)}
    assert weighed[False]["answers"] and "above any that a question" in weighed[False]["why"]
    assert not weighed[True]["answers"], weighed[True]["why"]



def test_a_newcomers_own_faq_is_answered_where_it_answers(newcomer_kb, settings):
    conn, _ = newcomer_kb
    for question, entry in (("Can I work abroad?", "faq-001"), ("How long can I work from Spain?", "faq-002")):
        result = answer_question(conn, settings, question)
        assert not result["abstained"], result["evidence"]
        assert result["sentences"][0]["citations"][0]["chunk_id"] in _chunks_of(conn, entry)
        assert result["evidence"]["why"].startswith("answered: confidence")  # not "too weak" on an answer
        assert result["calibration"]["origin"] == "knowledge base"
    for question in ("What is the dress code?", "Can I bring my dog to the office?"):
        refused = answer_question(conn, settings, question)
        assert refused["abstained"] and "too weak" in refused["evidence"]["why"], question


def test_a_situation_does_not_count_as_missing_evidence(newcomer_kb, settings):
    conn, _ = newcomer_kb
    message = ("I joined in March and my family lives in Valencia, where I grew up. My manager Ingrid is fine with"
               " it. Can I work from another country for a few weeks?")
    result = answer_question(conn, settings, message)
    assert result["asked"] == {"question": "Can I work from another country for a few weeks?",
                               "situation": "I joined in March and my family lives in Valencia, where I grew up."
                                            " My manager Ingrid is fine with it.", "kind": "yes_no"}
    assert not result["abstained"], result["evidence"]
    assert result["sentences"][0]["citations"][0]["chunk_id"] in _chunks_of(conn, "faq-001")


def test_a_yes_no_question_gets_its_verdict_and_the_cited_sentence(newcomer_kb, settings):
    conn, _ = newcomer_kb
    with FakeOpenAI(chat=scripted_chat()) as fake:
        result = answer_question(conn, with_chat(settings, fake), "Can I work from another country?")
    assert not result["abstained"] and result["yes_no"] == "yes"
    first = result["sentences"][0]
    assert first["text"].startswith("Yes, ") and first["citations"][0]["status"] != "INVALID"
    assert not result["removed"]  # the verdict is not dropped as a sentence that cites nothing


def test_a_yes_no_question_is_answered_extractively_with_the_sentence_that_decides_it(newcomer_kb, embedder,
                                                                                       settings, tmp_path):
    """A report's aim repeats the question's words, so it ranked first (PubMedQA: 41% of answers opened with one;
    bench/README.md) or joined the finding as its companion sentence, deciding nothing. The finding answers, cited;
    a question after a colon is still a yes/no question."""
    conn, _ = newcomer_kb
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "onboarding-pilot.md").write_text(
        "# Remote onboarding pilot\n\nThe aim of this pilot was to find out whether remote onboarding shortens the"
        " time to a new engineer's first merged change.\n\nForty engineers joined remotely and forty on site in"
        " 2025, in the same teams.\n\nRemote onboarding did not shorten it: the median time to a first merged change"
        " was nine days for remote joiners and eight days on site.\n")
    add_source(conn, declare("reports", tmp_path / "reports"), "tests")
    ingest(conn, embedder, settings)
    result = answer_question(conn, settings, "Onboarding: does remote onboarding shorten the time to a first merged"
                                             " change?")
    assert result["asked"]["kind"] == "yes_no" and not result["abstained"], result["evidence"]
    assert result["sentences"][0]["text"].startswith("Remote onboarding did not shorten it"), result["answer"]
    assert "aim of this pilot" not in result["answer"]
    assert result["sentences"][0]["citations"][0]["chunk_id"] in _chunks_of(conn, "onboarding-pilot.md")


SOUGHT = ["The purpose of this study was to determine whether or not flight impairs intubation.",
          "Objective: To describe variation in the use of carotid endarterectomy.", "We sought to compare A and B.",
          "It remains unclear whether the benefit persists.", "We examined whether X causes Y: a randomized trial.",
          "This study aimed to determine whether X causes Y in 2020: 40 patients.",
          "Objective \u2014 to decide whether X helps.",
          "The objective of the current study is to determine how X grew.",
          "To test if the drug works, we randomized 40 patients.", "However, it remains unknown if they predict death."]
FOUND = ["Yes, you can work abroad for up to 30 days a year.", "You may work abroad if your manager approves.",
         "Ask your manager whether you can swap the week.", "Intubation success was lower in flight (p<0.05).",
         "Finance checked whether team dinners are reimbursed: they are, up to 40 euros a head.",
         "We tested whether the backup restores and found that it does.",
         "Yes, analysts can work remotely if their manager agrees.", "Study leave is granted if your manager approves.",
         "Test accounts are deleted if unused for 30 days.", "Testers decide if a release ships.",
         "The purpose of this policy is to allow remote work for up to 30 days a year.",
         "Our aim is to reimburse all reasonable travel costs.", "Goal: all employees may work remotely on Fridays.",
         "Purpose: This policy allows employees to work abroad.",
         "We tested whether the backup restores \u2013 it does.",
         "It is unclear whether contractors are covered, so they are not covered.",
         "Prevalence would not be adequately assessed if terminations are not included."]


@pytest.mark.parametrize("sentence", SOUGHT)
def test_a_sentence_stating_what_was_sought_is_told(sentence):
    assert states_what_is_sought(sentence)


@pytest.mark.parametrize("sentence", FOUND)
def test_a_sentence_that_answers_is_not_taken_for_what_was_sought(sentence):
    assert not states_what_is_sought(sentence)


@pytest.mark.parametrize("question, yes_no", [
    ("Fast foods - are they a risk factor for asthma?", True), ("About my visa: can I work abroad?", True),
    ("Time-to-market: how long does it take?", False), ("What does 'fatal: could not read Username' mean?", False),
    ("Error: can't connect, what now?", False), ("Laptop - won't boot, how do I fix it?", False)])
def test_a_yes_no_question_after_a_colon_or_a_dash_is_one(question, yes_no):
    assert asked(question).yes_no is yes_no


def test_the_deciding_sentence_comes_from_the_questions_document():
    """The aim (context 1) ranks first; its document's finding is another chunk (context 2): it answers, though a
    sentence of another document (context 3) scores higher (letting that one win cited the wrong PubMed abstract more
    often). With no other sentence of the aim's document at hand, the best one of any document answers."""
    pool = [Context(1, 1, "r:pilot.md", "", "", 0.7), Context(2, 2, "r:pilot.md", "", "", 0.6),
            Context(3, 3, "r:other.md", "", "", 0.6)]
    aim = Candidate("The aim of this pilot was to find out whether remote onboarding is faster.", 1, score=6.0)
    finding = Candidate("Remote onboarding was not faster: nine days against eight.", 2, score=4.0)
    elsewhere = Candidate("Onboarding is remote for every new engineer.", 3, score=5.5)
    assert _extract(pool, [aim, elsewhere, finding], yes_no=True) == [(finding.text, [2])]
    assert _extract(pool, [aim, elsewhere], yes_no=True) == [(elsewhere.text, [3])]
    assert _extract(pool, [aim], yes_no=True) == [(aim.text, [1])]  # nothing else: the best as always
    assert _extract(pool, [aim, finding], yes_no=False)[0][0] == aim.text  # not yes/no: the best sentence


def test_a_sentence_that_asks_is_not_the_answer():
    """A page's heading question ("What is Coffin-Lowry syndrome?:", an FAQ's "Can I ...?") shares the question's
    words and scored first, so MEDIQA's answers were 4 times in 27 a question; the sentence that answers is taken."""
    pool = [Context(1, 1, "faq:faq-007", "", "", 0.8)]
    heading = Candidate("Can I work from another country?:", 1, score=7.0)
    quoted = Candidate('New hires often ask "can I work abroad?"', 1, score=6.5)
    answer = Candidate("Yes, for up to 30 days a year with your manager's approval.", 1, score=4.0)
    assert _extract(pool, [heading, quoted, answer]) == [(answer.text, [1])]
    assert _extract(pool, [heading]) == [(heading.text, [1])]  # nothing else: the best as always


def test_the_contexts_the_ceiling_answered_for_answer_when_they_hold_a_sentence():
    """The answer comes from the contexts closer than the ceiling; one that holds no sentence (an FAQ chunk of
    questions) leaves it to the others instead of refusing (the review's find)."""
    pool = [Context(1, 1, "faq:q", "", "", 0.8), Context(2, 2, "docs:a", "", "", 0.62)]
    near = Candidate("The price list has every part.", 1, score=3.0)
    far = Candidate("Submit form HR-7 to your manager.", 2, score=5.0)
    assert _extract(pool, [far, near], near={1}) == [(near.text, [1])]
    assert _extract(pool, [far], near={1}) == [(far.text, [2])]


def _refused_for_another_make(named: str, text: str) -> str | None:
    context = Context(1, 1, "docs:a", "", text, 0.85)
    weighed = weigh([context], [], [], [], Calibration((0.0, 0.0, 0.0, 0.0, 0.0), 0.5, "knowledge base"), [named])
    return None if weighed["answers"] else weighed["why"]


@pytest.mark.parametrize("named, text", [
    ("python3", "It works with python3.11 and later."), ("x86", "Builds are for x86_64 only."),
    ("5pm", "The office closes at 6pm."), ("SARS-CoV-2", "SARS\u2010CoV\u20102 differs from SARS-CoV-1."),
    ("HR-2024-047", "See HR 2024-047; HR-2023-031 is older."), ("COVID-2019", "COVID-19 cases rose."),
    ("ISO27001", "We hold ISO 27001 and ISO9001."), ("v2", "Release v2.3 adds search.")])
def test_a_code_the_documents_write_otherwise_is_not_taken_for_another(named, text):
    """Each was refused as "the documents hold X, not Y" by the rule's first version (the review's finds): another
    spelling, a longer version, a time, a code with few digits."""
    assert _refused_for_another_make(named, text) is None


def test_a_code_of_another_make_is_named_in_the_refusal():
    assert _refused_for_another_make("ERR-5012", "ERR-7781 means the belt slipped.") == \
        "the documents hold ERR-7781, not ERR-5012"


def test_a_caller_is_never_answered_with_a_fit_over_sources_it_cannot_read(conn, embedder, settings, tmp_path):
    public = tmp_path / "public.jsonl"
    public.write_text(NEWCOMER_FAQ.read_text())
    secret = tmp_path / "secret.jsonl"
    secret.write_text("".join(f'{{"_id": "s{n}", "title": "Project {n}", "text": "Project {n} budget is'
                              f' {n * 1000} EUR, approved by the board in week {n}."}}\n' for n in range(30)))
    add_source(conn, declare("faq", public), "tests")
    add_source(conn, declare("board", secret, groups=["board"]), "tests")
    ingest(conn, embedder, settings)
    everyone = current(conn, embedder.model_key, [])
    board = current(conn, embedder.model_key, ["board"])
    assert (everyone.scope_group, everyone.chunks) == ("", 25)
    assert (board.scope_group, board.chunks) == ("board", 55)
    probes = conn.execute("SELECT DISTINCT p.source_id FROM answer_probes p JOIN answer_calibrations c"
                          " USING (calibration_id) WHERE c.scope_group = ''").fetchall()
    assert probes == [("faq",)]  # the public fit never read the board's chunks
    result = answer_question(conn, settings, "Can I work abroad?", filters=Filters(groups=[]))
    assert result["calibration"]["scope"] == "public"


def _public_probes(conn) -> list[tuple[str, str]]:
    return conn.execute("SELECT p.kind, p.question FROM answer_probes p JOIN answer_calibrations c"
                        " USING (calibration_id) WHERE c.scope_group = '' ORDER BY p.probe").fetchall()


def test_the_public_fit_is_the_same_whatever_else_the_knowledge_base_holds(conn, embedder, settings, server_url,
                                                                           tmp_path):
    """A source only a group reads, ingested first, moved the public chunks' ids, and the public fit's probes with
    them (their reworded word was drawn by chunk id): a public caller's confidence depended on documents it cannot
    read (the hostile review's find)."""
    secret = tmp_path / "secret.jsonl"
    secret.write_text("".join(f'{{"_id": "s{n}", "title": "Project {n}", "text": "Project {n} budget is'
                              f' {n * 1000} EUR, approved by the board in week {n}."}}\n' for n in range(30)))
    add_source(conn, declare("board", secret, groups=["board"]), "tests")
    ingest(conn, embedder, settings)
    add_source(conn, declare("faq", NEWCOMER_FAQ), "tests")
    ingest(conn, embedder, settings)
    dbname = f"{conn.info.dbname}_alone"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        info = psycopg.conninfo.conninfo_to_dict(settings.database_url)
        alone = replace(settings, database_url=psycopg.conninfo.make_conninfo(**{**info, "dbname": dbname}))
        with connect(alone) as other:
            add_source(other, declare("faq", NEWCOMER_FAQ), "tests")
            ingest(other, embedder, alone)
            assert _public_probes(other) == _public_probes(conn) != []
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


def test_a_source_restricted_after_the_fit_is_not_read_through_it(conn, embedder, settings, tmp_path):
    """The public fit read a source that is restricted since: no caller is answered with it, and the next refresh
    fits the public scope again without it (the declarations of today decide, as for every read)."""
    from pipelines.sources.declarations import update_source

    notes = tmp_path / "notes.jsonl"
    notes.write_text("".join(f'{{"_id": "n{n}", "title": "Release {n}", "text": "Release {n} of the billing service'
                             f' shipped in week {n} with {n + 2} fixes to invoices."}}\n' for n in range(30)))
    add_source(conn, declare("faq", NEWCOMER_FAQ), "tests")
    add_source(conn, declare("notes", notes), "tests")
    ingest(conn, embedder, settings)
    assert current(conn, embedder.model_key, []).chunks == 55
    update_source(conn, "notes", "tests", groups=("billing",))
    assert current(conn, embedder.model_key, []).origin == "default"  # the fit read what everyone may not
    assert current(conn, embedder.model_key, ["billing"]).chunks == 55  # billing reads all that fit read
    ingest(conn, embedder, settings)  # nothing changed in the files: the new declaration is what refits
    assert (current(conn, embedder.model_key, []).chunks, current(conn, embedder.model_key, ["billing"]).chunks) \
        == (25, 55)


def test_a_knowledge_base_too_small_to_calibrate_keeps_the_default(conn, embedder, settings, tmp_path):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(NEWCOMER_FAQ.read_text().splitlines(keepends=True)[:MIN_CHUNKS - 5]))
    add_source(conn, declare("faq", small), "tests")
    ingest(conn, embedder, settings)
    assert current(conn, embedder.model_key, []).origin == "default"
    result = answer_question(conn, settings, "Can I work abroad?")
    assert result["calibration"]["origin"] == "default" and not result["abstained"]


def test_the_calibrate_stage_counts_its_probes_as_it_goes(conn, embedder, settings):
    """A terminal showed `calibrate: nothing to do` for the stage that takes a tenth of a first ingest."""
    from pipelines.ingest.report import Progress

    class Counted(Progress):
        def __init__(self):
            self.todo, self.done_ = 0, 0

        def total(self, count):
            self.todo += count

        def advance(self, count=1):
            self.done_ += count

    seen: dict[str, Counted] = {}
    add_source(conn, declare("faq", NEWCOMER_FAQ), "tests")
    ingest(conn, embedder, settings, progress=lambda stage: seen.setdefault(stage, Counted()))
    probes = conn.execute("SELECT count(*) FROM answer_probes").fetchone()[0]
    assert probes > 0 and seen["calibrate"].todo == seen["calibrate"].done_ == probes


def _calibrated(conn) -> list[dict]:
    return conn.execute("SELECT stages->'calibrate'->'notes'->'calibrations' FROM ingest_runs"
                        " ORDER BY run_id DESC LIMIT 1").fetchone()[0]


def test_probes_are_drawn_from_chunks_that_have_something_to_ask_about(conn, embedder, settings, tmp_path):
    """A knowledge base of error codes and a FAQ: most chunks hold no sentence to build a question from, and the fit
    draws on, up to every FAQ entry, instead of fitting on the few that the first chunks drawn hold."""
    codes = tmp_path / "codes.jsonl"
    codes.write_text("".join(f'{{"_id": "c{n}", "title": "E-{n:03d}", "text": "E-{n:03d}: fan {n} stalled."}}\n'
                             for n in range(100)))
    add_source(conn, declare("faq", NEWCOMER_FAQ), "tests")
    add_source(conn, declare("codes", codes), "tests")
    ingest(conn, embedder, settings)
    drawn = conn.execute("SELECT DISTINCT source_id, chunk_id FROM answer_probes").fetchall()
    assert {source for source, _ in drawn} == {"faq"} and len(drawn) == 25  # every FAQ entry


def test_a_knowledge_base_with_nothing_to_ask_about_says_so_and_keeps_the_default(conn, embedder, settings, tmp_path):
    codes = tmp_path / "codes.jsonl"
    codes.write_text("".join(f'{{"_id": "c{n}", "title": "E-{n:03d}", "text": "E-{n:03d}: fan {n} stalled."}}\n'
                             for n in range(MIN_CHUNKS + 5)))
    add_source(conn, declare("codes", codes), "tests")
    ingest(conn, embedder, settings)
    (public,) = _calibrated(conn)
    assert not public["fitted"] and public["why"] == ("no probe: no chunk drawn holds a Q&A card or a sentence of 6 to"
                                                      " 40 words to ask about; the default weights serve")
    assert current(conn, embedder.model_key, []).origin == "default"


def _chunks_of(conn, locator: str) -> set[int]:
    return {r[0] for r in conn.execute("SELECT c.chunk_id FROM chunks c JOIN documents d USING (document_id)"
                                       " WHERE d.locator = %s", (locator,)).fetchall()}
