"""Sources are declared objects: one row in `sources` holds a source's whole declaration, and every entry point
(the CLI, Dagster, search) reads it from there.

A declaration is made explicitly, from a config file kept in git (`kb source apply kb.toml`) or with
`kb source add | update | remove`, and never by a side effect: `kb ingest` of a known source with another
location, other globs or other groups is refused, and a refresh only reads the declaration. Every change is a
row in `source_changes` saying who made it, when, and the declaration before and after.
"""

from __future__ import annotations

import functools
import getpass
import os
import re
import socket
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path, PurePosixPath

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from pipelines.ingest.hashing import hash_text
from pipelines.sources import tables, web
from pipelines.sources.objects import is_url, normalise
from pipelines.sources.overlaps import below, coverage, place
from pipelines.sources.tables import TableSpec, place_path
from pipelines.storage.locks import LOCK_NAMESPACE

TREES = ("folder", "objects")  # kinds whose documents are named by their path below the source's location
ON_DISK = ("folder", "jsonl")  # kinds read from this machine's files (the rest are fetched: buckets, sites, tables)
UPSTREAM = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
GROUP = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,62}$")


class DeclarationError(ValueError):
    """A declaration (of a source or an API key) that cannot be made as asked; the message says what to do
    instead. The CLI reports it as a usage error (exit 2)."""


@dataclass(frozen=True)
class Source:
    source_id: str
    kind: str  # "folder" | "jsonl" | "objects" | "table"
    location: str  # the folder or .jsonl file (absolute, or relative to the kb.toml that declares it), a bucket's URL,
    #                or a database's (postgresql://)
    include: tuple[str, ...] = ()  # globs of files to take from a folder (empty: all)
    exclude: tuple[str, ...] = ()
    groups: tuple[str, ...] | None = None  # who may read its documents; None: every caller
    freshness_hours: float | None = None  # None: KB_FRESHNESS_HOURS
    refresh_cron: str | None = None  # None: KB_REFRESH_CRON
    allow_outside_links: bool = False  # may a symlink in the folder lead outside it?
    max_deletion_share: float = 0.5  # a crawl that would soft-delete more of the live documents deletes none
    declared_in: str | None = None  # the config file that declares the source; None: the CLI
    golden_set: str | None = None  # JSONL of {"query", "document"} its refreshes must keep finding; None: no gate
    table: TableSpec | None = None  # a table source's rows and columns
    upstream: str | None = None  # the Dagster asset that produces the source ("marts/faq"): it refreshes after it
    private_network: bool = False  # a web source's host may resolve to private addresses (the company's intranet)

    @property
    def path(self) -> Path | str:
        """Where the source is on this machine: a path, an object store's URL, or its table's (tables.place_path)."""
        if self.table is not None:
            return place_path(self.location, self.table)
        return located(self.location, self.declared_in, self.source_id)

    def declaration(self) -> dict:
        """Everything that governs the source, as recorded in the audit trail and compared on re-declaration."""
        data = asdict(self)
        del data["source_id"]
        if self.table is None:  # only a table source has one: other declarations read as they always did
            del data["table"]
        else:
            data["table"] = self.table.stored()
        for optional in ("upstream", "private_network"):
            if not data[optional]:
                del data[optional]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


COLUMNS = {  # Source field -> sources column
    "source_id": "source_id", "kind": "kind", "location": "location", "include": "include_globs",
    "exclude": "exclude_globs", "groups": "allowed_groups", "freshness_hours": "freshness_hours",
    "refresh_cron": "refresh_cron", "allow_outside_links": "allow_outside_links",
    "max_deletion_share": "max_deletion_share", "declared_in": "declared_in", "golden_set": "golden_set",
    "table": "table_spec", "upstream": "upstream_asset", "private_network": "private_network",
}
SELECT = f"SELECT {', '.join(COLUMNS.values())} FROM sources"
SELECT_WITH_STATE = f"SELECT {', '.join(COLUMNS.values())}, removed_at IS NULL FROM sources"


