"""`kb`: ingest, inspect and search the knowledge base from a terminal or a script (`--json`).

Exit status: 0 success; 3 the run finished but some files failed (listed in the summary), or `kb cite --strict`
found an INVALID citation; 4 the golden-set gate stopped a refresh (nothing of it was published); 2 usage or
configuration error (one line saying what to change); 1 any other error.
`--verbose` adds the traceback.
"""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import click

from pipelines.settings import load_settings


def _json_default(value):
    """ISO-8601 for times, numbers for decimals, text for anything else."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    return str(value)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _shown(value) -> str:
    """A value as it may appear in a line of text output: control characters escaped, so that a file name
    holding a newline cannot forge a line (`ERROR ...`) of kb's own output."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                        str(value))


def _snippet(text: str, length: int = 300) -> str:
    """The start of a text on one line, cut at a word."""
    flat = " ".join(text.split())
    return _shown(flat if len(flat) <= length else flat[:length].rsplit(" ", 1)[0] + " ...")


def _emit(data, as_json: bool, text: str) -> None:
    click.echo(json.dumps(data, indent=2, default=_json_default) if as_json else text)


class _Fraction(click.ParamType):
    """A number from 0 to 1 (NaN and infinities refused)."""

    name = "fraction"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not 0 <= number <= 1:  # false for NaN too
            self.fail(f"{value!r} is not a number from 0 to 1", param, ctx)
        return number


FRACTION = _Fraction()
EXIT_INVALID_CITATIONS = 3  # kb cite --strict


def _when(value) -> str:
    """A time as ISO-8601 in text output, "never" when there is none (never Python's None)."""
    return value.isoformat(timespec="seconds") if value is not None else "never"


UNITS = {"extract": "doc", "parse": "doc", "chunk": "doc", "enrich": "chunk", "embed": "chunk", "publish": "doc",
         "cards": "chunk"}


def _progress_factory(enabled: bool):
    """Each stage as a bar with total, rate and ETA on a terminal; a line when it starts and one when it ends
    otherwise (logs, CI)."""
    from pipelines.ingest.report import NO_PROGRESS, Progress

    class Bar(Progress):
        def __init__(self, stage: str):
            from tqdm import tqdm

            self.bar = tqdm(desc=f"{stage:<8}", unit=UNITS.get(stage, "it"), dynamic_ncols=True)  # kept when done

        def total(self, count: int) -> None:
            self.bar.total = (self.bar.total or 0) + count
            self.bar.refresh()

        def advance(self, count: int = 1) -> None:
            self.bar.update(count)

        def done(self, report) -> None:
            """A finished bar stays on screen; a stage with nothing to do says so in words, not as `0doc [?doc/s]`."""
            if not self.bar.total:
                self.bar.leave = False
                self.bar.close()
                self.bar.write(f"{self.bar.desc}: nothing to do", file=sys.stderr)
            else:
                self.bar.close()

    class Lines(Progress):
        """A log line per event, each with its time (a log read later must say when a stage started and ended)."""

        def __init__(self, stage: str):
            self.stage, self.count, self.announced = stage, 0, False

        def say(self, text: str) -> None:
            from datetime import datetime

            click.echo(f"{datetime.now().astimezone():%H:%M:%S} {self.stage}: {text}", err=True)

        def total(self, count: int) -> None:
            self.say(f"{count} {'more ' if self.announced else ''}to do")
            self.announced = True

        def advance(self, count: int = 1) -> None:
            self.count += count

        def done(self, report) -> None:
            self.say(f"done, {self.count} in {report.elapsed_s:.2f} s")

    def factory(stage: str) -> Progress:
        if not enabled:
            return NO_PROGRESS
        return Bar(stage) if sys.stderr.isatty() else Lines(stage)
    return factory


def _usage_problem(exc: Exception) -> str | None:
    """The one line to show when an error is the user's to fix (exit 2), else None."""
    from pipelines.evaluation.evaluate import DatasetError
    from pipelines.models.chat import ChatNotConfigured
    from pipelines.settings import ConfigError
    from pipelines.sources.declarations import DeclarationError
    from pipelines.storage.database import DatabaseUnavailable
    from pipelines.storage.migrations import MigrationLockBusy

    if isinstance(exc, (DeclarationError, ConfigError, DatabaseUnavailable, ChatNotConfigured, DatasetError,
                        MigrationLockBusy)):
        return str(exc)
    if type(exc).__module__.startswith("openai"):
        return _endpoint_problem(exc)
    return None


def _endpoint_problem(exc: Exception) -> str | None:
    """An OpenAI-compatible endpoint's refusal that the user fixes in the settings: a key it does not take, a model
    it does not serve. (Outages are retried by the client; what is left of them is an ordinary error.)"""
    import openai

    from pipelines.models.chat import endpoint

    where = endpoint(load_settings())
    if isinstance(exc, openai.AuthenticationError):
        return f"{where} refused the key (401): check OPENAI_API_KEY"
    if isinstance(exc, openai.NotFoundError):
        return f"{where} answered 404 ({exc.message}): check the model name (KB_CHAT_MODEL, KB_OPENAI_MODEL)"
    if isinstance(exc, openai.APIConnectionError):
        return f"lost the connection to {where} ({exc}); check that the server is running and OPENAI_BASE_URL"
    return None


class UserError(click.ClickException):
    """A mistake in the configuration, the input or a name that the user must fix: one line, exit 2. (click's
    UsageError, kept for a wrong command line, also prints the command's usage, which would bury this line.)"""

    exit_code = 2


class _Commands(click.Group):
    def invoke(self, ctx: click.Context):
        """Errors as one clear line: a usage or configuration problem exits 2 and says what to change, a database
        that goes away mid-command is named as the cause, anything else exits 1; --verbose adds the traceback."""
        import traceback

        import psycopg

        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            if ctx.params.get("verbose"):
                traceback.print_exception(exc)
            if problem := _usage_problem(exc):
                raise UserError(problem) from exc
            if isinstance(exc, psycopg.OperationalError):
                from pipelines.storage.database import describe_lost_connection

                raise click.ClickException(describe_lost_connection(exc, load_settings())) from exc
            hint = "" if ctx.params.get("verbose") else " (--verbose shows the traceback)"
            raise click.ClickException(f"{type(exc).__name__}: {exc}{hint}") from exc


# --as-of: a date, or a date and time to the minute or second, with or without a zone (none: UTC).
AS_OF = click.DateTime(["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M%z", "%Y-%m-%dT%H:%M", "%Y-%m-%d"])

@click.group(cls=_Commands)
@click.version_option(package_name="kb", message="%(prog)s %(version)s")
@click.option("--verbose", is_flag=True, help="Show the traceback of an error.")
def main(verbose: bool) -> None:
    """kb: documents in, a retrieval-ready knowledge base out (PostgreSQL + pgvector).

    \b
    Start:  kb ingest FOLDER            (or kb source apply kb.toml, then kb ingest)
            kb search "words" --group G  (without --group: public sources only)
            kb serve                     (API and console on http://127.0.0.1:8000)
    A mistake is one `Error:` line and exit 2; --verbose shows the traceback."""


def dask_option(help_text: str):
    """--dask ADDRESS, also read from KB_DASK_SCHEDULER: one deployment's cluster for every command that uses one."""
    return click.option("--dask", metavar="ADDRESS", envvar="KB_DASK_SCHEDULER", help=help_text)


@main.command()
@click.argument("paths", nargs=-1)
@click.option("--source", "source_name",
              help="Source name: with a PATH, the name to declare it under (default: the folder or file name);"
                   " alone, the declared source to ingest.")
@click.option("--include", multiple=True, help="Glob of files to take from a new folder source (repeatable).")
@click.option("--exclude", multiple=True, help="Glob of files to skip in a new folder source (repeatable).")
@click.option("--group", "groups", multiple=True,
              help="Only callers in this group may read a new source's documents (repeatable).")
@click.option("--public", is_flag=True, help="Every caller may read a new source's documents (say it: a new source"
                                             " needs --group or --public).")
@click.option("--allow-deletions", is_flag=True,
              help="Confirm that documents really are gone: soft-delete them even beyond the source's"
                   " max_deletion_share (a crawl that would delete more deletes none without this).")
