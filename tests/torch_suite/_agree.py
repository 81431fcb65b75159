"""Rank side of the port's batches: after each side of a case, every rank learns every rank's outcome.

A case fails by raising, and it may raise on one rank only (torch's checks compare each rank's own loss):
that rank leaves the case while the others go on into its next collective, which now waits forever for the
rank that left.  A ``dist.barrier()`` after the side would wait with them, until the batch's time limit.
So the ranks meet in the *store* instead (the rendezvous store of the group: no collective, so a rank
blocked in one cannot block it):

    rank r, its side over:   store[case/side/r] = (error or None, traceback)
                             wait until every rank's key is there
                             - all there: the side is over everywhere; go on (the outcomes are each rank's own)
                             - a rank failed and another is still missing ``LEFT_WAITING_S`` later: that one
                               waits in a collective the failed rank will never join.  Ask it for the stack it
                               waits in (its watchdog thread answers), and end the batch: raise
                               :class:`RanksLeftWaiting`, naming the case, the side, each rank's error and
                               where the others wait (in the rank's log, for the parent's harness).

A rank that is merely slower (no rank failed) is waited for, as the barrier did.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

import torch.distributed as dist

__all__ = ["LEFT_WAITING_S", "RanksLeftWaiting", "Meeting"]

LEFT_WAITING_S = 5.0  # after a rank's side failed: how long the other ranks get to finish that side too
STACK_WAIT_S = 3.0  # how long a rank that ends the batch waits for the stacks of the ranks left waiting
_POLL_S = 0.05


class RanksLeftWaiting(RuntimeError):
    """A side failed on some ranks while the others are still inside it: the batch cannot go on."""


class Meeting:
    """The store meetings of one batch on this rank, and the watchdog that answers where this rank waits."""

    def __init__(self, prefix: str = "minifsdp/torch_suite"):
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.prefix = prefix
        self._main = threading.main_thread().ident
        self._over = threading.Event()
        self._watchdog = threading.Thread(target=self._answer_abort, name="torch-suite-watchdog", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        self._over.set()
        self._watchdog.join(timeout=1.0)

    def _answer_abort(self) -> None:
        """When a rank ends the batch, write where this rank's main thread is (it may be blocked for good)."""
        abort = f"{self.prefix}/abort"
        while not self._over.wait(_POLL_S * 4):
            if self.store.check([abort]):
                frame = sys._current_frames().get(self._main)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no main thread)"
                self.store.set(f"{self.prefix}/stack/{self.rank}", stack[-3000:])
                return

    def side_over(self, cid: str, side: str, err: str | None, tb: str | None) -> None:
        """Say this rank's outcome of ``side`` of case ``cid``; return once every rank has said its own."""
        key = f"{self.prefix}/{cid}/{side}"
        self.store.set(f"{key}/{self.rank}", json.dumps([err, tb]))
        outcomes: dict[int, list] = {}
        failed_at = None
        while True:
            for r in range(self.world):
                if r not in outcomes and self.store.check([f"{key}/{r}"]):
                    outcomes[r] = json.loads(self.store.get(f"{key}/{r}"))
            if len(outcomes) == self.world:
                return
            if failed_at is None and any(e for e, _ in outcomes.values()):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > LEFT_WAITING_S:
                raise self._left_waiting(cid, side, outcomes)
            time.sleep(_POLL_S)

    def _left_waiting(self, cid: str, side: str, outcomes: dict) -> RanksLeftWaiting:
        """Collect the stacks of the ranks that never came; the error that ends the batch (summary in its
        message, every rank's traceback in ``.detail``)."""
        missing = [r for r in range(self.world) if r not in outcomes]
        self.store.set(f"{self.prefix}/abort", "1")
        deadline = time.monotonic() + STACK_WAIT_S
        stacks = {}
        while time.monotonic() < deadline and len(stacks) < len(missing):
            for r in missing:
                if r not in stacks and self.store.check([f"{self.prefix}/stack/{r}"]):
                    stacks[r] = self.store.get(f"{self.prefix}/stack/{r}").decode()
            time.sleep(_POLL_S)
        failed = sorted((r, e) for r, (e, _) in outcomes.items() if e)
        summary = (f"{side} side of {cid}: rank {failed[0][0]} failed ({failed[0][1]}) while rank(s) {missing} "
                   f"were left waiting inside the case (in a collective the failed rank never joins)")
        parts = [f"--- rank {r}: {e}\n{outcomes[r][1] or ''}" for r, e in failed]
        parts += [f"--- rank {r}: left waiting here\n{stacks.get(r, '(its stack did not come)')}" for r in missing]
        error = RanksLeftWaiting(summary)
        error.detail = "\n".join(parts)
        return error
