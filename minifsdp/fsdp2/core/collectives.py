"""A group's two collectives (torch's ``_fsdp_collectives.py``): the all-gather in, the reduce-scatter out.

Sharding is per parameter, but communication is per group (one ``fully_shard`` call): one all-gather brings in
every parameter of a block, one reduce-scatter sends out every gradient.  A collective moves one flat buffer per
rank, so each side packs the group's tensors into one buffer and unpacks the result.

All-gather (:func:`foreach_all_gather`, then :meth:`AllGatherResult.copy_out`), a group of ``w`` (5 x 2) and ``b``
(3,) at N = 2 (chunks of 3 rows of w, 2 of b, padding ``.``)::

    copy-in, each rank:  [ w's padded chunk | b's padded chunk ]          total = 6 + 2 = 8 numbers
    all-gather:          rows (N, total)   rank 0: [w0 w0 w1 w1 w2 w2 | b0 b1]
                                           rank 1: [w3 w3 w4 w4 .  .  | b2 . ]
    copy-out:            w.full_padded.view(N, 6) <- columns 0..5 of both rows  = w0..w4 and one padding row
                         b.full_padded.view(N, 2) <- columns 6..7               = b0 b1 b2 .
                         the modules see w.full_padded.view(6, 2)[:5] and b.full_padded[:3]

Why a copy-in and a copy-out, instead of one all-gather per parameter: one collective per group pays the
latency once (a block has a dozen tensors, many of them tiny), and the copies are the price: two passes over the
group's bytes, cheap next to the wire.

Reduce-scatter (:func:`foreach_reduce`), the mirror image: torch's "chunk-cat" cuts every full gradient into N
chunks of rows (padded like the parameter's), and row r of the input is every gradient's chunk r side by side,
exactly rank r's all-gather layout.  The collective sums row r over the ranks and hands it to rank r::

    input (N, total), each rank:  [ grad_w chunk 0 | grad_b chunk 0 ]  -> rank 0
                                  [ grad_w chunk 1 | grad_b chunk 1 ]  -> rank 1
    output (total,) on rank r:    sum over ranks of row r, averaged -> split per parameter, padding cut off
                                  -> the sharded parameter's ``.grad`` (a DTensor, as the parameter)

Note (the divide): ranks average their gradients.  In fp32 and bf16 torch asks the collective itself to average
(``avg``, one division inside).  fp16 has little range: a sum over many ranks may overflow, and dividing every
small gradient by N first may underflow; so torch divides by a power of two about sqrt(N) before a ``sum`` and by
the rest after (:func:`gradient_divide_factors`).  Ours follows the same rule, so the results match bitwise.
"""

from __future__ import annotations

import torch

from minifsdp.fsdp2.core.param import FSDPParam

__all__ = ["gradient_divide_factors", "AllGatherResult", "foreach_all_gather", "foreach_reduce"]


def gradient_divide_factors(shard_size: int, data_parallel_size: int, reduce_dtype: torch.dtype,
                            factor: float | None = None, force_sum: bool = False):
    """``(divide before, divide after, reduce-scatter op, all-reduce op)``: torch's ``_get_gradient_divide_factors``.
    ``factor``: divide by it instead of the rank count (``premul_sum`` by 1/f unless f is the shard size)."""
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            return (None, None, "sum", "sum") if data_parallel_size == 1 else (None, None, "avg", "avg")
        return None, None, "avg" if factor == shard_size else ("premul_sum", 1.0 / factor), "sum"
    factor = float(data_parallel_size) if factor is None else factor
    if not overflow_risk:
        return None, factor, "sum", "sum"
    pre = 1  # double it while it divides f and stays below f / pre: f = 8 -> 4 before, 2 after; f = 3 -> 2, 1.5
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre, "sum", "sum"


