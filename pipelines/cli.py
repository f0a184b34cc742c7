"""`kb`: ingest, inspect and search the knowledge base from a terminal or a script (`--json`).

Exit status: 0 success; 3 the run finished but some files failed (listed in the summary); 2 usage error;
1 any other error.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta, timezone
from pathlib import Path

import click

from pipelines.settings import load_settings


def _emit(data, as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)


def _progress_factory(enabled: bool):
    """A progress bar on a terminal, plain lines otherwise (logs, CI)."""
    def factory(stage: str, total: int | None):
        if not enabled:
            return lambda n: None
        if sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=total, desc=stage, unit="item", leave=False)
            return bar.update
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            click.echo(f"{stage}: {done[0]}{f'/{total}' if total else ''}", err=True)
        return advance
    return factory


@click.group()
def main() -> None:
    """kb: documents in, a retrieval-ready knowledge base out (PostgreSQL + pgvector)."""


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--source", "source_name", help="Source name (default: the folder or file name). One path only.")
@click.option("--include", multiple=True, help="Glob of files to take from a folder (repeatable).")
@click.option("--exclude", multiple=True, help="Glob of files to skip (repeatable).")
@click.option("--group", "groups", multiple=True,
              help="Only callers in this group may see the source's documents (repeatable; default: everyone).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary.")
def ingest(paths, source_name, include, exclude, groups, as_json) -> None:
    """Ingest folders of documents and/or JSONL files of records."""
    from pipelines.database import connect
    from pipelines.embedders import make_embedder
    from pipelines.extract import register_source, source_for_path
    from pipelines.ingest import EXIT_FILE_FAILURES, ingest as run_ingest
    from pipelines.locks import source_locks

    if source_name and len(paths) > 1:
        raise click.UsageError("--source names one source: give one path with it")
    settings = load_settings()
    sources = [source_for_path(p, source_name, include, exclude, tuple(groups) or None) for p in paths]
    source_ids = [s.source_id for s in sources]
    with connect(settings) as conn, source_locks(conn, source_ids):
        for source in sources:
            register_source(conn, source)
        summary = run_ingest(conn, make_embedder(settings), settings, source_ids, progress=_progress_factory(not as_json))
    data = summary.as_dict()
    lines = [f"{k.replace('_', ' ')}: {v}" for k, v in data.items() if k not in ("errors", "elapsed_s")]
    lines.append("elapsed: " + ", ".join(f"{k} {v:.2f}s" for k, v in data["elapsed_s"].items()))
    lines += [f"ERROR {e['source']}:{e['file']}: {e['reason']}" for e in data["errors"]]
    _emit(data, as_json, "\n".join(lines))
    if data["errors"]:
        sys.exit(EXIT_FILE_FAILURES)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def status(as_json) -> None:
    """Sources, document and chunk counts, failures and the last run."""
    from pipelines.database import connect
    from pipelines.status import knowledge_base_status

    with connect(load_settings()) as conn:
        data = knowledge_base_status(conn)
    text = [f"{s['source_id']} ({s['kind']} {s['location']}): {s['documents']} documents, {s['chunks']} chunks,"
            f" {s['deleted']} deleted, {s['failed']} failing, {s['stale']} stale, last crawled {s['last_crawled_at']}"
            for s in data["sources"]]
    text += [f"failing: {f['source_id']}:{f['locator']}: {f['reason']}" for f in data["failures"]]
    text.append(f"models: {', '.join(m['model_key'] + ' (' + m['state'] + ')' for m in data['models']) or 'none'}")
    _emit(data, as_json, "\n".join(text))


@main.command()
@click.argument("query")
@click.option("--k", default=5, show_default=True, type=click.IntRange(1, 100))
@click.option("--source-id", help="Only this source.")
@click.option("--arm", type=click.Choice(["hybrid", "dense", "lexical"]), default="hybrid", show_default=True)
@click.option("--lexical-weight", type=click.FloatRange(0, 1), help="RRF weight of the lexical arm (default: by query type).")
@click.option("--k-overfetch", default=20, show_default=True, type=click.IntRange(1, 1000))
@click.option("--group", "groups", multiple=True, help="A group the caller belongs to (repeatable).")
@click.option("--as-of", "as_of", type=click.DateTime(["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"]),
              help="Answer from the knowledge base as it was at this time (UTC unless an offset is given).")
@click.option("--diversity", default=0.0, type=click.FloatRange(0, 1), help="MMR diversity over the candidates (0: off).")
@click.option("--freshness", default=0.0, type=click.FloatRange(0, None), help="Boost for recent documents (0: off).")
@click.option("--no-rerank", is_flag=True, help="Skip the configured reranker (KB_RERANK).")
@click.option("--debug", is_flag=True, help="Show each result's rank and score in each arm.")
@click.option("--json", "as_json", is_flag=True)
def search(query, k, source_id, arm, lexical_weight, k_overfetch, groups, as_of, diversity, freshness, no_rerank,
           debug, as_json) -> None:
    """Hybrid search: dense vectors + BM25, fused with weighted Reciprocal Rank Fusion."""
    from pipelines.database import connect
    from pipelines.search import Filters
    from pipelines.service import EmptyKnowledgeBase, run_search

    if as_of is not None and as_of.tzinfo is None:
        as_of = as_of.replace(tzinfo=timezone.utc)
    settings = load_settings()
    filters = Filters(source_id=source_id, groups=list(groups), as_of=as_of)
    with connect(settings) as conn:
        try:
            data = run_search(conn, settings, query, k, arm=arm, lexical_weight=lexical_weight,
                              k_overfetch=k_overfetch, filters=filters, debug=debug, rerank=not no_rerank,
                              diversity=diversity, freshness=freshness)
        except EmptyKnowledgeBase as exc:
            raise click.ClickException(str(exc)) from exc
    text = "\n\n".join(
        f"{i}. [{c['score']:.4f}] {c['source']}:{c['document']}"
        + (f" > {' > '.join(c['section_path'])}" if c["section_path"] else "")
        + (f"  (dense #{c['dense_rank']}, lexical #{c['lexical_rank']})" if debug else "")
        + f"\n   {c['content'][:300]}" for i, c in enumerate(data["chunks"], 1)) or "no results"
    _emit(data, as_json, text)


@main.command()
@click.argument("document")
@click.option("--json", "as_json", is_flag=True)
def history(document, as_json) -> None:
    """A document's versions (DOCUMENT is `path` or `source:path`): when, content hash, chunks added/closed/kept."""
    from pipelines.database import connect
    from pipelines.history import document_history

    with connect(load_settings()) as conn:
        versions = document_history(conn, document)
    if not versions:
        raise click.ClickException(f"no history for {document!r}")
    text = "\n".join(f"v{v['version']} {v['recorded_at']:%Y-%m-%d %H:%M:%S} {v['event']:<9} {v['content_hash'] or '-'}"
                     f"  +{v['chunks_added']} -{v['chunks_closed']} ={v['chunks_kept']}" for v in versions)
    _emit(versions, as_json, text)


