"""Grades tasks 2.1a-c (FSDP's core operations): ``exercises/fsdp_tasks.py`` (``--impl=student``) or the
instructor's answer.

2.1a runs in the learner's process (no communication).  2.1b and 2.1c need ranks: one spawn of 3 ranks runs
the learner's functions for both (a group of the 3 ranks, N = 3, and of ranks 0 and 1, N = 2), each rank
handing back what they returned; a call that raises is recorded as failing and the next is graded.  If a rank
dies or hangs, each task is graded again in its own spawn, so one broken task cannot fail the other.  torch
FSDP1, the oracle of 2.1b, runs in a spawn of its own that runs no learner code.

Oracles and tolerances:
* 2.1a: the definition (concatenate, zero-pad to a multiple of N, cut N equal
  pieces), element for element; plus storage checks for "view, not copy".
* 2.1b: torch FSDP1 itself.  Each rank trains the same small model under torch's
  FSDP and as a plain copy (the oracle's spawn); the plain copy's flat gradient goes
  into the task's function (the learner's spawn), whose result must equal torch's
  sharded ``.grad`` bitwise (the same gloo reduce-scatter sums in the same order).  This catches padding and order
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
from minifsdp.classroom.course_remote import capture, to_bytes
from minifsdp.classroom.course_rules import enforce_here
from tests.exercises import learner_group, learner_ranks, module_name, outcome_line

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


# ---- 2.1a: in the learner's process ---------------------------------------------------------------------


@pytest.mark.parametrize("task", ["2.1a"])
def test_task2_1a_flatten_and_shard(learner, task, course_seed):
    mod = learner("fsdp_tasks")
    tensors = _tensors(course_seed)
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
def test_task2_1a_unflatten_views(learner, task, course_seed):
    mod = learner("fsdp_tasks")
    tensors = _tensors(course_seed + 1)
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

GROUPS = {"N=3": [0, 1, 2], "N=2": [0, 1]}


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))  # 113 parameters: padded at N = 2, 3


def torch_fsdp1_on_rank(seed: int) -> dict:
    """The oracle (no learner code here): per group, this rank's flat gradient of a plain copy of the model
    (2.1b's input) and torch FSDP1's sharded, averaged gradient of the same model on the same data."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    me, out = dist.get_rank(), {}
    groups = {name: dist.new_group(members) for name, members in GROUPS.items()}
    for name, members in GROUPS.items():
        if me not in members:
            continue
        plain = _small_model()
        theirs = TorchFSDP(_small_model(), process_group=groups[name], device_id=torch.device("cpu"))
        g = torch.Generator().manual_seed(1000 * seed + me)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 5, generator=g)
        F.mse_loss(theirs(x), y).backward()
        F.mse_loss(plain(x), y).backward()
        out[name] = {"input": torch.cat([p.grad.reshape(-1) for p in plain.parameters()]),
                     "torch": next(theirs.parameters()).grad.clone()}
    return out


