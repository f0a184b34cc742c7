"""A dask worker preload for the lost-worker test: the first worker that starts a task whose key contains
$KB_TEST_KILL_ON kills itself (SIGKILL, as the OOM killer or a lost machine would), once per $KB_TEST_KILL_MARKER.
Deterministic: it fires when that task starts, whatever the timing of the rest."""

import os
import signal

from distributed import WorkerPlugin


class KillOnce(WorkerPlugin):
    def transition(self, key, start, finish, **kwargs):
        if finish != "executing" or os.environ["KB_TEST_KILL_ON"] not in str(key):
            return
        try:
            os.close(os.open(os.environ["KB_TEST_KILL_MARKER"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # killed once already: this is the task's second worker
            return
        os.kill(os.getpid(), signal.SIGKILL)


async def dask_setup(worker) -> None:
    await worker.plugin_add(KillOnce(), name="kb-kill-once")
