"""The instructor's side of the course (the student edition leaves this file out).

* ``exercises/INSTRUCTOR.md`` names every graded task of ``exercises/points.csv`` (projects and the bug
  lab included), plans six weeks of two sessions, and its tables' points and hours, and its totals, are
  points.csv's.
* The find-the-bug lab: its faults (``tests/planted_faults/bug_lab.py``) are at least 20 catalog faults in at
  least 12 functions of chapters 2-5, each planting cleanly on disk today with a way its chapter shows it.
  A roster of 30 gets 30 labs with 30 different faults and a key (checked statically: each lab differs from
  the library in the key's line only, and holds nothing about its fault).  A class graded from the key
  (``course grade --submissions --key``): an unfixed lab whose bug_lab.json was edited, a fixed one, one
  with a malformed ANSWER.txt and one the key does not know, each its own row, the run going on.  Two labs
  run their fault's test (the cheapest: one process each); the others need none.
* Bad input is one clear line: seeds out of range, a file given as a folder, a missing lab, a bad key.

Oracle: the catalog's own tests (``tests/test_planted_faults.py`` proves each fails planted, passes clean).
"""

import contextlib
import csv
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from minifsdp.classroom.course_bug import (
    COMMANDS,
    check_seed,
    draw,
    lab_faults,
    named_place,
    plant_file,
    write_roster_labs,
)
from minifsdp.classroom.course_bug_fix import graded_fix
from minifsdp.classroom.course_class import grade_submissions
from minifsdp.classroom.points import read_points
from minifsdp.commands.cli import main
from tests.planted_faults.bug_lab import LAB, WAYS
from tests.planted_faults.catalog import by_name

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "exercises" / "INSTRUCTOR.md"
ONE_PROCESS = ("padded_size_rounds_down", "end_padding_not_zero", "last_rank_shard_range", "prefetch_direction",
               "ring_chunk_index", "plan_of_reads_the_wrong_row")  # faults whose test needs no ranks


def test_the_guide_names_every_graded_task_and_plans_six_weeks():
    text = GUIDE.read_text()
    rows = read_points(ROOT)
    missing = [r.task for r in rows if not re.search(rf"(?<![\w.-]){re.escape(r.task)}(?![\w-]|\.\d)", text)]
    assert not missing, f"exercises/INSTRUCTOR.md does not name these graded tasks: {missing}"
    for project in ("project-zero1", "project-hybrid", "project-noshard-accum", "project-ac-budget"):
        assert project in text, project
    weeks = re.findall(r"^## Week (\d+):", text, re.M)
    assert weeks == [str(w) for w in range(1, 7)], weeks
    sessions = {int(m) for m in re.findall(r"^\| (\d+) \|", text, re.M)}
    assert sessions == set(range(1, 13)), sorted(sessions)
    assert text.count("Answer:") >= 18 and "Common mistakes" in text


def test_the_guides_points_and_hours_are_points_csv():
    table = {r.task: r for r in read_points(ROOT)}
    seen = 0
    for line in GUIDE.read_text().splitlines():
        m = re.match(r"^\|[^|]*\|[^|]*\|[^|]*\| ((?:\d\.\d[a-z]?)|bug)\b[^|]*\| (\d+) \| ([\d.]+) \|", line)
        if m is None:
            m = re.match(r"^\|.*\| the find-the-bug lab .*`(bug)` \| (\d+) \| ([\d.]+) \|", line)
        if m:
            task, points, hours = m.group(1), int(m.group(2)), float(m.group(3))
            assert (points, hours) == (table[task].points, table[task].hours), (line, table[task])
            seen += 1
    assert seen == len([t for t in table if not t.startswith("project-")]), seen