@click.option("--accept-new-root", is_flag=True,
              help="Confirm that a source's folder really is a new one (moved or remounted): kb refuses to crawl a"
                   " root that is not the folder it crawled before.")
@click.option("--retry-failed", is_flag=True,
              help="Parse again the files whose unchanged bytes failed before (otherwise reported, not retried).")
@dask_option("Parse the documents on this dask scheduler's workers (tcp://host:8786), which need no access to"
             " the files: this process reads them and holds the lock; default: KB_PARSE_WORKERS local processes.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary.")
def ingest(paths, source_name, include, exclude, groups, public, allow_deletions, accept_new_root, retry_failed,
           dask, as_json) -> None:
    """Ingest declared sources: all of them, the one named by --source, or the folders and JSONL files given.

    A PATH that is not a declared source yet is declared from this command (with its --include, --exclude, and
    --group or --public: a new source says who may read it). A declared source is ingested exactly as declared:
    giving it another location, globs or groups here is refused; change a declaration with `kb source update` or
    in its config file. A name that the kb.toml at hand declares is that source, never a folder of that name."""
    from pipelines.ingest.golden import GateFailed
    from pipelines.ingest.run import (
        EXIT_FILE_FAILURES,
        EXIT_GATE_FAILED,
        Confirmations,
        IngestRun,
    )
    from pipelines.ingest.workers import Workers, WorkersUnavailable
    from pipelines.models.embedders import make_embedder
    from pipelines.sources.declarations import (
        actor,
        get_source,
        load_sources,
        source_for_ingest,
    )
    from pipelines.storage.database import connect

    if source_name and len(paths) > 1:
        raise click.UsageError("--source names one source: give one path with it")
    if not paths and (include or exclude or groups or public):
        raise click.UsageError("--include, --exclude, --group and --public declare a new source: give its PATH, or"
                               " change a declared source with `kb source update`")
    if groups and public:
        raise click.UsageError("--public and --group contradict each other")
    settings = load_settings()
    with connect(settings) as conn:
        if paths:
            who = actor("kb ingest")
            source_ids = []
            for path in paths:
                if (named := _name_in_config(conn, settings, path)) is not None:
                    source_ids.append(named)
                    continue
                declared, new = source_for_ingest(conn, path, source_name, include, exclude, groups or None, who,
                                                  public)
                if new:
                    click.echo(f"declared source {_source_line(declared)}", err=True)
                source_ids.append(declared.source_id)
        elif source_name:
            if get_source(conn, source_name) is None:
                raise UserError(f"no source {source_name!r} is declared; see `kb source list`")
            source_ids = [source_name]
        else:
            source_ids = [s.source_id for s in load_sources(conn)]
            if not source_ids:
                config = settings.config_path
                raise click.UsageError("no source is declared: " + (
                    f"{config} is not applied yet: run `kb source apply`" if config else
                    "`kb ingest PATH`, `kb source add` or `kb source apply`"))
        embedder = make_embedder(settings)
        try:
            confirmed = Confirmations(allow_deletions, accept_new_root, retry_failed)
            with IngestRun.open(conn, settings, embedder, source_ids, progress=_progress_factory(not as_json),
                                confirmed=confirmed, workers=Workers(settings.parse_workers, dask)) as run:
                for warning in run.warnings:
                    click.echo(f"note: {warning}", err=True)
                summary = run.run_all()
        except WorkersUnavailable as unavailable:
            raise UserError(str(unavailable)) from None
        except GateFailed as failed:
            _emit({"error": str(failed), "gate": failed.gate}, as_json, f"not published: {failed}")
            sys.exit(EXIT_GATE_FAILED)
    data = summary.as_dict()
    _emit(data, as_json, "\n".join(_ingest_lines(data, settings.unsupported_files)))
    if data["errors"]:
        sys.exit(EXIT_FILE_FAILURES)


def _name_in_config(conn, settings, path: str) -> str | None:
    """A PATH argument that names a source of the kb.toml at hand is that source: ingest it as declared, or, when the
    file's declaration is not applied, refuse (taking a folder of that name for a new public source would bypass
    what the file says about who may read it)."""
    from pipelines.sources.declarations import DeclarationError, get_source, read_config

    if settings.config_path is None or "/" in path:
        return None
    try:
        names = {s.source_id for s in read_config(settings.config_path)}
    except DeclarationError:
        return None  # a file that does not read declares nothing here; `kb source apply` says what is wrong with it
    if path not in names:
        return None
    if get_source(conn, path) is None:
        raise UserError(f"{path!r} is a source declared in {settings.config_path}, which is not applied: run"
                        f" `kb source apply` first, then `kb ingest --source {path}`")
    return path


def _ingest_lines(data: dict, unsupported: str) -> list[str]:
    """The run's counters as sentences a person reads: documents, then what each source's crawl listed, read and knew
    unchanged without reading it, what was skipped, chunks, time, then each failed file. Chunks say what happened to
    them (added, updated in place, closed), not a sum of writes."""
    from pipelines.storage.status import crawl_line

    d = data
    lines = [f"documents: {d['documents_seen']} seen ({d['documents_new']} new, {d['documents_changed']} changed,"
             f" {d['documents_unchanged']} unchanged), {d['documents_published']} published,"
             f" {d['documents_deleted']} deleted, {d['documents_failed']} failed",
             f"chunks: {d['chunks_inserted']} added, {d['chunks_updated']} updated, {d['chunks_closed']} closed;"
             f" {d['embeddings_computed']} embedded, {d['embeddings_reused']} reused; {_count(d['cards_written'], 'Q&A card')}",
             f"time: {sum(d['elapsed_s'].values()):.1f} s (" + ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds
                                                                    in d["elapsed_s"].items()) + ")"]
    lines[1:1] = [f"  {source_id}: {crawl_line(crawl)}" for source_id, crawl in d["sources"].items()]
    if d["skipped"]:
        shown = [f"{s['source']}:{_shown(s['file'])}" for s in d["skipped"][:10]]
        lines.insert(1, f"skipped {_count(len(d['skipped']), 'file')} of types kb does not read: {', '.join(shown)}"
                        + (f" and {len(d['skipped']) - 10} more (--json lists them)" if len(d["skipped"]) > 10 else "")
                        + ("" if unsupported == "fail" else "; exclude them, or KB_UNSUPPORTED_FILES=fail to fail them"))
    return lines + [f"ERROR {e['source']}:{_shown(e['file'])}: {_shown(e['reason'])}" for e in d["errors"]]


@main.command()
@click.option("--json", "as_json", is_flag=True)
def status(as_json) -> None:
    """Where the knowledge base is, its sources with document and chunk counts, failures and the last run."""
    from pipelines.storage.database import connect
    from pipelines.answers.calibration import MIN_CHUNKS
    from pipelines.storage.status import crawl_line, knowledge_base_status

    settings = load_settings()
    with connect(settings) as conn:
        data = {"home": {"path": str(settings.home), "found": settings.home_origin,
                         "database": "DATABASE_URL" if settings.database_url else "embedded"},
                **knowledge_base_status(conn)}
    text = [f"knowledge base: {settings.home} ({settings.home_origin}; database:"
            f" {'DATABASE_URL' if settings.database_url else 'embedded in it'})"]
    text += [f"{s['source_id']} ({s['kind']} {s['location']}; readable by {_readers(s['allowed_groups'])}):"
            f" {_count(s['documents'], 'document')}, {_count(s['chunks'], 'chunk')}, {s['deleted']} deleted, {s['failed']} failing,"
            f" {s['stale']} stale, last crawled {_when(s['last_crawled_at'])}"
            + (f"\n  last crawl: {crawl_line(s['last_crawl'])}" if s["last_crawl"] else "") for s in data["sources"]]
    text += [f"failing: {f['source_id']}:{_shown(f['locator'])}: {_shown(f['reason'])}" for f in data["failures"]]
    text.append(f"models: {', '.join(m['model_key'] + ' (' + m['state'] + ')' for m in data['models']) or 'none'}")
    text += [f"answer calibration ({c['model_key']}, {c['scope']} sources): answers at confidence {c['answer_at']}"
             + (f" or a closest context's similarity above {ceiling:.4f}"
                if (ceiling := c["report"].get("left_out_ceiling")) is not None else "") +
             f", fitted {_when(c['fitted_at'])} on {c['chunks']} chunks (Q&A cards aside); of its probes it answers"
             f" {c['report']['answered']['answerable']:.0%} answerable and refuses"
             f" {c['report']['refused']['left_out']:.0%} left out"
             for c in data["answer_calibrations"]] or ["answer calibration: none (the default weights serve; a"
                                                       f" refresh fits one once a scope has {MIN_CHUNKS} chunks)"]
    if run := data["last_run"]:
        text.append(f"last run: #{run['run_id']} started by {run['started_by']} at {_when(run['started_at'])},"
                    f" {'finished ' + _when(run['finished_at']) if run['finished_at'] else 'not finished'}")
    _emit(data, as_json, "\n".join(text))


