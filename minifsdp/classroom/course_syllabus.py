"""``SYLLABUS.md``: what a student needs to know about the course, generated from the instructor's guide.

The student edition leaves ``exercises/INSTRUCTOR.md`` out (it holds answers), so ``course student-copy``
writes the student's part of it into ``SYLLABUS.md``: one place to edit, two documents that follow.

    from the guide (exercises/INSTRUCTOR.md)       into the syllabus
    ## Week N: title                                the weeks, their titles
    | session | read | run | graded | points | hours |   per session what to read and run; per graded task its
      (the week's table)                                title, points, hours and due week: the week it is
                                                        listed in, or the "(due week N)" its row gives
    Objectives: ...                                 what the week checks
    ### How to hand in, ### How points become a     word for word (the grade table's shares get their
    grade, ### Working together (under "## For the  points: 90% of 189 is 171)
    syllabus")

Points, hours and titles are ``exercises/points.csv``'s (the guide's tables must agree: ``tests/``
checks it); the weeks and what is due when are the guide's tables.  A guide without those sections, or a
task of points.csv that no week lists, stops ``course student-copy`` with what to add.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from minifsdp.classroom.points import CourseError, Row, read_points

__all__ = ["GUIDE", "POLICIES", "schedule", "syllabus", "write_syllabus"]

GUIDE = Path("exercises") / "INSTRUCTOR.md"
POLICIES = ("How to hand in", "How points become a grade", "Working together")
_WEEK = re.compile(r"^## Week (\d+): (.+)$", re.M)
_ID = re.compile(r"(?<![\w.-])(\d\.\d[a-z]?|project-[a-z0-9-]+[a-z0-9]|`bug`)(?![\w-]|\.\d)")
_DUE = re.compile(r"\(due week (\d+)\)")
_SHARE = re.compile(r"^\| ([^|]+?) \| (\d+(?:\.\d+)?)% \|\s*$", re.M)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def schedule(guide: str, rows: list[Row]) -> list[dict]:
    """The guide's weeks: ``[{"week", "title", "sessions": [(session, read, run)], "objectives",
    "tasks": [(task id, due week)]}]``, each task under the week that lists it first."""
    known = {r.task for r in rows}
    weeks, seen = [], set()
    marks = list(_WEEK.finditer(guide))
    for i, m in enumerate(marks):
        text = guide[m.end(): marks[i + 1].start() if i + 1 < len(marks) else len(guide)]
        text = text.split("\n## ", 1)[0]
        week = {"week": int(m.group(1)), "title": m.group(2).strip(), "sessions": [], "tasks": [],
                "objectives": ""}
        for line in text.splitlines():
            if not re.match(r"^\| \d+ \|", line):
                continue
            session, read, run, graded = _cells(line)[:4]
            if read or run:
                week["sessions"].append((session, read, run))
            for clause in graded.split(";"):
                due = _DUE.search(clause)
                for task in (t.strip("`") for t in _ID.findall(clause)):
                    if task in known and task not in seen:
                        seen.add(task)
                        week["tasks"].append((task, int(due.group(1)) if due else week["week"]))
        objectives = re.search(r"^Objectives: (.+?)(?:\n\n|\Z)", text, re.M | re.S)
        week["objectives"] = " ".join(objectives.group(1).split()) if objectives else ""
        weeks.append(week)
    if not weeks:
        raise CourseError(f"{GUIDE} has no '## Week N: title' sections: the syllabus is made from them")
    missing = [r.task for r in rows if r.task not in seen]
    if missing:
        raise CourseError(f"{GUIDE}: no week's table lists {', '.join(missing)} (exercises/points.csv has them): "
                          "add each to the week it is handed out in")
    return weeks


def _policy(guide: str, title: str) -> str:
    m = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^##|\Z)", guide, re.M | re.S)
    if m is None or not m.group(1).strip():
        raise CourseError(f"{GUIDE} has no '### {title}' section (under '## For the syllabus'): the student's "
                          "syllabus copies it")
    return m.group(1).strip()


def _with_points(policy: str, total: int) -> str:
    """The grade table's shares, each with the points it takes: ``| A | 90% |`` -> ``| A | 90% | 171 |``."""
    lines = policy.splitlines()
    for i, line in enumerate(lines):
        m = _SHARE.match(line)
        if m:
            lines[i] = f"{line.rstrip()} {math.ceil(float(m.group(2)) / 100 * total)} |"
        elif re.match(r"^\|(\s*-+\s*\|){2}\s*$", line) and i > 0:
            lines[i - 1] = f"{lines[i - 1].rstrip()} points (of {total}) |"
            lines[i] = "|---|---|---|"
    return "\n".join(lines)


def syllabus(guide: str, rows: list[Row]) -> str:
    """The text of ``SYLLABUS.md`` from the guide's text and points.csv's rows."""
    by_id = {r.task: r for r in rows}
    weeks = schedule(guide, rows)
    kinds = {"tasks": [r for r in rows if r.task[0].isdigit()], "projects": [r for r in rows if r.task[0] == "p"],
             "lab": [r for r in rows if r.task == "bug"]}
    total = sum(r.points for r in rows)
    out = ["# Syllabus", "",
           "Written from your instructor's guide by `python -m minifsdp course student-copy`: the weeks, what to "
           "read and run, what is graded and when it is due, how to hand it in, how points become a grade, and how "
           "you may work together.  Grade yourself at any time with `python -m minifsdp course grade` (one task: "
           "`--task 2.2a`).", "",
           f"**{total} points in all:** {sum(r.points for r in kinds['tasks'])} for the {len(kinds['tasks'])} tasks "
           f"(`exercises/`), {sum(r.points for r in kinds['projects'])} for the {len(kinds['projects'])} projects "
           f"(`exercises/projects/`), {sum(r.points for r in kinds['lab'])} for the find-the-bug lab.  A task earns "
           "its points when every one of its tests passes.", ""]
    for w in weeks:
        out += [f"## Week {w['week']}: {w['title']}", ""]
        if w["sessions"]:
            out += ["| session | read | run |", "|---|---|---|"]
            out += [f"| {s} | {read} | {run} |" for s, read, run in w["sessions"]] + [""]
        if w["objectives"]:
            out += [f"By the end of the week you can: {w['objectives']}", ""]
        if w["tasks"]:
            out += ["| graded | what | points | hours | due |", "|---|---|---|---|---|"]
            for task, due in w["tasks"]:
                r = by_id[task]
                out.append(f"| `{task}` | {r.title} | {r.points} | {r.hours:g} | end of week {due} |")
            out.append("")
    out += ["## For the whole course", ""]
    for title in POLICIES:
        text = _policy(guide, title)
        out += [f"### {title}", "", _with_points(text, total) if title == POLICIES[1] else text, ""]
    return "\n".join(out).rstrip() + "\n"


def write_syllabus(root: Path, dest: Path) -> Path:
    """Write ``dest/SYLLABUS.md`` from ``root``'s guide and points; its path."""
    path = root / GUIDE
    if not path.is_file():
        raise CourseError(f"{path} is missing: the student's syllabus is written from it")
    out = dest / "SYLLABUS.md"
    out.write_text(syllabus(path.read_text(), read_points(root)))
    return out