def _from_row(row: tuple) -> Source:
    values = dict(zip(COLUMNS, row))
    values["include"], values["exclude"] = tuple(values["include"]), tuple(values["exclude"])
    values["groups"] = tuple(values["groups"]) if values["groups"] else None
    values["table"] = TableSpec.declared(values["table"]) if values["table"] else None
    return Source(**values)


def resolve_declared(path: str, declared_in: str | None, source_id: str | None = None) -> Path:
    """A declared path (a location, a golden set) of source `source_id` on this machine. An absolute path is used as
    it is. A path that a kb.toml wrote relative to itself stays relative, and resolves against the folder of that
    file: KB_CONFIG's when it is set and declares this source (this machine's copy of the file), else the folder the
    file was last applied from. So one kb.toml kept in git serves checkouts and hosts that hold it, and the
    documents, at different paths, while the sources of another kb.toml keep their own folder."""
    declared = Path(path)
    if declared.is_absolute() or declared_in is None:
        return declared
    here = os.environ.get("KB_CONFIG")
    config = Path(here).expanduser() if here and source_id in _names_in(here) else Path(declared_in)
    return config.resolve().parent / declared


def located(location: str, declared_in: str | None, source_id: str | None = None) -> Path | str:
    """A declared location on this machine: an object store's URL as it is, a path as resolve_declared says."""
    return location if is_url(location) else resolve_declared(location, declared_in, source_id)


