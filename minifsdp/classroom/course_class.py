"""``python -m minifsdp course grade --submissions DIR``: a class graded at once, one CSV, a feedback file each.

    DIR/alice/, DIR/bob/, ...       one copy per student (a clone of their repository, an upload); folders whose
                                    name starts with "." or "__" (``.git``, ``__MACOSX``) are not students
    DIR/grades.csv                  (or ``--csv FILE``) a row per student: points per task, earned, possible, the
                                    grading seed, the first failure
    DIR/feedback/alice.md           (beside the CSV) per task: points, and each failing test with its first
                                    useful line (the student's file and line, gloo's message for a deadlock)

Each copy is graded in a folder of its own with this repository's library, tests, points and starter code, and
from the student's copy only the files that hold graded code (``course_rules.LEARNER_FILES``): a student who
edited a test, the library, ``exercises/__init__.py`` or a project's starter code changes nothing.  A copy that
cannot be graded (no ``exercises/``, a file that is a link, the tests' outcomes not the ones the grader signed)
is that student's row, with the reason; the other students are graded.  A second run never writes over the
CSV or the feedback of a first without ``--force``.  Every copy is graded on the same grading seed.
"""

from __future__ import annotations

import csv
import shutil
import tempfile
from pathlib import Path

from minifsdp.classroom.course_bug import grade_bug, has_bug_lab
from minifsdp.classroom.course_rules import LEARNER_FILES
from minifsdp.classroom.course_run import grade
from minifsdp.classroom.points import POINTS, CourseError, check_seed, failure_line, graded_rows, read_points

__all__ = ["overlay", "students", "grade_submissions", "feedback"]


def overlay(root: Path, submission: Path, where: Path) -> Path:
    """This repository's library, tests, points and starter code in ``where``, with ``submission``'s graded files."""
    if not (submission / "exercises").is_dir():
        raise CourseError(f"{submission.name} has no exercises/ folder: is it a student copy?")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("minifsdp", "tests"):
        shutil.copytree(root / name, where / name, ignore=skip)
    shutil.copy2(root / "pyproject.toml", where / "pyproject.toml")
    shutil.copytree(root / "exercises", where / "exercises", ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "solutions", "INSTRUCTOR.md"))
    for rel in LEARNER_FILES:
        theirs = submission / rel
        if theirs.is_symlink() or (theirs.exists() and not theirs.is_file()):
            raise CourseError(f"{submission.name}/{rel} is not a plain file (a link or a folder)")
        if theirs.exists():
            shutil.copyfile(theirs, where / rel)
    shutil.copy2(root / POINTS, where / POINTS)
    return where


def students(folder: Path) -> list[Path]:
    """The student copies in ``folder``: its sub-folders, but hidden ones (``.git``, ``__MACOSX``, ``__pycache__``)."""
    if not folder.exists():
        raise CourseError(f"--submissions {folder}: no such folder")
    if not folder.is_dir():
        raise CourseError(f"--submissions {folder}: not a folder (one student copy per sub-folder)")
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    if not subs:
        raise CourseError(f"--submissions {folder}: no sub-folders (one student copy per folder)")
    return subs


def feedback(name: str, results: list[dict], seed: int) -> str:
    """One student's feedback file (Markdown): per task its points, and each failing test's first useful line."""
    earned, possible = sum(r["points"] for r in results), sum(r["possible"] for r in results)
    lines = [f"# Feedback for {name}", "", f"{earned} / {possible} points (grading seed {seed}).", "",
             "| task | points | |", "|---|---|---|"]
    for r in results:
        state = "passed" if not r["failed"] else "see below"
        lines.append(f"| {r['task']} | {r['points']} / {r['possible']} | {state} |")
    for r in results:
        bad = [t for t in r.get("tests", []) if t["outcome"] != "passed"]
        if not r["failed"] and not bad:
            continue
        lines += ["", f"## {r['task']}: {r['points']} / {r['possible']}", ""]
        if not bad:
            lines.append(f"- {r['failed']}")
        seen = set()
        for t in bad:
            line = t["line"] or t["outcome"]
            test = t["test"].split("::", 1)[-1]
            lines.append(f"- `{test}` {t['outcome']}: {line}" if line not in seen else f"- `{test}` {t['outcome']}: "
                                                                                       "the same")
            seen.add(line)
    return "\n".join(lines) + "\n"


def _row_error(rows, message: str) -> list[dict]:
    return [{"task": r.task, "points": 0, "possible": r.points, "failed": failure_line(message), "tests": []}
            for r in rows]


def grade_submissions(root: Path, folder: Path, csv_path: Path | None, only: list[str] | None = None,
                      seed: int = 0, force: bool = False, key: Path | None = None
                      ) -> tuple[Path, dict[str, list[dict]]]:
    """Grade every student copy in ``folder`` into one CSV and a feedback file each: (the CSV, results by student).
    A copy's ``bug/`` folder, if it holds a lab ``course bug`` wrote, is graded too, from the instructor's ``key``
    (what was planted is read there, never in the student's folder)."""
    seed = check_seed(seed)
    subs = students(folder)
    rows = [r for r in graded_rows(root, only) if r.task != "bug"]
    csv_path = csv_path or folder / "grades.csv"
    notes = csv_path.parent / "feedback"
    if not force and (csv_path.exists() or (notes.is_dir() and any(notes.iterdir()))):
        raise CourseError(f"{csv_path if csv_path.exists() else notes} is there from an earlier run: give --force to "
                          "write over it, or --csv another file")
    table_rows = []
    for sub in subs:
        with tempfile.TemporaryDirectory(prefix="minifsdp-submission-") as tmp:
            try:
                results, _ = grade(overlay(root, sub, Path(tmp)), "student", [r.task for r in rows], seed=seed)
            except (CourseError, OSError, UnicodeError, ValueError) as e:  # this student's, not the class's
                results = _row_error(rows, f"{sub.name}: {e}")
        if has_bug_lab(sub / "bug") and (only is None or "bug" in only):
            try:
                results.append({**grade_bug(root, sub / "bug", key=key, student=sub.name), "tests": []})
            except (CourseError, OSError, ValueError, KeyError) as e:
                possible = next((r.points for r in read_points(root) if r.task == "bug"), 0)
                results.append({"task": "bug", "points": 0, "possible": possible, "failed": f"bug lab: {e}",
                                "tests": []})
        table_rows.append((sub.name, results))
        print(f"{sub.name}: {sum(r['points'] for r in results)} / {sum(r['possible'] for r in results)}", flush=True)
    tasks = [r.task for r in rows] + (["bug"] if any(len(res) > len(rows) for _, res in table_rows) else [])
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", *tasks, "earned", "possible", "seed", "first failure"])
        for name, results in table_rows:
            got = {r["task"]: r for r in results}
            first = next((f"{r['task']}: {r['failed']}" for r in results if r["failed"]), "")
            w.writerow([name, *(got[t]["points"] if t in got else "" for t in tasks),
                        sum(r["points"] for r in results), sum(r["possible"] for r in results), seed, first])
    notes.mkdir(exist_ok=True)
    for name, results in table_rows:
        (notes / f"{name}.md").write_text(feedback(name, results, seed))
    return csv_path, dict(table_rows)
