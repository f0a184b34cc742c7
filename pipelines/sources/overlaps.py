"""Which sources overlap on disk, decided on what their paths are, not on how they are written.

Two declarations can name one folder in many ways: `data/hr`, `alias/hr` through a symbolic link, `/mnt/hr`
through a bind mount of `data/hr`, a share mounted twice. Comparing the text of the paths would let a restricted
folder be served to everyone as part of a public source that reaches it by another name. So a path is reduced to its
place: the filesystem it lives on (the device of its mount, from /proc/self/mountinfo) and its path inside that
filesystem (the mount's own root plus the rest of the real path), which is the same for every name of one folder.
An object store's URL is its bucket and a prefix in it: compared with the other prefixes of that bucket only. A mount
can appear after a source was declared, so this is decided again at every crawl (pipelines/ingest/extract.py),
where the walk also compares each folder's device and inode with the other sources' roots.

From the places, `coverage` says which part of which source a restricted source's folder holds: a caller outside
the restricted source's groups reads none of it (sql/015, pipelines/retrieval/readable.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable
from urllib.parse import urlsplit

from pipelines.sources.objects import is_url, store_of
from pipelines.sources.web import is_web
from pipelines.sources.web import place_path as web_place

MOUNTINFO = Path("/proc/self/mountinfo")
_ESCAPED = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Place:
    """Where a path is: `device` (a mount's major:minor) and `path` inside that filesystem, the same for every name of
    one folder; `real` is the path with its links resolved (as far as it exists), what is left to compare a path that
    is not on this machine (`device` None) by."""

    device: str | None
    path: PurePosixPath
    real: PurePosixPath

    @property
    def remote(self) -> bool:
        return self.device is not None and "://" in self.device

    def _pairs(self, other: "Place") -> list[tuple[PurePosixPath, PurePosixPath]]:
        """The ways to compare the two: their real paths always (a folder below a mount point is inside the folder
        above it), and their paths inside one filesystem when both are on it here (a bind mount is its source). A
        bucket is compared with places in that bucket only, by prefix."""
        if self.remote or other.remote:
            return [(self.path, other.path)] if self.device == other.device else []
        pairs = [(self.real, other.real)]
        if self.device is not None and self.device == other.device:
            pairs.append((self.path, other.path))
        return pairs

    def holds(self, other: "Place") -> bool:
        """Whether `other` is this place or lies below it, by either comparison."""
        return any(inner.is_relative_to(outer) for outer, inner in self._pairs(other))


@dataclass(frozen=True)
class _Mount:
    point: PurePosixPath  # where it is mounted here
    root: PurePosixPath  # which folder of its filesystem appears there
    device: str


def _unescape(field: str) -> str:
    return _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> list[_Mount]:
    """This process's mounts, read fresh each time: a share can be mounted or bound between two crawls."""
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:  # not Linux, or no /proc: devices from stat() still tell filesystems apart
        return []
    mounts = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 5:
            mounts.append(_Mount(PurePosixPath(_unescape(fields[4])), PurePosixPath(_unescape(fields[3])), fields[2]))
    return mounts


def place(path: str | os.PathLike, mounts: list[_Mount] | None = None) -> Place:
    """The place of a folder or file; a path missing here is compared by its text, resolved as far as it exists. An
    object store's URL is its bucket (`device`: scheme://bucket) and its prefix in it."""
    if is_web(str(path)):
        path = web_place(str(path))  # scheme-free, the default port explicit: http://h and https://h:443/ are one site
    if is_url(str(path)):
        parts = urlsplit(str(path))
        prefix = PurePosixPath("/", parts.path.strip("/"))
        return Place(store_of(str(path)), prefix, prefix)
    try:
        real = PurePosixPath(os.path.realpath(path, strict=True))
    except OSError:
        resolved = PurePosixPath(os.path.realpath(path))
        return Place(None, resolved, resolved)
    mounts = _mounts() if mounts is None else mounts
    # The mount a path is on: the longest mount point above it; of several on one point, the last one mounted.
    candidates = [m for m in mounts if real.is_relative_to(m.point)]
    if not candidates:
        return Place(f"st_dev:{os.stat(real).st_dev}", real, real)
    mount = max(enumerate(candidates), key=lambda im: (len(im[1].point.parts), im[0]))[1]
    return Place(mount.device, mount.root / real.relative_to(mount.point), real)


def below(inner: Place, outer: Place) -> str | None:
    """The path of `inner` inside the folder `outer` ('' when they are one place), or None when it is not inside."""
    for outer_path, inner_path in outer._pairs(inner):
        if inner_path.is_relative_to(outer_path):
            relative = inner_path.relative_to(outer_path).as_posix()
            return "" if relative == "." else relative
    return None


def mounts_below(folder: str | os.PathLike) -> dict[str, Place]:
    """{path inside `folder`: its place} of every mount point below the folder (a share, a bind mount of a folder or
    of one file): what it shows there may be another source's, whatever its path inside `folder` says."""
    try:
        real = PurePosixPath(os.path.realpath(folder, strict=True))
    except OSError:
        return {}
    mounts = _mounts()
    return {m.point.relative_to(real).as_posix(): place(m.point, mounts) for m in mounts
            if m.point != real and m.point.is_relative_to(real)}


Coverage = set[tuple[str, str, str]]  # (source_id, covered_by, locator prefix)


def coverage(places: dict[str, Place], restricted: Iterable[str], folders: Iterable[str]) -> Coverage:
    """Rows of source_coverage for these sources' places: (S, R, prefix) for every restricted, declared source R and
    every other source S whose documents lie (from `prefix` down; '' = all of them) in R's folder or file. `folders`
    names the sources whose locators are paths below their place (folder sources); a JSONL source's records are
    all covered or none."""
    folders = set(folders)
    rows: Coverage = set()
    for covering in restricted:
        for source_id, where in places.items():
            if source_id == covering:
                continue
            if places[covering].holds(where):
                rows.add((source_id, covering, ""))
            elif source_id in folders and (inside := below(places[covering], where)) is not None:
                rows.add((source_id, covering, inside))
    return rows
