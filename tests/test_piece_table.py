"""The piece table (``minifsdp/fsdp/param_pieces.py``): right on every rank, and built once per save.

One spawn at 3 ranks (TinyGPT's units are not multiples of 3: parameters cut across ranks, some ranks
holding none of one).  Oracle: torch FSDP1's own shard metadata for the same model and wrap policy
(each ``FlatParameter``'s offsets and ``_shard_param_infos``), compared exactly; and the numbers each
row points at, against the gathered full state dict (bitwise: slicing copies numbers).
"""

from __future__ import annotations

import pytest

import minifsdp
from tests import _workers_piece_table as w


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return minifsdp.spawn(w.piece_table_worker, args=(str(tmp_path_factory.mktemp("table")),), world_size=3,
                          timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("orig", [False, True])
def test_piece_table_is_torch_fsdp1_shard_metadata(three_ranks, orig):
    """Every row (name, offset, shape, this rank's range, where in the holder) is torch FSDP1's, on every rank."""
    for r in three_ranks:
        mine, theirs = r[f"orig={orig} rows"], r[f"orig={orig} torch rows"]
        assert len(mine) == len(theirs) > 0
        assert mine == theirs, [(a, b) for a, b in zip(mine, theirs, strict=True) if a != b][:3]
        assert r[f"orig={orig} row numbers wrong"] == []
        assert r[f"orig={orig} optim keys"] == [("step", "exp_avg", "exp_avg_sq")]  # AdamW's, after one step
    assert {row[3:5] for r in three_ranks for row in r[f"orig={orig} rows"]} >= {(0, 0)}  # some rank holds none


@pytest.mark.timeout(300)
@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_a_save_builds_the_piece_table_once(three_ranks, orig, full):
    """One walk of the model per save (``tests/_workers_piece_table.SaveWalks``), on every rank."""
    for r in three_ranks:
        assert r[f"orig={orig} full={full} walks"] == (1, {"param_pieces.piece_table": 1})
