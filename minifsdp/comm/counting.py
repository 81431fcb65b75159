"""Chapter 2.2: how many bytes did our collectives move?  ``with count_bytes() as stats: ...``

Every send and receive of our collectives (the textbook ring in :mod:`minifsdp.comm.ring`, the
tuned one in :mod:`minifsdp.comm.tuned`) adds its size to each counter open at the time::

    with count_bytes() as stats:
        ring_all_reduce(t)
    stats.sent, stats.received, stats.messages      # this rank's bytes, and data messages sent

Blocks nest (the inner block's bytes count in the outer one too).  Only data is counted: the
small messages that check every rank called the same collective are control traffic.

Note (counted where it was issued): an asynchronous collective runs later, on its group's comm
stream thread (:mod:`minifsdp.comm.stream`), maybe after its ``with`` block has closed.  Its
bytes still belong to the blocks open when it was *issued*: the stream runs each job inside
``counting_for(stats)``, with ``stats`` taken by :func:`active_stats` when the job was queued.
Read the counters after ``wait()``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

__all__ = ["ByteStats", "count_bytes", "active_stats", "counting_for"]


@dataclass(eq=False)  # identity, not value: count_bytes removes *its* counter on exit
class ByteStats:
    """Bytes this rank sent / received through our collectives, and how many data messages it sent."""

    sent: int = 0
    received: int = 0
    messages: int = 0

    def add(self, sent: int = 0, received: int = 0, messages: int = 0) -> None:
        self.sent, self.received, self.messages = self.sent + sent, self.received + received, self.messages + messages


_OPEN: list[ByteStats] = []  # the count_bytes() blocks open now, in any thread
_ISSUED = threading.local()  # .stats: the counters of the job this thread runs (counting_for)


@contextlib.contextmanager
def count_bytes():
    """Count the bytes of every collective issued inside the ``with`` block (nesting is fine)."""
    stats = ByteStats()
    _OPEN.append(stats)
    try:
        yield stats
    finally:
        _OPEN.remove(stats)


def active_stats() -> tuple[ByteStats, ...]:
    """The counters a send or receive made now adds to: the issuing blocks' inside a comm stream job,
    else every ``count_bytes()`` block open now."""
    issued = getattr(_ISSUED, "stats", None)
    return tuple(_OPEN) if issued is None else issued


class counting_for:  # noqa: N801 - used as a function: ``with counting_for(stats):``
    """Inside the block, this thread's sends and receives count into ``stats`` (what was open at issue).
    (A class, not ``@contextmanager``: it runs around every collective, so it is kept cheap.)"""

    def __init__(self, stats: tuple[ByteStats, ...]):
        self.stats = stats
        self.before: tuple[ByteStats, ...] | None = None

    def __enter__(self) -> None:
        self.before = getattr(_ISSUED, "stats", None)
        _ISSUED.stats = self.stats

    def __exit__(self, *exc) -> None:
        _ISSUED.stats = self.before
