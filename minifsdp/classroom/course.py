"""``python -m minifsdp course``: run a class from this repository -- grade tasks and projects with points.

    course grade [--task 2.2a,project-zero1] [--json] [--impl student|reference] [--seed S]
                                     run the graded tests, print points per task (the learner's code by default)
    course grade --submissions DIR [--csv FILE] [--force] [--seed S] [--key KEY]
                                     grade every student copy in DIR with *this* repository's tests: one CSV,
                                     one feedback file per student (``course_class.py``); each copy's bug/
                                     lab graded from the key
    course grade --task bug --dir DIR --key KEY [--student NAME] [--answer FILE:FUNCTION]
                                     the find-the-bug lab, graded from the instructor's key (``course_bug.py``)
    course student-copy DIR          the student edition (``course_copy.py``)
    course bug --roster CSV DIR      one find-the-bug lab per student and the key (``course_bug.py``);
    course bug DIR --seed S          or one lab

What is graded and how it is scored (``exercises/points.csv``, a task's points, a project's shares): ``points.py``.

The grading seed: the graded tests draw their inputs from it, so answers written for one run's inputs fail
another's.  ``--seed S`` (0 <= S < 2**31; the instructor keeps it); by default a fresh one, printed.

Note (the learner's code): it never runs in the process that decides (``course_remote.py``), and each task's
rules hold in the processes where it runs (``course_rules.py``).  It still runs as the user who grades: do it
in a container or an account that holds nothing else.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from minifsdp.classroom.course_bug import check_seed as check_lab_seed
from minifsdp.classroom.course_bug import grade_bug, write_bug_lab, write_roster_labs
from minifsdp.classroom.course_class import grade_submissions
from minifsdp.classroom.course_copy import student_copy
from minifsdp.classroom.course_run import grade
from minifsdp.classroom.points import MAX_SEED, POINTS, CourseError, as_json, check_seed, graded_rows, table

__all__ = ["add_arguments", "run_course"]


def _root() -> Path:
    """The repository graded: the current folder if it holds exercises/points.csv, else the one minifsdp came from."""
    here = Path.cwd()
    return here if (here / POINTS).exists() else Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="course_command", required=True)
    g = sub.add_parser("grade", help="run the graded tests, print points per task")
    g.add_argument("--task", default=None, help="only these tasks, comma-separated ids of exercises/points.csv "
                                                "(e.g. 2.2a,project-zero1; 'bug' for the find-the-bug lab)")
    g.add_argument("--json", action="store_true", help="print the result as JSON, for a learning platform")
    g.add_argument("--impl", choices=("student", "reference"), default="student",
                   help="the learner's code in exercises/ (default) or the instructor's answers")
    g.add_argument("--submissions", type=Path, default=None, help="a folder of student copies, one per sub-folder")
    g.add_argument("--csv", type=Path, default=None, help="--submissions: where to write (default DIR/grades.csv; "
                                                          "feedback files in a folder 'feedback' beside it)")
    g.add_argument("--force", action="store_true", help="--submissions: write over an earlier run's CSV and feedback")
    g.add_argument("--seed", type=int, default=None,
                   help=f"the grading seed, 0..{MAX_SEED}: the tests draw their inputs from it (default: a fresh one, "
                        "printed); --task bug: the lab's seed, instead of --key")
    g.add_argument("--key", type=Path, default=None, help="--task bug, --submissions: the key `course bug` wrote")
    g.add_argument("--student", default=None, help="--task bug: whose lab --dir is (default: its folder's name)")
    g.add_argument("--dir", type=Path, default=None, help="--task bug: the folder `course bug` wrote")
    g.add_argument("--answer", default=None,
                   help="--task bug: the fixed place as FILE:FUNCTION (default: read DIR/ANSWER.txt)")
    c = sub.add_parser("student-copy", help="write the student edition: no answers, a fresh git repository")
    c.add_argument("dir", type=Path)
    b = sub.add_parser("bug", help="the find-the-bug lab: one per student (--roster) or one (--seed), and the key")
    b.add_argument("dir", type=Path)
    b.add_argument("--roster", type=Path, default=None, help="a CSV of students: one lab each in DIR/<student>/")
    b.add_argument("--seed", type=int, default=None, help="one lab's seed; with --roster, which faults (default 0)")
    b.add_argument("--key", type=Path, default=None, help="one lab: where to write its key (default DIR-key.json)")
    b.add_argument("--shared-faults", action="store_true", help="--roster: more students than faults is allowed")


def run_course(args) -> int:
    """CLI entry for ``python -m minifsdp course ...``."""
    try:
        return _run(args)
    except CourseError as e:
        print(f"minifsdp course: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    root = _root()
    if args.course_command == "student-copy":
        print(student_copy(root, args.dir))
        return 0
    if args.course_command == "bug":
        if args.roster is not None:
            print(write_roster_labs(root, args.roster, args.dir, check_lab_seed(args.seed or 0), args.shared_faults))
        elif args.seed is None:
            raise CourseError("course bug DIR needs --seed S (one lab) or --roster students.csv (one per student)")
        else:
            print(write_bug_lab(root, args.dir, check_lab_seed(args.seed), args.key))
        return 0
    only = [t.strip() for t in args.task.split(",") if t.strip()] if args.task is not None else None
    if only == []:
        raise CourseError(f"--task {args.task!r} names no task: give ids of exercises/points.csv, e.g. --task 2.2a")
    results = []
    if only and "bug" in only and args.submissions is None:  # one lab, graded from the key (--seed: the lab's)
        if args.dir is None:
            raise CourseError("--task bug grades the folder `course bug` wrote: give it with --dir DIR")
        graded_rows(root, ["bug"])  # its row must be in points.csv
        results.append(grade_bug(root, args.dir, seed=args.seed, answer=args.answer, key=args.key,
                                 student=args.student))
        only = [t for t in only if t != "bug"] or None
        if only is None:
            print(as_json(results) if args.json else table(results))
            return 0
    seed = check_seed(args.seed) if args.seed is not None else secrets.randbelow(MAX_SEED + 1)
    print(f"grading seed {seed} (the tests' inputs are drawn from it; --seed {seed} grades them again)",
          file=sys.stderr)
    if args.submissions is not None:
        written, _ = grade_submissions(root, args.submissions, args.csv, only, seed=seed, force=args.force,
                                       key=args.key)
        print(f"wrote {written}")
        return 0
    graded, stray = grade(root, args.impl, only, seed=seed)
    results = graded + results
    if stray:
        print(f"not counted (their task has no row in exercises/points.csv): {', '.join(stray)}", file=sys.stderr)
    print(as_json(results) if args.json else table(results))
    if not args.json and only is None:
        print("the find-the-bug lab is graded on its own: "
              "python -m minifsdp course grade --task bug --dir DIR --key KEY")
    return 0