def _names_in(config: str) -> frozenset[str]:
    """The source names a kb.toml declares (none when it cannot be read), read again only when the file changes."""
    try:
        st = os.stat(Path(config).expanduser())
    except OSError:
        return frozenset()
    return _names_of(str(Path(config).expanduser().resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _names_of(config: str, mtime_ns: int, size: int) -> frozenset[str]:
    try:
        sources = tomllib.loads(Path(config).read_text(encoding="utf-8")).get("sources")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return frozenset()
    return frozenset(sources) if isinstance(sources, dict) else frozenset()


def locate(path: str | Path) -> tuple[str, str]:
    """(kind, absolute location) of a source path: a folder, a .jsonl file of records, or an object store's URL."""
    if is_url(str(path)):
        try:
            if tables.is_database(str(path)):
                return "table", tables.normalise(str(path))
            return ("web", web.normalise(str(path))) if web.is_web(str(path)) else ("objects", normalise(str(path)))
        except ValueError as exc:
            raise DeclarationError(str(exc)) from None
    resolved = Path(path).expanduser().resolve()
    if resolved.is_dir():
        return "folder", str(resolved)
    if resolved.is_file() and resolved.suffix.lower() == ".jsonl":
        return "jsonl", str(resolved)
    if not resolved.exists():
        raise DeclarationError(f"{path}: no such folder or file")
    raise DeclarationError(f"{path}: a source is a folder of documents or a .jsonl file of records, not a single file;"
                      f" give its folder, or declare the folder with --include")


def declare(name: str | None, path: str | Path, include=(), exclude=(), groups=None, freshness_hours=None,
            refresh_cron=None, allow_outside_links: bool = False, max_deletion_share: float = 0.5,
            declared_in: str | None = None, golden_set: str | Path | None = None, table: dict | None = None,
            upstream: str | None = None, private_network: bool = False) -> Source:
    """A validated declaration; the name defaults to the folder or file name. Paths that a config file
    (`declared_in`) gives relative to itself are kept relative to it; others are made absolute."""
    kind, location = locate(located(str(path), declared_in, name))
    include, exclude, groups = _globs(include, "include"), _globs(exclude, "exclude"), _readers(groups)
    name = name or Path(location).stem
    location = _as_declared(path, location, declared_in)
    if not NAME.match(name):
        raise DeclarationError(f"source name {name!r}: use letters, digits, '.', '_' or '-' (at most 63 characters)")
    return Source(name, kind, location, include, exclude, groups,
                  _positive(freshness_hours), _cron(refresh_cron), bool(allow_outside_links),
                  _share(max_deletion_share), declared_in, _golden(golden_set, declared_in, name), _table(kind, table),
                  _upstream(upstream), _private_network(kind, private_network))


def _private_network(kind: str, private: bool) -> bool:
    if private and kind != "web":
        raise DeclarationError("private_network = true is for web sources (an https:// location)")
    return bool(private)


def _upstream(asset: str | None) -> str | None:
    """An upstream asset's key as Dagster writes it in the UI and on the command line: path parts joined by '/'."""
    if asset is None:
        return None
    if not isinstance(asset, str) or not UPSTREAM.match(asset):
        raise DeclarationError(f"upstream {asset!r}: an asset key such as \"marts/faq\" (letters, digits, _ and -,"
                               " parts joined by /)")
    return asset


def _table(kind: str, table: dict | None) -> TableSpec | None:
    """A table source's spec: required for a database location, refused for any other."""
    if kind != "table":
        if table is not None:
            raise DeclarationError("table = ... declares the rows of a database table: give a postgresql:// location")
        return None
    if table is None:
        raise DeclarationError("a postgresql:// location needs its table: name (or query), id and text columns"
                               " ([sources.NAME.table] in kb.toml, or --table, --id-column, --text-column)")
    try:
        return TableSpec.declared(table)
    except ValueError as exc:
        raise DeclarationError(str(exc)) from None


def _globs(globs, key: str) -> tuple[str, ...]:
    """A list of globs; one string is refused, not read as its characters (`exclude = "drafts/*"` excluded nothing)."""
    if isinstance(globs, str) or not all(isinstance(g, str) for g in globs):
        raise DeclarationError(f"{key} is a list of globs, like {key} = [\"drafts/*\"], not {globs!r}")
    return tuple(globs)


def _readers(groups) -> tuple[str, ...] | None:
    """A source's readers: groups, or None for everyone. An empty list is refused: it would make the source public
    by accident, and public is said explicitly (`public = true`, `--public`)."""
    if groups is not None and not isinstance(groups, str) and len(list(groups)) == 0:
        raise DeclarationError("an empty group list would let everyone read the source; list its groups, or say"
                               " public = true (--public) if everyone may read it")
    return normalise_groups(groups)


def normalise_groups(groups) -> tuple[str, ...] | None:
    """Sorted, de-duplicated group names; no groups at all means the source is public (None)."""
    if groups is None:
        return None
    if isinstance(groups, str):
        raise DeclarationError("groups are a list of names, not one string")
    cleaned = sorted({str(g).strip() for g in groups})
    for group in cleaned:
        if not GROUP.match(group):
            raise DeclarationError(f"group name {group!r}: use letters, digits, '.', '_', ':', '@' or '-'")
    return tuple(cleaned) or None


def _positive(hours) -> float | None:
    if hours is None:
        return None
    if not isinstance(hours, (int, float)) or not hours > 0 or hours != hours or hours == float("inf"):
        raise DeclarationError(f"freshness_hours must be a positive number of hours, not {hours!r}")
    return float(hours)


def _share(share) -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise DeclarationError(f"max_deletion_share must be a fraction above 0 and at most 1, not {share!r}")
    return float(share)


def _cron(expression: str | None) -> str | None:
    if expression is None:
        return None
    from croniter import croniter

    # Five fields, as Dagster's schedules take them (croniter alone also accepts a sixth, for seconds).
    if not isinstance(expression, str) or len(expression.split()) != 5 or not croniter.is_valid(expression):
        raise DeclarationError(f"refresh_cron {expression!r} is not a cron expression of five fields"
                               " (minute hour day month weekday, e.g. '0 3 * * *')")
    return expression


def _as_declared(path: str | Path, resolved: str, declared_in: str | None) -> str:
    """What is stored for a declared path: as written when a config file gave it relative to itself, else absolute."""
    if is_url(resolved):
        return resolved
    written = PurePosixPath(Path(path).expanduser())  # `..` kept: `alias/..` is not `.` when alias is a link
    return written.as_posix() if declared_in and not written.is_absolute() else resolved


def _golden(path: str | Path | None, declared_in: str | None = None, source_id: str | None = None) -> str | None:
    """The golden set as declared; it must be a file of JSON lines, each {"query", "document"}."""
    if path is None:
        return None
    resolved = resolve_declared(str(path), declared_in, source_id).expanduser().resolve()
    if not resolved.is_file():
        raise DeclarationError(f"golden_set {path}: no such file (a JSONL file of {{\"query\", \"document\"}} lines)")
    return _as_declared(path, str(resolved), declared_in)


def actor(entry: str) -> str:
    """Who is making a change: the OS user, the host, and the command."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()} ({entry})"


def get_source(conn: psycopg.Connection, source_id: str) -> Source | None:
    row = conn.execute(SELECT + " WHERE source_id = %s AND removed_at IS NULL", (source_id,)).fetchone()
    return _from_row(row) if row else None


def load_sources(conn: psycopg.Connection, source_ids: list[str] | None = None) -> list[Source]:
    """Declared (not removed) sources, all of them or those named."""
    rows = conn.execute(SELECT + " WHERE removed_at IS NULL AND (%(ids)s::text[] IS NULL OR source_id = ANY(%(ids)s))"
                        " ORDER BY source_id", {"ids": source_ids}).fetchall()
    return [_from_row(r) for r in rows]


def _audit(conn: psycopg.Connection, source_id: str, who: str, action: str, before: Source | None,
           after: Source | None) -> None:
    conn.execute("INSERT INTO source_changes (source_id, actor, action, before, after) VALUES (%s, %s, %s, %s, %s)",
                 (source_id, who, action, Jsonb(before.declaration()) if before else None,
                  Jsonb(after.declaration()) if after else None))


def _write(conn: psycopg.Connection, source: Source) -> None:
    values = {COLUMNS[f.name]: getattr(source, f.name) for f in fields(Source)}
    for column in ("include_globs", "exclude_globs", "allowed_groups"):
        values[column] = list(values[column]) if values[column] is not None else None
    values["table_spec"] = Jsonb(source.table.stored()) if source.table else None
    names = list(values)
    conn.execute(
        f"INSERT INTO sources ({', '.join(names)}) VALUES ({', '.join('%s' for _ in names)})"
        f" ON CONFLICT (source_id) DO UPDATE SET {', '.join(f'{n} = excluded.{n}' for n in names[1:])},"
        " updated_at = now(), removed_at = NULL",
        list(values.values()))


def _locked(conn: psycopg.Connection, source_id: str) -> Source | None:
    """The declared source of that name, holding its row until the transaction ends. (A removed source's row is
    renamed away, `remove_source`: its name belongs to no one.)"""
    row = conn.execute(SELECT + " WHERE source_id = %s AND removed_at IS NULL FOR UPDATE", (source_id,)).fetchone()
    return _from_row(row) if row else None


def differences(old: Source, new: Source) -> list[str]:
    before, after = old.declaration(), new.declaration()
    return [f.name for f in fields(Source) if before.get(f.name) != after.get(f.name) and f.name != "source_id"]


def narrower(inner: Source, outer: Source) -> bool:
    """Whether every caller who may read `inner` may read `outer`: what a source inside another's folder must be."""
    return outer.groups is None or (inner.groups is not None and set(inner.groups) <= set(outer.groups))


def check_overlaps(conn: psycopg.Connection, source: Source) -> None:
    """Two sources on one folder are refused. A source inside another's folder is allowed only when it is readable by
    no more callers than the outer one: its files are then crawled by it alone (the outer source skips its folder),
    so the narrowest declaration wins and no declaration widens what another one restricts. Folders are compared as
    what they are (device, mount and real path: pipelines/sources/overlaps.py), so a link or a bind mount is no way
    around this."""
    here = place(source.path)
    for other in load_sources(conn):
        if other.source_id == source.source_id:
            continue
        there = place(other.path)
        if here.holds(there) and there.holds(here):
            what = "folder" if source.kind in ON_DISK else "location"
            raise DeclarationError(f"{source.path} is the {what} of source {other.source_id!r} ({other.path}): one {what}"
                                   " is one source (a second name would serve its files under other groups)")
        if there.holds(here):
            outer, inner = other, source
        elif here.holds(there):
            outer, inner = source, other
        else:
            continue
        if not narrower(inner, outer):
            raise DeclarationError(
                f"source {inner.source_id!r} ({inner.path}) lies inside {outer.source_id!r} ({outer.path}), which only"
                f" groups {', '.join(outer.groups)} may read; a source inside it may not be readable by more: give it"
                " groups among those")


def _claim_documents(conn: psycopg.Connection, source: Source) -> dict[str, int]:
    """Declaring a source inside another one's folder moves the documents the outer source holds there, with their
    history, to it: a file belongs to one source, and who may read any version of it is decided by the declaration
    that covers it today (sql/functions/sources.sql). Both sources' runs must be idle. Returns {outer: moved}."""
    here, moved = place(source.path), {}
    if source.kind not in TREES:  # a JSONL source's records are not the outer source's file; coverage hides that file
        return moved
    for outer in load_sources(conn):
        if outer.source_id == source.source_id or outer.kind not in TREES:
            continue
        folder = below(here, place(outer.path))
        if not folder:  # not inside (or the same folder, refused above)
            continue
        for source_id in sorted({outer.source_id, source.source_id}):
            _idle(conn, source_id, f"declare {source.source_id!r}")
        moved[outer.source_id] = conn.execute("SELECT kb_move_documents(%s, %s, %s, '')",
                                              (outer.source_id, folder, source.source_id)).fetchone()[0]
    return moved


def _idle(conn: psycopg.Connection, source_id: str, what: str) -> None:
    """Hold the source's run lock until the transaction ends, or refuse: a declaration that moves or removes
    documents must not interleave with a run writing them."""
    if not conn.execute("SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))", (LOCK_NAMESPACE, source_id)).fetchone()[0]:
        raise DeclarationError(f"source {source_id!r} has a run in progress (a refresh or a model backfill); {what}"
                               " again once it has finished (`kb status` shows the last run)")


def refresh_coverage(conn: psycopg.Connection, changed: set[str] = frozenset()) -> None:
    """Keep source_coverage (sql/015) in step with the declarations: every restricted, declared source covers what
    other sources (declared or removed) hold in its folder. Rows of the `changed` sources, and of sources no longer
    declared restricted, are recomputed; the others stay, so a cover found by a crawl's walk (a mount inside a
    folder) is not forgotten by a declaration made on a host that does not see that mount."""
    rows = [(_from_row(row[:-1]), row[-1]) for row in conn.execute(SELECT_WITH_STATE)]
    places = {source.source_id: place(source.path) for source, _ in rows}
    restricted = [source.source_id for source, declared in rows if declared and source.groups is not None]
    conn.execute("DELETE FROM source_coverage WHERE source_id = ANY(%(changed)s) OR covered_by = ANY(%(changed)s)"
                 " OR covered_by <> ALL(%(restricted)s)", {"changed": sorted(changed), "restricted": restricted})
    covered = coverage(places, restricted, [source.source_id for source, _ in rows if source.kind in TREES])
    if covered:
        add_coverage(conn, covered)


def add_coverage(conn: psycopg.Connection, rows) -> None:
    conn.execute("INSERT INTO source_coverage (source_id, covered_by, prefix)"
                 " SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]) ON CONFLICT DO NOTHING",
                 [list(column) for column in zip(*sorted(rows))])


def add_source(conn: psycopg.Connection, source: Source, who: str) -> bool:
    """Declare a new source. Declaring an existing source again is a no-op when nothing differs and an error
    otherwise: changes go through `update_source`. A name a removed source had is free: the new declaration is a new
    source, with no history and no recorded root (the removed one keeps its history and its readers). Documents
    another source held in this one's folder move to it. Returns True when written."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('kb.declarations'))")  # overlap checks see each other
        check_overlaps(conn, source)
        stored = _locked(conn, source.source_id)
        if stored is not None:
            changed = differences(stored, source)
            if not changed:
                return False
            raise DeclarationError(
                f"source {source.source_id!r} is already declared with another {', '.join(changed)}"
                f" ({_describe(stored, changed)}); change it with `kb source update {source.source_id} ...`"
                + (f" or in {stored.declared_in}" if stored.declared_in else "") + ", or pick another --source name")
        _write(conn, source)
        _audit(conn, source.source_id, who, "add", None, source)
        _claim_documents(conn, source)
        refresh_coverage(conn, {source.source_id})
    return True


def _describe(source: Source, names: list[str]) -> str:
    declared = source.declaration()
    return "; ".join(f"{name} is {shown(name, declared[name])}" for name in names)


def shown(key: str, value) -> str:
    """A declared value as a person writes it: `drafts/*, *.tmp`, `everyone`, `none`, never a Python repr."""
    if key == "groups" and not value:
        return "everyone"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def _changeable(conn: psycopg.Connection, source_id: str, via_config: str | None, fix: str) -> Source:
    """The declared source, locked for a change; one declared in a config file changes only through a file
    (`fix` says how, `{}` standing for the file)."""
    stored = _locked(conn, source_id)
    if stored is None:
        raise DeclarationError(f"no source {source_id!r} is declared; see `kb source list`")
    if stored.declared_in and via_config is None:
        raise DeclarationError(f"source {source_id!r} is declared in {stored.declared_in}: "
                               + fix.format(stored.declared_in))
    return stored


def update_source(conn: psycopg.Connection, source_id: str, who: str, via_config: str | None = None,
                  **changes) -> Source:
    """Change some fields of a declared source (a location change re-locates it). A source declared in a config
    file is changed only by applying that file."""
    with conn.transaction():
        stored = _changeable(conn, source_id, via_config, "edit it there and run `kb source apply {}`")
        declared_in = changes.get("declared_in", stored.declared_in)
        if "location" in changes:
            changes["kind"], resolved = locate(located(str(changes["location"]), declared_in, source_id))
            changes["location"] = _as_declared(changes["location"], resolved, declared_in)
        if "groups" in changes:
            changes["groups"] = _readers(changes["groups"])
        if "freshness_hours" in changes:
            changes["freshness_hours"] = _positive(changes["freshness_hours"])
        if "refresh_cron" in changes:
            changes["refresh_cron"] = _cron(changes["refresh_cron"])
        if "max_deletion_share" in changes:
            changes["max_deletion_share"] = _share(changes["max_deletion_share"])
        if "golden_set" in changes:
            changes["golden_set"] = _golden(changes["golden_set"], declared_in, source_id)
        for key in ("include", "exclude"):
            if key in changes:
                changes[key] = _globs(changes[key], key)
        updated = replace(stored, **changes)
        if differences(stored, updated):
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('kb.declarations'))")
            check_overlaps(conn, updated)
            _write(conn, updated)
            _audit(conn, source_id, who, "update", stored, updated)
            _claim_documents(conn, updated)
            refresh_coverage(conn, {source_id})
        if updated.path != stored.path:  # a declared move: the next crawl records the new root's identity
            conn.execute("UPDATE sources SET root_identities = '{}' WHERE source_id = %s", (source_id,))
    return updated


def retired_name(source_id: str, source_key: int) -> str:
    """The name a removed source's history keeps: no declaration can take it (`~` is not allowed in names)."""
    return f"{source_id}~{source_key}"


def remove_source(conn: psycopg.Connection, source_id: str, who: str, via_config: str | None = None) -> int:
    """Stop serving a source: its documents are soft-deleted with their chunks and it leaves every list. Its
    history stays, readable as of a past time by the groups that could read it, under its retired name
    (`retired_name`); its name is free, and a later declaration under it is a new source. Returns how many
    documents were deleted."""
    with conn.transaction():
        stored = _changeable(conn, source_id, via_config, "delete it there and run `kb source apply --prune {}`")
        _idle(conn, source_id, f"remove {source_id!r}")
        deleted = conn.execute("SELECT kb_soft_delete_documents(%(id)s, ARRAY(SELECT locator FROM documents"
                               " WHERE source_id = %(id)s AND deleted_at IS NULL))", {"id": source_id}).fetchone()[0]
        conn.execute("DELETE FROM failures WHERE source_id = %s", (source_id,))
        conn.execute("DELETE FROM source_coverage WHERE covered_by = %s", (source_id,))  # no longer declared
        conn.execute("UPDATE sources SET removed_at = now(), updated_at = now(), source_id = %s || '~' || source_key"
                     " WHERE source_id = %s", (source_id, source_id))
        _audit(conn, source_id, who, "remove", stored, None)
    return deleted


def read_config(path: str | Path) -> list[Source]:
    """The sources a kb.toml declares. Locations are relative to the file's folder.

        [sources.handbook]
        location = "docs/handbook"        # a folder, or a .jsonl file of records
        include = ["**/*.md"]             # optional globs
        exclude = ["drafts/*"]
        groups = ["hr"]                   # who may read it; or public = true: every caller
        freshness_hours = 24
        refresh_cron = "0 6 * * *"
        allow_outside_links = false
        max_deletion_share = 0.5          # a crawl that would delete more of its documents deletes none
        golden_set = "golden.jsonl"       # queries its refreshes must keep finding (relative to this file)
    """
    return parse_config(_config_text(path), path)


def _config_text(path: str | Path) -> str:
    try:
        return Path(path).expanduser().resolve().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DeclarationError(f"{path}: cannot read the source declarations: {exc}") from exc


def parse_config(text: str, path: str | Path) -> list[Source]:
    """The sources a kb.toml's text declares (`read_config`); `path` is the file it was read from."""
    config = Path(path).expanduser().resolve()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DeclarationError(f"{path}: cannot read the source declarations: {exc}") from exc
    known = {"location", "include", "exclude", "groups", "public", "freshness_hours", "refresh_cron",
             "allow_outside_links", "max_deletion_share", "golden_set", "table", "upstream", "private_network"}
    if other := sorted(set(data) - {"sources"}):  # `[source.x]` declared nothing, silently
        raise DeclarationError(f"{path}: unknown table{'s' if len(other) > 1 else ''} {', '.join(f'[{t}]' for t in other)};"
                               " declare each source as [sources.NAME] (with location, and groups or public = true)")
    if "sources" not in data:
        raise DeclarationError(f"{path} declares no source: add a [sources.NAME] table with location, and groups"
                               " = [...] or public = true")
    if not isinstance(data["sources"], dict):
        raise DeclarationError(f"{path}: sources is a table of [sources.NAME] tables, not {data['sources']!r}")
    declared = []
    for name, table in data["sources"].items():
        if not isinstance(table, dict) or "location" not in table:
            raise DeclarationError(f"{path}: [sources.{name}] needs a location")
        unknown = set(table) - known
        if unknown:
            raise DeclarationError(f"{path}: [sources.{name}] has unknown keys {', '.join(sorted(unknown))}; known:"
                                   f" {', '.join(sorted(known))}")
        if ("groups" in table) == (table.get("public") is True) or ("public" in table and table["public"] is not True):
            raise DeclarationError(f"{path}: [sources.{name}] says who may read it with either groups = [...] or"
                                   " public = true (exactly one of them)")
        try:
            declared.append(declare(name, str(table["location"]), table.get("include", ()), table.get("exclude", ()),
                                    table.get("groups"), table.get("freshness_hours"), table.get("refresh_cron"),
                                    table.get("allow_outside_links", False), table.get("max_deletion_share", 0.5),
                                    declared_in=str(config), golden_set=table.get("golden_set"),
                                    table=table.get("table"), upstream=table.get("upstream"),
                                    private_network=table.get("private_network", False)))
        except DeclarationError as exc:
            raise DeclarationError(f"{path}: [sources.{name}]: {exc}") from exc
    return declared


def apply_config(conn: psycopg.Connection, path: str | Path, who: str, prune: bool = False) -> dict:
    """Make the sources table match a config file: add what is new, update what changed, and (with prune)
    remove the sources this file declared before and no longer does. The same file applied from another checkout or
    host is the same declaration: its relative paths stay relative, and only where it was applied from is
    recorded. A source declared from the CLI is never taken over by a file. All or nothing: one refused change
    leaves every declaration as it was. Removals come first, so a file may give a folder to a new name."""
    text = _config_text(path)
    declared = parse_config(text, path)
    config = str(Path(path).expanduser().resolve())
    result: dict[str, list[str]] = {"added": [], "updated": [], "unchanged": [], "removed": [], "not_in_file": []}
    names = {s.source_id for s in declared}
    with conn.transaction():
        for source in declared:
            stored = get_source(conn, source.source_id)
            if stored is not None and stored.declared_in is None:
                raise DeclarationError(f"{path}: source {source.source_id!r} is already declared from the CLI; remove"
                                       f" it there first (`kb source remove {source.source_id}`) or rename it here;"
                                       " nothing of this file was applied")
        for stale in (s for s in load_sources(conn) if s.declared_in == config and s.source_id not in names):
            if prune:
                remove_source(conn, stale.source_id, who, via_config=config)
                result["removed"].append(stale.source_id)
            else:
                result["not_in_file"].append(stale.source_id)
        for source in declared:
            stored = get_source(conn, source.source_id)
            try:
                if stored is None:
                    add_source(conn, source, who)
                    result["added"].append(source.source_id)
                elif differences(stored, source):
                    changes = {k: getattr(source, k) for k in differences(stored, source)}
                    update_source(conn, source.source_id, who, via_config=config, **changes)
                    result["updated"].append(source.source_id)
                else:
                    result["unchanged"].append(source.source_id)
            except DeclarationError as exc:
                raise DeclarationError(f"{path}: [sources.{source.source_id}]: {exc}; nothing of this file was"
                                       " applied") from exc
        conn.execute("UPDATE sources SET declared_hash = %s WHERE declared_in = %s AND removed_at IS NULL",
                     (hash_text(text), config))
    return result


def changed_since_applied(conn: psycopg.Connection, source_ids: list[str]) -> list[str]:
    """A line for each config file declaring these sources whose text is not the text last applied: the run reads
    the declarations as applied, and whoever started it should know that the edits are not in it."""
    lines = []
    for declared_in, applied, names in conn.execute(
            "SELECT declared_in, declared_hash, array_agg(source_id) FROM sources WHERE source_id = ANY(%s)"
            " AND removed_at IS NULL AND declared_in IS NOT NULL GROUP BY 1, 2 ORDER BY 1", (source_ids,)).fetchall():
        local = os.environ.get("KB_CONFIG")  # this machine's copy of the file, if it is this file (resolve_declared)
        here = local if local and set(names) & _names_in(local) else declared_in
        try:
            current = hash_text(Path(here).expanduser().read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue  # a host that runs without the file: its declarations are what was applied
        if current != applied:
            lines.append(f"{here} changed since it was last applied: this run uses the declarations as applied; run"
                         f" `kb source apply {here}` to use the edits")
    return lines


def source_for_ingest(conn: psycopg.Connection, path: str | Path, name: str | None, include=(), exclude=(),
                      groups=None, who: str = "", public: bool = False) -> tuple[Source, bool]:
    """What `kb ingest PATH` means: a new source is declared from the command, which must say who may read it
    (`groups`, or `public`); a declared one is ingested as declared, and a command that would change its location,
    globs or groups is refused. Returns the source and whether this command declared it."""
    wanted = declare(name, path, include, exclude, groups)
    stored = get_source(conn, wanted.source_id)
    if stored is None:
        if wanted.groups is None and not public:
            raise DeclarationError(f"{path} is not a declared source, and declaring it as {wanted.source_id!r} needs to"
                                   " say who may read it: add --group G (repeatable) or --public")
        add_source(conn, wanted, who)
        return wanted, True
    asked = {"location": str(wanted.path)}
    if include:
        asked["include"] = list(wanted.include)
    if exclude:
        asked["exclude"] = list(wanted.exclude)
    if groups or public:
        asked["groups"] = list(wanted.groups or ())
    declared = {**stored.declaration(), "location": str(stored.path)}
    declared["groups"] = declared["groups"] or []
    clashes = [key for key, value in asked.items() if declared[key] != value]
    if clashes:
        how = (f"edit {stored.declared_in} and run `kb source apply`" if stored.declared_in
               else f"run `kb source update {stored.source_id} ...`")
        raise DeclarationError(f"source {stored.source_id!r} is declared with {_describe(stored, clashes)}, not what this"
                          f" command gives; ingesting never changes a declaration: {how}, or use another --source name")
    return stored, False


def source_changes(conn: psycopg.Connection, source_id: str, limit: int = 20) -> list[dict]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT change_id, changed_at, actor, db_user, action, before, after FROM source_changes"
                           " WHERE source_id = %s ORDER BY change_id DESC LIMIT %s", (source_id, limit)).fetchall()
