"""Tasks 5.1 and 5.2: FSDP2's per-parameter layout -- shard one parameter by rows; copy a gathered buffer out.

* 5.1 :func:`shard_rows`: this rank's dim-0 rows of one parameter, as FSDP2 stores them (a padded chunk of
  ``ceil(d0 / N)`` rows) and as the user sees them (``to_local()``: the unpadded rows, a view of that chunk).
* 5.2 :func:`copy_out`: after the all-gather of a parameter group, split every rank's row of the gathered
  buffer back into each parameter's full tensor, dropping the padding.

The task text and hints are in ``exercises/README_fsdp2.md``.  Grade with::

    pytest tests/exercises/test_fsdp2_exercises.py --impl=student      # or -k 5_1 for one task

Reference solution: ``exercises/solutions/fsdp2_tasks.py``; inside FSDP2 they are minifsdp/fsdp2/core/param.py's
``FSDPParam.__init__`` (it builds ``padded_local`` and ``sharded_param``, with ``chunk_rows`` / ``local_row_range``
beside it) and minifsdp/fsdp2/core/collectives.py's ``AllGatherResult.copy_out`` (read them after you are done).
"""

from __future__ import annotations

import torch


def shard_rows(tensor: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Task 5.1.  ``(padded, local)``: rank ``rank``'s rows of ``tensor`` (shape ``(d0, *rest)``, d0 >= 1).

    ``padded``: a new tensor (not sharing storage with ``tensor``) of shape ``(c, *rest)``,
    ``c = ceil(d0 / world_size)``, holding the rank's rows first and zeros below them.
    ``local``: the rank's rows only, ``torch.chunk(tensor, world_size)[rank]`` (an empty ``(0, *rest)``
    tensor for a rank past the last chunk), as a view of ``padded`` (it shares ``padded``'s storage).
    """
    raise NotImplementedError("Task 5.1: shard_rows -- see exercises/README_fsdp2.md")


def copy_out(gathered: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Task 5.2.  The full parameters from one group's all-gathered buffer.

    ``gathered``: shape ``(N, total)``; row r is rank r's all-gather input: the concatenation, in the order of
    ``shapes``, of each parameter's padded chunk (task 5.1's ``padded``) flattened.  Return one tensor per
    shape, of exactly that shape, without padding.
    """
    raise NotImplementedError("Task 5.2: copy_out -- see exercises/README_fsdp2.md")