class AllGatherResult:
    """An all-gather that ran, not yet copied out: ``rows`` is ``(P, total)``, one row per rank, each row the
    ``numels`` of ``params`` side by side (torch's ``AllGatherResult``)."""

    def __init__(self, params: list[FSDPParam], rows: torch.Tensor, numels: list[int]):
        self.params, self.rows, self.numels = params, rows, numels

    @torch.no_grad()
    def copy_out(self) -> None:
        """Each parameter's columns of every row into its full buffer, all in one op (``split_with_sizes_copy``,
        as torch's ``foreach_all_gather_copy_out``)."""
        outs = [p.alloc_unsharded().view(self.rows.shape[0], n) for p, n in zip(self.params, self.numels, strict=True)]
        # the same buffers are refilled every gather: keep autograd's version check from seeing the writes
        with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
            torch.split_with_sizes_copy(self.rows, self.numels, dim=1, out=outs)


@torch.no_grad()
def foreach_all_gather(params: list[FSDPParam], inputs: list[torch.Tensor], dtype: torch.dtype, comm, group,
                       rank: int, world_size: int) -> AllGatherResult:
    """Copy-in and one all-gather (torch's ``foreach_all_gather``): ``inputs`` (one flat tensor per parameter) into
    this rank's row of a ``(world_size, total)`` buffer, cast to ``dtype`` on the way, then every rank's row in."""
    numels = [t.numel() for t in inputs]
    total = sum(numels)
    gathered = torch.empty(world_size * total, dtype=dtype, device=inputs[0].device)
    mine = gathered.narrow(0, rank * total, total)
    torch._foreach_copy_(list(mine.split(numels)), inputs)  # the copy-in
    if world_size > 1:
        comm.all_gather(gathered, mine, group=group)  # synchronous, as torch's on a CPU: nothing overlaps it
    return AllGatherResult(params, gathered.view(world_size, total), numels)


@torch.no_grad()
def foreach_reduce(group, params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
    """Reduce-scatter a group's (:class:`~minifsdp.fsdp2.core.param_group.FSDPParamGroup`) full gradients; each rank
    keeps its rows as ``.grad`` of its sharded parameters.  ``grads`` is emptied once copied in (the caller's list
    too), so the full gradients are freed before the collective, as torch's ``unsharded_grads.clear()``."""
    for plugin in group.plugins:
        plugin.before_reduce(group, params, grads)
    if not grads:  # no parameter got a gradient, or a plugin keeps them for a later backward
        return
    reduce_dtype = params[0].reduce_dtype or grads[0].dtype
    n, numels = group.world_size, [p.shard_numel for p in params]
    if any(g.dtype != grads[0].dtype for g in grads):
        grads[:] = [g.to(reduce_dtype) for g in grads]
    inp = torch.empty(n, sum(numels), dtype=reduce_dtype, device=grads[0].device)
    torch._chunk_cat(grads, dim=0, num_chunks=n, out=inp)  # cut in N chunks of rows, zero-padded, cast: one op
    grads.clear()
    pre, post, op, _ = gradient_divide_factors(n, group.data_parallel_size, reduce_dtype,
                                               group.gradient_divide_factor, group.force_sum_reduction_for_comms)
    if pre is not None and pre != 1:
        inp.div_(pre)
    out = torch.empty(sum(numels), dtype=reduce_dtype, device=inp.device)
    if n > 1:
        if isinstance(op, tuple):  # ("premul_sum", 1/f): gloo has no PREMUL_SUM; scale, then sum
            inp.mul_(op[1])
            op = "sum"
        group.comm.reduce_scatter(out, inp.view(-1), op=op, group=group.group)
    elif group.gradient_divide_factor is not None:
        out.copy_(inp.view(-1) / group.gradient_divide_factor)
    else:
        out.copy_(inp.view(-1))
    for plugin in group.plugins:
        if plugin.after_reduce(group, out) is False:  # a plugin keeps this reduction for later (micro-batches)
            return
    if post is not None and post != 1:
        out.div_(post)
    for p, chunk in zip(params, out.split(numels), strict=True):
        p.accumulate_sharded_grad(chunk)