@main.command()
@click.option("--freshness-hours", type=float, help="Override KB_FRESHNESS_HOURS.")
@click.option("--json", "as_json", is_flag=True)
def sweep(freshness_hours, as_json) -> None:
    """Flag documents whose source was not crawled within the freshness window; purge old history if
    KB_RETENTION_DAYS is set."""
    from pipelines.database import connect
    from pipelines.history import purge_history
    from pipelines.staleness import sweep as run_sweep

    settings = load_settings()
    window = timedelta(hours=freshness_hours if freshness_hours is not None else settings.freshness_hours)
    with connect(settings) as conn:
        data = run_sweep(conn, window)
        if settings.retention_days is not None:
            data["retention"] = purge_history(conn, settings.retention_days)
    text = [f"{data['stale_documents']} stale documents (oldest crawl {data['oldest_crawl']})"]
    text += [f"  {s['source_id']}: {s['stale_documents']} stale, last crawled {s['last_crawled_at']}" for s in data["sources"]]
    _emit(data, as_json, "\n".join(text))


@main.command(name="eval")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--split", default="test", show_default=True, help="qrels/<split>.tsv")
@click.option("--database-url", help="Evaluate in this database (default: a kb_eval_<dataset> database of its own).")
@click.option("--lexical-weight", "weights", multiple=True, type=click.FloatRange(0, 1),
              help="Also evaluate hybrid with this fixed lexical weight (repeatable).")