def _readers(groups) -> str:
    return "groups " + ", ".join(groups) if groups else "everyone"


@main.command()
@click.argument("query")
@click.option("--k", default=5, show_default=True, type=click.IntRange(1, 100))
@click.option("--source-id", help="Only this source.")
@click.option("--arm", type=click.Choice(["hybrid", "dense", "lexical"]), default="hybrid", show_default=True)
@click.option("--mode", type=click.Choice(["chunks", "qa_first", "qa_only"]), default="chunks", show_default=True,
              help="Chunks, Q&A cards, or both with the cards that make the top k first.")
@click.option("--lexical-weight", type=FRACTION, help="RRF weight of the lexical arm (default: by query type).")
@click.option("--k-overfetch", default=20, show_default=True, type=click.IntRange(1, 1000))
@click.option("--group", "groups", multiple=True,
              help="Read as a member of this group (repeatable); without it, public sources only.")
@click.option("--as-of", "as_of", type=AS_OF,
              help="Answer from the knowledge base as it was at this time (UTC unless an offset is given).")
@click.option("--where", "where", multiple=True, metavar="COLUMN=VALUE",
              help="Only documents whose metadata holds this (a table source's metadata columns); repeatable.")
@click.option("--duplicates", is_flag=True,
              help="Also show a chunk whose text a better result already shows (else listed as its copy).")
@click.option("--diversity", default=0.0, type=FRACTION, help="MMR diversity over the candidates (0: off).")
@click.option("--freshness", default=0.0, type=click.FloatRange(0, None), help="Boost for recent documents (0: off).")
@click.option("--no-rerank", is_flag=True, help="Skip the configured reranker (KB_RERANK).")
@click.option("--no-exact-first", is_flag=True,
              help="Do not put chunks that hold a code the query asks about ahead of the others.")
@click.option("--debug", is_flag=True, help="Explain the ranking: the query's class, weight and why; each result's rank,"
                                            " score and RRF share in each arm, and the query terms it holds.")
@click.option("--json", "as_json", is_flag=True)
def search(query, k, source_id, arm, mode, lexical_weight, k_overfetch, groups, as_of, where, duplicates, diversity,
           freshness, no_rerank, no_exact_first, debug, as_json) -> None:
    """Hybrid search: dense vectors + BM25, fused with weighted Reciprocal Rank Fusion."""
    from pipelines.retrieval.responses import (
        NEAR_TIE_LEGEND,
        NEAR_TIE_MARK,
        EmptyKnowledgeBase,
        run_search,
        shown_scores,
    )
    from pipelines.retrieval.search import Filters, cited, metadata_filter
    from pipelines.storage.database import connect

    settings = load_settings()
    try:
        filters = Filters(source_id=source_id, groups=list(groups), as_of=as_of, metadata=metadata_filter(where),
                          duplicates=duplicates)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--where") from None
    with connect(settings) as conn:
        if note := _check_readers(conn, source_id, groups, as_of):
            click.echo(note, err=True)
        try:
            data = run_search(conn, settings, query, k, arm=arm, mode=mode, lexical_weight=lexical_weight,
                              k_overfetch=k_overfetch, filters=filters, debug=debug, rerank=not no_rerank,
                              diversity=diversity, freshness=freshness, exact_first=not no_exact_first)
        except EmptyKnowledgeBase as exc:
            raise UserError(str(exc)) from exc
    scores = shown_scores([c["score"] for c in data["chunks"]])
    text = "\n\n".join(
        f"{i}. [{scores[i - 1]}] {cited(c['source'] + ':' + _shown(c['document']), c['page'])}"
        + (f" > {_shown(' > '.join(c['section_path']))}" if c["section_path"] else "")
        + (f"\n   Q: {_snippet(c['question'])}" if c["kind"] == "card" else "")
        + (f"\n   also in: {_shown(', '.join(c['copies']))}" if c["copies"] else "")
        + (f"\n   {_shown(_explained(c))}" if debug else "")
        + f"\n   {_snippet(c['content'])}" for i, c in enumerate(data["chunks"], 1)) or (
        f"no results: {data['note']}" if data.get("note") else "no results")
    if any(NEAR_TIE_MARK in score for score in scores):
        text += f"\n\n{NEAR_TIE_LEGEND}"
    if debug:
        e = data["explain"]
        text = f"{e['kind']} query, lexical weight {e['lexical_weight']:g}: {e['reason']}\n\n{text}"
    _emit(data, as_json, text)


def _explained(chunk: dict) -> str:
    def arm(name: str, score_format: str) -> str:
        if chunk[f"{name}_rank"] is None:
            return f"{name}: not in its top"
        return (f"{name} #{chunk[f'{name}_rank']} ({format(chunk[f'{name}_score'], score_format)},"
                f" RRF +{chunk[f'{name}_rrf']:.4f})")
    parts = [arm("dense", ".3f"), arm("lexical", ".2f"), "terms " + (", ".join(chunk["matched_terms"]) or "-")]
    if chunk["exact"]:
        parts.append("holds " + ", ".join(chunk["exact"]))
    if chunk["tie_broken"]:
        parts.append("near-tie ordered by the arms' scores")
    return "; ".join(parts)


