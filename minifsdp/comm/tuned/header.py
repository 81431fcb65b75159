"""The tuned ring's header: the same check as the textbook's, in fewer messages, and a doorbell.

Every collective first checks that all ranks called the same collective on the same tensor
shape (:mod:`minifsdp.comm.checks` says why; the error is the same).  The textbook sends
N(N-1) header messages and posts their receives as it goes.  On gloo each of those is a
round trip of its own, so this module spends them more carefully.  Why each choice, with the
numbers: ``chapters/results/ring_going_deeper.md``.

Note (doorbell: the header receive is posted one collective early): gloo's send/recv is a
rendezvous, and a receive posted *while* the other rank's message arrives can cost a whole
scheduler tick on a loaded machine (gloo's event thread spins on the connection's lock while our
thread, holding it, waits to run again).  A receive posted long before the message comes is the
fast path.  gloo accepts a message shorter than the receive buffer, never a longer one, so each
rank keeps one header receive per peer always posted, of a known capacity; the next one is
posted the moment this collective's header from that peer has been read (the line is quiet
then).  Own tag (``HEADER_TAG``): they never catch data.  One set per group, kept by its comm
stream (two would steal each other's headers).

Note (who speaks first): two messages crossing on one connection meet on its lock.  So at N=2
rank 0 speaks first and rank 1 answers once it has read rank 0's header: one more one-way trip,
but no two messages ever cross, and every header finds its receive already posted.  At N > 2 the
same idea as a star: every rank sends its header to group rank 0 only, and rank 0, once it has
read them all, sends the whole table back to each: 2(N-1) messages instead of N(N-1), none crossing.

        N=2:  rank 0 --header--> rank 1          N=4:  rank 1 --header--> rank 0
              rank 0 <--header-- rank 1                rank 2 --header--> rank 0
                                                       rank 3 --header--> rank 0
                                                       rank 0 --table---> ranks 1, 2, 3

Note (two ranks: carry, and the room for it): with N=2 a small all-reduce rides *inside* the
header message (``carry``): one message each way, into a receive posted long before.  A mismatch
still raises on both ranks: both read both headers before anyone uses the data.  The room a
doorbell keeps grows with use (a fixed 1 MB would be kept alive on every rank, even under FSDP,
which never all-reduces): each rank sizes its next doorbell to the largest all-reduce it has been
asked for (up to ``CARRY_BYTES``), and *says so in its header*.  A tensor is carried when it fits
both ranks' rooms -- both ranks know both numbers, so both decide the same way.  The first
all-reduce of a new, larger size is swapped (:mod:`.swap`); from the next one on it is carried.

      header k:  [kind, numel, dtype, op, extra, carried numel, room of my doorbell k+1, -]
                  '--------- must agree on every rank ---------'
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from minifsdp.comm.checks import header_row, mismatch_error
from minifsdp.comm.tuned.seat import Seat

__all__ = ["HEADER_TAG", "HEADER_BYTES", "CARRY_BYTES", "agree_on_header", "carry_room"]

HEADER_TAG = 0x6D66  # the tag of header messages ("mf"): never matches anyone's data sends (tag 0)
HEADER_BYTES = 64  # 8 int64: kind, numel, dtype, op, extra, carried numel, room of my next doorbell, spare
CARRY_BYTES = 1 << 20  # 2 ranks: the largest all-reduce that may travel inside a header message
AGREE = 6  # the first AGREE fields of a header must be equal on every rank


def carry_room(seat: Seat) -> int:
    """Bytes the collective about to run may carry in its header: room in both ranks' doorbells (0 if N != 2)."""
    bell = seat.doorbells.get((seat.rank + 1) % 2) if seat.size == 2 else None
    if bell is None:  # N != 2, or the first collective on this group
        return 0
    return min(bell["peer_room"], bell["posted"][0][2] - HEADER_BYTES)  # [0]: this collective's doorbell


