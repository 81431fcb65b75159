"""``python -m minifsdp bench scale`` (the largest TinyGPT that trains under a per-rank memory limit): its
pieces, not its numbers (benchmarks are commands, not tests).

* ``params_of`` counts TinyGPT's parameters as the model does (the tied lm_head once), without building it;
* a trial under a per-rank limit that a model cannot fit in is reported as out of memory, not as a crash,
  and the same trial with room passes and reports its peak (one spawn of 2 ranks each);
* the prediction and the table read the rows the search writes.
"""

from __future__ import annotations

import pytest
import torch

from minifsdp.bench import scale as bench_scale
from minifsdp.models import TinyGPT


@pytest.mark.parametrize("n_layer,width", [(1, 64), (3, 128)])
def test_params_of_counts_like_the_model(n_layer, width):
    with torch.device("meta"):
        model = TinyGPT(bench_scale.config(n_layer, width))
    assert bench_scale.params_of(n_layer, width) == sum(p.numel() for p in model.parameters())


def test_a_trial_past_the_limit_is_out_of_memory_and_one_with_room_passes():
    assert bench_scale._fits("ours", 2, 64, 1 << 20, 2, 120) == (False, 0)  # 1 MiB: nothing fits
    ok, peak = bench_scale._fits("ours", 1, 64, 1 << 30, 2, 120)
    assert ok and peak > 0


def test_prediction_and_table_read_the_rows():
    row = {"trainer": "ours", "world_size": 4, "mem_limit_bytes": 1 << 30, "width": 64, "largest_layers": 8,
           "largest_params": bench_scale.params_of(8, 64), "peak_bytes": 1 << 29, "trials": 5,
           "smallest": (1, 100 << 20)}
    ddp = dict(row, trainer="ddp", largest_layers=2, largest_params=bench_scale.params_of(2, 64))
    for r in (row, ddp):
        r["predicted_params"] = bench_scale.predicted_params(r)
    assert row["predicted_params"] > ddp["predicted_params"] > 0
    table = bench_scale.format_table([ddp, row])
    assert len(table.splitlines()) == 3 and "ours" in table and "ZeRO predicts" in table
