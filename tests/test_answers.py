"""The answer layer (issue 12): Q&A cards (FAQ rules offline, a scripted chat model through the real openai
client), search modes, grounded answers whose citations are checked, abstention, and the bundled evaluation."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_openai import FakeOpenAI, scripted_chat
from fastapi.testclient import TestClient

from pipelines.answers.answer import answer_question
from pipelines.cli import main
from pipelines.ingest.run import ingest
from pipelines.models.embedders import make_embedder
from pipelines.retrieval.search import Filters, search
from pipelines.settings import SAMPLES_DIR
from pipelines.sources.declarations import add_source, declare
from pipelines.storage.database import connect

POLICY = "handbook/leave-policy.md"


def kb(*args: str, expect: int = 0):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result


def with_chat(settings, fake, **overrides):
    return dataclasses.replace(settings, chat_model="scripted-chat", openai_base_url=fake.base_url,
                               openai_api_key="test-key", **overrides)


def cards(conn, live=True) -> list[tuple]:
    return conn.execute("SELECT d.locator, c.question, c.generator, c.source_chunk_id FROM chunks c JOIN documents d"
                        f" USING (document_id) WHERE c.kind = 'card' {'AND c.valid_to IS NULL' if live else ''}"
                        " ORDER BY 1, 2").fetchall()


@pytest.fixture
def samples_kb(conn, embedder, settings, samples_copy):
    add_source(conn, declare("samples", samples_copy), "tests")
    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl"), "tests")
    ingest(conn, embedder, settings)
    return conn


def test_faq_cards_come_offline_and_each_mode_reads_what_it_says(samples_kb, embedder):
    made = cards(samples_kb)
    assert {(locator, question) for locator, question, *_ in made} == {
        ("faq-001", "How do I reset my VPN token?"), ("faq-002", "Where do I submit expense claims?"),
        ("faq-003", "What is the on-call compensation?"), ("faq-004", "Which laptop models are supported?")}
    assert {generator for _, _, generator, _ in made} == {"faq-rules-2"}  # "How to request leave" is no question
    query = "How can I reset the VPN token?"
    only = search(samples_kb, embedder, query, 3, mode="qa_only")
    assert only and all(h.kind == "card" for h in only)
    assert only[0].question == "How do I reset my VPN token?" and only[0].source_chunk_id
    assert all(h.kind != "card" for h in search(samples_kb, embedder, query, 10, mode="chunks"))
    first = search(samples_kb, embedder, query, 5, mode="qa_first")
    assert first[0].kind == "card" and first[0].question == "How do I reset my VPN token?"
    assert any(h.kind != "card" for h in first)


def test_chat_cards_are_cached_and_follow_their_chunks(samples_kb, settings, samples_copy, embedder):
    from pipelines.ingest.cards import generate_cards

    with FakeOpenAI(chat=scripted_chat()) as fake:
        chat = with_chat(settings, fake)
        report = generate_cards(samples_kb, chat, [embedder], ["samples"])
        live_chunks = samples_kb.execute("SELECT count(*) FROM chunks c JOIN documents d USING (document_id)"
                                         " WHERE d.source_id = 'samples' AND c.valid_to IS NULL AND c.kind <> 'card'"
                                         ).fetchone()[0]
        assert report.counts["generated"] == len(fake.prompts) == live_chunks
        before = samples_kb.execute("SELECT now()").fetchone()[0]
        calls = len(fake.prompts)
        assert generate_cards(samples_kb, chat, [embedder], ["samples"]).counts["generated"] == 0  # nothing new

        policy = samples_copy / POLICY  # one section edited: only its chunk is asked about
        policy.write_text(policy.read_text().replace("up to 10 days of paid family care leave",
                                                     "up to 12 days of paid family care leave"))
        ingest(samples_kb, embedder, chat, ["samples"])
        assert len(fake.prompts) == calls + 1 and "12 days" in fake.prompts[-1]
        old = search(samples_kb, embedder, "family care leave days", 3, mode="qa_only", filters=Filters(as_of=before))
        new = search(samples_kb, embedder, "family care leave days", 3, mode="qa_only")
        assert "10 days" in old[0].content and "12 days" in new[0].content  # cards are versioned with their chunks

        saved = policy.read_bytes()  # deleted and restored: its cards come back from the cache, with no call
        policy.unlink()
        ingest(samples_kb, embedder, chat, ["samples"])
        assert not [c for c in cards(samples_kb) if c[0] == POLICY]
        policy.write_bytes(saved)
        calls = len(fake.prompts)
        ingest(samples_kb, embedder, chat, ["samples"])
        assert len(fake.prompts) == calls and [c for c in cards(samples_kb) if c[0] == POLICY]

        other = dataclasses.replace(chat, chat_model="scripted-chat-2")  # a new model is a backfill that replaces
        generate_cards(samples_kb, other, [embedder], ["samples"])
    generators = {g for _, _, g, _ in cards(samples_kb) if g.startswith("chat:")}
    assert generators == {"chat:scripted-chat-2:cards-1"}


def test_answers_cite_their_sources_and_every_citation_is_checked(samples_kb, settings):
    question = "How many weeks of paid leave does a primary caregiver get?"
    with FakeOpenAI(chat=scripted_chat()) as fake:
        result = answer_question(samples_kb, with_chat(settings, fake), question)
    assert not result["abstained"] and "20 weeks" in result["answer"]
    assert f"[samples:{POLICY}, Parental and Family Leave Policy > Entitlements > Primary caregivers]" in result["answer"]
    assert [c["status"] for s in result["sentences"] for c in s["citations"]] == ["VALID"]
    assert {"retrieve_s", "generate_s", "verify_s"} <= set(result["timings"]) and result["contexts"]
    assert "Contexts:" in fake.prompts[-1] and "[1]" in fake.prompts[-1]

    for citing, why in (("missing", "cites missing context [99]"), ("none", "cites no context")):
        with FakeOpenAI(chat=scripted_chat(citing)) as fake:
            refused = answer_question(samples_kb, with_chat(settings, fake), question)
        assert refused["abstained"] and refused["sentences"] == []  # never an unverified citation
        assert refused["removed"][0]["why"] == why and "no sentence of the answer could be verified" in refused["reason"]


def test_not_in_the_documents_is_said_and_the_closest_sources_shown(samples_kb, settings):
    with FakeOpenAI(chat=scripted_chat()) as fake:
        model_says = answer_question(samples_kb, with_chat(settings, fake), "What were the Q2 2024 sales figures for Asia?")
    assert model_says["abstained"] and "not found in the documents" in model_says["answer"]
    assert model_says["closest_sources"][0]["document"] == "samples:sales/q3-2024-review.pptx"
    far = answer_question(samples_kb, settings, "How often are fire drills held at the Lyon plant?")
    assert far["abstained"] and "too weak" in far["reason"] and len(far["closest_sources"]) == 3
    assert far["evidence"]["lexical"] < 0.5  # nothing readable says "Lyon" or "drill"


def test_offline_answers_are_extracted_sentences_with_checked_citations(samples_kb, settings):
    result = answer_question(samples_kb, settings, "What is the daily meal allowance when travelling?")
    assert result["generator"] == "extractive" and not result["abstained"]
    assert "60 EUR" in result["answer"] and "[samples:finance/expense-policy.docx" in result["answer"]
    assert all(c["status"] in ("VALID", "WEAK") for s in result["sentences"] for c in s["citations"])


def test_a_question_is_read_as_the_documents_were(samples_kb, settings):
    """Full-width letters and a terminal's colour codes stayed in the question (search normalised them, answers did
    not): the full-width code was not found and "31mhow" counted as a missing rare word (the hostile review's find)."""
    plain = answer_question(samples_kb, settings, "HR-2024-047?")
    wide = answer_question(samples_kb, settings, "".join(chr(ord(c) + 0xFEE0) for c in "HR-2024-047?"))  # full width
    assert not plain["abstained"] and (wide["answer"], wide["evidence"]) == (plain["answer"], plain["evidence"])
    asked = "How many weeks of paid leave does a primary caregiver get?"
    coloured = answer_question(samples_kb, settings, f"\x1b[2J\x1b[31m{asked}\x1b[0m")
    assert coloured["evidence"] == answer_question(samples_kb, settings, asked)["evidence"]
    assert coloured["question"] == f"\x1b[2J\x1b[31m{asked}\x1b[0m"  # the caller's own words, as asked


def test_a_code_the_documents_do_not_hold_is_not_answered_with_another(samples_kb, settings):
    """"HR-2024-048?" was answered with HR-2024-047's policy at confidence 0.64 (the hostile review's find)."""
    other = answer_question(samples_kb, settings, "HR-2024-048?")
    assert other["abstained"] and other["reason"] == "the documents hold HR-2024-047, not HR-2024-048"
    assert not answer_question(samples_kb, settings, "HR-2024-047?")["abstained"]


def test_a_code_in_the_document_title_is_held_by_each_of_its_chunks(samples_kb, settings):
    """"What was the Q3 2024 revenue?" was answered from the title slide ("prepared for the leadership meeting on
    2024-10-08"): the revenue slide holds Q3 2024 only in the deck's title, which the lexical arm reads and the code
    rule did not (the hostile review's find). The title names the document: a chunk holding the code only there must
    hold the rest of what is asked itself (a first form counted the title's words, and the price list, titled with
    2024, answered whether it comes in Japanese)."""
    result = answer_question(samples_kb, settings, "What was the Q3 2024 revenue?")
    assert not result["abstained"] and "18.2 million EUR" in result["answer"], result["answer"]
    assert "pptx p. 2, Highlights" in result["answer"]
    japanese = answer_question(samples_kb, settings, "Is the spare parts price list 2024 available in Japanese?")
    assert not japanese["evidence"]["code_held"]


def test_a_question_said_again_is_read_once(samples_kb, settings):
    """Pasted three times, a question scored 0.70 instead of 0.91 (eight times: 0.56): its embedding moved away from
    its answer's."""
    asked = "How many weeks of leave does a primary caregiver get?"
    once = answer_question(samples_kb, settings, asked)
    again = answer_question(samples_kb, settings, f"{asked} {asked}\n{asked}")
    assert again["evidence"] == once["evidence"] and again["answer"] == once["answer"]
    situation = answer_question(samples_kb, settings, "I have a question about leave. " * 40 + asked)
    assert situation["asked"]["situation"] == "I have a question about leave."


def test_a_question_answered_for_its_close_context_is_answered_from_it(samples_kb, settings):
    """"spare parts price list": the price list is closer than any left-out probe came (the ceiling answers), and
    the answer was a sentence of the manual at similarity 0.20 (the hostile review's find). The fit's weights are
    set so that no confidence answers: the ceiling decides, whatever the fit makes of the price list's words."""
    assert samples_kb.execute("UPDATE answer_calibrations SET weights = ARRAY[-30, 0, 0, 0, 0]").rowcount >= 1
    result = answer_question(samples_kb, settings, "spare parts price list")
    assert not result["abstained"] and "above any that a question" in result["evidence"]["why"]
    documents = {c["chunk_id"]: c["document"] for c in result["contexts"]}
    cited = {documents[c["chunk_id"]] for s in result["sentences"] for c in s["citations"]}
    assert cited == {"samples:products/spare-parts-prices.xlsx"}, result["answer"]
    nearer = result["evidence"]["nearer_than_ceiling"]
    assert [documents[c["chunk_id"]] for c in result["contexts"] if c["n"] in nearer] == [
        "samples:products/spare-parts-prices.xlsx"]


def test_the_chat_endpoint_is_retried_through_429_500_and_timeouts(samples_kb, settings):
    with FakeOpenAI(chat=scripted_chat(), failures=[429, 500, "hang"]) as fake:
        result = answer_question(samples_kb, with_chat(settings, fake, openai_timeout_s=0.5),
                                 "What is the daily meal allowance when travelling?")
    assert not result["abstained"] and len(fake.attempt_times) >= 4
    with FakeOpenAI(chat=scripted_chat(), failures=[500] * 6) as fake:
        with pytest.raises(Exception, match="500|Internal|slow down"):
            answer_question(samples_kb, with_chat(settings, fake, openai_max_retries=1),
                            "What is the daily meal allowance when travelling?")


def test_hyde_and_compression_change_what_the_model_sees(samples_kb, settings):
    question = "How many weeks of paid leave does a primary caregiver get?"
    with FakeOpenAI(chat=scripted_chat()) as fake:
        plain = answer_question(samples_kb, with_chat(settings, fake), question)
        hyde = answer_question(samples_kb, with_chat(settings, fake), question, hyde=True, compress=True)
    assert any(p.startswith("Write a short passage") for p in fake.prompts)
    assert sum(len(c["text"]) for c in hyde["contexts"]) < sum(len(c["text"]) for c in plain["contexts"])
    assert not hyde["abstained"]
    with pytest.raises(Exception, match="KB_CHAT_MODEL"):
        answer_question(samples_kb, settings, question, hyde=True)


def test_answers_over_the_api_read_only_what_the_key_may_read(samples_kb, settings):
    from pipelines.serving.access import create_key

    samples_kb.execute("UPDATE sources SET allowed_groups = '{hr}' WHERE source_id = 'samples'")
    _, token = create_key(samples_kb, "hr-bot", ["hr"], "tests")
    body = {"question": "How many weeks of paid leave does a primary caregiver get?"}
    with TestClient(__import__("pipelines.serving.api", fromlist=["create_app"]).create_app(settings)) as client:
        anonymous = client.post("/v1/knowledge/answer", json=body).json()
        allowed = client.post("/v1/knowledge/answer", json=body, headers={"X-API-Key": token}).json()
        assert client.post("/v1/knowledge/answer", json={**body, "groups": ["finance"]},
                           headers={"X-API-Key": token}).status_code == 403
    assert all(not c["document"].startswith("samples:") for c in anonymous["contexts"])
    assert not allowed["abstained"] and "leave-policy.md" in allowed["answer"]
    assert "20 weeks" in allowed["answer"] or "Paid weeks: 20" in allowed["answer"]  # the prose, or the table's row


def test_kb_eval_scores_the_bundled_answer_set(samples_kb, settings, monkeypatch):
    with FakeOpenAI(chat=scripted_chat()) as fake:
        for name, value in {"KB_CHAT_MODEL": "scripted-chat", "OPENAI_BASE_URL": fake.base_url,
                            "OPENAI_API_KEY": "test-key"}.items():
            monkeypatch.setenv(name, value)
        report = json.loads(kb("eval", "--answers", str(SAMPLES_DIR / "answers.jsonl"), "--json").stdout)["answers"]
        text = kb("eval", "--answers", str(SAMPLES_DIR / "answers.jsonl")).stdout
    assert "refusals: precision" in text and "retrieval, mode qa_first" in text and "p95" in text
    assert report["questions"] == 32 and report["unanswerable"] == 12
    assert set(report["retrieval"]) == {"chunks", "qa_first"}
    assert report["retrieval"]["qa_first"]["hit@5"] >= 0.9 and report["retrieval"]["chunks"]["hit@5"] >= 0.9
    rows = report["per_question"]  # the summary is what the rows say
    refused = [r for r in rows if r["abstained"]]
    unanswerable_refused = [r for r in refused if r["group"] != "answerable"]
    assert report["refusals"]["recall"] == round(len(unanswerable_refused) / 12, 4)
    assert report["refusals"]["precision"] == round(len(unanswerable_refused) / len(refused), 4)
    # The scripted model says NOT_FOUND when the words are not there; three of these twelve (sick days, the CEO, and
    # a stillbirth's paid leave, whose confidence 0.36 passes the operating point chosen for citation recall on
    # SQuAD, bench/README.md) pass the calibrated evidence and share its words with a context, so the model answers
    # them (0.9 before issue 19, whose threshold was fitted on these very questions).
    assert report["refusals"]["recall"] >= 0.75
    answerable = [r for r in rows if r["group"] == "answerable"]
    assert report["answers"]["answered"] == round(sum(not r["abstained"] for r in answerable) / 20, 4)
    assert all(c["status"] in ("VALID", "WEAK") for r in rows for c in r["citations"])  # every one checked, none INVALID
    assert report["answers"]["citation_validity"] >= 0.85


def test_a_run_killed_while_writing_cards_converges_to_a_clean_run(settings, samples_copy, tmp_path):
    kb_bin = str(Path(sys.executable).parent / "kb")
    with FakeOpenAI(chat=scripted_chat(), hold_after=2) as fake:  # the third card call waits for the kill
        env = {**os.environ, "KB_CHAT_MODEL": "scripted-chat", "OPENAI_BASE_URL": fake.base_url,
               "OPENAI_API_KEY": "test-key", "KB_CHAT_CONCURRENCY": "1", "PYTHONUNBUFFERED": "1"}
        run = subprocess.Popen([kb_bin, "ingest", str(samples_copy), "--source", "samples", "--public"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert fake.held.wait(timeout=600), "the run never reached its third card call"
        run.send_signal(signal.SIGKILL)
        assert run.wait(timeout=60) == -signal.SIGKILL
        with connect(settings) as conn:
            killed = cards(conn)
        fake.hold_after = None
        assert subprocess.run([kb_bin, "ingest", "--source", "samples"], env=env, capture_output=True,
                              timeout=600).returncode == 0
        with connect(settings) as conn:
            resumed = cards(conn)
            conn.execute("DELETE FROM chunks WHERE kind = 'card'")
            conn.execute("TRUNCATE card_rounds, card_cache")
            from pipelines.ingest.cards import generate_cards

            generate_cards(conn, with_chat(settings, fake), [make_embedder(settings)], ["samples"])
            clean = cards(conn)
    strip = lambda rows: sorted((locator, question, generator) for locator, question, generator, _ in rows)  # noqa: E731
    assert len(killed) < len(clean)  # it was killed mid-generation: not every card was written
    assert strip(resumed) == strip(clean)


def test_an_as_of_answer_cites_what_was_valid_then_and_labels_come_from_metadata(settings, tmp_path):
    """An answer about a document as it was (since changed) is validated against the chunks valid then, not
    refused; a source label written inside a document is not copied into an answer."""
    import time
    from datetime import timedelta

    folder = tmp_path / "notes"
    folder.mkdir()
    policy = folder / "travel.md"
    policy.write_text("# Travel policy\n\nThe daily meal allowance for business travel is 42 EUR per day"
                      " [hr:salaries.md, Bands].\n")
    kb_bin = str(Path(sys.executable).parent / "kb")
    run = lambda *args: subprocess.run([kb_bin, *args], capture_output=True, text=True,  # noqa: E731
                                       env=os.environ.copy(), timeout=600)
    assert run("ingest", str(folder), "--source", "notes", "--public").returncode == 0
    with connect(settings) as conn:  # --as-of reads whole seconds: the first one at or after that publication
        published = conn.execute("SELECT max(valid_from) FROM chunks").fetchone()[0]
        then = published.replace(microsecond=0) + timedelta(seconds=bool(published.microsecond))
        deadline = time.monotonic() + 10
        while not conn.execute("SELECT clock_timestamp() > %s", (then,)).fetchone()[0]:  # the edit comes after it
            assert time.monotonic() < deadline, "the database's clock stands still"
            time.sleep(0.05)
    policy.write_text("# Travel policy\n\nBusiness travel now needs a manager's approval.\n")
    assert run("ingest", "--source", "notes").returncode == 0
    answer = json.loads(run("ask", "What is the daily meal allowance for business travel?", "--as-of", then.isoformat(),
                            "--json").stdout)
    assert not answer["abstained"], answer["reason"]
    assert "42 EUR" in answer["answer"] and "hr:salaries.md" not in answer["answer"]
    assert all(c["status"] != "INVALID" for s in answer["sentences"] for c in s["citations"])
