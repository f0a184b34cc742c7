"""Worker processes for work that a hostile file can break: a parser that hangs, balloons or crashes costs that
file, never the run.

pebble's ProcessPool (a well-kept library; the standard ProcessPoolExecutor breaks the whole pool with
BrokenProcessPool when one worker dies) gives every task a timeout, kills and replaces a worker past it, and
reports a worker that died (the OOM killer, a segfault in a C parser) as that one task's failure. A watchdog thread
in the parent kills a worker whose resident memory passes the limit. Workers are spawned, not forked (the parent
holds a database connection and library threads), and ask the kernel to kill them when their parent dies
(PR_SET_PDEATHSIG), so a SIGKILLed `kb ingest` leaves no orphan blocked forever. One pool lives as long as the
process and is reused by later runs, so a worker imports the parsers once.

The same work can go to a dask cluster's workers instead (`spread_map` with `Workers(dask=ADDRESS)`: `kb ingest
--dask`, or a Dagster run on the dask executor), one dask task per item. Each dask worker runs its tasks in a pool
of its own, as above, so a task's time and memory limits and a crashing parser cost that item there too. A dask
worker that dies (its machine lost, the process killed) loses no work: the scheduler hands its unfinished tasks to
another worker, up to `distributed.scheduler.allowed-failures` times (3 by default); an item whose workers died that
often is a failure of that item alone (KilledWorker), so a file that takes its worker down cannot kill every worker
in turn. Results come back to the caller, which stores them: the caller holds the run's lock and transactions, and a
task that ran twice (rescheduled) returns the same result, stored once.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import signal
import socket
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any, Callable, Iterable, Iterator

import psutil

WATCH_INTERVAL_S = 0.1
AHEAD_PER_WORKER = 4  # tasks handed out per worker at a time: each has its next ones queued, memory stays bounded
DASK_MIN_WINDOW = 16


@dataclass(frozen=True)
class Lost:
    """A task whose worker was stopped or died: why, in words for the failure record ("its worker ...": the caller
    says what the task was doing)."""

    reason: str


@dataclass(frozen=True)
class Workers:
    """Where a run's per-document work goes: `processes` worker processes on this machine, or, when `dask` names a
    scheduler (tcp://host:8786), the workers of that cluster, as many as it has."""

    processes: int = 1
    dask: str | None = None

    def __str__(self) -> str:
        return f"the dask cluster at {self.dask}" if self.dask else f"{self.processes} local worker process(es)"


class WorkersUnavailable(RuntimeError):
    """The dask scheduler named for the run does not answer."""


def where() -> str:
    """This process, as a worker is named in reports: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


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


_pool = None  # ((workers, warm), pebble.ProcessPool, the Event that ends its keeper thread)


def _shared_pool(workers: int, warm: Callable[[], None] | None):
    global _pool
    import pebble

    if _pool is not None and (_pool[0] != (workers, warm) or not _pool[1].active):
        _stop_pool()
    if _pool is None:
        context = multiprocessing.get_context("spawn")
        pool = pebble.ProcessPool(max_workers=workers, initializer=_start_worker, initargs=(warm,), context=context)
        _pool = ((workers, warm), pool, _start_in_lasting_thread(pool))
    return _pool[1]


def _start_in_lasting_thread(pool) -> threading.Event:
    """Start the pool's first workers from a thread that lives as long as the pool; returns the Event that ends it.
    PR_SET_PDEATHSIG fires when the *thread* that started a worker ends, and pebble starts its first workers in the
    thread that schedules first (later ones in its own manager thread): a dask worker's task threads come and go,
    and a worker started by one was killed with it ("All workers expired")."""
    started, stop = threading.Event(), threading.Event()

    def keep() -> None:
        try:
            pool.schedule(os.getpid)  # the first schedule starts the pool, here
        finally:
            started.set()
        stop.wait()

    threading.Thread(target=keep, name="kb-pool-keeper", daemon=True).start()
    started.wait()
    return stop


def running_pool(warm: Callable[[], None] | None) -> int:
    """How many workers the pool this process already holds for `warm` has (0: none), so that a later stage uses
    it at its size instead of stopping it for a pool of another size."""
    return _pool[0][0] if _pool is not None and _pool[0][1] is warm and _pool[1].active else 0


@atexit.register
def _stop_pool() -> None:
    global _pool
    if _pool is not None:
        _pool[1].stop()
        _pool[1].join(timeout=10)
        _pool[2].set()
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


def isolated_map(fn: Callable, tasks: Iterable, workers: int, timeout_s: float | None, memory_mb: float,
                 warm: Callable[[], None] | None = None) -> Iterator[tuple[int, Any]]:
    """(i, fn(task)) for the i-th task, in worker processes, in the order they finish: the result, or Lost(reason)
    when the task's worker ran past timeout_s (None: no limit), past memory_mb, or died. `warm` runs once in each
    new worker (imports). Tasks are taken from `tasks` as workers free up (see `_as_finished`)."""
    from concurrent.futures import TimeoutError as TaskTimeout

    from pebble import ProcessExpired

    pool = _shared_pool(workers, warm)
    with _memory_watchdog(memory_mb) as killed:
        for i, future in _as_finished(lambda _, task: pool.schedule(fn, args=(task,), timeout=timeout_s), tasks,
                                      AHEAD_PER_WORKER * workers):
            try:
                yield i, future.result()
            except TaskTimeout:
                yield i, Lost(f"its worker ran past the time limit of {timeout_s:g} s (KB_PARSE_TIMEOUT_S) and was"
                              " stopped")
            except ProcessExpired as exc:
                if exc.pid in killed:
                    yield i, Lost(f"its worker used more than {memory_mb:g} MB of memory (KB_PARSE_MEMORY_MB) and was"
                                  " stopped")
                else:
                    yield i, Lost(f"its worker died ({_exit_reason(exc.exitcode)})")


def _as_finished(submit: Callable[[int, Any], Any], tasks: Iterable, window: int) -> Iterator[tuple[int, Any]]:
    """(i, future) for each task as it finishes. A task is submitted when a slot frees up, at most `window`
    unfinished at a time: the files' bytes in memory stay bounded however large the source, the caller stores
    results while workers go on, and a slow task holds up no other (completion order, not submission order).
    Works with any future that has add_done_callback (concurrent.futures, pebble, dask). Unfinished tasks are
    cancelled when the caller stops early."""
    finished: queue.SimpleQueue = queue.SimpleQueue()
    running: dict = {}
    numbered = enumerate(tasks)
    try:
        while True:
            for i, task in islice(numbered, max(0, window - len(running))):
                future = submit(i, task)
                running[future] = i
                future.add_done_callback(finished.put)
            if not running:
                return
            future = finished.get()
            yield running.pop(future), future
    finally:
        for future in running:
            future.cancel()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _located(call: tuple) -> tuple[str, Any]:
    fn, task = call
    return where(), fn(task)


def spread_map(fn: Callable, tasks: Iterable[tuple[str, Any]], workers: Workers, timeout_s: float | None,
               memory_mb: float, warm: Callable[[], None] | None = None) -> Iterator[tuple[int, str | None, Any]]:
    """(i, where, fn(task)) for the i-th of the (name, task) pairs, in the order they finish, computed by `workers`
    (see the module's docstring), each in an isolated process under the time and memory limits; `where` names the
    process that did it (None for a Lost task); `name` labels the task on a dask cluster (its dashboard, its
    logs). Nothing to do starts no worker and asks no scheduler (a no-op refresh stays instant)."""
    tasks = iter(tasks)
    first = next(tasks, None)
    if first is None:
        return
    tasks = chain([first], tasks)
    if workers.dask:
        isolated = ((name, (fn, task, timeout_s, memory_mb, warm)) for name, task in tasks)
        for i, worker, result in dask_map(_isolated_on_dask_worker, isolated, workers.dask):
            yield i, None if isinstance(result, Lost) else worker, result  # a worker's own pool lost it there
        return
    located = ((fn, task) for _, task in tasks)
    for i, result in isolated_map(_located, located, workers.processes, timeout_s, memory_mb, warm):
        yield (i, None, result) if isinstance(result, Lost) else (i, *result)


@contextmanager
def dask_client(address: str) -> Iterator:
    """A client of the dask scheduler at `address`. Inside a task of that very cluster (a Dagster step on the dask
    executor) the task secedes from its worker's threads while it waits, so that its worker computes too."""
    from distributed import Client, get_worker, worker_client

    try:
        inside = get_worker().scheduler.address == address
    except ValueError:  # not on a dask worker
        inside = False
    if inside:
        with worker_client() as client:
            yield client
        return
    try:
        client = Client(address, set_as_default=False)
    except OSError as exc:
        raise WorkersUnavailable(f"the dask scheduler at {address} does not answer ({exc}); start it (`dask scheduler`"
                                 " and `dask worker`) or run without --dask / KB_DASK_SCHEDULER") from None
    with client:
        yield client


def dask_map(fn: Callable, tasks: Iterable[tuple[str, Any]], address: str
             ) -> Iterator[tuple[int, str | None, Any]]:
    """(i, where, fn(task)) for the i-th of the (name, task) pairs, in the order they finish, computed in the
    processes of the dask cluster's workers (no limits of their own: for trusted work such as embedding, whose model
    a worker loads once); a task whose workers died past allowed-failures is (i, None, Lost)."""
    from distributed import KilledWorker

    run = uuid.uuid4().hex[:8]  # task keys are unique per run: a rerun must not pick up an old run's results
    with dask_client(address) as client:
        # at least DASK_MIN_WINDOW: workers still connecting, or a cluster that scales up when work is queued
        window = max(DASK_MIN_WINDOW, AHEAD_PER_WORKER * sum(client.nthreads().values()))

        def submit(i: int, named: tuple[str, Any]):
            return client.submit(_located, (fn, named[1]), key=f"kb {named[0]} {run}-{i}", pure=False)

        for i, future in _as_finished(submit, tasks, window):
            try:
                yield (i, *future.result())
            except KilledWorker as exc:
                yield i, None, Lost(f"{exc.allowed_failures + 1} dask workers died while working on it"
                                    " (distributed.scheduler.allowed-failures); it was not retried again")


def _isolated_on_dask_worker(call: tuple) -> Any:
    """fn(task) in this dask worker's own pool of isolated processes (one per worker thread), under the same limits
    as on the caller's machine."""
    from distributed import get_worker

    fn, task, timeout_s, memory_mb, warm = call
    (_, result), = isolated_map(fn, [task], get_worker().state.nthreads, timeout_s, memory_mb, warm)
    return result