def agree_on_header(seat: Seat, kind: str, tensor: torch.Tensor, op: str, extra: int = 0,
                    carry: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every rank learns every rank's (collective, numel, dtype, op, extra); all check they agree.

    2 ranks: rank 0 sends its header, rank 1 answers with its own.  N > 2: every rank sends its
    header to group rank 0, which sends the table of all of them back (Note (who speaks first)).

    ``carry`` (2 ranks only, at most ``carry_room(seat)`` bytes): data sent to the other rank in the
    same message as the header; returns what the other rank carried, once the headers agree (its
    bytes are counted, as data).  No data receive is posted before this returns (:mod:`.swap`,
    Note (receives are posted after the header)), so a mismatch leaves nothing to clean up.
    """
    nbytes = 0 if carry is None else carry.numel() * carry.element_size()
    room = _next_room(seat, kind, tensor)
    mine = header_row(kind, tensor, op, extra) + [0 if carry is None else carry.numel(), room, 0]
    table_bytes = seat.size * HEADER_BYTES if seat.size > 2 and seat.rank == 0 else 0  # rank 0 sends the table
    out = torch.empty(max(HEADER_BYTES + nbytes, table_bytes), dtype=torch.uint8)
    out[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(mine))
    if carry is not None:
        out[HEADER_BYTES:HEADER_BYTES + nbytes] = carry.view(-1).view(torch.uint8)
    if seat.size == 2:
        table, got = _two_ranks(seat, out[:HEADER_BYTES + nbytes], mine)
    else:
        table, got = _star(seat, out, mine), None
    if any(row[:AGREE] != table[0][:AGREE] for row in table):  # (the carried numel follows from the rest)
        raise mismatch_error(kind, table)
    if carry is None:
        return None
    received = seat.scratch(carry.numel(), carry)
    received.view(torch.uint8).copy_(got[HEADER_BYTES:HEADER_BYTES + nbytes])
    for s in seat.stats:
        s.add(sent=nbytes, received=nbytes, messages=1)
    return received


def _two_ranks(seat: Seat, message: torch.Tensor, mine: list[int]) -> tuple[list[list[int]], torch.Tensor]:
    """Rank 0 speaks, rank 1 answers: (both rows in rank order, the buffer the peer's message landed in)."""
    peer = 1 - seat.rank
    sending = [] if seat.rank == 1 else _send(seat, message, [peer])
    got = _read(seat, peer, HEADER_BYTES + mine[AGREE])  # our next doorbell has the room we announce
    if seat.rank == 1:
        sending = _send(seat, message, [peer])
    for work in sending:
        work.wait()
    row = got[:HEADER_BYTES].view(torch.int64).tolist()
    seat.doorbells[peer]["peer_room"] = row[AGREE]
    return ([mine, row] if seat.rank == 0 else [row, mine]), got


def _star(seat: Seat, out: torch.Tensor, mine: list[int]) -> list[list[int]]:
    """N > 2: every rank sends its header to group rank 0, which answers each with the whole table."""
    n = seat.size
    if seat.rank != 0:
        sending = _send(seat, out[:HEADER_BYTES], [0])
        got = _read(seat, 0, n * HEADER_BYTES)
        for work in sending:
            work.wait()
        return got[: n * HEADER_BYTES].view(torch.int64).view(n, -1).tolist()
    rows = [mine] + [_read(seat, i, HEADER_BYTES)[:HEADER_BYTES].view(torch.int64).tolist() for i in range(1, n)]
    out[: n * HEADER_BYTES].view(torch.int64).copy_(torch.tensor(rows).view(-1))
    for work in _send(seat, out[: n * HEADER_BYTES], list(range(1, n))):
        work.wait()
    return rows


def _read(seat: Seat, peer: int, next_capacity: int) -> torch.Tensor:
    """Wait for the message from group rank ``peer`` in this collective's doorbell, then post the next
    collective's (of ``next_capacity`` bytes, in a buffer of its own: the line is quiet now).  The buffer
    returned is this collective's to read; nothing keeps it after."""
    bell = _doorbell(seat, peer)
    work, buf, _ = bell["posted"].popleft()
    work.wait()
    bell["posted"].append(_post(seat, peer, next_capacity))
    return buf


def _send(seat: Seat, message: torch.Tensor, to: list[int]) -> list:
    """Start sending ``message`` (our header and what it carries, or rank 0's table) to each group rank in ``to``."""
    return [dist.isend(message, seat.global_rank(i), group=seat.group, tag=HEADER_TAG) for i in to]


def _next_room(seat: Seat, kind: str, tensor: torch.Tensor) -> int:
    """Room (bytes past the header) of this rank's next doorbells: the largest all-reduce asked for so far,
    up to ``CARRY_BYTES``; 0 at N != 2 (nothing is carried there) and until the first all-reduce."""
    nbytes = tensor.numel() * tensor.element_size()
    room = seat.doorbells.get("my_room", 0)
    if seat.size == 2 and kind == "all_reduce" and room < nbytes <= CARRY_BYTES:
        room = seat.doorbells["my_room"] = nbytes
    return room


def _doorbell(seat: Seat, peer: int) -> dict:
    """{"posted": (work, buffer, capacity) in the order posted, "peer_room": room the peer said its next
    doorbell has} for group rank ``peer``.  (``seat.doorbells`` also keeps "my_room": the room of ours.)

    Between collectives one receive per peer is posted (the next collective's), and that is all a
    group keeps: each collective reads the peer's message, then posts the next one's receive in a
    buffer of its own.  The first collective on the group posts its own receive here, with no room yet.
    """
    bell = seat.doorbells.get(peer)
    if bell is None:
        capacity = seat.size * HEADER_BYTES if (seat.size > 2 and peer == 0) else HEADER_BYTES  # rank 0's table
        bell = seat.doorbells[peer] = {"posted": collections.deque(), "peer_room": 0}
        bell["posted"].append(_post(seat, peer, capacity))
    return bell


def _post(seat: Seat, peer: int, capacity: int) -> tuple:
    """Post a header receive of ``capacity`` bytes from group rank ``peer``: (work, buffer, capacity)."""
    buf = torch.empty(capacity, dtype=torch.uint8)
    work = dist.irecv(buf, seat.global_rank(peer), group=seat.group, tag=HEADER_TAG)
    return work, buf, capacity
