"""The instructor's side of the course (the student edition leaves this file out).

* ``exercises/INSTRUCTOR.md`` names every graded task of ``exercises/points.csv`` (projects and the bug
  lab included), plans six weeks of two sessions, and its tables' points and hours are points.csv's.
* The find-the-bug lab: every fault ``tests/planted_faults/bug_lab.py`` lists is in the catalog and plants
  cleanly on disk today, and the commands every student gets include its compare flags.  One seed end to
  end (``course bug``, then ``course grade --task bug``): the lab differs from minifsdp in one line; graded
  as handed out, it fails compare (no point for the fix, the named place's points given); with the
  original file copied back, it trains bitwise like torch again and earns every point.  Two compare runs,
  the cheapest fault's (2 ranks when one is listed).
"""

import re
import shutil
from pathlib import Path

import pytest

from minifsdp.tools.course import read_points
from minifsdp.tools.course_bug import COMMANDS, _eligible, draw, grade_bug, named_place, plant_file, write_bug_lab
from tests.planted_faults.bug_lab import REVEALED_BY
from tests.planted_faults.catalog import by_name

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "exercises" / "INSTRUCTOR.md"


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


def test_every_lab_fault_is_in_the_catalog_and_plants_cleanly():
    assert len(REVEALED_BY) >= 5
    for name, flags in REVEALED_BY.items():
        assert not by_name(name).pending, name
        assert tuple(flags) in COMMANDS, (name, flags)
    assert sorted(f.name for f in _eligible(ROOT)) == sorted(REVEALED_BY)
    for seed in range(20):  # a draw is one of them, and the same for the same seed
        fault, flags = draw(ROOT, seed)
        assert draw(ROOT, seed)[0] is fault and fault.name in REVEALED_BY


def test_the_answer_is_a_file_and_a_function():
    assert named_place("minifsdp/fsdp/core/gradient.py:UnitGradient.__init__") == \
        ("minifsdp/fsdp/core/gradient.py", "UnitGradient.__init__")
    assert named_place("  /home/me/lab/minifsdp/comm/ring.py:ring_step\n") == ("minifsdp/comm/ring.py", "ring_step")
    with pytest.raises(Exception, match="FILE:FUNCTION"):
        named_place("ring.py")


@pytest.mark.timeout(900)
def test_one_lab_end_to_end(tmp_path):
    seed = next((s for s in range(50) if draw(ROOT, s)[1] == ()), 0)  # the cheapest: compare at 2 ranks
    fault, _ = draw(ROOT, seed)
    lab = tmp_path / "lab"
    text = write_bug_lab(ROOT, lab, seed)
    assert "compare --world-size 3" in text and fault.name not in text
    rel, original, planted = plant_file(ROOT, fault)
    assert (lab / rel).read_text() == planted != original
    changed = [p.relative_to(lab).as_posix() for p in (lab / "minifsdp").rglob("*.py")
               if p.read_bytes() != (ROOT / p.relative_to(lab)).read_bytes()]
    assert changed == [rel], changed
    module_file, qualname = rel, fault.target.partition(":")[2]
    (lab / "ANSWER.txt").write_text(f"{module_file}:{qualname}\n")
    possible = next(r.points for r in read_points(ROOT) if r.task == "bug")

    handed_out = grade_bug(ROOT, lab)
    assert handed_out["points"] == possible // 2, handed_out
    assert handed_out["failed"].startswith("not fixed: `python -m minifsdp compare"), handed_out
    assert "VERDICT" in handed_out["failed"] or "failed" in handed_out["failed"], handed_out

    shutil.copy2(ROOT / rel, lab / rel)  # the fix: the original file back
    fixed = grade_bug(ROOT, lab, seed=seed)
    assert fixed == {"task": "bug", "points": possible, "possible": possible, "failed": ""}, fixed