def _page_ranges(pages: list[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10": the pages a version changed."""
    runs: list[list[int]] = []
    for page in pages:
        if runs and page == runs[-1][-1] + 1:
            runs[-1].append(page)
        else:
            runs.append([page])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


@main.command()
@click.argument("document")
@click.option("--json", "as_json", is_flag=True)
def history(document, as_json) -> None:
    """A document's versions (DOCUMENT is `path` or `source:path`): when, content hash, chunks added/closed/kept, and
    the pages they are on."""
    from pipelines.storage.database import connect
    from pipelines.storage.history import document_history

    with connect(load_settings()) as conn:
        versions = document_history(conn, document)
    if not versions:
        raise UserError(f"no document {document!r} in any source: give it as `kb search` shows it, SOURCE:PATH"
                        " (such as handbook:leave-policy.md); `kb status` lists the sources")
    text = "\n".join(f"v{v['version']} {_when(v['recorded_at'])} {v['event']:<9} {v['content_hash'] or '-'}"
                     f"  +{v['chunks_added']} -{v['chunks_closed']} ={v['chunks_kept']}"
                     + (f"  p. {_page_ranges(v['pages'])}" if v["pages"] else "") for v in versions)
    _emit(versions, as_json, text)


@main.command()
@click.option("--freshness-hours", type=float, help="Override KB_FRESHNESS_HOURS.")
@click.option("--json", "as_json", is_flag=True)
def sweep(freshness_hours, as_json) -> None:
    """Flag documents whose source was not crawled within the freshness window; purge old history if
    KB_RETENTION_DAYS is set."""
    from pipelines.sources.staleness import sweep as run_sweep
    from pipelines.storage.database import connect
    from pipelines.storage.history import purge_history

    settings = load_settings()
    window = timedelta(hours=freshness_hours if freshness_hours is not None else settings.freshness_hours)
    with connect(settings) as conn:
        data = run_sweep(conn, window)
        if settings.retention_days is not None:
            data["retention"] = purge_history(conn, settings.retention_days)
    text = [f"{_count(data['stale_documents'], 'stale document')}" + (f" (oldest crawl {_when(data['oldest_crawl'])})"
                                                            if data["oldest_crawl"] else "")]
    text += [f"  {s['source_id']}: {s['stale_documents']} stale, last crawled {_when(s['last_crawled_at'])}"
             for s in data["sources"]]
    _emit(data, as_json, "\n".join(text))


@main.command(name="eval")
@click.argument("datasets", nargs=-1, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--split", help="qrels/<split>.tsv (default: test, or the dataset's only split)")
@click.option("--database-url", help="Evaluate in this database (default: a kb_eval_<dataset> database of its own).")
@click.option("--lexical-weight", "weights", multiple=True, type=FRACTION,
              help="Also evaluate hybrid with this fixed lexical weight (repeatable).")
@click.option("--misses", is_flag=True, help="List the queries with no relevant document in the top 10.")
@click.option("--per-query", "per_query_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write every query's metrics here (JSON), for a later --compare.")
@click.option("--compare", "compare_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A --per-query file of an earlier run: paired per-query differences (mean, standard error).")
@click.option("--answers", "answer_set", type=click.Path(exists=True, path_type=Path),
              help="Also score the answer layer: a question file over the current knowledge base (e.g."
                   " samples/answers.jsonl), or a dataset folder (corpus.jsonl + questions.jsonl) ingested into a"
                   " database of its own; format in docs/retrieval.md.")
@click.option("--group", "groups", multiple=True, help="With --answers: read as a member of this group.")
@click.option("--hyde", is_flag=True, help="With --answers: HyDE retrieval (needs KB_CHAT_MODEL).")
@click.option("--compress", is_flag=True, help="With --answers: contextual compression.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write an HTML report with plots to this folder (index.html).")
@click.option("--json", "as_json", is_flag=True)
def evaluate(datasets, split, database_url, weights, misses, per_query_path, compare_path, answer_set, groups, hyde,
             compress, report_dir, as_json) -> None:
    """Ingest BEIR datasets through the real pipeline and report hit@1/5/10, MRR@10, nDCG@10, recall@100 per
    arm, per query kind where the queries carry one (identifier sets), and against an earlier run; with
    --answers, score grounded answers on the current knowledge base."""
    from pipelines.evaluation.evaluate import (
        METRICS,
        evaluate_dataset,
        latency_summary,
        paired_comparison,
    )
    from pipelines.retrieval.rerank import make_reranker

    if not datasets and not answer_set:
        raise click.UsageError("give a BEIR dataset folder, or --answers FILE")
    from pipelines.evaluation.evaluate import check_dataset, load_answer_set

    for dataset in datasets:  # every input checked before the first dataset is ingested
        check_dataset(dataset, split)
    if answer_set:
        load_answer_set(answer_set / "questions.jsonl" if answer_set.is_dir() else answer_set)
    settings = load_settings()
    reranker = make_reranker(settings)
    report = {dataset.name: evaluate_dataset(settings, dataset, split, database_url, weights, misses, reranker,
                                             _progress_factory(not as_json)) for dataset in datasets}
    if per_query_path:
        per_query_path.write_text(json.dumps({name: {cfg: r["per_query"] for cfg, r in data["results"].items()}
                                              for name, data in report.items()}, indent=1))
    if compare_path:
        earlier = json.loads(compare_path.read_text())
        for name, data in report.items():
            for cfg, result in data["results"].items():
                if cfg in earlier.get(name, {}):
                    result["earlier"] = earlier[name][cfg]
                    result["compared"] = {metric: paired_comparison(earlier[name][cfg], result["per_query"], metric)
                                          for metric in ("ndcg@10", "hit@5")}
    lines = []
    for name, data in report.items():
        lines += [f"{name} ({data['split']}, {data['queries']} queries)",
                  f"{'configuration':<22}" + "".join(f"{m:>11}" for m in METRICS)]
        lines += [f"{cfg:<22}" + "".join(f"{r['metrics'][m]:>11.4f}" for m in METRICS) for cfg, r in data["results"].items()]
        for cfg, result in data["results"].items():
            lines += [f"  {cfg} {group:<18}" + "".join(f"{values[m]:>11.4f}" for m in METRICS) + f"  ({values['queries']})"
                      for group, values in result.get("groups", {}).items()]
            for metric, c in result.get("compared", {}).items():
                lines.append(f"  {cfg}: {metric} {c['before']:.4f} -> {c['after']:.4f}, per query {c['mean_delta']:+.4f}"
                             f" +/- {c['standard_error']:.4f} (wins {c['wins']}, losses {c['losses']}, ties {c['ties']})")
            lines += [f"  miss [{cfg}] {m['query_id']}: {_snippet(m['query'], 80)}" for m in result.get("misses", [])]
        lines.append("")
    if answer_set:
        answers = report["answers"] = _evaluate_answer_set(settings, answer_set, list(groups), database_url, hyde,
                                                           compress, _progress_factory(not as_json))
        lines += _answer_lines(answers)
    if report_dir:
        from pipelines.evaluation.html_report import write_report

        lines.append(f"report: {write_report(report, report_dir)}")
    for name, data in report.items():  # the JSON keeps summaries, not every query
        for result in data.get("results", {}).values():
            for key in ("per_query", "earlier"):
                result.pop(key, None)
            result["latency_ms"] = latency_summary(result.pop("latency_ms", []))
    _emit(report, as_json, "\n".join(lines).rstrip())


def _evaluate_answer_set(settings, path: Path, groups: list[str], database_url: str | None, hyde: bool,
                         compress: bool, progress) -> dict:
    """A question file over the current knowledge base, or a dataset folder in a database of its own."""
    from pipelines.evaluation.evaluate import (
        evaluate_answer_dataset,
        evaluate_answers,
        load_answer_set,
    )
    from pipelines.storage.database import connect

    if path.is_dir():
        return evaluate_answer_dataset(settings, path, groups, database_url, hyde, compress, progress)
    cases = load_answer_set(path)
    with connect(settings) as conn:
        return evaluate_answers(conn, settings, cases, groups, hyde=hyde, compress=compress)


def _answer_lines(answers: dict) -> list[str]:
    """`kb eval --answers` in text: the summary, then every question that went wrong."""
    groups = ", ".join(f"{n} {g}" for g, n in answers["groups"].items() if n)
    a, r = answers["answers"], answers["refusals"]
    lines = [f"answers ({answers['questions']} questions: {groups})"]
    lines += [f"  retrieval, mode {mode}: " + ", ".join(f"{m} {v:.4f}" for m, v in values.items())
              for mode, values in answers["retrieval"].items()]
    lines.append(f"  answerable: answered {a['answered']}, holding the expected answer {a['answer_recall']},"
                 f" citing a gold passage {a['citation_recall']}, short answer right {a['short_answer_recall']},"
                 f" citations VALID {a['citation_validity']}")
    lines.append("  refusals: " + ", ".join(f"{name} {value}" for name, value in r.items()))
    lines.append("  latency per answer: median {median:.0f} ms, p95 {p95:.0f} ms".format(**answers["latency_ms"]))
    lines += [f"  {row['verdict']}: {_snippet(row['question'], 70)} -> {_snippet(row['answer'], 90)}"
              for row in answers["per_question"] if row["verdict"] not in ("right", "refused, right")]
    return lines


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--require-key", is_flag=True, help="Refuse requests without an API key (default: they read public"
                                                  " sources only).")
def serve(host, port, require_key) -> None:
    """Serve the search API (/v1/knowledge/search, OpenAPI docs at /docs) and the search console (/).

    Callers authenticate with keys from `kb keys create`; each key reads the groups it was created with."""
    import os
    import signal

    import uvicorn

    from pipelines.serving.api import create_app

    if os.environ.get("KB_API_KEY"):
        raise UserError("KB_API_KEY is no longer read: create per-caller keys bound to groups with"
                               " `kb keys create NAME --group G`, then unset KB_API_KEY")
    _check_port_free(host, port, "another `kb serve`?")
    settings = load_settings()
    if settings.chat_model:  # answers need it: say what is missing now, not at the first question
        from pipelines.models.chat import check_endpoint

        check_endpoint(settings)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it to the handler it found: make that handler an
    # ordinary exit, so that exit handlers run and the embedded PostgreSQL this server started is stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(create_app(require_key=require_key), host=host, port=port)
    except SystemExit as stop:
        if stop.code == 3:  # uvicorn's "startup failed", which is not kb's exit 3 ("files failed")
            raise click.ClickException("the server did not start (see uvicorn's lines above)") from None
        raise


def _check_port_free(host: str, port: int, holder: str) -> None:
    """A port in use is one line and exit 2 before a server starts (uvicorn would log, then exit 3, kb's code for
    failed files; `dagster dev` would start its daemon and keep it running without a UI). `holder` guesses who holds
    it. Bound as uvicorn binds it (SO_REUSEADDR), so a port in TIME_WAIT is not mistaken for a busy one."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UserError(f"--host {host}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc} ({holder}); stop it, or choose"
                            " another with --port") from None


@main.command(name="migrate")
@click.option("--wait", "wait_s", default=60.0, show_default=True, type=click.FloatRange(0, None),
              help="Seconds to wait for the migration lock while another process holds it.")
@click.option("--json", "as_json", is_flag=True)
def migrate_command(wait_s, as_json) -> None:
    """Install or upgrade kb's schema: run it after upgrading kb (until then serving answers 503 and other commands
    say to run it). Says what is pending and about how long it will take before it starts, then applies each migration
    in its own transaction (the last one with the function files) and prints each file's time. Nothing pending: says so."""
    import psycopg

    from pipelines.storage.database import location, upgrade_schema
    from pipelines.storage.migrations import RATES, duration, estimate

    settings = load_settings()
    plan, applied = [], []

    def say(line: str) -> None:
        click.echo(line, err=as_json)  # with --json, progress goes to stderr and stdout is the JSON alone

    def before(conn, files) -> None:
        plan.extend({"name": item.name, **estimate(conn, item).as_dict()} for item in files)
        say(f"{_count(len(plan), 'file')} pending in {location(settings)}: "
            + "; ".join(f"{step['name']} ({step['work']})" for step in plan))
        say(f"estimate: {duration(sum(step['estimate_s'] for step in plan))} ({RATES}); serving answers 503 until"
            " it is done")

    def done(item, seconds: float) -> None:
        applied.append({"name": item.name, "elapsed_s": round(seconds, 3)})
        say(f"applied {item.name} in {seconds:.2f} s")

    try:
        upgrade_schema(settings, wait_s=wait_s, before=before, applied=done)
    except psycopg.Error as exc:
        if isinstance(exc, psycopg.OperationalError) or len(applied) == len(plan):
            raise
        first = plan[len(applied)]["name"]  # the first file of the transaction that failed
        failed = getattr(exc, "failed_file", first)
        along = "" if failed == first else f" (it commits with {first} and the files between, not applied either)"
        raise click.ClickException(f"{failed} failed: {' '.join(str(exc).split())}. The files before it are applied"
                                   f" and kept, nothing of it is{along}; fix the cause, then run `kb migrate` again") from exc
    data = {"database": location(settings), "pending": plan, "applied": applied,
            "elapsed_s": round(sum(step["elapsed_s"] for step in applied), 3)}
    _emit(data, as_json, f"kb's schema in {location(settings)} is up to date: "
          + (f"applied {_count(len(applied), 'file')} in {data['elapsed_s']:.2f} s" if applied else "nothing to migrate"))


@main.command()
@click.option("--force", is_flag=True, help="Stop it even while other kb processes use it (they lose their"
                                            " connections; a running `kb serve` answers 503 from then on).")
def stop(force) -> None:
    """Stop the embedded PostgreSQL of this KB_HOME. It runs for as long as some kb process uses it and stops with
    the last one, but a process killed without running its exit handlers (SIGKILL, or SIGTERM to most commands)
    leaves it running. Refuses, naming them, while other kb processes use it; does nothing when it is not running."""
    from pipelines.storage.database import ServerInUse, stop_embedded

    try:
        click.echo(stop_embedded(load_settings().home, force))
    except ServerInUse as in_use:
        raise UserError(str(in_use)) from None


@main.command()
@click.argument("answer", type=click.File("r"))
@click.option("--group", "groups", multiple=True, help="Read as a caller in this group (repeatable).")
@click.option("--strict", is_flag=True, help="Exit 3 when any citation is INVALID.")
@click.option("--json", "as_json", is_flag=True)
def cite(answer, groups, strict, as_json) -> None:
    """Validate an answer's citations. ANSWER is a JSON file (or - for stdin): `kb ask --json` output, or
    {"claims": [{"text": ..., "citations": [chunk_id, ...]}], "retrieved": [chunk_id, ...]}."""
    from pipelines.retrieval.responses import EmptyKnowledgeBase, run_citation_check
    from pipelines.storage.database import connect

    try:
        claims, retrieved = _claims_to_check(json.load(answer))
    except (ValueError, AttributeError, KeyError, TypeError) as exc:
        raise UserError(f"{answer.name}: not an answer to check: {exc}") from None
    settings = load_settings()
    with connect(settings) as conn:
        _check_readers(conn, None, groups)
        try:
            data = run_citation_check(conn, settings, claims, retrieved, list(groups))
        except EmptyKnowledgeBase as exc:
            raise UserError(str(exc)) from exc
    text = "\n".join(f"{c['status']:<8} chunk {c['chunk_id']}: {c['reason']} | {_snippet(c['claim'], 70)}"
                     for c in data["citations"]) or "no citations to check: the answer makes no claim"
    _emit(data, as_json, text)
    if strict and data["summary"]["INVALID"]:
        sys.exit(EXIT_INVALID_CITATIONS)


def _claims_to_check(payload) -> tuple[list[dict], list[int]]:
    """(claims, retrieved chunk ids) of an answer: kb's own (`kb ask --json`: sentences citing chunks, the contexts
    it was given) or the documented {"claims", "retrieved"}. Anything else is refused: a file that is not an answer
    must not pass as one that cites nothing (`--strict` would exit 0)."""
    def chunk_id(item) -> int:
        value = item["chunk_id"] if isinstance(item, dict) else item
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{value!r} is not a chunk id")
        return value

    if not isinstance(payload, dict):
        raise ValueError("expected a JSON object")
    if "claims" in payload:
        claims, retrieved = payload["claims"], payload.get("retrieved", [])
    elif "sentences" in payload and "contexts" in payload:  # kb ask --json
        claims = [{"text": s["text"], "citations": [chunk_id(c) for c in s["citations"]]} for s in payload["sentences"]]
        retrieved = [chunk_id(c) for c in payload["contexts"]]
    else:
        raise ValueError('it has neither "claims" nor "sentences" and "contexts" (`kb ask --json` output)')
    if not isinstance(claims, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                               and isinstance(c.get("citations", []), list) for c in claims):
        raise ValueError('"claims" must be a list of {"text": ..., "citations": [chunk id, ...]}')
    if not isinstance(retrieved, list) or not all(isinstance(i, int) for i in retrieved):
        raise ValueError('"retrieved" must be a list of chunk ids')
    return [{**c, "citations": [chunk_id(i) for i in c.get("citations", [])]} for c in claims], retrieved


def _check_readers(conn, source_id: str | None, groups, as_of=None) -> str | None:
    """What the caller named must exist and be readable, or the command says so (exit 2) instead of answering "no
    results": a --source-id nobody declared, a source the --group cannot read, a group no source names. Returns a
    note naming the sources this caller does not read (an operator's CLI reads as its --group, public otherwise)."""
    from pipelines.sources.declarations import load_sources

    declared = load_sources(conn)
    in_use = sorted({g for s in declared for g in s.groups or ()})
    unknown = [g for g in groups if g not in in_use]
    if unknown:
        raise UserError(f"no declared source is readable by group {', '.join(map(repr, unknown))}"
                        f" ({'groups in use: ' + ', '.join(in_use) if in_use else 'every source is public'});"
                        " see `kb source list`")
    hidden = [s for s in declared if s.groups and not set(s.groups) & set(groups)]
    if source_id is not None:
        named = next((s for s in declared if s.source_id == source_id), None)
        if named is None and as_of is None:
            raise UserError(f"no source {source_id!r} is declared; see `kb source list`")
        if named in hidden:
            raise UserError(f"source {source_id!r} is readable by groups {', '.join(named.groups)} only: add"
                            f" --group {named.groups[0]}")
        return None
    if not hidden:
        return None
    return (f"note: reading as {'groups ' + ', '.join(groups) if groups else 'a public caller'}, so"
            f" {_count(len(hidden), 'source')} {'is' if len(hidden) == 1 else 'are'} left out: "
            + "; ".join(f"{s.source_id} (groups {', '.join(s.groups)})" for s in hidden)
            + f". Add --group {hidden[0].groups[0]} (or another of their groups) to read as its member")


def _count(n: int, noun: str) -> str:
    """`1 document`, `2 documents`: a count in words a person would write."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


@main.command()
@click.argument("question")
@click.option("--k", default=5, show_default=True, type=click.IntRange(1, 20), help="Contexts given to the answer.")
@click.option("--mode", type=click.Choice(["chunks", "qa_first", "qa_only"]), default="qa_first", show_default=True)
@click.option("--source-id", help="Only this source.")
@click.option("--group", "groups", multiple=True,
              help="Read as a member of this group (repeatable); without it, public sources only.")
@click.option("--as-of", "as_of", type=AS_OF,
              help="Answer from the knowledge base as it was at this time.")
@click.option("--hyde", is_flag=True, help="Search with the embedding of a hypothetical answer (needs KB_CHAT_MODEL).")
@click.option("--compress", is_flag=True, help="Keep only the context sentences that bear on the question.")
@click.option("--no-rerank", is_flag=True, help="Skip the configured reranker (KB_RERANK).")
@click.option("--json", "as_json", is_flag=True)
def ask(question, k, mode, source_id, groups, as_of, hyde, compress, no_rerank, as_json) -> None:
    """Answer from the documents, every sentence citing its sources (checked), or say it is not there."""
    from pipelines.answers.answer import answer_question
    from pipelines.retrieval.responses import EmptyKnowledgeBase
    from pipelines.retrieval.search import Filters
    from pipelines.storage.database import connect

    settings = load_settings()
    with connect(settings) as conn:
        if note := _check_readers(conn, source_id, groups, as_of):
            click.echo(note, err=True)
        try:
            data = answer_question(conn, settings, question, k, mode=mode, rerank=not no_rerank, hyde=hyde,
                                   compress=compress, filters=Filters(source_id=source_id, groups=list(groups), as_of=as_of))
        except EmptyKnowledgeBase as exc:
            raise UserError(str(exc)) from exc
    lines = [_shown(data["answer"])]
    if data["abstained"]:
        lines.append(f"({data['reason']})")
        lines += ["closest sources:"] + [f"  {_shown(s['document'])}" + (f" > {_shown(s['section'])}" if s["section"]
                                                                          else "") for s in data["closest_sources"]]
    for sentence in data["sentences"]:
        lines += [f"  {c['status']} chunk {c['chunk_id']} ({c['reason']})" for c in sentence["citations"]]
    lines += [f"  removed: {_shown(r['text'])} ({r['why']})" for r in data["removed"]]
    _emit(data, as_json, "\n".join(lines))


@main.group()
def source() -> None:
    """Declare sources: where documents come from, which files to take, who may read them, how fresh to keep them.

    Declarations live in PostgreSQL; every change is recorded with who made it. Keep them in git with a kb.toml
    and `kb source apply`, or manage them here."""


def _sync_dagster(conn) -> None:
    """Keep the Dagster instance's source partitions in step at once (its sensor does the same every minute)."""
    from pipelines.sources.declarations import load_sources

    try:
        from assets.instance import open_instance
        from assets.partitions import sync_source_partitions

        with open_instance(load_settings()) as instance:
            sync_source_partitions(instance, [s.source_id for s in load_sources(conn)])
    except Exception as exc:  # noqa: BLE001 - the declaration is made; the sensor will catch up
        click.echo(f"warning: could not update Dagster's source partitions now: {exc}", err=True)


def _source_dict(s) -> dict:
    return {"source_id": s.source_id, **s.declaration()}


def _source_line(s) -> str:
    extras = [f"include {', '.join(s.include)}" if s.include else "", f"exclude {', '.join(s.exclude)}" if s.exclude else "",
              f"freshness {s.freshness_hours:g} h" if s.freshness_hours else "",
              f"refresh '{s.refresh_cron}'" if s.refresh_cron else "",
              "follows links outside" if s.allow_outside_links else "",
              f"may delete {s.max_deletion_share:.0%} per crawl" if s.max_deletion_share != 0.5 else "",
              f"golden set {s.golden_set}" if s.golden_set else "",
              f"declared in {s.declared_in}" if s.declared_in else ""]
    return (f"{s.source_id}: {s.kind} {_shown(s.path)}; readable by {_readers(s.groups)}"
            + "".join(f"; {e}" for e in extras if e))


@source.command("add")
@click.argument("name")
@click.argument("path")
@click.option("--include", multiple=True, help="Glob of files to take (repeatable; default: all).")
@click.option("--exclude", multiple=True, help="Glob of files to skip (repeatable).")
@click.option("--group", "groups", multiple=True,
              help="Only callers in this group may read the documents (repeatable).")
@click.option("--public", is_flag=True, help="Every caller may read the documents (say it: no group means nothing).")
@click.option("--freshness-hours", type=float, help="Flag documents stale after this long without a crawl.")
@click.option("--refresh-cron", help="When Dagster refreshes the source (cron; default KB_REFRESH_CRON).")
@click.option("--allow-outside-links", is_flag=True, help="Follow symlinks that lead outside the folder.")
@click.option("--max-deletion-share", type=float, default=0.5, show_default=True,
              help="A crawl that would soft-delete more of the source's documents deletes none unless confirmed.")
@click.option("--golden-set", type=click.Path(exists=True, dir_okay=False),
              help="JSONL of {query, document} its refreshes must keep finding (default: no gate).")
@click.option("--table", "table_name", help="A database source's table (schema.table); or --query.")
@click.option("--query", help="A database source's rows: a SELECT (run read-only, as a subquery).")
@click.option("--id-column", help="The column naming each row's document.")
@click.option("--text-column", multiple=True, help="A column of the document's text (repeatable: paragraphs).")
@click.option("--title-column", help="The column of the document's title.")
@click.option("--version-column", help="A column that changes whenever the row does (updated_at): only changed rows"
                                       " are fetched.")
@click.option("--metadata-column", multiple=True, help="A column kept with the document, for filters (repeatable).")
@click.option("--upstream", help="The Dagster asset that produces the source (marts/faq): refresh when it materializes.")
@click.option("--private-network", is_flag=True, help="A web source's host is on the company's network (it may resolve"
                                                    " to private addresses).")
@click.option("--json", "as_json", is_flag=True)
def source_add(name, path, include, exclude, groups, public, freshness_hours, refresh_cron, allow_outside_links,
               max_deletion_share, golden_set, table_name, query, id_column, text_column, title_column, version_column,
               metadata_column, upstream, private_network, as_json):
    """Declare source NAME at PATH, readable by --group G ... or --public. PATH is a folder, a .jsonl file of records,
    a bucket (s3://bucket/prefix, gs://, az://), or a database (postgresql://USER@HOST/DB, with --table or --query,
    --id-column and --text-column; the password from PGPASSWORD or ~/.pgpass)."""
    if bool(groups) == public:
        raise click.UsageError("say who may read the source: --group G (repeatable), or --public for every caller")
    from pipelines.sources.declarations import actor, add_source, declare
    from pipelines.storage.database import connect

    with connect(load_settings()) as conn:
        table = {key: value for key, value in (("name", table_name), ("query", query), ("id", id_column),
                                               ("text", list(text_column)), ("title", title_column),
                                               ("version", version_column), ("metadata", list(metadata_column)))
                 if value} or None
        declared = declare(name, path, include, exclude, groups or None, freshness_hours, refresh_cron,
                           allow_outside_links, max_deletion_share, golden_set=golden_set, table=table,
                           upstream=upstream, private_network=private_network)
        written = add_source(conn, declared, actor("kb source add"))
        _sync_dagster(conn)
    _emit({**_source_dict(declared), "changed": written}, as_json,
          ("declared " if written else "already declared: ") + _source_line(declared))


@source.command("list")
@click.option("--json", "as_json", is_flag=True)
def source_list(as_json):
    """Every declared source and who may read it."""
    from pipelines.sources.declarations import load_sources
    from pipelines.storage.database import connect

    with connect(load_settings()) as conn:
        declared = load_sources(conn)
    _emit([_source_dict(s) for s in declared], as_json, "\n".join(map(_source_line, declared)) or "no sources declared")


@source.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def source_show(name, as_json):
    """A source's declaration and its recent changes (who, when, what)."""
    from pipelines.sources.declarations import get_source, source_changes
    from pipelines.storage.database import connect

    with connect(load_settings()) as conn:
        declared = get_source(conn, name)
        changes = source_changes(conn, name)
    if declared is None and not changes:
        raise UserError(f"no source {name!r} is declared; see `kb source list`")
    data = {"source": _source_dict(declared) if declared else None, "changes": changes}
    lines = [_source_line(declared) if declared else f"{name}: removed"]
    lines += [f"  {_when(c['changed_at'])} {c['action']} by {c['actor']} (database user {c['db_user']})"
              + (f": {_changed_fields(c['before'], c['after'])}" if c["before"] and c["after"] else "")
              for c in changes]
    _emit(data, as_json, "\n".join(lines))


def _changed_fields(before: dict, after: dict) -> str:
    from pipelines.sources.declarations import shown

    return "; ".join(f"{k} {shown(k, before.get(k))} -> {shown(k, after.get(k))}" for k in after
                     if before.get(k) != after.get(k))


@source.command("update")
@click.argument("name")
@click.option("--location", help="Move the source to this folder, .jsonl file or bucket URL.")
@click.option("--include", multiple=True, help="Replace the include globs (repeatable).")
@click.option("--exclude", multiple=True, help="Replace the exclude globs (repeatable).")
@click.option("--clear-globs", is_flag=True, help="Take every file again (no include or exclude globs).")
@click.option("--group", "groups", multiple=True, help="Replace the groups that may read the source (repeatable).")
@click.option("--public", is_flag=True, help="Let every caller read the source (no groups).")
@click.option("--freshness-hours", type=float)
@click.option("--refresh-cron")
@click.option("--allow-outside-links/--no-allow-outside-links", default=None)
@click.option("--max-deletion-share", type=float)
@click.option("--golden-set", type=click.Path(exists=True, dir_okay=False),
              help="The JSONL of {query, document} its refreshes must keep finding.")
@click.option("--json", "as_json", is_flag=True)
def source_update(name, location, include, exclude, clear_globs, groups, public, freshness_hours, refresh_cron,
                  allow_outside_links, max_deletion_share, golden_set, as_json):
    """Change a declared source. Only the options given change; the change is recorded."""
    from pipelines.sources.declarations import actor, update_source
    from pipelines.storage.database import connect

    if public and groups:
        raise click.UsageError("--public and --group contradict each other")
    changes = {"location": location, "freshness_hours": freshness_hours, "refresh_cron": refresh_cron,
               "allow_outside_links": allow_outside_links, "max_deletion_share": max_deletion_share,
               "golden_set": golden_set}
    changes = {k: v for k, v in changes.items() if v is not None}
    if clear_globs:
        changes["include"], changes["exclude"] = (), ()
    if include:
        changes["include"] = include
    if exclude:
        changes["exclude"] = exclude
    if groups or public:
        changes["groups"] = groups or None
    if not changes:
        raise click.UsageError("nothing to change: give at least one option (see --help)")
    with connect(load_settings()) as conn:
        updated = update_source(conn, name, actor("kb source update"), **changes)
    _emit(_source_dict(updated), as_json, "updated " + _source_line(updated))


@source.command("remove")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def source_remove(name, as_json):
    """Stop serving a source: its documents are soft-deleted; its history stays under NAME~N, readable as of a past
    time by the groups that could read it. The name is free: declaring it again makes a new source."""
    from pipelines.sources.declarations import actor, remove_source
    from pipelines.storage.database import connect

    with connect(load_settings()) as conn:
        deleted = remove_source(conn, name, actor("kb source remove"))
        _sync_dagster(conn)
    _emit({"source_id": name, "documents_deleted": deleted}, as_json,
          f"removed {name}: {_count(deleted, 'document')} soft-deleted")


@source.command("apply")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--prune", is_flag=True, help="Also remove sources this file declared before and no longer does.")
@click.option("--json", "as_json", is_flag=True)
def source_apply(config, prune, as_json):
    """Make the declared sources match a config file (default: $KB_CONFIG, else ./kb.toml), and say when Dagster
    will refresh each one."""
    from pipelines.sources.declarations import actor, apply_config, load_sources
    from pipelines.storage.database import connect

    settings = load_settings()
    config = config or settings.config_path
    if config is None:
        raise UserError("no config file: give one, set KB_CONFIG, or create ./kb.toml")
    with connect(settings) as conn:
        result = apply_config(conn, config, actor(f"kb source apply {config}"), prune)
        _sync_dagster(conn)
        declared = [s for s in load_sources(conn) if s.source_id in {*result["added"], *result["updated"],
                                                                       *result["unchanged"]}]
    result["refreshes"] = {s.source_id: _refresh_plan(s, settings) for s in declared}
    lines = [f"{what}: {', '.join(names)}" for what, names in result.items() if names and what != "refreshes"]
    if result["not_in_file"]:
        lines.append("(sources no longer in the file stay declared; --prune removes them)")
    lines += [f"{name}: refreshed by Dagster at '{plan['cron']}', next {plan['next']}"
              for name, plan in result["refreshes"].items()]
    if declared:
        lines.append("(the scheduled_refresh sensor runs them whenever `dagster dev` or the Dagster daemon runs)")
    _emit(result, as_json, "\n".join(lines) or "nothing declared")


def _refresh_plan(source, settings) -> dict:
    """When Dagster refreshes a source: its cron (or KB_REFRESH_CRON) and the next time it fires."""
    from datetime import datetime, timezone

    from croniter import croniter

    cron = source.refresh_cron or settings.refresh_cron
    upcoming = croniter(cron, datetime.now(timezone.utc)).get_next(datetime)
    return {"cron": cron, "next": upcoming.isoformat(timespec="minutes")}


@main.group(name="dagster")
def dagster_group() -> None:
    """Run kb's Dagster jobs and UI on an instance kept in PostgreSQL (its own database beside kb's, kb_dagster on the embedded server)."""


def _declare_cluster(dask: str | None) -> None:
    """`--dask` on the operator's own command line declares the deployment's scheduler for this process, as
    KB_DASK_SCHEDULER would: the only one a run may use (assets/executors.py)."""
    import os

    if dask:
        os.environ["KB_DASK_SCHEDULER"] = dask


DASK = dask_option("Run on this dask scheduler's workers (tcp://host:8786; default: this machine).")


@dagster_group.command("ingest")
@click.argument("sources", nargs=-1)
@DASK
@click.option("--json", "as_json", is_flag=True)
def dagster_ingest(sources, dask, as_json) -> None:
    """Run the Dagster `kb_ingest` job for these declared sources (default: all), one run per source, quietly; print
    each run's counters. The runs are on the configured Dagster instance: the UI lists them, and the partitions
    and asset catalog show what they materialized."""
    from assets.namespace import DEFAULT
    from assets.partitions import sync_source_partitions
    from assets.runs import execute
    from pipelines.sources.declarations import load_sources

    results = {}
    with _dagster_instance() as (conn, instance):
        declared = [s.source_id for s in load_sources(conn)]
        unknown = sorted(set(sources) - set(declared))
        if unknown:
            raise UserError(f"not declared: {', '.join(unknown)}; see `kb source list`")
        sync_source_partitions(instance, declared)
        _declare_cluster(dask)
        for source_id in sources or declared:
            outcome = execute(DEFAULT.name("ingest"), instance, partition=source_id)
            row = conn.execute("SELECT counters FROM ingest_runs WHERE external_run_id = %s",
                                (outcome.run_id,)).fetchone()
            results[source_id] = {"run_id": outcome.run_id, "success": outcome.success, "failure": outcome.failure,
                                  "counters": row[0] if row else {}}
    lines = []
    for source_id, result in results.items():
        c = result["counters"]
        lines.append(f"{source_id}: run {(result['run_id'] or 'refused')[:8]} " + ("succeeded" if result["success"] else "FAILED")
                     + (f": {_count(c.get('documents_seen', 0), 'document')} seen, {c.get('documents_new', 0)} new,"
                        f" {c.get('documents_changed', 0)} changed, {c.get('documents_deleted', 0)} deleted,"
                        f" {c.get('documents_skipped', 0)} skipped, {c.get('documents_failed', 0)} failed;"
                        f" chunks {c.get('chunks_inserted', 0)} added, {c.get('chunks_updated', 0)} updated,"
                        f" {c.get('chunks_closed', 0)} closed; {c.get('embeddings_computed', 0)} embedded;"
                        f" {_count(c.get('cards_written', 0), 'Q&A card')}" if c else "")
                     + (f"\n  {result['failure']}" if result["failure"] else ""))
    _emit(results, as_json, "\n".join(lines))
    if not all(r["success"] for r in results.values()):
        sys.exit(1)


@dagster_group.command("reembed")
@DASK
@click.option("--json", "as_json", is_flag=True)
def dagster_reembed(dask, as_json) -> None:
    """Run the Dagster `kb_reembed` job: the configured model's vectors for every live chunk in 16 hash shards (in
    this process; with --dask, `kb_reembed_on_dask` over the cluster's workers), then switch search to it."""
    from assets.namespace import DEFAULT
    from assets.runs import execute

    _declare_cluster(dask)
    with _dagster_instance() as (_, instance):
        outcome = execute(DEFAULT.name("reembed_on_dask" if dask else "reembed"), instance)
    summary = next((output for step, output in outcome.outputs.items()
                    if step.endswith(DEFAULT.name("backfill_summary"))), {})
    data = {"run_id": outcome.run_id, "success": outcome.success, "failure": outcome.failure, **summary}
    text = (f"reembed: run {(outcome.run_id or 'refused')[:8]} " + ("succeeded" if outcome.success else "FAILED")
            + (f": {summary['shards_done']} shards in {len(summary['workers'])} worker process"
               f"{'es' if len(summary['workers']) != 1 else ''}, {summary['computed']} vectors computed;"
               f" search uses {summary['model']}" if summary else "")
            + (f"\n  {outcome.failure}" if outcome.failure else ""))
    _emit(data, as_json, text)
    if not outcome.success:
        sys.exit(1)


@contextmanager
def _dagster_instance():
    """kb's database (holding the embedded server while the runs last) and its Dagster instance."""
    from assets.instance import open_instance
    from pipelines.storage.database import connect

    settings = load_settings()
    with connect(settings) as conn, open_instance(settings) as instance:
        yield conn, instance


@dagster_group.command("dev")
@click.option("--host", default="127.0.0.1", show_default=True, help="Where the UI listens.")
@click.option("--port", default=3000, show_default=True, type=click.IntRange(1, 65535))
def dagster_dev(host, port) -> None:
    """The Dagster UI and daemon (`dagster dev -w workspace.yaml`) on kb's instance, with DAGSTER_HOME in
    KB_HOME/dagster so that run logs outlive it.

    It serves the kb checkout it is started in: the nearest folder, from the current directory up, that holds
    workspace.yaml and assets/definitions.py; elsewhere, the installed kb. A port in use is one line and exit 2;
    stopping kb (Ctrl-C, SIGTERM) stops the UI, the daemon and their code servers with it."""
    _check_port_free(host, port, "another `kb dagster dev` or Dagster UI?")
    sys.exit(_run_own_session(*_dev_process(host, port, Path.cwd())))


def _checkout(start: Path) -> Path:
    """The kb checkout a command started in `start` works on: the nearest folder from `start` up holding kb's
    workspace.yaml and code location (a clone being changed serves its own code), else the installed kb's."""
    from pipelines.settings import REPO_ROOT

    start = start.resolve()
    return next((folder for folder in (start, *start.parents)
                 if all((folder / marker).is_file() for marker in ("workspace.yaml", "assets/definitions.py",
                                                                   "pipelines/cli.py"))),
                REPO_ROOT)


def _dev_process(host: str, port: int, start: Path) -> tuple[list[str], Path, dict[str, str]]:
    """(argv, working directory, environment) of `dagster dev` for the checkout `start` is in. The checkout's code
    comes first on PYTHONPATH, for every process Dagster starts. It runs in DAGSTER_HOME: in a folder holding another
    dagster.yaml (a checkout's), Dagster warns at every start that that file will not be used. KB_HOME is the
    knowledge base kb found from `start` (a `.kb` above it), which Dagster's processes, run elsewhere, would miss."""
    import os

    from assets.instance import dagster_home

    settings = load_settings()
    code, home = _checkout(start), dagster_home(settings)
    command = [str(Path(sys.executable).parent / "dagster"), "dev", "-w", str(code / "workspace.yaml"),
               "--host", host, "--port", str(port)]
    path = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    return command, home, {**os.environ, "DAGSTER_HOME": str(home), "KB_HOME": str(settings.home), "PYTHONPATH": path}


STOP_WAIT_S = 90  # `dagster dev` gives its webserver and daemon 60 s each to stop


def _run_own_session(command: list[str], cwd: Path, env: dict[str, str]) -> int:
    """Runs `command` in a session of its own and returns its exit status. Ctrl-C or SIGTERM is passed on to the
    session as Ctrl-C in a terminal would be, and Dagster's own shutdown is awaited; then whatever of the session
    still runs (a webserver or daemon its parent left behind) is killed, so no process outlives kb."""
    import os
    import signal
    import subprocess
    from contextlib import suppress

    # SIGTERM stops it as Ctrl-C does; and Ctrl-C does even when kb was started with SIGINT ignored (a shell's
    # background job, a CI runner), which Python would otherwise keep ignoring.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.default_int_handler)
    process = subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True)
    try:
        process.wait()
    except KeyboardInterrupt:
        with suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=STOP_WAIT_S)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


@main.group()
def keys() -> None:
    """API keys: each is bound to the groups it may read. The server stores only a hash of each key."""


@keys.command("create")
@click.argument("name")
@click.option("--group", "groups", multiple=True, help="A group the key may read (repeatable; none: public only).")
@click.option("--json", "as_json", is_flag=True)
def keys_create(name, groups, as_json):
    """Create a key; it is printed once and cannot be shown again."""
    from pipelines.serving.access import create_key
    from pipelines.sources.declarations import actor
    from pipelines.storage.database import connect

    with connect(load_settings()) as conn:
        key, token = create_key(conn, name, groups, actor("kb keys create"))
    _emit({"name": key.name, "key_id": key.key_id, "groups": list(key.groups), "key": token}, as_json,
          f"{token}\nkey {key.name!r} ({key.key_id}) reads {_readers(key.groups)}; store it now, it is not shown again")


@keys.command("list")
@click.option("--all", "include_revoked", is_flag=True, help="Include revoked keys.")
@click.option("--json", "as_json", is_flag=True)
def keys_list(include_revoked, as_json):
    """Keys (never their secrets), their groups and who created them."""
    from pipelines.serving.access import list_keys
    from pipelines.storage.database import connect

    with connect(load_settings()) as conn:
        found = list_keys(conn, include_revoked)
    data = [{"name": k.name, "key_id": k.key_id, "groups": list(k.groups), "created_at": k.created_at,
             "created_by": k.created_by, "revoked_at": k.revoked_at} for k in found]
    _emit(data, as_json, "\n".join(
        f"{k.name} ({k.key_id}): {_readers(k.groups)}; created {_when(k.created_at)} by {k.created_by}"
        + (f"; revoked {_when(k.revoked_at)}" if k.revoked_at else "") for k in found) or "no keys")


@keys.command("revoke")
@click.argument("name_or_id")
@click.option("--json", "as_json", is_flag=True)
def keys_revoke(name_or_id, as_json):
    """Revoke a key at once: requests with it get 401."""
    from pipelines.serving.access import revoke_key
    from pipelines.storage.database import connect

    with connect(load_settings()) as conn:
        revoked = revoke_key(conn, name_or_id)
    if not revoked:
        raise UserError(f"no live key named {name_or_id!r}; see `kb keys list`")
    _emit({"revoked": [k.key_id for k in revoked]}, as_json, "revoked " + ", ".join(f"{k.name} ({k.key_id})" for k in revoked))
