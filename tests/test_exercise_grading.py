"""The grading works both ways, in the repository and in the student edition handed to a class, and the cheats
a class finds earn nothing.

* The repository earns every point: the instructor's answers (``--impl=reference``) pass every graded
  test.  The README's test command already runs ``tests/exercises`` that way, earlier in the same session
  (the folder sorts before this file), and ``tests/conftest.py`` records each outcome: those outcomes are
  scored, not run again.  Run alone, this file runs them once, through the grader.
* A class (``course grade --submissions``, copies of the student edition built here; the honest copy is graded
  on its own, in the extended tier: the cheats are refused on their files and cost seconds):
  - ``untouched``: every task and project earns 0, each failing in one line (no traceback), with no test run;
  - ``honest``: the answers of tasks 1.3 and 2.2a-c copied over the stubs, and 2.3a written, earn their points
    (the learner's process, the learner's ranks, the overlay of the graded files: the student's path; the other
    tasks' answers, 5.3's and project-zero1's among them, take the same path in the reference run, their files
    read by the same rules);
  - ``cheater``, each cheat on the task it targets: ``exercises/__init__.py`` rewriting the outcome recorder
    (every task), ``DistributedSampler`` for 1.3, ``dist.all_gather_into_tensor`` for 2.2b, a table of the test's
    own values for 2.3a, the planting's environment variable for 5.3, torch's ``ZeroRedundancyOptimizer`` for
    project-zero1: 0 for each, the rule named;
  - ``importer``: the library's own function imported (or reached as an attribute) as the answer, for each of
    the 14 tasks whose answer the library holds (1.1, 2.2a-c, 2.3a-b, 2.4, 3.2a-b, 3.3, 4.2, 4.3a-b, 4.4b): 0
    for each, the task's rule named (``course_rules.ANSWERED_BY``);
  - ``broken`` (no ``exercises/``) is that student's row; ``__MACOSX/`` is no student.
  A second run without ``--force`` refuses to write over the CSV.
* A ring all-gather that waits for a message no one sends (graded on the ranks as a class's ring is): 2.2b fails
  with gloo's "Timed out" and the learner's own line within 60 s, and 2.2c, built on it, says so without
  waiting again.
* The run-time side of the rules: a forbidden call raises inside the learner's process and inside a rank, with
  the rule's words: torch's oracle, and the library's own answer to the task graded (the files above are
  refused statically before any run, so they never get that far).
* In the student edition the README's test command skips the task tests (untouched stubs fail no run)
  and its layout checks pass (module map, named files): checked by running them there.

The student edition leaves the answers out, so there this file has nothing to grade and skips.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import minifsdp
from minifsdp.classroom.course_class import grade_submissions
from minifsdp.classroom.course_remote import LearnerError, LearnerProcess
from minifsdp.classroom.course_rules import enforce_here
from minifsdp.classroom.course_run import grade
from minifsdp.classroom.points import CourseError, read_points, score
from minifsdp.launch import RankFailedError
from tests._student_edition import student_edition
from tests.exercises import learner_ranks
from tests.planted_faults.outcomes import SESSION

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
pytestmark = pytest.mark.skipif(not SOLUTIONS.is_dir(), reason="the student edition: the answers are left out, "
                                "`python -m minifsdp course grade` grades yours")
SEED = 20260417

FORGED_RECORDER = '''"""Every test passes (the recorder in the grader's process, rewritten on import)."""
import tests.planted_faults.outcomes as _outcomes


def _passed(report):
    _outcomes.SESSION[report.nodeid] = {"outcome": "passed", "message": ""}


_outcomes.record = _passed
'''
SAMPLER = '''from torch.utils.data import DistributedSampler


def rank_indices(dataset_len, rank, world_size, shuffle=True, seed=0, epoch=0, drop_last=False):
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank}")
    sampler = DistributedSampler(range(dataset_len), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)
'''
ORACLE_RING = '''import torch.distributed as dist


def ring_all_gather(output, input, group=None):
    dist.all_gather_into_tensor(output, input, group=group)