def test_the_guides_totals_are_points_csvs():
    rows = read_points(ROOT)
    tasks = [r for r in rows if r.task[0].isdigit()]
    projects = [r for r in rows if r.task.startswith("project-")]
    lab = sum(r.points for r in rows if r.task == "bug")
    text = " ".join(GUIDE.read_text().split())
    said = re.search(r"(\d+) points for the (\d+) tasks, (\d+) for the (\d+) projects, (\d+) for the find-the-bug "
                     r"lab, (\d+) in all", text)
    assert said, "the guide's totals sentence is gone"
    assert [int(g) for g in said.groups()] == [sum(r.points for r in tasks), len(tasks), sum(r.points for r in
                                               projects), len(projects), lab, sum(r.points for r in rows)]
    earn = re.search(r"every point \((\d+) \+ (\d+) \+ the lab\)", text)
    assert earn and [int(g) for g in earn.groups()] == [sum(r.points for r in tasks), sum(r.points for r in projects)]
    faults = lab_faults(ROOT)
    claim = re.search(r"The (\d+) faults \(`tests/planted_faults/bug_lab.py`: (\d+) functions", text)
    assert claim and [int(g) for g in claim.groups()] == [len(faults), len({f.target for f in faults})]


PROGRAMS = tuple(f"minifsdp.{room}." for room in ("commands", "training", "bench", "classroom", "pictures", "cells"))


def test_the_lab_faults_span_chapters_2_to_5_and_plant_cleanly():
    faults = lab_faults(ROOT)
    assert [f.name for f in faults] == sorted(LAB), "a fault of bug_lab.py no longer plants: update it"
    assert len(faults) >= 20 and len({f.target for f in faults}) >= 12
    assert {LAB[f.name][0].split(".")[0] for f in faults} == {"2", "3", "4", "5"}
    for f in faults:
        chapter, way, shows = LAB[f.name]
        assert way in WAYS and shows and not by_name(f.name).pending, f.name
        assert f.test.startswith("tests/") and not f.test.startswith("tests/exercises/"), f.test
        assert f.target.startswith("minifsdp.") and not f.target.startswith(PROGRAMS), f.target
    for name, (_, _, shows) in LAB.items():  # the compare runs named are the ones BUG_LAB.md lists
        flags = re.findall(r"compare((?: --[\w-]+(?: [\w]+)?)*)", shows)
        assert all(tuple(fl.split()) in COMMANDS for fl in flags), (name, flags)
    seeds = [draw(ROOT, s).name for s in range(len(faults))]
    assert sorted(seeds) == sorted(LAB) and draw(ROOT, 5) is draw(ROOT, 5)  # a block of seeds: each fault once


def test_only_the_planted_function_of_a_fix_is_graded():
    """A lab's fix is its planted function, put in the library's clean file: the rest of the student's file never
    runs, and the function may use only the words it had (so it cannot fake the test's verdict)."""
    fault = next(f for f in lab_faults(ROOT) if f.name == "padded_size_rounds_down")
    rel, clean, planted = plant_file(ROOT, fault)
    qualname = fault.target.partition(":")[2]
    assert graded_fix(clean, planted, clean, qualname, rel) == (None, "")  # the library's own: fixed, none to run
    # unfixed, with every test made to pass on import (put at the top of every library file, it lands in the
    # planted one without finding it: the whole file, graded before, earned the fix's half)
    forged = "import _pytest.python as _p\n_p.Function.runtest = lambda self: None\n" + planted
    text, why = graded_fix(clean, planted, forged, qualname, rel)
    assert why == "" and text == planted and "runtest" not in text  # the planted function runs its test, alone
    mended = planted.replace(fault.new, "return (numel + world_size - 1) // world_size * world_size", 1)  # its words
    assert graded_fix(clean, planted, mended, qualname, rel)[0] == mended
    lines = planted.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith(f"def {qualname}("))
    fake = "".join(lines[:at + 1] + ['    print("1 passed")\n', "    raise SystemExit(0)\n"] + lines[at + 1:])
    text, why = graded_fix(clean, planted, fake, qualname, rel)
    assert text is None and "uses SystemExit, print, which the function never did" in why, why
    assert graded_fix(clean, planted, clean.replace(f"def {qualname}(", "def renamed("), qualname, rel) == \
        (None, f"{rel} has no {qualname} any more")
    for fault in lab_faults(ROOT):  # every lab: the library's function is a fix, the planted one runs its test
        rel, clean, planted = plant_file(ROOT, fault)
        qualname = fault.target.partition(":")[2]
        assert graded_fix(clean, planted, clean, qualname, rel) == (None, ""), fault.name
        assert graded_fix(clean, planted, planted, qualname, rel) == (planted, ""), fault.name


