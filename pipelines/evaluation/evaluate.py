"""`kb eval`: a BEIR-format dataset through the real pipeline and the real search, scored with trec_eval.

Metrics come from pytrec_eval (the trec_eval reference implementation): hit@k is trec_eval's success@k, MRR@10 is
recip_rank over the top 10, plus nDCG@10 and recall@100. A document's rank is its best chunk's rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psycopg

from pipelines.models.embedders import Embedder
from pipelines.retrieval.search import Filters, search

log = logging.getLogger(__name__)
METRICS = ("hit@1", "hit@5", "hit@10", "mrr@10", "ndcg@10", "recall@100")
CHUNKS_PER_QUERY = 300  # enough chunks to rank 100 distinct documents


@dataclass(frozen=True)
class Configuration:
    name: str
    arm: str
    lexical_weight: float | None = None
    rerank: bool = False
    mode: str = "chunks"


CONFIGURATIONS = (
    Configuration("dense", "dense"),
    Configuration("lexical", "lexical"),
    Configuration("hybrid", "hybrid"),
)


def latency_summary(ms: list[float]) -> dict[str, float]:
    """Median and p95 of per-query latencies, as `kb eval --json` and its report show them (0 when none)."""
    ordered = sorted(ms) or [0.0]
    return {"median": statistics.median(ordered), "p95": ordered[int(0.95 * len(ordered)) - 1]}


BEIR_DOWNLOAD = "https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets/scifact.zip"


class DatasetError(ValueError):
    """An evaluation input that is not what `kb eval` reads (not a BEIR folder, a question set without questions):
    the user's to fix, so the CLI shows it as one line (exit 2) naming the file and the fix."""


def check_dataset(dataset: Path, split: str | None) -> str:
    """The split to evaluate, once the folder is known to be a BEIR dataset; checked before anything is ingested."""
    split = split or default_split(dataset)
    missing = [name for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv") if not (dataset / name).is_file()]
    if missing == [f"qrels/{split}.tsv"] and (splits := sorted(p.stem for p in (dataset / "qrels").glob("*.tsv"))):
        raise DatasetError(f"{dataset}: no qrels/{split}.tsv; its splits are {', '.join(splits)} (--split)")
    if missing:
        raise DatasetError(f"{dataset} is not a BEIR dataset: it has no {', '.join(missing)}. A BEIR folder holds"
                           f" corpus.jsonl, queries.jsonl and qrels/<split>.tsv; download one, e.g. SciFact from"
                           f" {BEIR_DOWNLOAD}, and unzip it")
    return split


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of each non-blank line; a line that is not one is a DatasetError naming it."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{path} line {number} is not valid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{path} line {number} is not a JSON object")
            yield number, record


def load_dataset_queries(dataset: Path, split: str) -> tuple[dict[str, str], dict[str, dict[str, int]], dict[str, dict]]:
    """Queries that have judgements in the split, the judgements {query_id: {doc_id: relevance}}, and each query's
    metadata (an identifier set's `kind` and `form`, for per-kind reports)."""
    qrels: dict[str, dict[str, int]] = {}
    path = dataset / "qrels" / f"{split}.tsv"
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or parts[0] == "query-id":
                continue
            try:
                qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
            except ValueError:
                raise DatasetError(f"{path} line {number}: the score {parts[2]!r} is not a whole number"
                                   " (query-id, corpus-id, score, tab-separated)") from None
    queries, metadata = {}, {}
    for number, record in _json_lines(dataset / "queries.jsonl"):
        if "_id" not in record or not isinstance(record.get("text"), str):
            raise DatasetError(f"{dataset / 'queries.jsonl'} line {number}: a query is {{\"_id\": ..., \"text\": ...}}")
        if str(record["_id"]) in qrels:
            queries[str(record["_id"])] = record["text"]
            metadata[str(record["_id"])] = record.get("metadata") or {}
    return queries, {q: rels for q, rels in qrels.items() if q in queries}, metadata


