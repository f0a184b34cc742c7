"""Worker processes for work that a hostile file can break: a parser that hangs, balloons or crashes costs that
file, never the run.

pebble's ProcessPool (a well-kept library; the standard ProcessPoolExecutor breaks the whole pool with
BrokenProcessPool when one worker dies) gives every task a timeout, kills and replaces a worker past it, and
reports a worker that died (the OOM killer, a segfault in a C parser) as that one task's failure. A watchdog thread
in the parent kills a worker whose resident memory passes the limit. Workers are spawned, not forked (the parent
holds a database connection and library threads), and ask the kernel to kill them when their parent dies
(PR_SET_PDEATHSIG), so a SIGKILLed `kb ingest` leaves no orphan blocked forever. One pool lives as long as the
process and is reused by later runs, so a worker imports the parsers once.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import psutil

WATCH_INTERVAL_S = 0.1


@dataclass(frozen=True)
class Lost:
    """A task whose worker was stopped or died: why, in words for the failure record."""

    reason: str


def _start_worker(warm: Callable[[], None] | None) -> None:
    """Worker initializer: die with the parent (Linux: the kernel sends SIGKILL when it dies), then load what every
    task needs, so that a task's time limit measures its own work and not the imports."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the request took effect
            os._exit(1)
    except (OSError, AttributeError):  # not Linux: workers then end when their pipe to the parent closes
        pass
    if warm is not None:
        warm()


_pool = None  # ((workers, warm), pebble.ProcessPool)


def _shared_pool(workers: int, warm: Callable[[], None] | None):
    global _pool
    import pebble

    if _pool is not None and (_pool[0] != (workers, warm) or not _pool[1].active):
        _stop_pool()
    if _pool is None:
        context = multiprocessing.get_context("spawn")
        _pool = ((workers, warm), pebble.ProcessPool(max_workers=workers, initializer=_start_worker,
                                                     initargs=(warm,), context=context))
    return _pool[1]


@atexit.register
def _stop_pool() -> None:
    global _pool
    if _pool is not None:
        _pool[1].stop()
        _pool[1].join(timeout=10)
        _pool = None


def _worker_pids() -> list[psutil.Process]:
    """This process's spawned multiprocessing children: the pool's workers."""
    workers = []
    for child in psutil.Process().children():
        try:
            if any("spawn_main" in part for part in child.cmdline()):
                workers.append(child)
        except psutil.Error:
            continue
    return workers


@contextmanager
def _memory_watchdog(limit_mb: float) -> Iterator[set[int]]:
    """Kill any worker whose resident memory passes the limit; yields the pids it killed."""
    killed: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_INTERVAL_S):
            for worker in _worker_pids():
                try:
                    if worker.memory_info().rss > limit_mb * 1e6:
                        killed.add(worker.pid)
                        worker.kill()
                except psutil.Error:
                    continue

    thread = threading.Thread(target=watch, name="kb-memory-watchdog", daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        done.set()
        thread.join()


def isolated_map(fn: Callable, tasks: list, workers: int, timeout_s: float, memory_mb: float,
                 warm: Callable[[], None] | None = None) -> Iterator:
    """fn(task) for each task in worker processes, yielded in order: the result, or Lost(reason) when the task's
    worker ran past timeout_s, past memory_mb, or died. `warm` runs once in each new worker (imports)."""
    from concurrent.futures import TimeoutError as TaskTimeout

    from pebble import ProcessExpired

    futures = [_shared_pool(workers, warm).schedule(fn, args=(task,), timeout=timeout_s) for task in tasks]
    try:
        with _memory_watchdog(memory_mb) as killed:
            for future in futures:
                try:
                    yield future.result()
                except TaskTimeout:
                    yield Lost(f"parsing took longer than {timeout_s:g} s (KB_PARSE_TIMEOUT_S); its worker was stopped")
                except ProcessExpired as exc:
                    if exc.pid in killed:
                        yield Lost(f"parsing used more than {memory_mb:g} MB of memory (KB_PARSE_MEMORY_MB);"
                                   " its worker was stopped")
                    else:
                        yield Lost(f"the parse worker died ({_exit_reason(exc.exitcode)}) while reading it")
    finally:
        for future in futures:
            future.cancel()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"