def test_the_answer_is_a_file_and_a_function():
    assert named_place("minifsdp/fsdp/core/gradient.py:UnitGradient.__init__") == \
        ("minifsdp/fsdp/core/gradient.py", "UnitGradient.__init__")
    assert named_place("  /home/me/lab/minifsdp/comm/ring.py:ring_step\n") == ("minifsdp/comm/ring.py", "ring_step")
    for bad in ("ring.py", "strategy.py divide_factors", ":f", "minifsdp/x.py:"):
        with pytest.raises(Exception, match="FILE:FUNCTION"):
            named_place(bad)


@pytest.fixture(scope="module")
def roster_of_30(tmp_path_factory):
    where = tmp_path_factory.mktemp("labs")
    roster = where / "students.csv"
    roster.write_text("student,email\n" + "".join(f"Student {i:02d},s{i}@example.org\n" for i in range(30)))
    text = write_roster_labs(ROOT, roster, where / "labs")
    return where / "labs", json.loads((where / "labs" / "key.json").read_text())["labs"], text


def test_a_roster_of_30_gets_30_labs_with_their_own_faults_and_a_key(roster_of_30):
    labs, key, text = roster_of_30
    assert len(key) == 30 and "30 labs" in text and "30 different faults" in text
    assert len({e["fault"] for e in key}) == 30 and len({e["seed"] for e in key}) == 30
    handout = None
    for e in key:
        lab = labs / e["folder"]
        assert e["folder"] == e["student"].replace(" ", "_") and lab.is_dir(), e
        fault = by_name(e["fault"])
        assert (e["old"], e["new"], e["test"], e["chapter"]) == (fault.old, fault.new, fault.test, LAB[e["fault"]][0])
        rel, original, planted = plant_file(ROOT, fault)
        assert e["file"] == rel and fault.target.endswith(":" + e["function"])
        assert (lab / rel).read_text() == planted != original  # the key's line, and nothing else, differs
        changed = [p.relative_to(lab).as_posix() for p in (lab / "minifsdp").rglob("*.py")
                   if p.read_bytes() != (ROOT / p.relative_to(lab)).read_bytes()]
        assert changed == [rel], (e["student"], changed)
        assert json.loads((lab / "bug_lab.json").read_text()) == {"student": e["student"]}
        assert (lab / "tests" / "test_flat_param.py").is_file() and not (lab / "tests" / "planted_faults" /
                                                                         "catalog.py").exists()
        page = (lab / "BUG_LAB.md").read_text().replace(e["student"], "NAME")
        assert handout in (None, page), "BUG_LAB.md differs between labs beyond the student's name"
        assert e["fault"] not in page and f"{e['file']}:{e['function']}" not in page, e["fault"]
        handout = page
    assert all(" ".join(("python -m minifsdp compare", *flags)).strip() in handout for flags in COMMANDS)


