"""Object-store sources: a bucket and prefix (`s3://bucket/prefix`, `gs://...`, `az://...`; STORES), read through
fsspec (s3fs ships with kb; gcsfs and adlfs install beside it).

A crawl lists the prefix once (every page of it) and reads no object whose tag is the one stored: the ETag (or the
provider's hash, generation or version id) changes when the bytes do, so an unchanged object costs no request beyond
its share of the listing. A changed object is read (at most the per-file limit) and hashed; parsing reads it again.
A listing that fails (403, a missing bucket, no network, a page cut short) fails the whole crawl, which then deletes
nothing: the same guarantee a missing mount gets.

Credentials are the provider's own chain (AWS_* variables, a profile, an instance role, GOOGLE_APPLICATION_CREDENTIALS,
AZURE_STORAGE_*): kb never stores or prints them, and a URL that carries them is refused when it is declared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator
from urllib.parse import urlsplit

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SAME_STORE = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}  # fsspec's other names for one kind of store
# The object stores kb reads. Any other fsspec protocol is refused: local:// or file:// would be a folder without the
# folder rules (root identity, links, narrower sources), ftp:// or http:// a network read without the web's checks.
STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
BACKENDS = {"gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
TAG_FIELDS = ("ETag", "etag", "md5Hash", "generation", "VersionId", "version_id")  # what changes when the bytes do


class ObjectStoreError(OSError):
    """An object store kb cannot reach or list; the message says which and why."""


def is_url(location: str) -> bool:
    return bool(SCHEME.match(str(location)))


def normalise(url: str) -> str:
    """The declared form of an object-store URL (`scheme://bucket/prefix`, no trailing slash), or ValueError with what
    to write instead."""
    scheme = SCHEME.match(url).group(1).lower()
    if scheme not in STORES:  # file://, local://, ftp://, memory://...: not a bucket, and none of the folder rules
        raise ValueError(f"{url}: a {scheme}:// location is not a bucket kb reads; declare a folder path or a .jsonl"
                         " file, a bucket (s3://bucket/prefix, gs://, az://), a site (https://) or a database"
                         " (postgresql://)")
    parts = urlsplit(url)
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"{scheme}://{parts.hostname or ''}/...: a source URL names a bucket and a prefix only;"
                         " credentials and options come from the environment (AWS_*, a profile, an instance role)")
    if not parts.netloc:
        raise ValueError(f"{url}: name the bucket ({scheme}://BUCKET/prefix)")
    prefix = parts.path.strip("/")
    return f"{scheme}://{parts.netloc}" + (f"/{prefix}" if prefix else "")


def store_of(url: str) -> str:
    """The bucket a URL names (`scheme://bucket`), under one name per kind of store."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return f"{SAME_STORE.get(scheme, scheme)}://{parts.netloc}"


def address(url: str, key: str) -> str:
    """An object's URL, as messages name it."""
    return f"{url}/{key}"


@dataclass(frozen=True)
class Listed:
    key: str  # below the source's prefix
    size: int
    tag: str
    mtime: datetime | None


def filesystem(url: str) -> tuple[Any, str]:
    """(a fresh fsspec filesystem for the URL, the path of its prefix there). Fresh: no listing cached from an earlier
    crawl, and the credentials the environment holds now."""
    import fsspec

    scheme = SCHEME.match(url).group(1).lower()
    try:
        return fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
    except ImportError as exc:
        package = BACKENDS.get(scheme, f"the fsspec backend for {scheme}://")
        raise ObjectStoreError(f"{url}: kb needs {package} to read {scheme}:// sources: pip install {package}") from exc
    except ValueError as exc:  # fsspec knows no such protocol
        raise ObjectStoreError(f"{url}: {exc}") from exc


def _tag(info: dict) -> str:
    for name in TAG_FIELDS:
        if info.get(name):
            return str(info[name]).strip('"')
    return f"{info.get('size')}:{_mtime(info)}"  # a store that gives no hash: size and time


def _mtime(info: dict) -> datetime | None:
    value = info.get("LastModified") or info.get("mtime") or info.get("updated") or info.get("last_modified")
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=timezone.utc)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(timezone.utc)
        except ValueError:
            return None
    return None


def list_objects(url: str) -> Iterator[Listed]:
    """Every object below the URL's prefix, by key. All pages are read before the first object is given: a listing
    that fails part way raises ObjectStoreError and gives nothing, so nothing is taken for deleted."""
    fs, root = filesystem(url)
    try:
        found = fs.find(root, detail=True)
    except Exception as exc:  # the providers raise their own types (botocore's, aiohttp's, PermissionError, ...)
        raise ObjectStoreError(f"cannot list {url}: {type(exc).__name__}: {exc}") from exc
    base = root.rstrip("/") + "/"
    for name, info in sorted(found.items()):
        if info.get("type", "file") != "file" or not name.startswith(base) or name.endswith("/"):
            continue  # folder markers, and the prefix itself when it is an object
        yield Listed(name[len(base):], int(info.get("size") or 0), _tag(info), _mtime(info))


class Reader:
    """Reads the objects of one source, on one filesystem for the whole stage."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = filesystem(url)

    def read(self, key: str, limit_bytes: float) -> bytes:
        """The object's bytes, in one ranged GET that asks for no more than `limit_bytes` + 1: one response is one
        version of the object (several ranged reads could mix two), and no request is spent asking for its size."""
        try:
            data = self.fs.cat_file(f"{self.root.rstrip('/')}/{key}", start=0, end=int(limit_bytes) + 1)
        except Exception as exc:  # as list_objects
            raise ObjectStoreError(f"cannot read it: {type(exc).__name__}: {exc}") from exc
        if len(data) > limit_bytes:
            raise ValueError(f"the object is over the {limit_bytes / 1e6:g} MB limit (KB_MAX_FILE_MB)")
        return data
