"""Grades tasks 5.1-5.2: ``exercises/fsdp2_tasks.py`` (``--impl=student``) or the instructor's answer, run in the
learner's process.  No ranks; the numbers are drawn from the grading seed.

Oracles, both used on every case: ``torch.chunk`` (torch FSDP2's documented rule for dim-0 sharding:
``torch.chunk(tensor, N, dim=0)[rank]``, empty for ranks past the last chunk) and minifsdp's
``FSDPParam`` (the per-parameter sharding that tests/test_fsdp2.py proves bitwise against torch's
``fully_shard``): its ``padded_local`` / ``sharded_param`` for 5.1, the group's copy-out
(``AllGatherResult.copy_out``) for 5.2.  Bitwise:
the tasks only move numbers.
"""

import math

import torch
import torch.nn as nn

from minifsdp.fsdp2.core.collectives import AllGatherResult
from minifsdp.fsdp2.core.param import FSDPParam

SHAPES = [torch.Size(s) for s in [(5, 3), (4,), (2, 7), (1, 4), (96, 32), (33,), (7, 2, 3)]]
WORLD_SIZES = (1, 2, 3, 4)


def _param(t: torch.Tensor, rank: int, n: int) -> FSDPParam:
    return FSDPParam(nn.Parameter(t.clone()), [], rank, n)


def _fsdpparam_rows(t, rank, n):
    """The oracle from the library: minifsdp's FSDPParam's padded chunk and ``to_local()`` rows."""
    p = _param(t, rank, n)
    return p.padded_local, p.local_tensor


def _reference_copy_out(gathered, shapes):
    n = gathered.shape[0]
    params = [_param(torch.zeros(shape, dtype=gathered.dtype), 0, n) for shape in shapes]
    AllGatherResult(params, gathered, [p.shard_numel for p in params]).copy_out()
    return [p.unsharded_param.detach().clone() for p in params]


def _fn(learner, name):
    return getattr(learner("fsdp2_tasks"), name)


def _tensor(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _chunk_padded(t, rank, n):
    """The oracle's padded chunk, from torch.chunk alone."""
    c = math.ceil(t.shape[0] / n)
    chunks = torch.chunk(t, n)
    padded = t.new_zeros((c, *t.shape[1:]))
    if rank < len(chunks):
        padded[: chunks[rank].shape[0]] = chunks[rank]
    return padded


def test_task5_1_shard_rows(learner, course_seed):
    f = _fn(learner, "shard_rows")
    cases = 0
    for i, shape in enumerate(SHAPES):
        t = _tensor(shape, 1000 * course_seed + i)
        for n in WORLD_SIZES:
            locals_ = []
            for rank in range(n):
                padded, local = f(t, rank, n)
                chunks = torch.chunk(t, n)
                expected = chunks[rank] if rank < len(chunks) else t[t.shape[0]:]
                where = f"shape {tuple(shape)}, N = {n}, rank {rank}"
                assert local.shape == expected.shape and torch.equal(local, expected), where
                assert padded.shape == (math.ceil(shape[0] / n), *shape[1:]), where
                assert torch.equal(padded, _chunk_padded(t, rank, n)), f"{where}: padding rows must be zeros"
                ref_padded, ref_local = _fsdpparam_rows(t, rank, n)  # minifsdp's FSDPParam
                assert torch.equal(padded, ref_padded) and torch.equal(local, ref_local), where
                assert padded.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), \
                    f"{where}: padded must be a copy, not a view of the original"
                if local.numel():
                    assert local.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr(), \
                        f"{where}: local must be a view of padded (as to_local() is)"
                locals_.append(local)
                cases += 1
            assert torch.equal(torch.cat(locals_), t), f"shape {tuple(shape)}, N = {n}: the ranks' rows"
    assert cases == sum(WORLD_SIZES) * len(SHAPES)


def test_task5_2_copy_out(learner, course_seed):
    f = _fn(learner, "copy_out")
    groups = [SHAPES, SHAPES[:2], [torch.Size((33, 5)), torch.Size((2,))], [torch.Size((96, 32))]]
    for g, shapes in enumerate(groups):
        params = [_tensor(s, 1000 * course_seed + 100 * g + i) for i, s in enumerate(shapes)]
        for n in WORLD_SIZES:
            rows = [torch.cat([_chunk_padded(p, r, n).reshape(-1) for p in params]) for r in range(n)]
            gathered = torch.stack(rows)  # what the all-gather returns, one row per rank
            out = f(gathered, shapes)
            reference = _reference_copy_out(gathered, shapes)  # minifsdp's group copy-out
            assert len(out) == len(params) == len(reference), (g, n)
            for i, (o, p, r) in enumerate(zip(out, params, reference, strict=True)):
                where = f"group {g}, N = {n}, parameter {i} {tuple(shapes[i])}"
                assert o.shape == p.shape, f"{where}: shape {tuple(o.shape)} (padding rows left in?)"
                assert torch.equal(o, p), where
                assert torch.equal(o, r), where