def document_run(hits, limit: int = 100) -> dict[str, float]:
    """Chunk hits -> documents ranked by their best chunk, as trec_eval scores (higher is better)."""
    ranked: dict[str, float] = {}
    for hit in hits:
        if hit.document not in ranked:
            ranked[hit.document] = float(limit - len(ranked))
            if len(ranked) == limit:
                break
    return ranked


def score(run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]) -> tuple[dict[str, float], dict[str, dict]]:
    import pytrec_eval

    full = pytrec_eval.RelevanceEvaluator(qrels, {"success.1,5,10", "ndcg_cut.10", "recall.100"}).evaluate(run)
    top10 = {q: dict(sorted(docs.items(), key=lambda kv: -kv[1])[:10]) for q, docs in run.items()}
    mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    per_query = {q: {"hit@1": m["success_1"], "hit@5": m["success_5"], "hit@10": m["success_10"],
                     "mrr@10": mrr[q]["recip_rank"], "ndcg@10": m["ndcg_cut_10"], "recall@100": m["recall_100"]}
                 for q, m in full.items()}
    means = {metric: round(sum(v[metric] for v in per_query.values()) / max(len(per_query), 1), 4) for metric in METRICS}
    return means, per_query


def evaluate(conn: psycopg.Connection, embedder: Embedder, queries: dict[str, str], qrels: dict[str, dict[str, int]],
             source_id: str, configurations=CONFIGURATIONS, misses: bool = False, reranker=None,
             k_overfetch: int = 20) -> dict:
    """Run every query through each configuration; returns metrics per configuration (and misses if asked)."""
    vectors = dict(zip(queries, embedder.embed(list(queries.values()))))
    cached = _CachedQueries(embedder, {text: vectors[q] for q, text in queries.items()})
    report = {}
    for config in configurations:
        run, latency_ms = {}, []
        for qid, text in queries.items():
            started = time.perf_counter()
            hits = search(conn, cached, text, CHUNKS_PER_QUERY, arm=config.arm, lexical_weight=config.lexical_weight,
                          k_overfetch=CHUNKS_PER_QUERY, filters=Filters(source_id=source_id), mode=config.mode)
            if config.rerank:  # the reranker sees the over-fetched head, as in serving
                hits = reranker.rerank(text, hits[:k_overfetch]) + hits[k_overfetch:]
            latency_ms.append(round((time.perf_counter() - started) * 1000, 2))
            run[qid] = document_run(hits)
        means, per_query = score(run, qrels)
        entry = {"metrics": means, "queries": len(queries), "per_query": per_query, "latency_ms": latency_ms}
        if misses:
            entry["misses"] = [{"query_id": q, "query": queries[q], "relevant": sorted(qrels[q]),
                                "top5": list(run[q])[:5]} for q, m in per_query.items() if not m["hit@10"]]
        report[config.name] = entry
    return report


class _CachedQueries:
    """The evaluation embeds all queries in one batch up front; search then reads them from here."""

    def __init__(self, embedder: Embedder, vectors: dict):
        self.model_key, self.dimensions, self.counter = embedder.model_key, embedder.dimensions, embedder.counter
        self._vectors = vectors

    def embed(self, texts):
        import numpy as np

        return np.stack([self._vectors[t] for t in texts])


def classifier_kinds(conn: psycopg.Connection, queries: dict[str, str], source_id: str) -> dict[str, int]:
    """How the query classifier reads a query set (identifier / question / keywords), for the report."""
    from pipelines.retrieval.query_class import classify
    from pipelines.retrieval.readable import readable

    source_keys = readable(conn, [], source_id).keys
    counts: dict[str, int] = {}
    for text in queries.values():
        kind = classify(conn, text, source_keys).kind
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def by_group(per_query: dict[str, dict], metadata: dict[str, dict], fields=("kind", "form")) -> dict[str, dict]:
    """Mean metrics per value of a query metadata field (an identifier set's kinds and forms)."""
    groups: dict[str, list[dict]] = {}
    for qid, metrics in per_query.items():
        for name in fields:
            if name in metadata.get(qid, {}):
                groups.setdefault(f"{name}={metadata[qid][name]}", []).append(metrics)
    return {group: {m: round(sum(r[m] for r in rows) / len(rows), 4) for m in METRICS} | {"queries": len(rows)}
            for group, rows in sorted(groups.items())}