def _near_overflow(rank: int, n: int) -> torch.Tensor:
    """Why torch pre-divides: gradients near fp32's largest number (2^128).  Rank r's element i is c * 2^125
    with a small integer c (N = 3: c in 3..5, the sums 9 or 12; N = 2: c in 5..6), so every sum and every
    division by 2 or 3 is exact, and the sum over ranks exceeds 2^128 (one division after the sum gives inf)."""
    return torch.tensor([8 // n + 1.0 + (i * (rank + 1)) % n for i in range(10)]) * 2.0**125


def _clip_units(seed: int):
    return [_tensors(seed + 2)[:3], _tensors(seed + 3)[3:]]  # two "units": 23 and 8 numbers, the same on every rank


def _clip_norms(seed: int) -> list[tuple[str, float]]:
    whole = torch.cat([t.reshape(-1) for unit in _clip_units(seed) for t in unit]).norm().item()
    return [("clipping", 0.5 * whole), ("no clipping", 10.0 * whole)]


def _learner_2_1b(mod, group, name, r, n, inputs) -> dict:
    given = inputs[name][dist.get_rank()]["input"]
    sent = given.clone()
    got = capture(mod.reduce_scatter_gradient, sent, group=group)
    big = _near_overflow(dist.get_rank(), n)
    over = capture(mod.reduce_scatter_gradient, big.clone(), group=group) if "value" in got else None
    return {"got": got, "modified": not torch.equal(sent, given), "over": over}


def _learner_2_1c(mod, group, name, r, n, seed) -> list:
    rows = []
    for label, max_norm in _clip_norms(seed):
        shards = [_oracle_shard(unit, r, n).clone() for unit in _clip_units(seed)]
        if r == 0:
            shards.append(torch.empty(0))  # an empty shard (a unit whose numbers all sit elsewhere)
        objects = list(shards)
        got = capture(mod.clip_grad_norm_sharded_, shards, max_norm, group=group)
        if "value" in got:
            got["value"] = torch.as_tensor(got["value"], dtype=torch.float32).detach().clone()
        rows.append((label, got, [s.clone() for s in shards], all(a is b for a, b in zip(shards, objects))
                     and len(shards) == len(objects)))
        if "raised" in got:
            break
    return rows


def grade_on_rank(name: str, tasks: tuple, inputs: dict, seed: int) -> bytes:
    """On one rank, the learner's process: {task: {group: (rank in group, what the learner's calls gave)}}."""
    enforce_here(("2.1b", "2.1c"))
    mod = importlib.import_module(name)
    out = {}
    for task in tasks:
        groups = {g: learner_group(members) for g, members in GROUPS.items()}  # fresh, on every rank
        out[task] = {}
        for g, members in GROUPS.items():
            if dist.get_rank() in members:
                r, n = members.index(dist.get_rank()), len(members)
                out[task][g] = (r, _learner_2_1b(mod, groups[g], g, r, n, inputs) if task == "2.1b"
                                else _learner_2_1c(mod, groups[g], g, r, n, seed))
    return to_bytes(out)


@pytest.fixture(scope="module")
def torch_fsdp1(course_seed):
    """torch FSDP1's gradient shards and their inputs, per rank (the oracle's spawn)."""
    ranks = minifsdp.spawn(torch_fsdp1_on_rank, args=(course_seed,), world_size=3, timeout_s=120)
    return {g: {rank: ranks[rank][g] for rank in members} for g, members in GROUPS.items()}


@pytest.fixture(scope="module")
def graded_together(impl, torch_fsdp1, course_seed):
    """2.1b and 2.1c in one spawn, or the line saying why it failed (then each task gets its own)."""
    try:
        return learner_ranks(grade_on_rank, (module_name("fsdp_tasks", impl), ("2.1b", "2.1c"), torch_fsdp1,
                                             course_seed), 3, 90)
    except AssertionError as e:
        return str(e)


def _check_2_1b(ranks, oracle) -> list[str]:
    fails = []
    for rank, report in enumerate(ranks):
        for g, (r, res) in report["2.1b"].items():
            n, where = len(GROUPS[g]), f"{g} rank {r}"
            got, want = res["got"], oracle[g][rank]["torch"]
            if "raised" in got:
                fails.append(f"{where}: {outcome_line(got)}")
                continue
            value = got["value"]
            if res["modified"]:
                fails.append(f"{where}: full_grad was modified; work on a copy")
            if not isinstance(value, torch.Tensor) or value.shape != want.shape:
                fails.append(f"{where}: the shard is {getattr(value, 'shape', type(value).__name__)}, torch FSDP1's "
                             f"has shape {tuple(want.shape)}")
            elif not torch.equal(value, want):
                diff = (value - want).abs().max().item()
                fails.append(f"{where}: differs from torch FSDP1's gradient shard (max |diff| {diff:.3g}); "
                             + ("tiny: divide after the sum, not by N before it" if diff < 1e-5 else
                                "check padding and averaging"))
            exact = sum(_near_overflow(q, n).double() for q in range(n)) / n  # float64: exact for these numbers
            assert torch.isinf(torch.stack([_near_overflow(q, n) for q in range(n)]).sum(0)).any(), \
                "test data error: the plain fp32 sum does not overflow"
            m = math.ceil(10 / n)
            want = F.pad(exact.float(), [0, m * n - 10])[r * m: (r + 1) * m]
            over = res["over"]
            if over is not None and ("raised" in over or not torch.equal(over["value"], want)):
                shown = outcome_line(over) if "raised" in over else over["value"].tolist()
                fails.append(f"{where}: gradients near fp32's limit: got {shown}, want the exact average "
                             f"{want.tolist()}; inf means the sum overflowed: divide by torch's pre-divide factor "
                             "first")
    return fails


def _check_2_1c(ranks, seed) -> list[str]:
    fails, totals = [], {}
    for report in ranks:
        for g, (r, rows) in report["2.1c"].items():
            n = len(GROUPS[g])
            for (label, max_norm), (_, got, shards, same_objects) in zip(_clip_norms(seed), rows):
                where = f"{g} rank {r}, {label}"
                if "raised" in got:
                    fails.append(f"{where}: {outcome_line(got)}")
                    break
                # the oracle: torch's clip_grad_norm_ on the whole gradient, one process
                units = _clip_units(seed)
                params = [nn.Parameter(torch.zeros_like(t)) for unit in units for t in unit]
                for p, t in zip(params, [t for unit in units for t in unit], strict=True):
                    p.grad = t.clone()
                total_want = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
                clipped = iter(p.grad for p in params)
                want = [_oracle_shard([next(clipped) for _ in unit], r, n) for unit in units]
                total = got["value"]
                if not torch.allclose(total, total_want, rtol=1e-5, atol=0):
                    fails.append(f"{where}: total norm {total.item():.6g}, want {total_want.item():.6g} "
                                 "(the whole gradient's)")
                    continue
                totals.setdefault((g, label), set()).add(total.item())
                if not same_objects:
                    fails.append(f"{where}: the list of shards was replaced; scale the tensors in place")
                originals = [_oracle_shard(unit, r, n) for unit in units]
                for i, (s, w) in enumerate(zip(shards, want)):
                    ok = torch.equal(s, originals[i]) if label == "no clipping" else \
                        torch.allclose(s, w, rtol=1e-5, atol=1e-8)
                    if not ok:
                        fails.append(f"{where}: shard {i} is {s[:4].tolist()}..., want {w[:4].tolist()}..."
                                     + (" (unchanged: nothing to clip)" if label == "no clipping" else ""))
    fails += [f"{g}, {label}: ranks returned different totals {sorted(t)}" for (g, label), t in totals.items()
              if len(t) != 1]
    return fails


def _grade(impl, task, graded_together, torch_fsdp1, seed) -> None:
    ranks = graded_together
    if isinstance(ranks, str):
        ranks = learner_ranks(grade_on_rank, (module_name("fsdp_tasks", impl), (task,), torch_fsdp1, seed), 3, 90)
    fails = _check_2_1b(ranks, torch_fsdp1) if task == "2.1b" else _check_2_1c(ranks, seed)
    assert not fails, f"Task {task} is not right yet: " + "; ".join(fails[:6])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("task", ["2.1b"])
def test_task2_1b_reduce_scatter_gradient(impl, task, graded_together, torch_fsdp1, course_seed):
    _grade(impl, task, graded_together, torch_fsdp1, course_seed)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("task", ["2.1c"])
def test_task2_1c_clip_grad_norm_sharded(impl, task, graded_together, torch_fsdp1, course_seed):
    _grade(impl, task, graded_together, torch_fsdp1, course_seed)