@click.option("--misses", is_flag=True, help="List the queries with no relevant document in the top 10.")
@click.option("--json", "as_json", is_flag=True)
def evaluate(dataset, split, database_url, weights, misses, as_json) -> None:
    """Ingest a BEIR dataset through the real pipeline and report hit@1/5/10, MRR@10, nDCG@10, recall@100."""
    import dataclasses
    import re

    from pipelines.database import connect, database_url as server_url, ensure_database
    from pipelines.embedders import make_embedder
    from pipelines.evaluation import CONFIGURATIONS, METRICS, Configuration, classifier_weights, evaluate as run_eval, load_queries
    from pipelines.extract import register_source, source_for_path
    from pipelines.ingest import ingest as run_ingest

    settings = load_settings()
    name = re.sub(r"[^a-z0-9]+", "_", dataset.resolve().name.lower())
    if database_url is None:
        database_url = ensure_database(server_url(settings), f"kb_eval_{name}")
    settings = dataclasses.replace(settings, database_url=database_url)
    queries, qrels = load_queries(dataset, split)
    source_id = f"beir-{name}"
    embedder = make_embedder(settings)
    from pipelines.rerank import make_reranker

    reranker = make_reranker(settings)
    configs = list(CONFIGURATIONS) + [Configuration(f"hybrid w={w:g}", "hybrid", w) for w in weights]
    if reranker is not None:
        configs.append(Configuration("hybrid+rerank", "hybrid", rerank=True))
    with connect(settings) as conn:
        register_source(conn, source_for_path(dataset / "corpus.jsonl", source_id))
        summary = run_ingest(conn, embedder, settings, [source_id], progress=_progress_factory(not as_json))
        report = run_eval(conn, embedder, queries, qrels, source_id, configs, misses, reranker)
    data = {"dataset": str(dataset), "split": split, "queries": len(queries), "ingest": summary.counters(),
            "classifier": {str(k): v for k, v in sorted(classifier_weights(queries).items())}, "results": report}
    lines = [f"{dataset.name} ({split}, {len(queries)} queries)", f"{'configuration':<16}" + "".join(f"{m:>11}" for m in METRICS)]
    lines += [f"{cfg:<16}" + "".join(f"{r['metrics'][m]:>11.4f}" for m in METRICS) for cfg, r in report.items()]
    for cfg, r in report.items():
        lines += [f"miss [{cfg}] {m['query_id']}: {m['query'][:80]}" for m in r.get("misses", [])]
    _emit(data, as_json, "\n".join(lines))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
def serve(host, port) -> None:
    """Serve the search API (/v1/knowledge/search, OpenAPI docs at /docs) and the search console (/)."""
    import os

    import uvicorn

    from pipelines.api import create_app

    uvicorn.run(create_app(api_key=os.environ.get("KB_API_KEY") or None), host=host, port=port)


@main.command()
@click.argument("answer", type=click.File("r"))
@click.option("--json", "as_json", is_flag=True)
def cite(answer, as_json) -> None:
    """Validate an answer's citations. ANSWER is a JSON file (or - for stdin):
    {"claims": [{"text": ..., "citations": [chunk_id, ...]}], "retrieved": [chunk_id, ...]}."""
    from pipelines.database import connect
    from pipelines.service import EmptyKnowledgeBase, run_citation_check

    payload = json.load(answer)
    settings = load_settings()
    with connect(settings) as conn:
        try:
            data = run_citation_check(conn, settings, payload.get("claims", []), payload.get("retrieved", []))
        except EmptyKnowledgeBase as exc:
            raise click.ClickException(str(exc)) from exc
    text = "\n".join(f"{c['status']:<8} chunk {c['chunk_id']}: {c['reason']} | {c['claim'][:70]}" for c in data["citations"])
    _emit(data, as_json, text)
