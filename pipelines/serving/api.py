"""The search API and console: `kb serve` runs this FastAPI app under uvicorn.

GET /v1/knowledge/search?q=&k=&source_id=&mode=&debug=   (OpenAPI docs at /docs)
GET /                                                      a search console for people

Access is decided here, not by the caller: a request's key (`Authorization: Bearer <key>` or `X-API-Key: <key>`,
created with `kb keys create`) carries the groups it may read; `groups=` can only narrow them. A request without a
key reads public sources only (or is refused when the server runs with require_key). A wrong or revoked key, an
Authorization header that is not `Bearer <key>`, or more than one credential in a request, is a 401, never a
fall-back to public.

Every request is bounded in size, time and concurrency (pipelines/serving/bounds.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import ExitStack, asynccontextmanager
from datetime import datetime
from importlib import resources
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import anyio.to_thread
import psycopg
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from pipelines.retrieval.responses import (
    EmptyKnowledgeBase,
    run_citation_check,
    run_search,
    serving_problem,
)
from pipelines.retrieval.readable import readable
from pipelines.retrieval.search import Filters, metadata_filter
from pipelines.serving.access import AccessDenied, ApiKey, authenticate, caller_groups
from pipelines.serving.bounds import (
    MAX_CITATIONS_PER_CLAIM,
    MAX_CLAIM_CHARS,
    MAX_CLAIMS,
    MAX_FILTERS,
    MAX_GROUPS,
    MAX_K,
    MAX_NAME_CHARS,
    MAX_QUERY_CHARS,
    MAX_RETRIEVED,
    UNAVAILABLE,
    BodyLimit,
    Lane,
    Limits,
    one_line_422,
    set_budget,
)
from pipelines.settings import Settings, load_settings

log = logging.getLogger(__name__)
T = TypeVar("T")

CONSOLE = Path(__file__).parent / "console" / "index.html"
KB_VERSION = version("kb")


class Chunk(BaseModel):
    chunk_id: int
    content: str
    source: str
    document: str
    title: str | None
    section_path: list[str]
    score: float
    entities: dict
    kind: str = Field("text", description="text, table, or card (a Q&A card: content is its answer).")
    question: str | None = Field(None, description="A card's question.")
    source_chunk_id: int | None = Field(None, description="A card's source chunk: what citations point at.")
    page: int | None = Field(None, description="The page the chunk starts on (PDFs), for citing it as `file.pdf p. 16`.")
    copies: list[str] = Field([], description="Other places (source:path p. N > section) holding the same text, not"
                                              " listed (duplicates=true lists them as results).")
    dense_rank: int | None = Field(None, description="Rank in the dense arm (debug).")
    dense_score: float | None = Field(None, description="Cosine similarity to the query (debug).")
    lexical_rank: int | None = Field(None, description="Rank in the lexical (BM25) arm (debug).")
    lexical_score: float | None = Field(None, description="BM25 score (debug).")
    dense_rrf: float | None = Field(None, description="The dense arm's share of the fused score (debug).")
    lexical_rrf: float | None = Field(None, description="The lexical arm's share of the fused score (debug).")
    matched_terms: list[str] | None = Field(None, description="Query lexemes the chunk holds (debug).")
    exact: list[str] | None = Field(None, description="Codes of the query the chunk holds (debug).")
    tie_broken: bool | None = Field(None, description="Moved within a near-tie by the arms' own scores (debug).")
    highlights: list[tuple[int, int]] | None = Field(None, description="Character spans of matched words (debug).")


class Explanation(BaseModel):
    kind: str = Field(description="How the classifier read the query: identifier, question or keywords.")
    lexical_weight: float = Field(description="The lexical arm's RRF weight (the dense arm's is 1 minus it).")
    reason: str
    identifiers: list[str]
    identifier_terms: list[str]
    exact_first: bool
    tie_share: float
    rrf_k: int


class SearchResponse(BaseModel):
    query: str
    k: int
    source_id: str | None
    mode: str
    arm: str
    chunks: list[Chunk]
    explain: Explanation | None = None
    note: str | None = Field(None, description="Why an as_of read found nothing, when the date is the reason.")


def _text(value: str | None) -> str | None:
    """Query text a database can hold: a NUL character is a client error (422), not a server error."""
    if value is not None and "\x00" in value:
        raise HTTPException(status_code=422, detail="parameters must not contain NUL characters")
    return value


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class AnswerRequest(BaseModel):
    question: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    k: int = Field(5, ge=1, le=20, description="Contexts given to the answer.")
    mode: Literal["chunks", "qa_first", "qa_only"] = "qa_first"
    source_id: Name | None = None
    groups: list[Name] | None = Field(None, max_length=MAX_GROUPS, description="Read as only these of the key's groups.")
    as_of: datetime | None = None
    hyde: bool = Field(False, description="Search with the embedding of a hypothetical answer (needs a chat model).")
    compress: bool = Field(False, description="Keep only the context sentences that bear on the question.")


class Claim(BaseModel):
    text: str = Field(min_length=1, max_length=MAX_CLAIM_CHARS)
    citations: list[int] = Field(max_length=MAX_CITATIONS_PER_CLAIM)


class CitationRequest(BaseModel):
    claims: list[Claim] = Field(max_length=MAX_CLAIMS)
    retrieved: list[int] = Field(max_length=MAX_RETRIEVED,
                                 description="Chunk ids of the retrieval set the answer was written from.")
    groups: list[Name] | None = Field(None, max_length=MAX_GROUPS, description="Read as only these of the key's groups.")


def create_app(settings: Settings | None = None, require_key: bool = False, limits: Limits | None = None) -> FastAPI:
    settings = settings or load_settings()
    limits = limits or Limits()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from psycopg_pool import ConnectionPool

        from pipelines.storage.database import database_url, revive_embedded

        url = database_url(settings)  # starts (or joins) the embedded server; never installs or migrates
        with ExitStack() as stack:
            pools = {name: stack.enter_context(ConnectionPool(
                url, min_size=0, max_size=getattr(limits, name), name=f"kb-{name}", kwargs={"autocommit": True},
                configure=lambda conn: _configure(conn, limits.budget_s))) for name in ("search", "answers", "citations")}

            def recover() -> None:
                """A request lost its connection: bring back the embedded server if it died, and drop the pooled
                connections that died with it, so that the next request gets a live one."""
                revive_embedded(settings)
                for pool in pools.values():
                    pool.check()

            app.state.lanes = {name: Lane(name, pool.max_size, limits.wait_s,
                                          lambda pool=pool: pool.connection(timeout=limits.wait_s), recover)
                               for name, pool in pools.items()}
            app.state.lanes["health"] = Lane("health", limits.health, limits.wait_s, recover=recover)
            # Pooled connections are opened once the schema serves (they register the vector type, which a database
            # without kb's schema lacks); one search connection is kept open from then on.
            app.state.schema = SchemaGate(settings, lambda: pools["search"].resize(1, limits.search))
            if problem := app.state.schema.check():
                log.warning("not serving yet: %s", problem)
            yield

    app = FastAPI(title="kb search API", version=KB_VERSION, lifespan=lifespan, docs_url=None,
                  description="Hybrid retrieval (pgvector + BM25, weighted RRF) over the kb knowledge base.")
    app.add_middleware(BodyLimit)
    app.add_exception_handler(RequestValidationError, one_line_422)

    @app.middleware("http")
    async def schema_gate(request: Request, call_next):
        """Every request, /health included, is a 503 with one line while the schema cannot serve this code."""
        gate = request.app.state.schema
        if gate.problem is not None and (problem := await anyio.to_thread.run_sync(gate.check)):
            return JSONResponse({"detail": problem}, status_code=503, headers={"Retry-After": "10"})
        return await call_next(request)

    # Swagger UI 5 (it renders OpenAPI 3.1, which FastAPI writes) from the fastapi-swagger package, not a CDN:
    # /docs works with no network.
    app.mount("/static/swagger", StaticFiles(directory=str(resources.files("fastapi_swagger") / "resources")),
              name="swagger")
    bearer, header = HTTPBearer(auto_error=False), APIKeyHeader(name="X-API-Key", auto_error=False)

    def unauthorized(detail: str) -> HTTPException:
        return HTTPException(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})

    async def caller_token(request: Request, _bearer: HTTPAuthorizationCredentials | None = Depends(bearer),
                           _header: str | None = Depends(header)) -> str | None:
        """The key a request carries, read from the raw headers (the security dependencies only document them).
        A request carries at most one credential: with several (two X-API-Key headers, Bearer then Basic, or an
        Authorization beside an X-API-Key, even holding the same key) the first used to win, so a header a proxy
        added could shadow the caller's or the other way round. A header that is present but does not hold a key
        is a 401 too, so a caller that meant to authenticate is never served as anonymous."""
        authorizations, api_keys = request.headers.getlist("authorization"), request.headers.getlist("x-api-key")
        if len(authorizations) + len(api_keys) > 1:
            raise unauthorized(f"one credential per request, got {len(authorizations) + len(api_keys)}: send a"
                               " single 'Authorization: Bearer <key>' or a single 'X-API-Key: <key>' header")
        if authorizations:
            scheme, _, value = authorizations[0].strip().partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise unauthorized("malformed Authorization header: expected 'Bearer <key>'")
            return value.strip()
        if api_keys:
            if not api_keys[0].strip():
                raise unauthorized("empty X-API-Key header")
            return api_keys[0].strip()
        if require_key:
            raise unauthorized("this server requires an API key")
        return None

    def key_for(conn: psycopg.Connection, token: str | None) -> ApiKey | None:
        if token is None:
            return None
        key = authenticate(conn, token)
        if key is None:
            raise unauthorized("invalid or revoked API key")
        return key

    def groups_for(key: ApiKey | None, requested: list[str] | None) -> list[str]:
        try:
            return caller_groups(key, requested)
        except AccessDenied as exc:
            raise HTTPException(status_code=403, detail=str(exc)) from exc

    def readable_or_404(conn: psycopg.Connection, filters: Filters) -> None:
        """A source the request names must be one the caller may read. A typo answered "no chunks" looked like an
        empty source; unknown and unreadable read the same, live and as of a time, so a caller learns nothing about
        sources it may not read."""
        if filters.source_id is not None and filters.source_id not in readable(conn, filters.groups,
                                                                               as_of=filters.as_of).sources:
            raise HTTPException(status_code=404, detail=f"no source {filters.source_id!r} that this caller may read;"
                                                        " GET /v1/sources lists them")

    async def in_lane(request: Request, lane: str, token: str | None,
                      work: Callable[[psycopg.Connection, ApiKey | None], T]) -> T:
        """work(conn, caller's key) in the endpoint class's lane; the key is checked on the lane's connection."""
        def authenticated(conn: psycopg.Connection) -> T:
            try:
                return work(conn, key_for(conn, token))
            except EmptyKnowledgeBase as exc:
                raise HTTPException(status_code=409, detail=str(exc)) from exc

        return await request.app.state.lanes[lane].run(authenticated)

    @app.get("/v1/knowledge/search", response_model=SearchResponse, response_model_exclude_unset=True)
    async def knowledge_search(
        request: Request,
        token: str | None = Depends(caller_token),
        q: str = Query(..., min_length=1, max_length=MAX_QUERY_CHARS, description="The query text."),
        k: int = Query(5, ge=1, le=MAX_K, description="How many chunks to return."),
        source_id: str | None = Query(None, max_length=MAX_NAME_CHARS, description="Only chunks from this source."),
        mode: Literal["chunks", "qa_first", "qa_only"] = Query("chunks"),
        arm: Literal["hybrid", "dense", "lexical"] = Query("hybrid", description="Both arms fused, or one alone."),
        debug: bool = Query(False, description="Explain the ranking: the query's class and weight, each chunk's"
                                               " rank, score and RRF share in each arm, matched terms."),
        lexical_weight: float | None = Query(None, ge=0, le=1, description="RRF weight of the lexical arm"
                                                                         " (default: the query classifier's)."),
        as_of: datetime | None = Query(None, description="Search the knowledge base as it was at this time."),
        exact_first: bool = Query(True, description="Chunks holding a code the query asks about come first."),
        groups: str | None = Query(None, max_length=MAX_QUERY_CHARS,
                                   description="Comma-separated: read as only these of the key's groups."),
        diversity: float = Query(0.0, ge=0, le=1, description="MMR diversity over the candidates (0: off)."),
        freshness: float = Query(0.0, ge=0, le=10, description="Boost for recent documents (0: off)."),
        where: list[str] = Query([], max_length=MAX_FILTERS, description="column=value, repeatable: only documents"
                                 " whose metadata holds it (a table source's metadata columns)."),
        duplicates: bool = Query(False, description="Also list a chunk whose text a better result already shows."),
    ) -> dict:
        _text(q), _text(source_id), _text(groups), [_text(pair) for pair in where]
        requested = None if groups is None else [g.strip() for g in groups.split(",") if g.strip()]
        try:
            metadata = metadata_filter(where)
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None

        def work(conn: psycopg.Connection, key: ApiKey | None) -> dict:
            filters = Filters(source_id=source_id, groups=groups_for(key, requested), as_of=as_of, metadata=metadata,
                              duplicates=duplicates)
            readable_or_404(conn, filters)
            return run_search(conn, settings, q, k, arm=arm, lexical_weight=lexical_weight, filters=filters,
                              debug=debug, mode=mode, diversity=diversity, freshness=freshness, exact_first=exact_first)

        return await in_lane(request, "search", token, work)

    @app.post("/v1/knowledge/answer")
    async def knowledge_answer(request: Request, body: AnswerRequest,
                               token: str | None = Depends(caller_token)) -> dict:
        """An answer whose every sentence cites its sources as [document, section], each citation checked (VALID,
        WEAK; sentences with an INVALID citation are removed and listed), or "not found in the documents" with the
        closest sources."""
        from pipelines.answers.answer import answer_question
        from pipelines.models.chat import ChatNotConfigured

        _text(body.question), _text(body.source_id)

        def work(conn: psycopg.Connection, key: ApiKey | None) -> dict:
            filters = Filters(source_id=body.source_id, groups=groups_for(key, body.groups), as_of=body.as_of)
            readable_or_404(conn, filters)
            try:
                return answer_question(conn, settings, body.question, body.k, mode=body.mode, filters=filters,
                                       hyde=body.hyde, compress=body.compress)
            except ChatNotConfigured as exc:
                raise HTTPException(status_code=422, detail=str(exc)) from exc

        return await in_lane(request, "answers", token, work)

    @app.get("/v1/sources")
    async def readable_sources(request: Request, token: str | None = Depends(caller_token)) -> dict:
        """The sources this caller may read (the console's source filter)."""
        return await in_lane(request, "search", token,
                             lambda conn, key: {"sources": sorted(readable(conn, groups_for(key, None)).sources)})

    @app.post("/v1/citations/validate")
    async def validate(request: Request, body: CitationRequest, token: str | None = Depends(caller_token)) -> dict:
        """Each cited chunk: VALID (supports the claim), WEAK (retrieved, weak support) or INVALID (not retrieved,
        or not a live chunk the caller may read)."""
        claims = [c.model_dump() for c in body.claims]
        return await in_lane(request, "citations", token, lambda conn, key: run_citation_check(
            conn, settings, claims, body.retrieved, groups_for(key, body.groups)))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def console() -> str:
        return CONSOLE.read_text()

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - docs",
                                   swagger_js_url="/static/swagger/swagger-ui-bundle.js",
                                   swagger_css_url="/static/swagger/swagger-ui.css",
                                   swagger_favicon_url="/static/swagger/favicon-32x32.png")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness and readiness: 200 only when the database answers and the active model can serve a query
        (its vectors are there, and queries embed to its dimensions); 503 otherwise, with the reason. It opens its
        own connection in its own lane, so a busy search or citations lane cannot make it report the database
        down, and a stale pooled connection cannot make it report the database up."""
        lane = request.app.state.lanes["health"]
        return await lane.call(lambda: _health(settings, limits.budget_s, lane.recover))

    return app


class SchemaGate:
    """Serving never installs or migrates kb's schema: a migration may rebuild HNSW indexes for minutes, and is
    `kb migrate`'s job. While the schema is missing or behind this code, `problem` says so in one line and every
    request answers 503 with it; each request checks again (one check at a time, on a connection of its own, the
    others answer at once), so the server serves as soon as `kb migrate` has run, with no restart."""

    def __init__(self, settings: Settings, on_ready: Callable[[], None]):
        self.settings, self.on_ready = settings, on_ready
        self.problem: str | None = "the schema has not been checked yet"
        self._checking = threading.Lock()

    def check(self) -> str | None:
        if self.problem is not None and self._checking.acquire(blocking=False):
            from pipelines.storage.database import DatabaseUnavailable, schema_problem

            try:
                self.problem = schema_problem(self.settings)
            except (DatabaseUnavailable, psycopg.OperationalError) as exc:
                log.warning("schema check: %s", " ".join(str(exc).split()))
                self.problem = UNAVAILABLE
            finally:
                self._checking.release()
            if self.problem is None:
                self.on_ready()
        return self.problem


def _health(settings: Settings, budget_s: float, recover: Callable[[], None]) -> JSONResponse:
    from pipelines.storage.database import database_url

    try:
        with psycopg.connect(database_url(settings), autocommit=True, connect_timeout=5) as conn:
            set_budget(conn, min(budget_s, 5))
            model, problem = serving_problem(conn, settings)
    except Exception as exc:  # noqa: BLE001 - unreachable is "not ready"; the detail goes to the log
        log.warning("health: database unavailable: %s", exc)
        if isinstance(exc, psycopg.OperationalError):
            recover()
        return JSONResponse({"status": "unavailable", "database": f"unavailable ({type(exc).__name__})",
                             "version": KB_VERSION}, status_code=503)
    if problem:
        return JSONResponse({"status": "unavailable", "database": "ok", "model": model, "problem": problem,
                             "version": KB_VERSION}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok", "model": model, "version": KB_VERSION})


def _configure(conn: psycopg.Connection, budget_s: float) -> None:
    from pgvector.psycopg import register_vector
    from psycopg.types.json import JsonbDumper

    register_vector(conn)
    conn.adapters.register_dumper(dict, JsonbDumper)
    set_budget(conn, budget_s)
