"""Answers a user can trust (issue 19): each wrong answer the issue lists, on a small company corpus as a new user
writes one, a chat model that misbehaves the way small models do, `kb eval --answers` on a dataset folder (a
slice of SQuAD 2.0, tests/data/README.md), and what users see (scores in rank order, highlights of the query's
own terms, the console's mode and ask box)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_openai import FakeOpenAI, scripted_chat
from fastapi.testclient import TestClient

from pipelines.answers.answer import Context, _extract, answer_question
from pipelines.answers.evidence import Candidate
from pipelines.answers.short_answer import asks_for_value, short_answer
from pipelines.cli import main
from pipelines.ingest.run import ingest
from pipelines.retrieval.responses import NEAR_TIE_MARK, shown_scores
from pipelines.sources.declarations import add_source, declare

SLICE = Path(__file__).parent / "data" / "squad-normans"
COMPANY = {
    "it/vpn-certificates.md": "# VPN certificates\n\nThe certificate behind your VPN token expires after 12 months and"
                              " the token is then reset automatically.\n\n## How do I reset my VPN token?\n\nOpen the"
                              " self-service portal and choose Security. A new code is sent to your phone within two"
                              " minutes.\n",
    "support/ticket-558812.md": "# Ticket 558812\n\nWhat happened with order 558812: the parcel was lost in transit, so"
                                " a replacement order was sent on 3 May.\n",
    "support/ticket-559001.md": "# Ticket 559001\n\nOrder 559001 was held at customs because the invoice was"
                                " missing. The broker filed the invoice and the order was delivered on 12 May.\n",
    "hr/on-call.md": "# On-call FAQ\n\nQ: Can I swap my on-call week?\nA: Yes. Agree the swap with a colleague and"
                     " record it in the rota tool before the week starts.\n\nQ: Who approves on-call overtime?\nA: Your"
                     " team lead approves on-call overtime within five working days.\n\n## What we offer\n\nEvery"
                     " engineer on the rota gets a company phone and a laptop with a mobile data plan.\n",
    "ops/errors.md": "# Error codes\n\n## ERR-5012\n\nERR-5012 means the license server did not answer. Check the"
                     " network route to port 7070.\n\n## ERR-7781\n\nERR-7781 means the disk quota is exhausted."
                     " Delete old exports to free space.\n",
    "ops/logging.md": "# Logging settings\n\nlog_min_duration_statement logs every statement slower than the given"
                      " time. Function call statistics are collected when track_functions is set to all.\n",
}
# What the new user asked, with the text a right answer holds, and two questions nothing here answers.
COMPANY_QUESTIONS = [
    {"question": "How do I reset my VPN token?", "answers": ["self-service portal"],
     "passages": ["company:it/vpn-certificates.md"]},
    {"question": "What happened with order 559001?", "answers": ["customs"],
     "passages": ["company:support/ticket-559001.md"]},
    {"question": "Can I swap my on-call week?", "answers": ["Agree the swap with a colleague"],
     "passages": ["company:hr/on-call.md"]},
    {"question": "When does the certificate behind a VPN token expire?", "answers": ["12 months"],
     "passages": ["company:it/vpn-certificates.md"]},
    {"question": "What does ERR-7781 mean?", "answers": ["disk quota"], "passages": ["company:ops/errors.md"]},
    {"question": "Who approves on-call overtime?", "answers": ["team lead"], "passages": ["company:hr/on-call.md"]},
    {"question": "What does backtrace_functions do?", "answers": [], "passages": [], "group": "out_of_corpus"},
    {"question": "Which dental insurance plan does the company offer?", "answers": [], "passages": [],
     "group": "out_of_corpus"},
]


def kb(*args: str, expect: int = 0):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result


@pytest.fixture
def company(conn, embedder, settings, tmp_path):
    for name, text in COMPANY.items():
        path = tmp_path / "company" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    add_source(conn, declare("company", tmp_path / "company"), "tests")
    ingest(conn, embedder, settings)
    return conn


def cited(result: dict) -> set[str]:
    documents = {c["chunk_id"]: c["document"] for c in result["contexts"]}
    return {documents[c["chunk_id"]] for s in result["sentences"] for c in s["citations"]}


def test_a_matching_card_answers_with_its_answer(company, settings):
    """The certificate sentence is closer in meaning to the question than the card's answer, and was the answer."""
    result = answer_question(company, settings, "How do I reset my VPN token?")
    assert not result["abstained"] and result["contexts"][0]["via_card"] == "How do I reset my VPN token?"
    assert result["answer"].startswith("Open the self-service portal and choose Security. A new code is sent")
    assert "certificate" not in result["answer"].split("[")[0] and cited(result) == {"company:it/vpn-certificates.md"}


