"""Grades tasks 2.1a-c (FSDP's core operations): the module ``impl_module("fsdp_tasks", impl)`` gives, the
stubs in exercises/fsdp_tasks.py (``--impl=student``) or the instructor's answer.

2.1a runs in this process (no communication).  2.1b and 2.1c need ranks: one
spawn of 3 ranks grades both (the default group, N = 3, and the subgroup of
ranks 0 and 1, N = 2); a task that raises NotImplementedError is recorded as
failing and the next is graded.  If anything else goes wrong (a crash, a hang)
each task is graded again in its own spawn, so one broken task cannot fail the other.

Oracles and tolerances:
* 2.1a: the definition (concatenate, zero-pad to a multiple of N, cut N equal
  pieces), element for element; plus storage checks for "view, not copy".
* 2.1b: torch FSDP1 itself.  Each rank trains the same small model under torch's
  FSDP and as a plain copy; the plain copy's flat gradient goes into the task's
  function, whose result must equal torch's sharded ``.grad`` bitwise (the same
  gloo reduce-scatter sums in the same order).  This catches padding and order
  errors, and dividing by N = 3 *before* the sum (it rounds on every rank).
  Dividing by N once *after* the sum gives the same bits as torch's recipe in
  fp32 (torch's pre-divide factor is a power of two: exact), so a second case
  uses gradients near fp32's largest number, where that sum overflows to inf;
  the oracle there is the exact average (small integers times 2^125, exact
  in float64), and the test checks that the plain sum really overflows.
* 2.1c: ``torch.nn.utils.clip_grad_norm_`` on the whole gradient in one process.
  Tolerance rtol 1e-5: the squares are summed in another order (per shard,
  then across ranks) than torch's per-tensor norms.  Without clipping the
  shards must come back bitwise unchanged.
"""

import importlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import minifsdp
from minifsdp.launch import RankFailedError
from tests.exercises import impl_module

