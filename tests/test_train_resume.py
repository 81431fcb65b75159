"""``python -m minifsdp train --resume``: every trainer, every precision, bitwise the run that never stopped.

Paths: ``--impl ours`` (our sharded checkpoints, ``minifsdp.checkpoint``), ``torch-fsdp1`` and ``torch-fsdp2``
(torch's full state dict, one file), each in fp32, bf16 (``--mixed-precision bf16``) and fp16 (with its
sharded grad scaler, whose scale and growth tracker the checkpoint must carry).  Each resumes after a crash
between two checkpoints: from an older checkpoint than the last step run, with log lines to drop
(``tests/_workers_train_resume.py`` draws it).  The stop-then-resume of the command line itself (fp32, ours):
``tests/test_train_job.py``.

Oracle: the same job run without stopping, in the same spawn.  Exact: every logged step (loss, lr, global
grad norm, loss scale; NaN where the first fp16 step overflowed, as JSON writes it) and every tensor of the
final consolidated weights.  All selected paths run in one spawn of 2 ranks (a few seconds).
"""

from __future__ import annotations

import json

import pytest

from minifsdp import spawn
from tests import _workers_train_resume as W

PATHS = [(impl, precision) for impl in ("ours", "torch-fsdp1", "torch-fsdp2") for precision in ("fp32", "bf16", "fp16")]
FRESH_SCALE = 65536.0  # a new ShardedGradScaler's scale (torch's and ours)


@pytest.fixture(scope="module")
def resumed(request, tmp_path_factory):
    """{(impl, precision): result} for the paths this session selected, in one spawn."""
    chosen = [tuple(item.callspec.params["path"]) for item in request.session.items
              if item.nodeid.startswith("tests/test_train_resume.py::test_resume_is_bitwise")]
    return spawn(W.resume_paths, (str(tmp_path_factory.mktemp("resume")), chosen), world_size=2, timeout_s=300)[0]


@pytest.mark.parametrize("path", PATHS, ids=[f"{i}-{p}" for i, p in PATHS])
def test_resume_is_bitwise_the_run_that_never_stopped(resumed, path):
    r = resumed[path]
    whole, again = r["uninterrupted"], r["resumed"]
    assert r["resumed_from"] == 2 and [x["step"] for x in whole] == [1, 2, 3, 4], r
    if path[1] == "fp16":  # the checkpoint's scale is not a fresh scaler's: forgetting it would show
        assert whole[1]["loss_scale"] not in (None, FRESH_SCALE), whole
    assert len(again) == len(whole), f"the resumed log has {len(again)} lines: {again}"
    for x, y in zip(whole, again):
        assert json.dumps(x) == json.dumps(y), f"step {x['step']}: never stopped {x}, resumed {y}"
    assert r["final_equal"], "the final weights differ from the run that never stopped"