def per_query_deltas(before: dict[str, dict], after: dict[str, dict], metric: str = "ndcg@10") -> list[float]:
    """after - before for each query both runs scored, in query-id order."""
    return [after[q][metric] - before[q][metric] for q in sorted(set(before) & set(after))]


def paired_comparison(before: dict[str, dict], after: dict[str, dict], metric: str = "ndcg@10") -> dict:
    """Per-query difference after - before on the queries both runs scored: mean, its standard error, and how
    many queries won, lost or tied. A drop is real when the mean is below zero by more than about two errors."""
    common = sorted(set(before) & set(after))
    deltas = per_query_deltas(before, after, metric)
    mean = statistics.fmean(deltas) if deltas else 0.0
    error = statistics.stdev(deltas) / len(deltas) ** 0.5 if len(deltas) > 1 else 0.0
    return {"metric": metric, "queries": len(common), "before": round(statistics.fmean(before[q][metric] for q in common), 4),
            "after": round(statistics.fmean(after[q][metric] for q in common), 4), "mean_delta": round(mean, 4),
            "standard_error": round(error, 4), "wins": sum(d > 1e-9 for d in deltas),
            "losses": sum(d < -1e-9 for d in deltas), "ties": sum(abs(d) <= 1e-9 for d in deltas)}


def default_split(dataset: Path) -> str:
    splits = sorted(p.stem for p in (dataset / "qrels").glob("*.tsv"))
    return "test" if "test" in splits or not splits else splits[0]


def own_database(settings, dbname: str) -> str:
    """The URL of `kb eval`'s own database `dbname` on the knowledge base's server, created when missing and brought
    to this version of kb's schema: it is the evaluation's scratch store, so an upgrade of kb migrates it here.
    (`kb migrate` upgrades the knowledge base's database, never these, so a schema left behind by an older kb
    stopped every later `kb eval` of that dataset with advice that did not help.) A database given with
    --database-url is the user's and is never migrated by `kb eval`."""
    from pipelines.storage.database import database_url as server_url
    from pipelines.storage.database import ensure_database, upgrade_schema
    from pipelines.storage.migrations import is_installed

    def said(conn, files) -> None:
        if is_installed(conn):  # a new database is installed silently: every first run would warn
            log.warning("kb eval: bringing its database %s to this kb's schema (%s: %s)", dbname,
                        f"{len(files)} file{'s' if len(files) != 1 else ''}", ", ".join(f.name for f in files))

    url = ensure_database(server_url(settings), dbname)
    upgrade_schema(dataclasses.replace(settings, database_url=url), before=said)
    return url


def dataset_name(dataset: Path) -> str:
    """A dataset folder's name as its evaluation database and source are named after it (kb_eval_<name>)."""
    return re.sub(r"[^a-z0-9]+", "_", dataset.resolve().name.lower())


def evaluation_settings(settings, dbname: str, given: str | None):
    """The settings of the database an evaluation runs in: its own `dbname` (own_database), or the one given with
    --database-url, which kb eval installs kb's schema in when it is empty and never migrates. (`kb migrate` reads
    DATABASE_URL, so a given database that is behind is said to need it run with DATABASE_URL set to that one.)"""
    from pipelines.storage.database import SchemaNotReady, connect

    if given is None:
        return dataclasses.replace(settings, database_url=own_database(settings, dbname))
    settings = dataclasses.replace(settings, database_url=given)
    try:
        with connect(settings):
            pass
    except SchemaNotReady as exc:
        raise SchemaNotReady(f"{exc} (for the database given with --database-url: with DATABASE_URL set to it)"
                             ) from None
    return settings


