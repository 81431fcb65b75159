"""``python -m minifsdp train --impl student``: the exercises' functions run inside our FSDP.

Oracle: ``--impl ours`` on the same ranks, flags, seed and data, in the same job;
tolerance: bitwise (2 ranks: every ring sum is one rounding, in any order).  Each case
is one CLI run (2 ranks, 3 steps of the tiny GPT), run once for the module:

* reference: minifsdp's own solutions plugged in train bitwise like ours, and every
  plugged function was really called by FSDP (call counts), so the pass is not vacuous;
* a ring reduce-scatter that forgets its last step fails at step 1 (gradient norm),
  and only ring_reduce_scatter is named (its all-gather is right and is not blamed);
* an unflatten that swaps two same-shaped views (a LayerNorm's weight and bias) changes
  step 1's loss, so FSDP really computes with the student's views; only unflatten is named;
* a prefetch order read the wrong way leaves the losses equal (a prefetch never changes
  numbers) and still fails, naming prefetch_target: the call-by-call watch catches it;
* the bare stubs stop the run with the task to finish (2.1a's flatten_and_shard runs first).
"""

import contextlib
import io

import pytest

from minifsdp.classroom.student import parse_student
from minifsdp.commands.cli import main
from minifsdp.training.checks import JobError

CASES = {
    "reference": ["--student", "reference"],
    "wrong_ring": ["--student", "2.2=tests._workers_student"],
    "wrong_views": ["--student", "2.1a=tests._workers_student"],
    "wrong_prefetch": ["--student", "2.5=tests._workers_student"],
    "stubs": [],
}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, extra in CASES.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            rc = main(["train", "--impl", "student", "--steps", "3", "--world-size", "2", *extra])
        out[name] = (rc, buf.getvalue())
    return out


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split()[:1] and line.split()[0].isdigit()]


@pytest.mark.timeout(240)
def test_reference_solutions_train_bitwise_like_ours(runs):
    rc, text = runs["reference"]
    assert rc == 0 and "PASS" in text, text
    rows = _rows(text)
    assert len(rows) == 3, text
    for row in rows:
        assert row[1] == row[2] and row[3] == row[4] and row[5] == "yes", row
    for f in ("flatten_and_shard", "unflatten", "ring_reduce_scatter", "ring_all_gather", "prefetch_target"):
        line = next(ln for ln in text.splitlines() if f" {f} " in ln)
        assert int(line.split()[-2]) > 0, f"{f} was never called by FSDP:\n{text}"


@pytest.mark.timeout(240)
def test_a_ring_that_forgets_a_step_is_caught_and_named(runs):
    rc, text = runs["wrong_ring"]
    assert rc == 1, text
    assert "FAIL at step 1: the gradient norm differs" in text, text
    wrong = text.split("first wrong answer")[1]
    assert "ring_reduce_scatter (Task 2.2a" in wrong and "numbers differ" in wrong, text
    assert "ring_all_gather" not in wrong, text
    rows = _rows(text)
    assert rows[0][1] == rows[0][2] and rows[0][5] == "NO", text  # step 1's loss is before any update


@pytest.mark.timeout(240)
def test_swapped_views_from_unflatten_are_used_and_named(runs):
    rc, text = runs["wrong_views"]
    assert rc == 1, text
    assert "FAIL at step 1: the loss differs" in text, text
    wrong = text.split("first wrong answer")[1]
    assert "unflatten (Task 2.1a" in wrong and "flatten_and_shard" not in wrong, text


@pytest.mark.timeout(240)
def test_a_wrong_prefetch_order_is_caught_though_the_losses_agree(runs):
    rc, text = runs["wrong_prefetch"]
    assert rc == 1, text
    assert "FAIL: the losses and gradient norms agree" in text, text
    assert all(row[5] == "yes" for row in _rows(text)), text
    assert "prefetch_target (Task 2.5" in text and "backward from unit" in text, text


@pytest.mark.timeout(240)
def test_the_bare_stub_names_the_task_to_finish(runs):
    rc, text = runs["stubs"]
    assert rc == 1, text
    assert "Task 2.1a is not done yet" in text and "NotImplementedError" in text, text
    assert "exercises/README_fsdp.md" in text and "rank 1 also failed" not in text, text


def test_student_flag_parsing():
    assert parse_student("2.5") == {"prefetch_target": "exercises.overlap_tasks"}
    assert parse_student("2.2=reference")["ring_all_gather"] == "minifsdp.comm.tuned"  # kept in the student edition
    assert set(parse_student(None)) == {"flatten_and_shard", "unflatten", "ring_reduce_scatter", "ring_all_gather",
                                        "ring_all_reduce", "prefetch_target"}
    with pytest.raises(JobError, match="unknown task '2.3'"):
        parse_student("2.3")
