"""Grades task 1.3 (each rank's slice of the data): ``exercises/launch_tasks.py``, run in the learner's process
(where its rule keeps ``DistributedSampler`` out of reach).  Oracle: ``torch.utils.data.DistributedSampler``
itself, here, iterated after ``set_epoch``, compared as lists (exact: they are indices).  Sizes, seeds and epochs
drawn from the grading seed join the fixed cases."""

import random

import pytest
from torch.utils.data import DistributedSampler


@pytest.fixture
def rank_indices(learner):
    return learner("launch_tasks").rank_indices


def torch_slice(n, rank, world_size, shuffle, seed, epoch, drop_last):
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


# Sizes that a world size divides and sizes it does not, a dataset smaller than the world (padding longer than
# the data), world sizes 1 and 3.
CASES = [(n, w) for n in (1, 2, 10, 11, 17, 100) for w in (1, 2, 3, 4, 7, 16)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_task1_3_every_rank_slice_is_torchs(rank_indices, shuffle, drop_last, course_seed):
    rng = random.Random(f"{course_seed}:1.3:{shuffle}:{drop_last}")
    drawn = [(rng.randint(1, 300), rng.randint(1, 9)) for _ in range(4)]
    cases = [(n, r, w, seed, epoch) for n, w in CASES + drawn
             for epoch, seed in ((0, 0), (3, 0), (1, 42), (rng.randint(0, 99), rng.randint(0, 10**6)))
             for r in range(w)]
    got = rank_indices.many([((n, r, w), {"shuffle": shuffle, "seed": seed, "epoch": epoch, "drop_last": drop_last})
                             for n, r, w, seed, epoch in cases])  # one round trip to the learner's process
    assert len(got) == len(cases)
    for (n, r, w, seed, epoch), mine in zip(cases, got, strict=True):
        if isinstance(mine, Exception):
            raise mine
        want = torch_slice(n, r, w, shuffle, seed, epoch, drop_last)
        assert list(mine) == want, (f"n={n}, rank {r} of {w}, shuffle={shuffle}, seed={seed}, "
                                    f"epoch={epoch}, drop_last={drop_last}: {list(mine)} != torch's {want}")


def test_task1_3_slices_are_equal_in_length_and_cover_the_data(rank_indices):
    """What the padding is for: every rank runs the same number of steps (else the last collective waits forever)."""
    n, w = 10, 4
    slices = [rank_indices(n, r, w, shuffle=True, seed=0, epoch=0) for r in range(w)]
    assert {len(s) for s in slices} == {3}
    assert set().union(*map(set, slices)) == set(range(n))


def test_task1_3_a_new_epoch_reshuffles_and_a_bad_rank_is_refused(rank_indices):
    assert rank_indices(100, 0, 2, epoch=0) != rank_indices(100, 0, 2, epoch=1)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="rank"):
            rank_indices(10, bad, 2)