def evaluate_dataset(settings, dataset: Path, split: str | None = None, database_url: str | None = None,
                     weights=(), misses: bool = False, reranker=None, progress=None) -> dict:
    """Ingest a BEIR dataset's corpus as source `beir-<name>` (in its own kb_eval_<name> database unless one is
    given) and evaluate every configuration on its queries. In kb_eval_<name>, which is the evaluation's own, the
    source follows the dataset's location; in a database given with --database-url a source declared there is
    never changed: one at another location is refused."""
    from pipelines.models.embedders import make_embedder
    from pipelines.storage.database import connect
    from pipelines.storage.status import ingest_statistics

    name = dataset_name(dataset)
    split = check_dataset(dataset, split)
    settings = evaluation_settings(settings, f"kb_eval_{name}", database_url)
    queries, qrels, metadata = load_dataset_queries(dataset, split)
    source_id = f"beir-{name}"
    embedder = make_embedder(settings)
    configs = list(CONFIGURATIONS) + [Configuration(f"hybrid w={w:g}", "hybrid", w) for w in weights]
    if reranker is not None:
        configs.append(Configuration("hybrid+rerank", "hybrid", rerank=True))
    with connect(settings) as conn:
        summary = _ingest_corpus(conn, settings, source_id, dataset / "corpus.jsonl", database_url, progress)
        if summary.counters()["cards_written"] or conn.execute(
                "SELECT 1 FROM chunks c JOIN documents d USING (document_id) WHERE d.source_id = %s AND c.kind = 'card'"
                " LIMIT 1", (source_id,)).fetchone():
            configs.append(Configuration("hybrid qa_first", "hybrid", mode="qa_first"))
        results = evaluate(conn, embedder, queries, qrels, source_id, configs, misses, reranker)
        statistics = ingest_statistics(conn, [source_id])
        kinds = classifier_kinds(conn, queries, source_id)
    if any(metadata.values()):
        for result in results.values():
            result["groups"] = by_group(result["per_query"], metadata)
    return {"dataset": str(dataset), "split": split, "queries": len(queries), "model": embedder.model_key,
            "reranker": f"{settings.rerank} {settings.rerank_model}" if reranker is not None else None,
            "ingest": summary.counters(),
            "classifier": kinds, "results": results, "statistics": statistics}


ANSWER_GROUPS = ("answerable", "unanswerable", "out_of_corpus")


def load_answer_set(path: Path) -> list[dict]:
    """An answer set (docs/retrieval.md, "Evaluating answers"): one JSON object per line with `question`,
    `answers` (the texts a right answer holds; [] when the documents do not answer), `passages` (the documents
    that hold the answer, as source:locator or, in a dataset folder, the corpus record's _id), and optionally
    `id` and `group` (answerable, unanswerable: the documents do not say, out_of_corpus: about something not
    ingested). The older form with `document` and `answer` (samples/answers.jsonl) reads the same. A line that is
    not such a question is a DatasetError naming it."""
    cases = []
    for n, record in _json_lines(path):
        if not isinstance(record.get("question"), str) or not record["question"].strip():
            raise DatasetError(f"{path} line {n} has no \"question\": each line is {{\"question\": ...,"
                               " \"answers\": [...], \"passages\": [...]}, or {\"question\", \"document\","
                               " \"answer\"} as in samples/answers.jsonl")
        for key in ("document", "answer"):
            if record.get(key) is not None and not isinstance(record[key], str):
                raise DatasetError(f"{path} line {n}: \"{key}\" must be a string or null")
        answers = record.get("answers", [record["answer"]] if record.get("answer") else [])
        passages = record.get("passages", [record["document"]] if record.get("document") else [])
        group = record.get("group") or ("answerable" if passages else "unanswerable")
        if group not in ANSWER_GROUPS:
            raise DatasetError(f"{path} line {n}: \"group\" is one of {', '.join(ANSWER_GROUPS)}, not {group!r}")
        cases.append({"id": str(record.get("id", n)), "question": record["question"], "answers": answers,
                      "passages": passages, "group": group})
    if not cases:
        raise DatasetError(f"{path} holds no questions (one JSON object per line, as in samples/answers.jsonl)")
    return cases