def test_a_question_about_a_code_is_answered_from_the_contexts_that_hold_it(company, settings):
    """558812's ticket reads like the question and was the answer, although search ranked 559001's first."""
    result = answer_question(company, settings, "What happened with order 559001?")
    assert not result["abstained"] and "customs" in result["answer"] and "558812" not in result["answer"]
    assert cited(result) == {"company:support/ticket-559001.md"} and result["exact_match"]


def test_a_code_that_no_context_holds_does_not_skip_the_refusal(company, settings):
    """backtrace_functions: track_functions holds "functions", which once set exact_match and answered."""
    result = answer_question(company, settings, "What does backtrace_functions do?")
    assert result["abstained"] and not result["exact_match"], result["answer"]
    assert "backtrace_functions" in result["reason"]


def test_markdown_faq_lines_become_cards_and_a_question_is_never_the_answer(company, settings):
    questions = {q for (q,) in company.execute("SELECT question FROM chunks WHERE kind = 'card' AND valid_to IS NULL")}
    assert {"Can I swap my on-call week?", "Who approves on-call overtime?"} <= questions
    assert "What we offer" not in questions  # a heading that is not a question is no card's question
    result = answer_question(company, settings, "Can I swap my on-call week?")
    assert not result["abstained"] and result["answer"].startswith("Yes. Agree the swap with a colleague")
    assert "Q:" not in result["answer"] and "Can I swap" not in result["answer"]


def test_the_answer_reports_the_short_value_the_question_asks_for(company, settings):
    result = answer_question(company, settings, "When does the certificate behind a VPN token expire?")
    assert not result["abstained"] and "12 months" in result["answer"] and result["short_answer"] == "12 months"
    assert short_answer("Who approves on-call overtime?",
                        "On-call overtime is approved by Maria Lopez, the team lead.") == "Maria Lopez"
    assert short_answer("What museum holds the collection?",  # a "what" question: the phrase naming the thing asked
                        "The collection is held by the Peabody Museum of Archaeology in Cambridge.") == \
        "the Peabody Museum of Archaeology"
    assert short_answer("Why do on-call weeks rotate?", "On-call weeks rotate so that nobody is on call twice.") is None
    # past "was the", the noun asked for is the last of the phrase, and an amount keeps its currency ("year" was the
    # answer, from "year on year"; a first cut read "last year's revenue" as asking for a date)
    revenue = "Revenue grew 14% year on year to 18.2 million EUR."
    for question in ("What was the Q3 2024 revenue?", "What was last year's revenue?"):
        assert short_answer(question, revenue) == "18.2 million EUR", question
    assert short_answer("What is this year's budget?", "The budget for 2024 is 2 million euros.") == "2 million euros"
    assert short_answer("What is the museum that holds the collection?",
                        "The collection is held by the Peabody Museum of Archaeology in Cambridge.") == \
        "the Peabody Museum of Archaeology"
    # the noun a "which" opens is what it asks; a question whose verb is not "be" asks for no noun after it
    assert short_answer("Which year's budget was larger?",
                        "The 2023 budget of 4 million EUR was larger than the 2022 budget.") == "2023"
    assert short_answer("What did the president say?",
                        "The president said that taxes would rise, according to Jean Dupont.") != "Jean Dupont"
    assert short_answer("What is the fee?", "The fee is EUR 250 per week.") == "EUR 250"
    assert short_answer("When was the order delivered?", "The order was delivered on 12 May.") == "12 May"
    assert short_answer("How many days of family care leave?",
                        "Employees get 10 days of family care leave.") == "10 days"


