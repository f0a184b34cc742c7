"""Opening files inside a source, so that no file outside it is ever read.

A path is never checked and then opened again by name: a writer could swap the file for a symbolic link in
between. Instead every file is opened once, component by component below the source root's own descriptor, with
O_NOFOLLOW (a symbolic link anywhere on the way is refused, not followed) and O_NONBLOCK (a named pipe cannot
hang the run), and must be a regular file; whatever reads it (the hash at extract, the parser) reads that
descriptor. The root itself is opened by its declared path and its identity (device and inode) compared with the
one recorded when the source was first crawled on this host: a root replaced by another folder, or by a link to
one, is refused and nothing is read or deleted.

A source that declares `allow_outside_links` opts out: its files are opened by path, following links.

A folder source is listed the same way (`walk_below`): every folder is opened below its parent's descriptor
without following links, and the walk stops at MAX_FOLDER_DEPTH levels.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import posixpath
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
READ_NO_LINKS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Folder levels below a source root that a crawl enters (docs/bad-days.md). Real trees are a few dozen deep; past
# this a folder is one failure, like an unreadable one. It also bounds the descriptors a walk holds open.
MAX_FOLDER_DEPTH = 256


class OutsideSource(ValueError):
    """A path that would lead outside the source (a symbolic link, `..`), refused."""


class NotARegularFile(ValueError):
    """A pipe, device, socket or folder where a document file was expected."""


class RootChanged(OSError):
    """The source's root is not the folder (or file) this host crawled before."""


class FolderTooDeep(OSError):
    """A folder nested deeper than MAX_FOLDER_DEPTH below the source root: not entered."""

    def __init__(self, relpath: str) -> None:
        super().__init__(errno.ELOOP, f"nested deeper than {MAX_FOLDER_DEPTH} levels; its files were not read", relpath)


def host() -> str:
    return socket.gethostname()


def identity(fd: int) -> str:
    """Device and inode of an open file: what a swapped-in folder or link cannot fake."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


@contextmanager
def open_root(path: Path, known: str | None) -> Iterator[int]:
    """The source root's folder, opened; `known` is its identity recorded on this host (None: not yet)."""
    try:
        fd = os.open(path, DIRECTORY)
    except NotADirectoryError:
        raise FileNotFoundError(errno.ENOENT, f"{path} is not a folder", str(path)) from None
    try:
        if known is not None and identity(fd) != known:
            raise RootChanged(errno.EXDEV, f"{path} is not the folder kb crawled before: it was replaced, is a link"
                                           " to another folder now, or was mounted anew (a remount can change its"
                                           " device number); nothing was read or deleted", str(path))
        yield fd
    finally:
        os.close(fd)