_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalized(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace())
    return " ".join(_ARTICLES.sub(" ", text).split())


def holds_answer(answer: str, gold: list[str]) -> bool:
    said = f" {normalized(answer)} "
    return any(f" {normalized(g)} " in said for g in gold if normalized(g))


def _is_gold(document: str, passages: list[str]) -> bool:
    return document in passages or document.split(":", 1)[-1] in passages


def _ingest_corpus(conn: psycopg.Connection, settings, source_id: str, corpus: Path, database_url: str | None,
                   progress=None):
    """Declare (or follow) the evaluation's corpus source and ingest it. In the evaluation's own database the
    source follows the dataset's location; in a database given with --database-url a source declared there is
    never changed: one at another location is refused."""
    from pipelines.ingest.run import ingest
    from pipelines.models.embedders import make_embedder
    from pipelines.sources.declarations import DeclarationError, actor, add_source, declare, get_source, update_source

    declared = declare(source_id, corpus)
    stored = get_source(conn, source_id)
    if stored is None:
        add_source(conn, declared, actor("kb eval"))
    elif stored.path != declared.path and database_url:
        raise DeclarationError(f"source {source_id!r} is declared in that database at {stored.path}, not"
                               f" {declared.path}; kb eval never changes a declared source: evaluate in another"
                               " database, or move the source with `kb source update`")
    elif stored.path != declared.path:
        update_source(conn, source_id, actor("kb eval"), location=declared.location)
    return ingest(conn, make_embedder(settings), settings, [source_id], **({"progress": progress} if progress else {}))