def test_a_short_answer_never_cuts_a_code_or_leaves_a_bracket_open():
    """spaCy splits "HR-2024-047" at its last hyphen: the short answer was "policy HR-2024", for "What is policy
    HR-2023-031?" "policy HR-2023" (the question's own code, cut), and "(duplicate_table" kept its bracket (the
    hostile review's finds)."""
    assert short_answer("Which policy covers parental leave?",
                        "Parental leave is covered by policy HR-2024-047.") == "policy HR-2024-047"
    assert short_answer("What is policy HR-2023-031?", "Engineers on call receive a weekly allowance, as policy"
                        " HR-2023-031 says.") == "a weekly allowance"
    assert short_answer("Which error does a second CREATE TABLE raise?",
                        "A second CREATE TABLE raises 42P07 (duplicate_table.") == "42P07"
    # the question's code says nothing new, a part of it may
    assert short_answer("When was policy HR-2023-031 issued?", "Policy HR-2023-031 was issued in 2023.") == "2023"
    assert short_answer("How many days does ERR-30 allow?", "ERR-30 allows 30 days.") == "30 days"


def test_a_question_asking_for_a_value_is_answered_by_a_sentence_near_the_top_that_holds_one():
    """The sentence that reads closest to "When was order 559001 delivered?" names the order but not the date; the
    next one, from another context and nearly as close, says the date: it answers. With none holding a date, the best
    sentence answers as before."""
    pool = [Context(n, n, f"company:ticket-{n}.md", "", "", 0.6) for n in (1, 2)]
    named = Candidate("Order 559001 was held at customs because its invoice was missing.", 1, score=5.0)
    dated = Candidate("The broker's parcel was delivered on 12 May.", 2, score=4.6)
    assert _extract(pool, [named, dated], "When was order 559001 delivered?") == [(dated.text, [2])]
    assert _extract(pool, [named, dated]) == [(named.text, [1])]  # not a value question: the best sentence
    undated = Candidate("The broker filed the invoice.", 2, score=4.6)
    assert _extract(pool, [named, undated], "When was order 559001 delivered?") == [(named.text, [1])]
    assert asks_for_value("In what year did the rota start?") and asks_for_value("How many phones are there?")
    assert not asks_for_value("How do I appeal when the phone is late?")  # it asks how; its "when" is not asked
    assert not asks_for_value("Can I swap when I am ill?") and not asks_for_value("What is the policy?")
    assert asks_for_value("What is the fee?")  # the noun asked for, past "is the": an amount
    assert short_answer("When did Wei Yilin die?", "The physician Wei Yilin (1277–1347) set joints.") == "1277–1347"


@pytest.mark.parametrize("citing, why", [
    ("wrong", "does not say this"),  # the next context's number instead of the right one
    ("invent", "does not say this"),  # an answer the contexts do not hold, with a figure none of them has
])
def test_a_model_citing_what_does_not_say_it_is_caught(company, settings, citing, why):
    with FakeOpenAI(chat=scripted_chat(citing)) as fake:
        chat = dataclasses.replace(settings, chat_model="scripted-chat", openai_base_url=fake.base_url,
                                   openai_api_key="test-key")
        question = ("What happened with order 559001?" if citing == "wrong"
                    else "When does the certificate behind a VPN token expire?")
        result = answer_question(company, chat, question)
    assert result["abstained"] and result["sentences"] == [], result["answer"]
    assert why in result["removed"][0]["why"]


@pytest.mark.parametrize("citing", ["all", "label", "prose"])
def test_a_model_that_copies_the_prompt_or_words_its_refusal_is_read_right(company, settings, citing):
    question = "When does the certificate behind a VPN token expire?"
    with FakeOpenAI(chat=scripted_chat(citing)) as fake:
        chat = dataclasses.replace(settings, chat_model="scripted-chat", openai_base_url=fake.base_url,
                                   openai_api_key="test-key")
        result = answer_question(company, chat, question)
    if citing == "prose":  # "The answer is not found." is a refusal, not an answer citing nothing
        assert result["abstained"] and "the model found no answer" in result["reason"]
        return
    assert not result["abstained"] and "12 months" in result["answer"]
    assert cited(result) == {"company:it/vpn-certificates.md"}  # only the context that says it stays cited
    assert "hr:salaries.md" not in result["answer"]