def open_below(root_fd: int, relpath: str, root: Path, follow_links: bool = False) -> int:
    """A descriptor of the regular file at `relpath` below the open root, reached without following a link."""
    parts = PurePosixPath(relpath).parts
    if not parts or any(part in ("", ".", "..") for part in parts) or PurePosixPath(relpath).is_absolute():
        raise OutsideSource(f"{relpath!r} is not a path inside the source")
    if follow_links:
        fd = os.open(root / relpath, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    else:
        fd = _open_without_links(root_fd, parts)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile("not a regular file (a folder, pipe, device or socket); kb reads files only")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_without_links(root_fd: int, parts: tuple[str, ...]) -> int:
    opened: list[int] = []
    parent, part = root_fd, parts[0]
    try:
        for part in parts[:-1]:
            parent = os.open(part, DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            opened.append(parent)
        part = parts[-1]
        return os.open(part, READ_NO_LINKS, dir_fd=parent)
    except OSError as exc:
        # O_NOFOLLOW meets a link as ELOOP (the file) or ENOTDIR (a folder on the way, with O_DIRECTORY)
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(part, parent)):
            raise OutsideSource("is a symbolic link (or lies below one), which kb does not follow: a source never"
                                " reads what a link points at (a source declared with allow_outside_links follows"
                                " links)") from None
        raise
    finally:
        for fd in opened:
            os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def read_all(fd: int, limit_bytes: float) -> bytes:
    """The whole file behind `fd` (closed after), refused past the limit (it may have grown since it was listed)."""
    with open(fd, "rb", closefd=True) as handle:
        data = handle.read(int(limit_bytes) + 1)
    if len(data) > limit_bytes:
        raise ValueError(f"the file is over the {limit_bytes / 1e6:g} MB limit (KB_MAX_FILE_MB)")
    return data


def read_below(root: Path, known_root: str | None, relpath: str, follow_links: bool, limit_bytes: float) -> bytes:
    """The bytes of the file at `relpath` in the source folder `root`, read as `open_below` opens it."""
    with open_root(root, known_root) as root_fd:
        return read_all(open_below(root_fd, relpath, root, follow_links), limit_bytes)


def walk_below(root_fd: int, onerror: Callable[[OSError], None]) -> Iterator[tuple[str, list[str], list[str], int]]:
    """os.fwalk(".", dir_fd=root_fd) without its recursion: (dirpath, dirnames, filenames, dir_fd) for each folder,
    top down, dirpath relative to the root ("." for the root). As with os.fwalk, the caller may prune and reorder
    dirnames in place; the walk enters them in that order.

    os.fwalk recurses in Python, so a folder 1,100 deep stopped the whole run with RecursionError, and it holds a
    descriptor for every level. Here a list of pending folders replaces the recursion; each folder is opened below
    its parent's descriptor with O_NOFOLLOW, and only the folders from the root down to the one being listed are
    open (at most MAX_FOLDER_DEPTH). A link is never entered: a link to a folder is in neither list (as os.fwalk
    never enters it); any other link is a file name, refused when it is opened. A folder deeper than
    MAX_FOLDER_DEPTH is not entered (FolderTooDeep), and one that cannot be opened or listed is skipped; both go to
    `onerror` with `filename` set to the folder's path relative to the root, so that what is stored under it is
    kept (os.fwalk gave only the last component of the name)."""
    try:
        dirnames, filenames = _list_folder(root_fd)
    except OSError as exc:
        exc.filename = "."
        onerror(exc)
        return
    yield ".", dirnames, filenames, root_fd
    pending = _below(".", dirnames, onerror)  # folders still to list, the next one last
    opened: list[tuple[str, int]] = []  # the folders open below the root, each the parent of the next
    try:
        while pending:
            dirpath = pending.pop()
            parent = posixpath.dirname(dirpath)
            while opened and opened[-1][0] != parent:  # done with the folders between here and the last one listed
                os.close(opened.pop()[1])
            try:
                fd = os.open(posixpath.basename(dirpath), DIRECTORY | os.O_NOFOLLOW,
                             dir_fd=opened[-1][1] if opened else root_fd)
                opened.append((dirpath, fd))
                dirnames, filenames = _list_folder(fd)
            except OSError as exc:
                exc.filename = dirpath
                onerror(exc)
                continue
            yield dirpath, dirnames, filenames, fd
            pending += _below(dirpath, dirnames, onerror)
    finally:
        for _, fd in opened:
            os.close(fd)


def _below(dirpath: str, dirnames: list[str], onerror: Callable[[OSError], None]) -> list[str]:
    """The paths of the subfolders to enter, the first one last (the walk pops from the end); one past
    MAX_FOLDER_DEPTH goes to `onerror` instead."""
    below = []
    for name in dirnames:
        relpath = posixpath.normpath(posixpath.join(dirpath, name))
        if relpath.count("/") >= MAX_FOLDER_DEPTH:  # a path of n folders has n - 1 slashes
            onerror(FolderTooDeep(relpath))
        else:
            below.append(relpath)
    return below[::-1]


def _list_folder(fd: int) -> tuple[list[str], list[str]]:
    """The names of the open folder's subfolders and of its other entries, as os.fwalk sorts them: a link to a
    folder is in neither list, a link that cannot be followed (a loop, a dangling link) is among the others."""
    folders, others = [], []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.name)
                elif not entry.is_dir():
                    others.append(entry.name)
            except OSError:  # a link that cannot be followed; anything else vanished meanwhile
                if entry.is_symlink():
                    others.append(entry.name)
    return folders, others
