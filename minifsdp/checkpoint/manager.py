"""Keep the newest K checkpoints of a run: ``root/step_<n>``, written and pruned safely.

Built on :func:`~minifsdp.checkpoint.save_load.save` / ``load``; the file-level safety
(atomic directories, checksums) is in ``files.py``.
"""

from __future__ import annotations

import os
import re
import shutil

from minifsdp.checkpoint.files import barrier, is_complete, rank_of
from minifsdp.checkpoint.save_load import load, save

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """``root/step_<n>`` checkpoints, the newest ``keep`` kept.

        ckpt = CheckpointManager("run", keep=2)
        start = ckpt.load_latest(model, opt)         # None when there is none yet
        ...
        ckpt.save(step, model, opt, extra={...})     # then removes all but the 2 newest

    Note: only complete checkpoints count (``latest`` skips a ``.tmp`` left by a
    crash), and old ones are removed only after the new one is complete.
    """

    _NAME = re.compile(r"^step_(\d+)$")

    def __init__(self, root: str, keep: int = 2, group=None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest checkpoint is never deleted), got {keep}")
        self.root, self.keep, self.group = root, keep, group

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        found = [(int(m.group(1)), n) for n in os.listdir(self.root) if (m := self._NAME.match(n))]
        return sorted(s for s, n in found if is_complete(os.path.join(self.root, n)))

    def latest(self) -> str | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(self, step: int, model, optimizer=None, extra=None, **kwargs) -> str:
        path = self.path(step)
        save(path, model, optimizer, extra=extra, group=self.group, **kwargs)
        if rank_of(self.group) == 0:
            for old in self.steps()[: -self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)
        barrier(self.group)  # no rank lists the checkpoints while rank 0 is still removing old ones
        return path

    def load_latest(self, model, optimizer=None, **kwargs):
        """Load the newest complete checkpoint; returns its ``extra`` (None if there is no checkpoint)."""
        path = self.latest()
        return None if path is None else load(path, model, optimizer, group=self.group, **kwargs)
