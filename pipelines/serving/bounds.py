"""What one API request may ask for and use, so that no caller, with or without a key, can make the server spend
without limit or starve other callers (issue 18).

- Size: a body over BODY_BYTES is a 413 before anything parses it; fields over their limits (MAX_*) are 422s
  with one line naming the field and the limit. The limits sit far above what a real client sends.
- Time: every database statement a request runs is cut at the budget (PostgreSQL statement_timeout, set on
  each connection) and the request is answered 503; CPU work (embedding claims) is bounded by the size limits.
- Failure: a request whose database connection is lost (the server killed or restarted) is a 503 "database
  unavailable, retry", never a 500 with the driver's error; the lane's `recover` runs first (the API brings back
  the embedded server it uses and drops dead pooled connections), so that a retry succeeds.
- Isolation: each endpoint class runs in its own lane (slots, threads and a connection pool of its own), so a
  flood of citation checks fills the citations lane only; search, answers and /health keep theirs. A request
  that cannot get a slot within `wait_s` is a 503 "busy, retry", never a 30 s hang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import psycopg
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from psycopg import sql
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY_BYTES = 1024 * 1024
MAX_QUERY_CHARS = 2_000
MAX_K = 100  # as `kb search --k`
MAX_CLAIMS = 200
MAX_CLAIM_CHARS = 8_000
MAX_CITATIONS_PER_CLAIM = 100
MAX_RETRIEVED = 1_000
MAX_GROUPS = 100
MAX_NAME_CHARS = 200  # a source id or a group name
MAX_FILTERS = 20  # metadata filters (where=column=value) of one search

T = TypeVar("T")
log = logging.getLogger(__name__)
UNAVAILABLE = "database unavailable, retry"


@dataclass(frozen=True)
class Limits:
    """The server's runtime bounds; tests shorten them, `kb serve` uses these defaults."""

    budget_s: float = 10.0  # statement_timeout of every statement a request runs
    wait_s: float = 2.0  # the longest a request waits for a slot in its lane before a 503
    search: int = 6  # slots (= threads = pooled connections) per lane
    answers: int = 2
    citations: int = 2
    health: int = 2


def busy(lane: str, size: int) -> HTTPException:
    return HTTPException(status_code=503, headers={"Retry-After": "1"},
                         detail=f"busy, retry: all {size} {lane} slots are in use")


class Lane:
    """Up to `size` requests of one endpoint class at a time, each on a thread and a connection of the lane's own,
    so the default thread pool and the other lanes' connections are never what a flood of this class waits on."""

    def __init__(self, name: str, size: int, wait_s: float,
                 connection: Callable[[], AbstractContextManager[psycopg.Connection]] | None = None,
                 recover: Callable[[], None] = lambda: None):
        self.name, self.size, self.wait_s, self.connection, self.recover = name, size, wait_s, connection, recover
        self._slots = anyio.Semaphore(size)  # created inside the event loop (the app's lifespan)
        self._threads = anyio.CapacityLimiter(size)

    async def call(self, fn: Callable[[], T]) -> T:
        """fn() on one of the lane's threads once a slot is free; 503 when none frees up within wait_s."""
        try:
            with anyio.fail_after(self.wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise busy(self.name, self.size) from None
        try:
            return await anyio.to_thread.run_sync(fn, limiter=self._threads)
        finally:
            self._slots.release()

    async def run(self, work: Callable[[psycopg.Connection], T]) -> T:
        """work(conn) with one of the lane's pooled connections; a statement over the budget is a 503, and so is a
        lost database (its server killed or restarted: `recover` is called first, so that a retry can succeed)."""
        assert self.connection is not None

        def with_connection() -> T:
            try:
                with self.connection() as conn:
                    return work(conn)
            except psycopg.errors.QueryCanceled:
                raise HTTPException(status_code=503, headers={"Retry-After": "1"},
                                    detail="the request ran past its time budget; retry, or ask for less") from None
            except psycopg.OperationalError as exc:
                # PoolTimeout included: a lane has as many connections as slots, so a request that holds a slot
                # waits for a connection only when none can be made.
                log.warning("%s: lost the database: %s", self.name, " ".join(str(exc).split()))
                self.recover()
                raise HTTPException(status_code=503, headers={"Retry-After": "1"}, detail=UNAVAILABLE) from None

        return await self.call(with_connection)


def set_budget(conn: psycopg.Connection, budget_s: float) -> None:
    """Every statement on this connection is cancelled after budget_s (a pool's `configure` calls it once)."""
    conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(max(1, int(budget_s * 1000)))))


class BodyLimit:
    """Refuses a request body over `limit` bytes with a 413 before the app reads it: at once when Content-Length
    says so, else (a chunked body) as soon as the bytes received pass the limit. Never holds more than `limit`."""

    def __init__(self, app: ASGIApp, limit: int = BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body: at most {self.limit} bytes ({self.limit // 1024 // 1024} MiB)"
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


async def one_line_422(request: Request, exc: Any) -> JSONResponse:
    """A 422 whose detail is one line naming each bad field and what it must be (the first three, then a count),
    however many items a hostile body got wrong."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return JSONResponse({"detail": "; ".join(parts) + more}, status_code=422)