def test_kb_eval_answers_on_the_company_set_and_the_report_lists_every_question(company, settings, tmp_path):
    questions = tmp_path / "company-questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in COMPANY_QUESTIONS))
    report = json.loads(kb("eval", "--answers", str(questions), "--json").stdout)["answers"]
    rows = report["per_question"]
    assert [r["verdict"] for r in rows] == ["right"] * 6 + ["refused, right"] * 2, [
        (r["question"], r["answer"]) for r in rows]
    assert report["answers"]["answer_recall"] == 1.0 and report["answers"]["citation_recall"] == 1.0
    assert report["refusals"] == {"precision": 1.0, "recall": 1.0, "recall unanswerable": None,
                                  "recall out_of_corpus": 1.0}
    kb("eval", "--answers", str(questions), "--report", str(tmp_path / "report"))
    page = (tmp_path / "report" / "index.html").read_text()
    assert all(q["question"].replace("'", "&#x27;") in page for q in COMPANY_QUESTIONS)
    assert page.count("refused, right") == 2 and "customs" in page


def test_kb_eval_answers_reads_a_dataset_folder(settings):
    """A slice of SQuAD 2.0 (calibration articles): the folder is ingested into a database of its own."""
    report = json.loads(kb("eval", "--answers", str(SLICE), "--database-url", settings.database_url,
                           "--json").stdout)["answers"]
    assert report["groups"] == {"answerable": 61, "unanswerable": 77, "out_of_corpus": 37}
    assert report["ingest"]["documents_new"] == 24 and report["ingest"]["documents_failed"] == 0
    assert report["refusals"]["recall out_of_corpus"] >= 0.95  # about another article: refused
    # Issue 19 took this slice from 0.74 answered and 0.61 cited to 0.85 and 0.7. Single questions are not held:
    # among 24 paragraphs of one article the dense cosines nearly tie, and the int8 kernels of another CPU reorder
    # them. On an AMD EPYC (AVX2, no VNNI) the Bannow Bay year, asserted answered right here until then, is not: its
    # paragraph leads the lexical arm but is not in the dense top 5, so not in the hybrid top 5 the answer reads,
    # whatever the weights. The shares are held with a margin of a few questions that still fails the old behaviour.
    assert report["answers"]["answered"] >= 0.8 and report["answers"]["citation_recall"] >= 0.67
    assert len(report["per_question"]) == 175 and report["latency_ms"]["p95"] > 0


def test_highlights_mark_the_query_terms_not_the_parts_of_other_codes(company, settings):
    from pipelines.serving.api import create_app

    with TestClient(create_app(settings)) as client:
        body = client.get("/v1/knowledge/search", params={"q": "ERR-5012", "debug": "true", "k": 5}).json()
    marked = [(hit["content"], [hit["content"][a:b] for a, b in hit["highlights"]]) for hit in body["chunks"]]
    assert any("ERR-5012" in words for content, words in marked if content.startswith("ERR-5012 means"))
    assert any(content.startswith("ERR-7781 means") for content, _ in marked)  # found, and nothing marked in it:
    assert all(word == "ERR-5012" for _, words in marked for word in words)  # not ERR-7781 through "err"


def test_scores_are_shown_in_rank_order_or_marked():
    assert shown_scores([0.0162, 0.0161, 0.0150]) == ["0.0162", "0.0161", "0.0150"]
    near_tie = shown_scores([0.0161, 0.0162, 0.0150])  # the demo's first search, ordered by the arms' scores
    assert near_tie == [f"{NEAR_TIE_MARK}0.0161", f"{NEAR_TIE_MARK}0.0162", "0.0150"]


def test_the_console_offers_the_mode_and_an_ask_box(company, settings):
    from test_api import console_dom

    dom = console_dom(settings, "/?ask=What%20happened%20with%20order%20559001%3F")
    assert 'id="mode"' in dom and "qa_first" in dom and 'id="question"' in dom
    assert "held at customs" in dom and "VALID" in dom and "confidence" in dom
