"""N ranks as threads of one process, for the ring's fast checks: no spawn, no sockets, a hang is a timeout.

``run_ranks(fn, n)`` runs ``fn(group)`` on ``n`` threads and returns their results in rank order;
each thread's ``group`` is a :class:`ThreadGroup` that knows its rank.  While it runs, the
``torch.distributed`` calls our collectives make (``is_initialized``, ``get_rank``,
``get_world_size``, ``get_global_rank``, ``isend``, ``irecv``) go to an in-memory mailbox instead:
a message is matched to the receives its destination posted for that (source, tag) *in the order
they were posted*, as gloo matches them; a message longer than its receive is an error (gloo
aborts the process); a receive no one sends to times out after ``TIMEOUT_S`` and names the rank.
So the real ring code (textbook and tuned) runs at any world size in well under a second, and a
wrong chunk index fails here, in seconds, before any multi-rank spawn.

Sends are buffered (a send never waits for its receive), so this cannot show a deadlock of
blocking sends; the multi-rank tests on gloo can.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from unittest import mock

import torch
import torch.distributed as dist

from minifsdp.comm.stream import close_streams

TIMEOUT_S = 5.0


class ThreadGroup:
    """The process group of one thread-rank: its rank and the world size (group rank == global rank)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def __repr__(self) -> str:
        return f"ThreadGroup(rank={self.rank}, size={self.size})"


class _Receive:
    def __init__(self, tensor: torch.Tensor, where: str):
        self.tensor, self.where = tensor, where
        self.done = threading.Event()
        self.error: Exception | None = None

    def wait(self, timeout=None) -> bool:
        if not self.done.wait(TIMEOUT_S):
            raise TimeoutError(f"{self.where}: nothing arrived in {TIMEOUT_S:.0f} s "
                               "(waiting for a chunk no rank sends?)")
        if self.error is not None:
            raise self.error
        return True


class _Sent:
    def wait(self, timeout=None) -> bool:
        return True


class Mailbox:
    """Messages and posted receives per (source, destination, tag), matched first come, first served."""

    def __init__(self):
        self.lock = threading.Lock()
        self.messages: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self.receives: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def _match(self, key: tuple) -> None:
        while self.messages[key] and self.receives[key]:
            message, receive = self.messages[key].popleft(), self.receives[key].popleft()
            room = receive.tensor.numel() * receive.tensor.element_size()
            if message.numel() > room:
                receive.error = RuntimeError(f"{receive.where}: a message of {message.numel()} B for a receive "
                                             f"of {room} B (gloo would abort)")
            else:
                receive.tensor.view(-1).view(torch.uint8)[: message.numel()].copy_(message)
            done, receive = receive.done, None  # let go of the receiver's tensor before it wakes, as gloo does
            done.set()

    def isend(self, tensor: torch.Tensor, dst: int, group: ThreadGroup, tag: int = 0) -> _Sent:
        key = (group.rank, dst, tag)
        with self.lock:
            self.messages[key].append(tensor.detach().reshape(-1).view(torch.uint8).clone())
            self._match(key)
        return _Sent()

    def irecv(self, tensor: torch.Tensor, src: int, group: ThreadGroup, tag: int = 0) -> _Receive:
        key = (src, group.rank, tag)
        receive = _Receive(tensor, f"rank {group.rank} receiving from rank {src} (tag {tag})")
        with self.lock:
            self.receives[key].append(receive)
            self._match(key)
        return receive


@contextlib.contextmanager
def _thread_dist(mailbox: Mailbox):
    patches = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "get_rank": lambda group=None: group.rank if group is not None else -1,
        "get_world_size": lambda group=None: group.size,
        "get_global_rank": lambda group, rank: rank,
        "isend": mailbox.isend,
        "irecv": mailbox.irecv,
    }
    with contextlib.ExitStack() as stack:
        for name, fake in patches.items():
            stack.enter_context(mock.patch.object(dist, name, fake))
        try:
            yield
        finally:
            close_streams(timeout=TIMEOUT_S)  # the thread-ranks' comm streams (one per ThreadGroup)


def run_ranks(fn, n: int, args: tuple = ()) -> list:
    """``fn(group, *args)`` on ``n`` thread-ranks at once; their results in rank order, or the first error."""
    results: list = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(ThreadGroup(rank, n), *args)
        except BaseException as e:  # noqa: BLE001 - reported below, with the rank
            errors.append((rank, e))

    with _thread_dist(Mailbox()):
        threads = [threading.Thread(target=body, args=(r,), name=f"thread-rank-{r}") for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * TIMEOUT_S)
        stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise TimeoutError(f"{stuck} still running after {4 * TIMEOUT_S:.0f} s")
    if errors:
        rank, error = min(errors, key=lambda e: e[0])
        raise AssertionError(f"rank {rank} of {n} raised {type(error).__name__}: {error}") from error
    return results
