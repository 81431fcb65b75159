"""Tasks 4.4a-b: a row-parallel Linear on N simulated ranks; the 1F1B order of one pipeline stage.

* 4.4a :func:`row_parallel_linear`: the forward of Megatron's row-parallel Linear, every rank simulated
  in one process: each rank's partial product from its slice, the all-reduce, the bias.
* 4.4b :func:`one_f_one_b_order`: the order in which stage ``s`` of a ``p``-stage pipeline runs the
  forwards and backwards of ``m`` micro-batches under the 1F1B schedule.

The task text and hints are in ``exercises/README_parallel.md``.  Grade with::

    pytest tests/exercises/test_parallel_exercises.py --impl=student      # or -k 4_4a for one task

Reference solution: ``exercises/solutions/parallel_tasks.py``; the library's are
``minifsdp.parallel.tensor_parallel`` (``RowwiseParallel`` and its ``_rowwise_forward``) and
``minifsdp.parallel.pipeline_schedules.action_order`` (read them after you are done).
"""

from __future__ import annotations

import torch


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Task 4.4a.  ``nn.Linear``'s forward ``x @ weight.T + bias`` computed as ``world_size`` ranks would.

    Args:
        x: the whole input, shape ``(..., in_features)``.  Rank r only ever sees its columns
            ``r * in_features / N`` up to ``(r + 1) * in_features / N`` (the output of a column-parallel layer).
        weight: the whole weight, shape ``(out_features, in_features)``; rank r holds the same columns of it.
        bias: shape ``(out_features,)`` or None; whole on every rank.
        world_size: N, the number of ranks.  Must divide ``in_features`` (else raise ValueError).

    Returns ``(partials, outputs)``, two lists of N tensors of shape ``(..., out_features)``:
    ``partials[r]`` is rank r's product of its slices (before any communication) and ``outputs[r]`` what
    rank r holds after the all-reduce (the sum of the partials, in rank order 0, 1, ..., N-1) and the bias.
    Do not modify the inputs.
    """
    raise NotImplementedError("Task 4.4a: row_parallel_linear -- see exercises/README_parallel.md")


def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> list[str]:
    """Task 4.4b.  The actions stage ``stage_index`` runs in one 1F1B step, in order.

    ``"F3"`` is the forward of micro-batch 3, ``"B3"`` its backward; each micro-batch 0..m-1 appears once as
    F and once as B.  Stages are numbered 0 (gets the input) to ``num_stages - 1`` (computes the loss).
    Raise ValueError if ``n_microbatches < num_stages`` (torch's ``Schedule1F1B`` refuses it too) or if
    ``stage_index`` is not in ``0 .. num_stages - 1``.
    """
    raise NotImplementedError("Task 4.4b: one_f_one_b_order -- see exercises/README_parallel.md")