def evaluate_answers(conn: psycopg.Connection, settings, cases: list[dict], groups: list[str], k: int = 5,
                     hyde: bool = False, compress: bool = False) -> dict:
    """Score the answer layer on an answer set (load_answer_set) over the current knowledge base:

    - retrieval: hit@1 and hit@5 of a gold passage, in mode qa_first against chunks;
    - answerable questions: the share answered, whose answer holds a gold answer text (answer recall), and that
      cite a gold passage (citation recall); the share of citations VALID;
    - refusals: precision (refused questions that were not answerable) and recall, overall and per group;
    - latency of each answer; and every question with its answer, citations and verdict."""
    from pipelines.answers.answer import answer_question
    from pipelines.retrieval.responses import retrieve

    filters = Filters(groups=groups)
    answerable = [c for c in cases if c["group"] == "answerable"]
    retrieval = {}
    for mode in ("chunks", "qa_first"):
        hits_at = {1: 0, 5: 0}
        for case in answerable:
            _, hits = retrieve(conn, settings, case["question"], 5, mode=mode, filters=filters)
            documents = list(dict.fromkeys(f"{h.source}:{h.document}" for h in hits))
            hits_at[1] += any(_is_gold(d, case["passages"]) for d in documents[:1])
            hits_at[5] += any(_is_gold(d, case["passages"]) for d in documents[:5])
        retrieval[mode] = {f"hit@{n}": round(v / max(len(answerable), 1), 4) for n, v in hits_at.items()}
    rows, latency_ms, valid, cited = [], [], 0, 0
    for case in cases:
        started = time.perf_counter()
        result = answer_question(conn, settings, case["question"], k, filters=filters, hyde=hyde, compress=compress)
        latency_ms.append(round((time.perf_counter() - started) * 1000, 2))
        documents = {c["chunk_id"]: c["document"] for c in result["contexts"]}
        citations = [{"document": documents.get(c["chunk_id"], str(c["chunk_id"])), "status": c["status"]}
                     for s in result["sentences"] for c in s["citations"]]
        valid, cited = valid + sum(c["status"] == "VALID" for c in citations), cited + len(citations)
        holds = not result["abstained"] and holds_answer(result["answer"], case["answers"])
        cites_gold = any(_is_gold(c["document"], case["passages"]) for c in citations)
        if case["group"] != "answerable":
            verdict = "refused, right" if result["abstained"] else "answered, should refuse"
        elif result["abstained"]:
            verdict = "refused, should answer"
        else:
            verdict = {(True, True): "right", (True, False): "right text, wrong source",
                       (False, True): "right source, text missing", (False, False): "wrong"}[(holds, cites_gold)]
        rows.append({"id": case["id"], "question": case["question"], "group": case["group"],
                     "expected": case["answers"], "passages": case["passages"], "abstained": result["abstained"],
                     "answer": result["answer"], "short_answer": result.get("short_answer"), "citations": citations,
                     "holds_answer": holds, "cites_gold": cites_gold, "verdict": verdict,
                     "confidence": result["confidence"], "evidence": result.get("evidence"),
                     "latency_ms": latency_ms[-1]})
    return {"questions": len(cases), "groups": {g: sum(c["group"] == g for c in cases) for g in ANSWER_GROUPS},
            "unanswerable": len(cases) - len(answerable), "retrieval": retrieval,
            "answers": _answer_metrics(rows, valid, cited), "refusals": _refusal_metrics(rows),
            "latency_ms": latency_summary(latency_ms), "per_question": rows}


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _answer_metrics(rows: list[dict], valid: int, cited: int) -> dict:
    answerable = [r for r in rows if r["group"] == "answerable"]
    answered = [r for r in answerable if not r["abstained"]]
    return {"answerable": len(answerable), "answered": _share(len(answered), len(answerable)),
            "answer_recall": _share(sum(r["holds_answer"] for r in answerable), len(answerable)),
            "citation_recall": _share(sum(r["cites_gold"] for r in answerable), len(answerable)),
            "short_answer_recall": _share(sum(bool(r["short_answer"]) and holds_answer(r["short_answer"], r["expected"])
                                              for r in answerable), len(answerable)),
            "citation_validity": _share(valid, cited)}


def _refusal_metrics(rows: list[dict]) -> dict:
    refused = [r for r in rows if r["abstained"]]
    metrics = {"precision": _share(sum(r["group"] != "answerable" for r in refused), len(refused)),
               "recall": _share(sum(r["group"] != "answerable" for r in refused),
                                sum(r["group"] != "answerable" for r in rows))}
    for group in ANSWER_GROUPS[1:]:
        members = [r for r in rows if r["group"] == group]
        metrics[f"recall {group}"] = _share(sum(r["abstained"] for r in members), len(members))
    return metrics


def evaluate_answer_dataset(settings, dataset: Path, groups: list[str], database_url: str | None = None,
                            hyde: bool = False, compress: bool = False, progress=None) -> dict:
    """An answer dataset folder (corpus.jsonl + questions.jsonl) ingested as source `answers-<name>` into its own
    kb_eval_answers_<name> database (or the one given), then scored with evaluate_answers."""
    from pipelines.storage.database import connect

    name = dataset_name(dataset)
    settings = evaluation_settings(settings, f"kb_eval_answers_{name}", database_url)
    cases = load_answer_set(dataset / "questions.jsonl")
    with connect(settings) as conn:
        summary = _ingest_corpus(conn, settings, f"answers-{name}", dataset / "corpus.jsonl", database_url, progress)
        report = evaluate_answers(conn, settings, cases, groups, hyde=hyde, compress=compress)
    return {"dataset": str(dataset), "ingest": summary.counters(), **report}