SPAWNED_TASKS = ("2.1b", "2.1c")
SHAPES = [(3, 4), (5,), (2, 1, 3), (1,), (7,)]  # 31 numbers: padded at N = 2, 3, 4


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _oracle_shard(tensors, rank, n):
    """The definition: concatenate, zero-pad to a multiple of N, take the rank-th of N equal pieces."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    m = math.ceil(flat.numel() / n)
    padded = torch.cat([flat, torch.zeros(m * n - flat.numel())])
    return padded[rank * m : (rank + 1) * m]


# ---- 2.1a: in this process ---------------------------------------------------------------------


@pytest.mark.parametrize("task", ["2.1a"])
def test_task2_1a_flatten_and_shard(impl, task):
    mod = impl_module("fsdp_tasks", impl)
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    for n in (1, 2, 3, 4, 8):
        shards = [mod.flatten_and_shard(tensors, r, n) for r in range(n)]
        for r, got in enumerate(shards):
            want = _oracle_shard(tensors, r, n)
            assert got.shape == want.shape, f"N={n} rank {r}: shard shape {tuple(got.shape)}, want {tuple(want.shape)}"
            assert torch.equal(got, want), f"N={n} rank {r}: got {got.tolist()}, want {want.tolist()}"
            assert all(got.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in tensors), \
                f"N={n} rank {r}: the shard shares memory with an input; return a new tensor"
        assert len({s.untyped_storage().data_ptr() for s in shards}) == n or n == 1, \
            f"N={n}: shards share one storage (views of one padded buffer?); each rank keeps only its own"
    assert all(torch.equal(t, b) for t, b in zip(tensors, before)), "the input tensors were modified"


@pytest.mark.parametrize("task", ["2.1a"])
def test_task2_1a_unflatten_views(impl, task):
    mod = impl_module("fsdp_tasks", impl)
    tensors = _tensors(1)
    shapes = [t.shape for t in tensors]
    n = 4
    full = torch.cat([_oracle_shard(tensors, r, n) for r in range(n)])  # what the all-gather returns
    flat = full.clone().requires_grad_(True)
    views = mod.unflatten(flat, shapes)
    assert [tuple(v.shape) for v in views] == [tuple(s) for s in shapes], "views have the wrong shapes"
    for i, (v, t) in enumerate(zip(views, tensors)):
        assert torch.equal(v.detach(), t), f"view {i} holds {v.detach().reshape(-1).tolist()}, want {t.tolist()}"
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), \
            f"view {i} is a copy; it must be a view of the flat buffer (no new memory)"
    # Gradients of the views land in the flat buffer's gradient; the padding gets zero.
    weights = [torch.full(s, float(i + 1)) for i, s in enumerate(shapes)]
    sum((v * w).sum() for v, w in zip(views, weights)).backward()
    want = torch.cat([w.reshape(-1) for w in weights] + [torch.zeros(full.numel() - 31)])
    assert flat.grad is not None and torch.equal(flat.grad, want), "gradients of the views did not reach flat.grad"
    # Writing into the full buffer shows through the views (as all-gathering into it must).
    plain = full.clone()
    views = mod.unflatten(plain, shapes)
    plain.mul_(2)
    assert all(torch.equal(v, 2 * t) for v, t in zip(views, tensors)), "views do not see writes to the flat buffer"


# ---- 2.1b and 2.1c: 3 ranks -----------------------------------------------------------------------


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))  # 113 parameters: padded at N = 2, 3


def _grade_reduce_scatter(mod, group, members) -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    me, n = dist.get_rank(), len(members)
    plain = _small_model()
    theirs = TorchFSDP(_small_model(), process_group=group, device_id=torch.device("cpu"))
    g = torch.Generator().manual_seed(1000 + me)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 5, generator=g)
    F.mse_loss(theirs(x), y).backward()
    want = next(theirs.parameters()).grad  # torch FSDP1's sharded, averaged gradient
    F.mse_loss(plain(x), y).backward()
    full_grad = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    fails = []
    before = full_grad.clone()
    got = mod.reduce_scatter_gradient(full_grad, group=group)
    where = f"N={n} rank {members.index(me)}"
    if not torch.equal(full_grad, before):
        fails.append(f"{where}: full_grad was modified; work on a copy")
    if got.shape != want.shape:
        fails.append(f"{where}: shard has shape {tuple(got.shape)}, torch FSDP1's has {tuple(want.shape)}")
    elif not torch.equal(got, want):
        diff = (got - want).abs().max().item()
        fails.append(f"{where}: differs from torch FSDP1's gradient shard (max |diff| {diff:.3g}); "
                     + ("tiny: divide after the sum, not by N before it" if diff < 1e-5 else
                        "check padding and averaging"))
    return fails + _grade_near_overflow(mod, group, members)


def _grade_near_overflow(mod, group, members) -> list[str]:
    """Why torch pre-divides: gradients near fp32's largest number (2^128).

    Rank r's gradient element i is c * 2^125 with a small integer c, so every sum and
    every division by 2 or 3 below is exact: the oracle is the exact average.  The sum over
    ranks exceeds 2^128 (a single division after the sum gives inf: checked); torch's
    recipe divides by f = 2 first, so its sum stays finite and the result is exact.
    """
    me, n = dist.get_rank(), len(members)
    r = members.index(me)

    def values(rank):  # N = 3: c in 3..5, the sums 9 or 12 (multiples of 3); N = 2: c in 5..6
        c = torch.tensor([8 // n + 1.0 + (i * (rank + 1)) % n for i in range(10)])
        return c * 2.0**125

    exact = sum(values(q).double() for q in range(n)) / n  # float64: exact for these numbers
    summed = torch.stack([values(q) for q in range(n)]).sum(0)
    if not torch.isinf(summed).any():
        return [f"N={n}: test data error: the plain fp32 sum does not overflow, so the task is not graded"]
    m = math.ceil(10 / n)
    want = F.pad(exact.float(), [0, m * n - 10])[r * m : (r + 1) * m]
    got = mod.reduce_scatter_gradient(values(me), group=group)
    if not torch.equal(got, want):
        return [f"N={n} rank {r}: gradients near fp32's limit: got {got.tolist()}, want the exact average "
                f"{want.tolist()}; inf means the sum overflowed: divide by torch's pre-divide factor first"]
    return []


def _grade_clip(mod, group, members) -> list[str]:
    me, n = dist.get_rank(), len(members)
    r = members.index(me)
    units = [_tensors(2)[:3], _tensors(3)[3:]]  # two "units": 23 and 8 numbers, the same on every rank
    fails = []
    for scale, label in ((0.5, "clipping"), (10.0, "no clipping")):
        # the oracle: torch's clip_grad_norm_ on the whole gradient, one process
        params = [nn.Parameter(torch.zeros_like(t)) for unit in units for t in unit]
        for p, t in zip(params, [t for unit in units for t in unit]):
            p.grad = t.clone()
        total_want = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf"))
        max_norm = scale * total_want.item()
        torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        clipped = iter(p.grad for p in params)
        want = [_oracle_shard([next(clipped) for _ in unit], r, n) for unit in units]
        shards = [_oracle_shard(unit, r, n).clone() for unit in units]
        if r == 0:
            shards.append(torch.empty(0))  # an empty shard (a unit whose numbers all sit elsewhere)
        originals = [s.clone() for s in shards]
        objects = list(shards)
        total = mod.clip_grad_norm_sharded_(shards, max_norm, group=group)
        where = f"N={n} rank {r}, {label}"
        total = torch.as_tensor(total, dtype=torch.float32)
        if not torch.allclose(total, total_want, rtol=1e-5, atol=0):
            fails.append(f"{where}: total norm {total.item():.6g}, want {total_want.item():.6g} (the whole gradient's)")
            continue
        totals = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(totals, total.reshape(1), group=group)
        if len({t.item() for t in totals}) != 1:
            fails.append(f"{where}: ranks returned different totals {[t.item() for t in totals]}")
        if any(a is not b for a, b in zip(shards, objects)):
            fails.append(f"{where}: the list of shards was replaced; scale the tensors in place")
        for i, (s, w) in enumerate(zip(shards, want)):
            ok = torch.equal(s, originals[i]) if scale > 1 else torch.allclose(s, w, rtol=1e-5, atol=1e-8)
            if not ok:
                fails.append(f"{where}: shard {i} is {s[:4].tolist()}..., want {w[:4].tolist()}..."
                             + (" (unchanged: nothing to clip)" if scale > 1 else ""))
    return fails


def _grade(module_name: str, task: str) -> list[str]:
    """Runs on every rank; returns what went wrong (empty list: the task passes)."""
    mod = importlib.import_module(module_name)
    pair = dist.new_group([0, 1])  # every rank must create it, members or not
    fails = []
    for group, members in ((None, [0, 1, 2]), (pair, [0, 1])):
        if dist.get_rank() not in members:
            continue
        grade = _grade_reduce_scatter if task == "2.1b" else _grade_clip
        fails += grade(mod, group, members)
    return fails


def _grade_all(module_name: str) -> dict[str, list[str]]:
    report = {}
    for task in SPAWNED_TASKS:
        try:
            report[task] = _grade(module_name, task)
        except NotImplementedError as e:
            report[task] = [f"NotImplementedError: {e}"]
    return report


def _module_name(impl: str) -> str:
    return impl_module("fsdp_tasks", impl).__name__


@pytest.fixture(scope="module")
def graded_together(impl):
    """2.1b and 2.1c in one spawn, or None if that spawn failed (then each task gets its own)."""
    try:
        return minifsdp.spawn(_grade_all, args=(_module_name(impl),), world_size=3, timeout_s=60)
    except RankFailedError:
        return None


def _run(impl: str, task: str, graded_together) -> None:
    if graded_together is not None:
        fails = [f"rank {r}: {line}" for r, report in enumerate(graded_together) for line in report[task]]
    else:
        results = minifsdp.spawn(_grade, args=(_module_name(impl), task), world_size=3, timeout_s=60)
        fails = [f"rank {r}: {line}" for r, lines in enumerate(results) for line in lines]
    assert not fails, f"Task {task} is not right yet:\n" + "\n".join(fails[:10])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", ["2.1b"])
def test_task2_1b_reduce_scatter_gradient(impl, task, graded_together):
    _run(impl, task, graded_together)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", ["2.1c"])
def test_task2_1c_clip_grad_norm_sharded(impl, task, graded_together):
    _run(impl, task, graded_together)
