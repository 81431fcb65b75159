"""This rank's seat in the tuned ring: its neighbours, its byte counters, its buffers for one collective.

The textbook ring (:mod:`minifsdp.comm.ring`) asks ``dist`` for the rank, the world size and the
peers' global ranks at every step, and allocates its buffers in every call.  The tuned ring
keeps them in a :class:`Seat`, built once per collective: the scratch buffers it receives into
(``workspace``, one per dtype and device, made in this collective), and the header receives
posted ahead (``doorbells``: :mod:`.header`), the one thing the group's comm stream keeps between
collectives (:mod:`minifsdp.comm.stream`).

Note (workspace): one scratch buffer per dtype and device, for this collective only, and dropped
with the seat when it ends, as gloo's own algorithms allocate theirs per call: memory kept between
collectives is memory every rank holds while it trains (a census counts it; torch does not hold
it).  Its size: (N-1)/N of the tensor all-reduced (the whole tensor at N=2, swapped: :mod:`.swap`),
one chunk for a reduce-scatter (FSDP: one rank's shard of the unit), two if the output is a chunk
of the input.  The price is the allocation: glibc's malloc, once a block of a size has been freed,
serves the next one of that size from memory it kept (its dynamic mmap threshold, up to 32 MB on
64-bit: mallopt(3), M_MMAP_THRESHOLD); above that, each call maps, and faults in, fresh pages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minifsdp.comm.counting import ByteStats, active_stats

__all__ = ["Seat", "NOTHING"]


class _Nothing:
    """Stands in for the handle of an empty message, which is never sent."""

    def wait(self) -> bool:
        return True


NOTHING = _Nothing()


class Seat:
    """This rank's seat in the ring of ``group``: its rank, neighbours, counters and kept buffers."""

    def __init__(self, group, workspace: dict | None = None, doorbells: dict | None = None,
                 stats: tuple[ByteStats, ...] | None = None):
        self.group = group
        self.workspace = {} if workspace is None else workspace  # tensors only, this collective's
        self.doorbells = {} if doorbells is None else doorbells
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.stats = active_stats() if stats is None else stats
        self._global: dict[int, int] = {}  # group rank -> global rank, which isend/irecv expect

    def global_rank(self, group_rank: int) -> int:
        group_rank %= self.size
        if group_rank not in self._global:
            self._global[group_rank] = dist.get_global_rank(self.group, group_rank)
        return self._global[group_rank]

    def isend(self, tensor: torch.Tensor, to: int):
        """Start sending ``tensor`` to group rank ``to``; returns something to ``.wait()`` on."""
        for s in self.stats:
            s.add(sent=tensor.numel() * tensor.element_size(), messages=int(tensor.numel() > 0))
        if not tensor.numel():  # both ends know every chunk size, so both skip empty messages
            return NOTHING
        return dist.isend(tensor, self.global_rank(to), group=self.group)

    def irecv(self, tensor: torch.Tensor, source: int):
        """Start receiving into ``tensor`` from group rank ``source``; returns something to ``.wait()`` on."""
        for s in self.stats:
            s.add(received=tensor.numel() * tensor.element_size())
        if not tensor.numel():
            return NOTHING
        return dist.irecv(tensor, self.global_rank(source), group=self.group)

    def exchange(self, send: torch.Tensor, send_to: int, recv: torch.Tensor, recv_from: int) -> None:
        """Send ``send`` to group rank ``send_to`` while receiving ``recv`` from ``recv_from``; wait for both."""
        sending, receiving = self.isend(send, send_to), self.irecv(recv, recv_from)
        sending.wait()
        receiving.wait()

    def step(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """One ring step: send to the next rank, receive from the previous one."""
        self.exchange(send, self.rank + 1, recv, self.rank - 1)

    def scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable buffer of ``numel`` elements (dtype/device of ``like``) to receive into (Note (workspace))."""
        key = (like.dtype, like.device)
        buf = self.workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.workspace[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]
