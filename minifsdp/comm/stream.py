"""A "communication stream": one background thread per process group that runs collectives in order.

Why?  ``dist.all_reduce(t, async_op=True)`` returns at once and the caller keeps
computing while the bytes move; DDP overlaps its gradient all-reduces with the
rest of backward exactly this way.  Our ring collectives are a loop of
send/receive steps written in Python, so to run them "in the background" we
hand the whole loop to a worker thread and return a handle::

    caller thread                      comm stream of `group` (one thread, FIFO)
    -------------                      -----------------------------------------
    w1 = ring_all_reduce(a, async_op=True) --> [ ring over a ]
    w2 = ring_all_reduce(b, async_op=True) -->                [ ring over b ]
    ... keeps computing ...
    w1.wait(); w2.wait()               <-- done events set as each job finishes

Note (issue order): a stream runs its jobs one at a time, in the order they
were submitted.  Every rank submits the same collectives in the same order
(the rule of all collectives, torch's too), so the k-th ring on rank 0 talks to
the k-th ring on rank 1, and the messages of two collectives never interleave.
A synchronous call is just ``submit(job).wait()``, so it also queues behind the
async ones issued before it.  This is the CPU counterpart of a CUDA stream that
NCCL collectives are enqueued on.

Note (one stream per group): the streams live in a small table keyed by the
process group object.  Two groups get two threads; their messages cannot mix
because torch gives every process group its own connections.

Note (one intra-op thread): every job runs with ``torch.set_num_threads(1)`` in the thread that
runs it (inline or the stream's own), and the count is put back after.  On torch's OpenMP backend
an add or copy above 32768 elements is split over a thread team, and after the work the team's
threads spin, waiting for more; each thread that starts parallel work gets a team of its own
(the caller's and the stream's: two).  On a machine whose cores all have ranks on them, those
spinning threads take the cores that the other ranks (and gloo's threads) need to move our
bytes: with torch's default thread count our ring ran 5 to 25 times slower, gloo's not at all.
gloo adds on one thread; so do we.  The setting is the thread's own (OpenMP's is per thread), so
the caller's compute keeps its threads.  Measured: ``chapters/results/ring_threads.md``.

Note (a finished job is dropped): a job is a closure over its collective's tensors.  The thread
lets go of it as soon as it has run, *before* it wakes the waiter: when ``wait()`` returns, the
stream holds nothing of the caller's, so a tensor the caller drops is freed at once (a thread that
kept its last job until the next one came would keep the last gradient alive while the stream idles,
memory a census counts and torch does not hold).  Between collectives a stream keeps only the tuned
ring's header receives posted ahead (``doorbells``: :mod:`minifsdp.comm.tuned.header`).

Note (closing before exit): a stream's thread is a daemon, and Python does not
wait for daemon threads at exit.  A thread still inside a send or receive when
the interpreter shuts down dies in C++ as it tries to take the GIL back, and
the process aborts ("terminate called without an active exception").  The
table also keeps every group object alive, so a destroyed group's connections
would never close.  :func:`close_streams` stops the threads (each finishes the
jobs already queued, then exits) and empties the table.  The launcher calls it
(through :func:`minifsdp.launch.on_teardown`) before it destroys a process
group, and this module calls it at exit as well.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Callable

import torch

from minifsdp.comm.counting import active_stats, counting_for
from minifsdp.launch import on_teardown

__all__ = ["Work", "CommStream", "stream_for", "run_on_stream", "on_one_intra_op_thread", "close_streams",
           "live_streams"]

CLOSE_TIMEOUT_S = 30.0
_STOP = object()  # the job that tells a stream's thread to exit
# Only OpenMP's thread count is per thread; torch's native pool is one for all (and warns when resized).
_PER_THREAD_COUNT = "parallel backend: OpenMP" in torch.__config__.parallel_info()


def on_one_intra_op_thread(job: Callable[[], Any]) -> Any:
    """``job()`` with torch ops of *this* thread on one thread, the count put back after (Note (one intra-op
    thread)).  A plain function, not a ``with`` block: it runs around every collective, so it is kept cheap."""
    before = torch.get_num_threads() if _PER_THREAD_COUNT else 1
    if before == 1:
        return job()
    torch.set_num_threads(1)
    try:
        return job()
    finally:
        torch.set_num_threads(before)


class Work:
    """Handle of a collective that may still be running (like torch's ``dist.Work``).

    ``wait()`` blocks until it finished and re-raises its error, if any, in the
    calling thread.  ``is_completed()`` asks without blocking.
    """

    def __init__(self, name: str = "collective"):
        self.name = name
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the collective finished; raise its error here if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.name} did not finish within {timeout} s.")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._done.is_set()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self.is_completed() else "running")
        return f"Work({self.name}, {state})"


class CommStream:
    """A FIFO queue of jobs and the one daemon thread that runs them, in order."""

    def __init__(self, name: str):
        self.name = name
        self.doorbells: dict = {}  # the tuned ring's header receives posted ahead: all it keeps (comm/tuned/header.py)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._submit_lock = threading.Lock()  # no job may slip in behind the stop marker
        self._unfinished = 0  # jobs submitted and not finished yet (under _submit_lock)
        self._running = threading.Lock()  # held while a job runs, on the thread or inline
        self._thread = threading.Thread(target=self._run, name=f"minifsdp-comm-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any], name: str = "collective") -> Work:
        """Queue ``job`` behind every job submitted before it; return its handle."""
        work = Work(name)
        with self._submit_lock:
            if self._closed:
                raise RuntimeError(f"comm stream {self.name} is closed (its process group was torn down); "
                                   "issue collectives only while the process group exists.")
            self._unfinished += 1
            self._jobs.put((job, work))
        return work

    def run_inline_if_idle(self, job: Callable[[], Any]) -> bool:
        """Run ``job`` in the calling thread if no job is queued or running; False (not run) otherwise.

        A synchronous collective on an idle stream skips two thread wake-ups (hundreds of
        microseconds on a loaded machine).  Order is kept: a job submitted meanwhile waits for
        this one (the thread takes ``_running`` first).  ``job``'s error is raised here.
        """
        with self._submit_lock:
            if self._closed or self._unfinished or not self._running.acquire(blocking=False):
                return False
        try:
            on_one_intra_op_thread(job)
        finally:
            self._running.release()
        return True

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S) -> bool:
        """Let the jobs already queued finish, then stop the thread; True once it has exited.

        A job blocked for good (a receive whose sender is gone) keeps the thread
        alive: after ``timeout`` seconds we give up and return False.
        """
        with self._submit_lock:
            if not self._closed:
                self._closed = True
                self._jobs.put((_STOP, None))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def is_alive(self) -> bool:
        """True while the stream's thread runs (before :meth:`close` has finished)."""
        return self._thread.is_alive()

    def synchronize(self) -> None:
        """Wait until every job submitted so far has finished."""
        self.submit(lambda: None, "synchronize").wait()

    def _run(self) -> None:
        while True:
            job, work = self._jobs.get()
            if job is _STOP:
                return
            try:
                with self._running:
                    on_one_intra_op_thread(job)
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                error_or_none = error
            else:
                error_or_none = None
            job = None  # Note (a finished job is dropped): before the waiter wakes, never at the next job
            with self._submit_lock:
                self._unfinished -= 1
            work._finish(error_or_none)
            work = error_or_none = None


_STREAMS: dict[Any, CommStream] = {}
_STREAMS_LOCK = threading.Lock()


def stream_for(group: Any) -> CommStream:
    """The communication stream of ``group`` (created on first use)."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get(group)
        if stream is None:
            stream = _STREAMS[group] = CommStream(name=str(id(group)))
        return stream


def run_on_stream(group: Any, job: Callable[[CommStream], Any], name: str, async_op: bool) -> Work | None:
    """Run ``job(stream)`` on ``group``'s comm stream, behind every job issued before it; wait unless
    ``async_op`` (then return its :class:`Work`).  Its bytes count for the ``count_bytes()`` blocks open
    now, when it is issued (:mod:`minifsdp.comm.counting`).

    A synchronous call on an idle stream runs in the calling thread instead (the same order,
    two thread wake-ups fewer: :meth:`CommStream.run_inline_if_idle`).
    """
    stats = active_stats()
    stream = stream_for(group)

    def counted() -> None:
        with counting_for(stats):
            job(stream)

    if not async_op and stream.run_inline_if_idle(counted):
        return None
    work = stream.submit(counted, name)
    if async_op:
        return work
    work.wait()
    return None


def close_streams(timeout: float | None = CLOSE_TIMEOUT_S) -> list[str]:
    """Stop every stream's thread and forget the streams (and with them the groups they keep alive).

    Each thread first finishes the jobs already queued on it.  Returns the names
    of the threads still alive after ``timeout`` seconds (a job stuck in a
    receive); normally the list is empty.  A later collective starts a new stream.
    """
    with _STREAMS_LOCK:
        streams = list(_STREAMS.values())
        _STREAMS.clear()
    return [s._thread.name for s in streams if not s.close(timeout)]


def live_streams() -> list[str]:
    """Names of the comm-stream threads running now (for tests and teardown checks)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("minifsdp-comm-")]


def _close_streams_before_the_group_goes() -> None:
    stuck = close_streams()
    if stuck:
        print(f"minifsdp: comm stream thread(s) {stuck} still busy after {CLOSE_TIMEOUT_S:.0f} s "
              "(a collective that never completes?); tearing the process group down anyway.", flush=True)


# The launcher's teardown closes the streams before it destroys the group.  And even when no
# launcher of ours tears the group down, no comm thread outlives the interpreter's atexit phase:
# a daemon thread caught inside C++ at shutdown aborts the process.
on_teardown(_close_streams_before_the_group_goes)
atexit.register(_close_streams_before_the_group_goes)
