"""Grades tasks 4.3a-b (sharded checkpoint, loaded at another world size): ``exercises/checkpoint_tasks.py``
(``--impl=student``) or the instructor's answer, run in the learner's process.

No process group: each function is one rank's work, so every world size is graded in-process.
Oracle: built number by number in this file (which parameter and index each flat position
holds), independent of both implementations; 4.3b is fed the oracle's pieces, not 4.3a's, so
the two tasks are graded separately.  Comparisons are bitwise (numbers are only copied).
"""

import pytest
import torch

from minifsdp.models import TinyGPT

LAYOUTS = {
    "readme": [("w", 6), ("b", 2), ("s", 1)],
    "one": [("only", 1)],
    "uneven": [("a", 5), ("b", 1), ("c", 13), ("d", 2)],
    "tinygpt block": [(n, p.numel()) for n, p in TinyGPT(seed=0).blocks[0].named_parameters()],
}


def _params(numels, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + sum(n for _, n in numels))
    return {name: torch.randn(n, generator=g) for name, n in numels}


def _oracle_pieces(params, numels, world, rank):
    """Number by number: flat position -> (parameter, index); keep the positions of this rank's shard."""
    total = sum(n for _, n in numels)
    size = -(-total // world)
    owner = [(name, i) for name, n in numels for i in range(n)]
    held: dict[str, list[int]] = {}
    for pos in range(rank * size, min((rank + 1) * size, total)):
        name, i = owner[pos]
        held.setdefault(name, []).append(i)
    return {name: (idx[0], idx[-1] + 1, params[name][idx[0] : idx[-1] + 1].clone()) for name, idx in held.items()}


def _shard(params, numels, world, rank):
    flat = torch.cat([params[n] for n, _ in numels])
    size = -(-flat.numel() // world)
    flat = torch.cat([flat, torch.zeros(size * world - flat.numel())])
    return flat[rank * size : (rank + 1) * size].clone()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task", ["4.3a"])
def test_task4_3a_save_pieces(learner, task, course_seed):
    mod = learner("checkpoint_tasks")
    fails = []
    for lname, numels in LAYOUTS.items():
        params = _params(numels, course_seed)
        for world in (1, 2, 3, 4, 5):
            for rank in range(world):
                shard = _shard(params, numels, world, rank)
                got = mod.save_pieces(shard, numels, world, rank)
                want = _oracle_pieces(params, numels, world, rank)
                where = f"{lname} N={world} rank={rank}"
                if sorted(got) != sorted(want):
                    fails.append(f"{where}: pieces of {sorted(got)}, want {sorted(want)}")
                    continue
                for name, (lo, hi, t) in want.items():
                    g_lo, g_hi, g_t = got[name]
                    if (g_lo, g_hi) != (lo, hi) or not torch.equal(g_t, t):
                        fails.append(f"{where}: {name} -> ({g_lo}, {g_hi}, {g_t.tolist()[:4]}...), "
                                     f"want ({lo}, {hi}, {t.tolist()[:4]}...)")
                    elif g_t.numel() and g_t.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
                        fails.append(f"{where}: {name}'s numbers share the shard's memory: save a copy")
                shard.add_(1.0)  # the next optimizer step: a saved piece must not change
                if any(not torch.equal(got[n][2], want[n][2]) for n in want if n in got):
                    fails.append(f"{where}: a saved piece changed when the shard did: save a copy")
    assert not fails, f"Task {task} is not right yet:\n" + "\n".join(fails[:10])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task", ["4.3b"])
def test_task4_3b_load_shard_at_another_world_size(learner, task, course_seed):
    mod = learner("checkpoint_tasks")
    fails = []
    cases = []
    for lname, numels in LAYOUTS.items():
        params = _params(numels, course_seed)
        for old in (1, 2, 3, 4):
            saved = [_oracle_pieces(params, numels, old, r) for r in range(old)]
            saved = saved[::-1]  # the files may come in any order
            cases += [(lname, numels, params, old, saved, new, rank) for new in (1, 2, 3, 4, 5) for rank in range(new)]
    results = mod.load_shard.many([((saved, numels, new, rank), {}) for _, numels, _, _, saved, new, rank in cases])
    assert len(results) == len(cases)
    for (lname, numels, params, old, _, new, rank), got in zip(cases, results, strict=True):
        if isinstance(got, Exception):
            raise got
        want = _shard(params, numels, new, rank)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
            shown = got.tolist()[:6] if isinstance(got, torch.Tensor) else got
            fails.append(f"{lname}: saved at N={old}, loading rank {rank} of {new}: got {shown}..., "
                         f"want {want.tolist()[:6]}... ({want.numel()} numbers, padding zeros)")
    assert not fails, f"Task {task} is not right yet:\n" + "\n".join(fails[:10])