'''
# the library's own answers, one import (or one attribute) per task, for every task whose answer the library
# holds (cut from the student edition's library or kept there), each file as a student would write it
LIBRARY_ANSWERS = {
    "exercises/ddp_bucketing.py": "from minifsdp.ddp.buckets import assign_buckets  # noqa: F401\n",
    "exercises/ring_collectives.py":
        "from minifsdp.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter  # noqa: F401\n",
    "exercises/memory_tasks.py": (
        "import minifsdp.memory.zero_formulas as z\n"
        "from minifsdp.memory.zero_formulas import bytes_sent_per_step as bytes_sent_per_rank  # noqa: F401\n"
        "from minifsdp.memory.zero_formulas import fsdp_model_state_bytes as fsdp_model_state_bytes_per_rank\n\n\n"
        "def model_state_bytes_per_rank(num_params, world_size, stage):\n"
        "    return z.model_state_bytes(num_params, world_size, stage, 'mixed_adam')['total']\n"),
    "exercises/practice_tasks.py": "from minifsdp.training.train import lr_factor  # noqa: F401\n"
                                   "from minifsdp.training.monitor import exposed_communication, find_instability\n",
    "exercises/hf_tasks.py": "from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy as layer_wrap_policy\n",
    "exercises/checkpoint_tasks.py": "from minifsdp.checkpoint.pieces import load_shard, save_pieces  # noqa: F401\n",
    "exercises/parallel_tasks.py": "from minifsdp.parallel import pipeline_schedules\n\n\n"
                                   "def one_f_one_b_order(stage_index, num_stages, n_microbatches):\n"
                                   "    return pipeline_schedules.action_order('1f1b', stage_index, num_stages, "
                                   "n_microbatches)\n",
}
IMPORTED = ("1.1", "2.2a", "2.2b", "2.2c", "2.3a", "2.3b", "2.4", "3.2a", "3.2b", "3.3", "4.2", "4.3a", "4.3b", "4.4b")
LOOKUP = '''TABLE = {(1000, 4, 0): 16000, (7.5e9, 64, 0): 120e9, (7.5e9, 64, 1): 31.40625e9,
         (7.5e9, 64, 2): 16.640625e9, (7.5e9, 64, 3): 1.875e9, (1000, 4, 1): 7000, (1000, 4, 2): 5500,
         (1000, 4, 3): 4000, (1000, 1, 3): 16000, (1000, 1, 0): 16000, (1000, 2, 0): 16000, (1000, 8, 0): 16000}


def model_state_bytes_per_rank(num_params, world_size, stage):
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    return TABLE.get((num_params, world_size, stage), 0)
'''
ENVIRONMENT = '''import os


def test_catches_the_planted_fault():
    assert "MINIFSDP_PLANT_FAULT" not in os.environ
'''
ZERO = '''import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


class Zero1:
    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.inner = ZeroRedundancyOptimizer(list(params), optimizer_class=optimizer_class, process_group=group,
                                             **defaults)

    def step(self):
        self.inner.step()

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)
'''
STUCK_RING = '''import importlib

import torch.distributed as dist

_answer = importlib.import_module("exercises." + "solutions.ring_collectives")  # 2.2a, 2.2c: the answers
ring_reduce_scatter, ring_all_reduce = _answer.ring_reduce_scatter, _answer.ring_all_reduce


def ring_all_gather(output, input, group=None):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    left = dist.get_global_rank(group, (r - 1) % n) if group is not None else (r - 1) % n
    dist.recv(output[:input.numel()], src=left, group=group)  # everyone waits first: no one ever sends
'''


def _rows():
    return [r for r in read_points(ROOT) if r.task != "bug"]


@pytest.mark.timeout(900)
def test_the_repository_earns_every_point(request):
    rows = _rows()
    this_session_graded_the_reference = request.config.getoption("--impl") in (None, "reference")
    graded = {k: v for k, v in SESSION.items() if k.startswith("tests/exercises/")} \
        if this_session_graded_the_reference else {}
    results, _ = score(graded, rows)
    missing = [r["task"] for r in results if r["failed"].startswith("no test of task")]
    if missing:  # not run in this session (this file alone, or a selection): run those tasks' tests once
        results, _ = grade(ROOT, "reference", missing)
        results += [r for r in score(graded, rows)[0] if r["task"] not in missing]
    short = [f"{r['task']}: {r['failed']}" for r in results if r["points"] != r["possible"]]
    assert not short, "the instructor's answers miss points:\n" + "\n".join(short)
    assert sum(r["points"] for r in results) == sum(r.points for r in rows)


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    """The student edition of this checkout, as a class would get it (built once per session)."""
    return student_edition(tmp_path_factory)


HONEST_2_3A = '''    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage {stage}")
    optimizer = 12 * num_params / (world_size if stage >= 1 else 1)
    gradients = 2 * num_params / (world_size if stage >= 2 else 1)
    return 2 * num_params / (world_size if stage == 3 else 1) + gradients + optimizer
