"""Database-table sources: the rows of a PostgreSQL table or query (tickets, an FAQ table, CMS rows), each row one
document, read as a JSONL record is (`_id`, `title`, `text`, metadata columns as filters).

A crawl reads every row's id and version (its `updated_at` or version column) and fetches the title, text and
metadata of the rows whose version differs from the one stored, so an unchanged table costs one scan of two columns,
and a row whose clock went backwards is still seen. Ids missing from the key set are deletions, under the source's
deletion guard. Without a version column every row is fetched and compared by content.

The connection's password comes from libpq's own places (PGPASSWORD, ~/.pgpass, a service file), never from the
declaration: a URL that holds one is refused. kb reads in a READ ONLY transaction; a declared query is the
operator's SQL, run as a subquery.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from datetime import date, datetime
from decimal import Decimal
from typing import Iterator
from urllib.parse import unquote, urlsplit

from pipelines.ingest.hashing import hash_text

SCHEMES = ("postgresql", "postgres")
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
RESERVED = ("_id", "title", "text")  # a record's own fields: no metadata column may take their names
FETCH_BATCH = 500


class TableError(OSError):
    """A table kb cannot reach or read; the message says which and why."""


@dataclass(frozen=True)
class TableSpec:
    """Which rows are the documents and which columns say what."""

    id: str  # the column whose value names each row's document (its locator)
    text: tuple[str, ...]  # columns joined, as paragraphs, into the document's text
    name: str | None = None  # schema.table (or table); or:
    query: str | None = None  # a SELECT whose rows are the documents
    title: str | None = None
    version: str | None = None  # changes whenever a row does (updated_at, a version number): what a refresh compares
    metadata: tuple[str, ...] = ()  # columns kept with each document, for filters

    @classmethod
    def declared(cls, table: dict) -> "TableSpec":
        """A spec from a declaration's `table` (kb.toml's [sources.NAME.table], or stored), or ValueError."""
        if not isinstance(table, dict):
            raise ValueError("table is a table of keys: name or query, id, text, and optionally title, version,"
                             " metadata")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(table) - known):
            raise ValueError(f"table has unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if ("name" in table) == ("query" in table):
            raise ValueError("table needs name = \"schema.table\" or query = \"SELECT ...\" (one of them)")
        text = table.get("text")
        text = (text,) if isinstance(text, str) else tuple(text or ())
        spec = cls(table.get("id"), text, table.get("name"), table.get("query"), table.get("title"),
                   table.get("version"), tuple(table.get("metadata") or ()))
        columns = [spec.id, *spec.text, spec.title, spec.version, *spec.metadata]
        if not spec.id or not spec.text:
            raise ValueError("table needs id = \"COLUMN\" (names each row's document) and text = [\"COLUMN\", ...]")
        if bad := [c for c in columns if c is not None and not (isinstance(c, str) and IDENTIFIER.match(c))]:
            raise ValueError(f"table: {bad[0]!r} is not a column name (letters, digits, _; at most 63)")
        if spec.name is not None and not all(IDENTIFIER.match(part) for part in str(spec.name).split(".", 1)):
            raise ValueError(f"table name {spec.name!r}: give it as table or schema.table")
        if spec.query is not None and not str(spec.query).strip():
            raise ValueError("table query is empty")
        if clash := sorted(set(spec.metadata) & set(RESERVED)):
            raise ValueError(f"table metadata column {clash[0]!r} would overwrite the record's own {clash[0]}; alias it"
                             " in a query")
        return spec

    def stored(self) -> dict:
        return {f.name: list(v) if isinstance(v, tuple) else v for f in fields(self)
                if (v := getattr(self, f.name)) not in (None, ())}


def is_database(location: str) -> bool:
    return str(location).split("://", 1)[0].lower() in SCHEMES and "://" in str(location)


def normalise(url: str) -> str:
    """The declared form of a connection URL, or ValueError: no password (libpq finds it), a database named."""
    import psycopg

    parts = urlsplit(url)
    try:
        given = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"postgresql://{parts.hostname or ''}/...: not a connection URL libpq reads ({exc})") from None
    if parts.password is not None or {"password", "sslpassword"} & set(given):  # also pass%77ord=: libpq decodes it
        raise ValueError(f"postgresql://{parts.hostname or ''}/...: the password comes from PGPASSWORD, ~/.pgpass or a"
                         " service file, never from the declaration; remove it from the URL")
    if not parts.path.strip("/"):
        raise ValueError(f"{url}: name the database (postgresql://USER@HOST:PORT/DATABASE)")
    return url


def place_path(url: str, spec: TableSpec) -> str:
    """What the source is, for the overlap rules: server, database and table (a query: its text's hash), whoever
    connects. Two sources on one table are one source declared twice."""
    parts = urlsplit(url)
    server = parts.netloc.rsplit("@", 1)[-1].lower()
    database = unquote(parts.path.strip("/"))
    what = spec.name if spec.name and "." in spec.name else f"public.{spec.name}" if spec.name else \
        f"query-{hash_text(spec.query)[:16]}"
    return f"postgresql://{server}/{database}/{what}"


def _relation(spec: TableSpec):
    from psycopg import sql

    if spec.name is not None:
        return sql.Identifier(*spec.name.split(".", 1))
    # % is literal in the declared query (LIKE 'o%'); a new line ends a trailing -- comment.
    return sql.SQL("({}\n) AS kb_rows").format(sql.SQL(spec.query.replace("%", "%%")))


def _plain(value):
    """A metadata value as JSON holds it."""
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return json.loads(json.dumps(value, default=str))


class Rows:
    """One read of a table source, in one READ ONLY transaction: a consistent snapshot of its rows."""

    def __init__(self, url: str, spec: TableSpec, shown: str) -> None:
        import psycopg

        self.spec, self.shown = spec, shown
        try:
            self.conn = psycopg.connect(url, connect_timeout=30, application_name="kb extract")
            self.conn.read_only = True
            self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        except psycopg.Error as exc:
            raise TableError(f"cannot read {shown}: {_first_line(exc)}") from exc

    def __enter__(self) -> "Rows":
        return self

    def __exit__(self, *exc) -> None:
        self.conn.close()

    def keys(self) -> list[tuple[str | None, str | None]]:
        """(id, version) of every row, as text; version None when the spec names no version column."""
        from psycopg import sql

        version = sql.Identifier(self.spec.version) if self.spec.version else sql.NULL
        query = sql.SQL("SELECT {}::text, {}::text FROM {}").format(sql.Identifier(self.spec.id), version,
                                                                     _relation(self.spec))
        return self._all(query)

    def records(self, ids: list[str]) -> Iterator[tuple[str, dict]]:
        """(id, record) of the rows with these ids: {"_id", "title", "text", metadata...}."""
        from psycopg import sql

        spec = self.spec
        columns = [spec.id, spec.title, *spec.text, *spec.metadata]
        selected = sql.SQL(", ").join(sql.Identifier(c) if c else sql.NULL for c in columns)
        for start in range(0, len(ids), FETCH_BATCH):
            query = sql.SQL("SELECT {} FROM {} WHERE {}::text = ANY(%s)").format(
                selected, _relation(spec), sql.Identifier(spec.id))
            for row in self._all(query, (ids[start:start + FETCH_BATCH],)):
                row_id, title, rest = str(row[0]), row[1], row[2:]
                texts, metadata = rest[:len(spec.text)], rest[len(spec.text):]
                record = {"_id": row_id, "title": None if title is None else str(title),
                          "text": "\n\n".join(str(t) for t in texts if t is not None and str(t).strip())}
                record.update({name: _plain(value) for name, value in zip(spec.metadata, metadata)})
                yield row_id, record

    def _all(self, query, params=None) -> list[tuple]:
        import psycopg

        try:
            # Prepared: the extended protocol runs one statement, so a declared query cannot end the READ ONLY
            # transaction and write ("...; COMMIT; DELETE FROM ...").
            return self.conn.execute(query, params or (), prepare=True).fetchall()
        except psycopg.Error as exc:
            raise TableError(f"cannot read {self.shown}: {_first_line(exc)}") from exc


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