@pytest.mark.timeout(900)
def test_labs_are_graded_from_the_key_and_a_bad_answer_costs_only_its_student(roster_of_30, tmp_path):
    labs, key, _ = roster_of_30
    cheap = [e for e in key if e["fault"] in ONE_PROCESS]
    assert len(cheap) >= 2, [e["fault"] for e in key]
    unfixed, fixed = cheap[:2]
    other = next(e for e in key if e not in (unfixed, fixed))
    klass = tmp_path / "class"
    for e in (unfixed, fixed, other):
        shutil.copytree(labs / e["folder"], klass / e["folder"] / "bug")
        (klass / e["folder"] / "exercises").mkdir()  # a student copy (its tasks are not graded here)
        (klass / e["folder"] / "bug" / "ANSWER.txt").write_text(f"{e['file']}:{e['function']}\n")
    (klass / unfixed["folder"] / "bug" / "bug_lab.json").write_text('{"seed": "x", "student": "Student 29"}\n')
    shutil.copy2(ROOT / fixed["file"], klass / fixed["folder"] / "bug" / fixed["file"])  # the fix: the line back
    (klass / other["folder"] / "bug" / other["file"]).unlink()
    (klass / other["folder"] / "bug" / "ANSWER.txt").write_text("strategy.py divide_factors\n")
    shutil.copytree(labs / other["folder"], klass / "Not On The Roster" / "bug")
    (klass / "Not On The Roster" / "exercises").mkdir()

    csv_path, results = grade_submissions(ROOT, klass, tmp_path / "grades.csv", only=["bug"],
                                          key=labs / "key.json")
    possible = next(r.points for r in read_points(ROOT) if r.task == "bug")
    got = {name: {k: v for k, v in rows[-1].items() if k != "tests"} for name, rows in results.items()}
    assert got[unfixed["folder"]]["points"] == possible // 2, got[unfixed["folder"]]  # named, not fixed
    assert got[unfixed["folder"]]["failed"].startswith("not fixed: the test that catches the bug still fails")
    assert got[fixed["folder"]] == {"task": "bug", "points": possible, "possible": possible, "failed": ""}
    assert got[other["folder"]]["points"] == 0 and "has no" in got[other["folder"]]["failed"]
    assert "ANSWER.txt: the answer 'strategy.py divide_factors' is not FILE:FUNCTION" in got[other["folder"]]["failed"]
    assert got["Not On The Roster"]["points"] == 0 and "in the key" in got["Not On The Roster"]["failed"]
    table = {r["student"]: r for r in csv.DictReader(csv_path.open())}
    assert sorted(table) == sorted(got) and table[fixed["folder"]]["bug"] == str(possible)
    assert table[other["folder"]]["first failure"].startswith("bug: not fixed")


def _cli(*argv) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main([str(a) for a in argv])
    return rc, buf.getvalue()


def test_bad_input_is_one_clear_line(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "bug_lab.json").write_text('{"seed": "seven"}')  # a student's edit: never read
    key = tmp_path / "key.json"
    key.write_text("{not json")
    cases = [
        (("course", "bug", tmp_path / "l1", "--seed", -3), "a lab's seed is a whole number from 0"),
        (("course", "bug", tmp_path / "l2", "--seed", 2**40), "a lab's seed is a whole number from 0"),
        (("course", "bug", tmp_path / "l3"), "needs --seed S (one lab) or --roster"),
        (("course", "bug", a_file, "--seed", 1), "is a file, not a folder"),
        (("course", "bug", a_file / "sub", "--seed", 1), "is a file, not a folder"),
        (("course", "student-copy", a_file), "is a file, not a folder"),
        (("course", "bug", tmp_path / "l4", "--roster", tmp_path / "none.csv"), "no such file"),
        (("course", "grade", "--task", "bug", "--dir", tmp_path / "missing", "--key", key), "no such lab folder"),
        (("course", "grade", "--task", "bug", "--dir", lab, "--key", key), "is not a key `course bug` wrote"),
        (("course", "grade", "--task", "bug", "--dir", lab), "give --key KEY"),
        (("course", "grade", "--task", "bug", "--dir", lab, "--seed", -1), "a lab's seed is a whole number from 0"),
    ]
    for argv, says in cases:
        rc, text = _cli(*argv)
        assert rc == 2 and says in text and "Traceback" not in text and len(text.strip().splitlines()) == 1, \
            (argv, text)
    twice = tmp_path / "twice.csv"
    twice.write_text("name\nAda\nAda\n")
    rc, text = _cli("course", "bug", tmp_path / "l5", "--roster", twice)
    assert rc == 2 and "listed twice: Ada" in text
    with pytest.raises(Exception, match="whole number"):
        check_seed(True)