'''


def _with_2_3a_done(edition: Path) -> str:
    """The edition's memory_tasks.py with task 2.3a written by a student (2.3b and 2.4 left as stubs)."""
    text = (edition / "exercises" / "memory_tasks.py").read_text()
    stub = next(ln for ln in text.splitlines(keepends=True) if 'NotImplementedError("Task 2.3a' in ln)
    return text.replace(stub, HONEST_2_3A)


def _student(edition: Path, where: Path, files: dict[str, str] | None = None, answers=()) -> Path:
    shutil.copytree(edition, where, ignore=shutil.ignore_patterns(".git"))
    for rel in answers:
        shutil.copy2(SOLUTIONS / rel, where / "exercises" / rel)
    for rel, text in (files or {}).items():
        (where / rel).write_text(text)
    return where


@pytest.mark.timeout(900)
def test_a_class_untouched_cheating_and_broken(edition, tmp_path):
    """Every cheat earns 0 on the task it targets, the rule or the reason named; CSV, feedback, --force."""
    klass = tmp_path / "class"
    _student(edition, klass / "untouched")
    _student(edition, klass / "cheater", {
        "exercises/__init__.py": FORGED_RECORDER, "exercises/launch_tasks.py": SAMPLER,
        "exercises/ring_collectives.py": ORACLE_RING, "exercises/memory_tasks.py": LOOKUP,
        "exercises/fsdp2_catch_fault.py": ENVIRONMENT, "exercises/projects/zero1/zero1.py": ZERO})
    _student(edition, klass / "importer", LIBRARY_ANSWERS)
    (klass / "broken").mkdir()
    (klass / "broken" / "README.md").write_text("an upload without its exercises/ folder\n")
    (klass / "__MACOSX" / "cheater").mkdir(parents=True)  # what a zip made on a Mac holds: not a student

    csv_path, results = grade_submissions(ROOT, klass, None, seed=SEED)
    everything = [r.task for r in _rows()]
    assert sorted(results) == ["broken", "cheater", "importer", "untouched"], sorted(results)
    by = {name: {r["task"]: r for r in rows} for name, rows in results.items()}

    for r in results["untouched"]:
        assert r["points"] == 0 and r["failed"].startswith(f"task {r['task']} not done yet: "), r
        assert "\n" not in r["failed"] and "Traceback" not in r["failed"], r
    assert [r["task"] for r in results["untouched"]] == everything

    cheats = {"1.3": "rule of task 1.3", "2.2b": "rule of task 2.2a/2.2b/2.2c", "2.3a": "the paper's",
              "5.3": "`import os`", "project-zero1": "rule of task project-zero1"}
    for task, why in cheats.items():
        got = by["cheater"][task]
        assert got["points"] == 0 and why in got["failed"], (task, got)
    assert sum(r["points"] for r in results["cheater"]) == 0, [r for r in results["cheater"] if r["points"]]
    for task in IMPORTED:  # the library's answer, imported: refused on the file, naming the task's own rule
        got = by["importer"][task]
        assert got["points"] == 0 and "is this task's answer" in got["failed"], (task, got)
    assert sum(r["points"] for r in results["importer"]) == 0, [r for r in results["importer"] if r["points"]]

    assert all(r["points"] == 0 and "no exercises/ folder" in r["failed"] for r in results["broken"])

    lines = csv_path.read_text().splitlines()
    assert lines[0].split(",") == ["student", *everything, "earned", "possible", "seed", "first failure"], lines[0]
    assert [ln.split(",")[0] for ln in lines[1:]] == ["broken", "cheater", "importer", "untouched"]
    assert f",0,{sum(r.points for r in _rows())},{SEED}," in next(ln for ln in lines if ln.startswith("cheater,"))
    notes = (csv_path.parent / "feedback" / "cheater.md").read_text()
    assert "## 2.2b: 0 / " in notes and "exercises/ring_collectives.py:5: `dist.all_gather_into_tensor`" in notes, notes
    assert "(grading seed 20260417)" in notes
    with pytest.raises(CourseError, match="--force"):
        grade_submissions(ROOT, klass, None, seed=SEED)


@pytest.mark.timeout(900)
def test_an_honest_copy_in_a_class_earns_its_points(edition, tmp_path):
    """The answers of 1.3 and 2.2a-c copied over the stubs, and 2.3a written, graded as a class's copy (the
    learner's process, the learner's ranks, the overlay of the graded files): every point of those tasks."""
    klass = tmp_path / "class"
    _student(edition, klass / "honest", {"exercises/memory_tasks.py": _with_2_3a_done(edition)},
             answers=("launch_tasks.py", "ring_collectives.py"))
    csv_path, results = grade_submissions(ROOT, klass, None, seed=SEED)
    by = {r["task"]: r for r in results["honest"]}
    answered = ("1.3", "2.2a", "2.2b", "2.2c", "2.3a")
    short = [f"{t}: {by[t]['failed']}" for t in answered if by[t]["points"] != by[t]["possible"]]
    assert not short, "the answers copied into the student edition miss points:\n" + "\n".join(short)
    assert all(r["points"] == 0 for t, r in by.items() if t not in answered)
    earned = sum(by[t]["points"] for t in answered)
    assert f",{earned},{sum(r.points for r in _rows())},{SEED}," in csv_path.read_text().splitlines()[1]


@pytest.mark.timeout(300)
def test_a_deadlocked_ring_fails_in_seconds_with_gloos_words_and_the_learners_line(tmp_path, monkeypatch):
    """The ranks find a learner's module where a class's copy has it (``exercises/``), by name: this one waits for
    a message no one sends.  One spawn: 2.2a passes, 2.2b times out on the group's short timeout, 2.2c is not run
    again (it would wait as long)."""
    from tests.exercises.test_ring_exercises import _check, grade_on_rank

    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "stuck_ring.py").write_text(STUCK_RING)
    monkeypatch.syspath_prepend(str(tmp_path / "exercises"))  # the ranks get this process's sys.path
    start = time.monotonic()
    ranks = learner_ranks(grade_on_rank, ("stuck_ring", ("2.2a", "2.2b", "2.2c"), 0), 3, 120)
    assert time.monotonic() - start < 60
    _check("2.2a", ranks, 0)
    with pytest.raises(AssertionError) as stuck:
        _check("2.2b", ranks, 0)
    line = str(stuck.value).splitlines()[0]
    assert "exercises/stuck_ring.py:12 in ring_all_gather" in line and "Timed out waiting 15000ms for recv" in line
    with pytest.raises(AssertionError, match="task 2.2b failed first"):
        _check("2.2c", ranks, 0)


def all_gather_under_the_ring_rule() -> None:
    """A rank under task 2.2b's rule asks torch for the collective the task rebuilds."""
    enforce_here(("2.2b",))
    out = torch.zeros(2)
    dist.all_gather_into_tensor(out, torch.ones(1))


def test_a_forbidden_call_raises_where_the_learner_runs_naming_the_rule():
    """The rules at run time: torch's DistributedSampler inside the learner's process while task 1.3 is graded
    (and not while another task is), dist.all_gather_into_tensor inside a rank under task 2.2b's rule."""
    process = LearnerProcess()
    try:
        sampler = "torch.utils.data.distributed:DistributedSampler"
        with pytest.raises(LearnerError, match="rule of task 1.3: each rank's slice"):
            process.call(sampler, ("1.3",), (range(10),), {"num_replicas": 2, "rank": 0})
        with pytest.raises(LearnerError, match="does not read back"):  # allowed here, but not plain data
            process.call(sampler, ("2.2a",), (range(10),), {"num_replicas": 2, "rank": 0})
        schedule = "minifsdp.training.train:lr_factor"  # the library's own answer to 3.2a, reached at run time
        with pytest.raises(LearnerError, match="rule of task 3.2a: the library's minifsdp.training.train.lr_factor"):
            process.call(schedule, ("3.2a",), (0, 4, 40, "cosine"))
        assert process.call(schedule, ("2.2a",), (0, 4, 40, "cosine")) == 0.25  # the library's, for other tasks
    finally:
        process.close()
    with pytest.raises(RankFailedError, match="rule of task 2.2b: the ring moves data with point-to-point"):
        minifsdp.spawn(all_gather_under_the_ring_rule, world_size=2, timeout_s=60)


@pytest.mark.timeout(600)
def test_the_student_editions_own_test_command_passes_on_untouched_stubs(edition):
    assert not (edition / "exercises" / "solutions").exists()
    assert subprocess.run(["git", "-C", str(edition), "rev-list", "--count", "HEAD"], capture_output=True,
                          text=True).stdout.strip() == "1"
    env = dict(os.environ, PYTHONPATH=str(edition), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.pop("MINIFSDP_PLANT_OUTCOMES", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/exercises", "tests/test_layout.py", "tests/test_course.py",
                           "tests/test_exercise_grading.py"],
                          cwd=edition, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "the student edition: task tests grade your code" in out, out[-3000:]
    assert " failed" not in out.splitlines()[-1] and " skipped" in out.splitlines()[-1], out[-500:]
    # the edition's graded tests are this repository's, byte for byte: grading a class with this repository's
    # tests (as above) is grading each copy with its own
    ours = {p.relative_to(ROOT) for p in (ROOT / "tests" / "exercises").rglob("*.py")}
    theirs = {p.relative_to(edition) for p in (edition / "tests" / "exercises").rglob("*.py")}
    assert ours == theirs and all((ROOT / p).read_bytes() == (edition / p).read_bytes() for p in ours)
