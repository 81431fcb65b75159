"""``python -m minifsdp course student-copy DIR``: the student edition, a repository a class can be handed.

The copy holds every file of this repository that git tracks (or would: untracked files not ignored),
except the instructor's, with the hints that point to an answer rewritten, in a fresh git repository
with one commit that an instructor can push:

    left out (INSTRUCTOR_ONLY)              why
    exercises/solutions/                    the answers (tasks and projects)
    exercises/INSTRUCTOR.md                 the guide: answers to its questions, the bug lab's faults
    tests/planted_faults/catalog.py         every planted fault names a file, a function and the bad line:
    tests/planted_faults/bug_lab.py         the answers of the find-the-bug lab (its faults are drawn from
    tests/test_planted_faults.py            there); the test that runs them goes with them
    tests/test_student_impl.py,             plug the instructor's 2.1a answer into FSDP
      tests/_workers_student.py
    tests/test_exercise_solutions.py,       check the answers and the lab themselves
      tests/test_course_instructor.py,
      tests/test_student_edition.py

    rewritten
    a block that starts "Reference solution:" (or "**Reference solution:**") in exercises/: the sentence
        AFTER_IT_PASSES instead (its pointer to the answer, in the library or in solutions/, is gone)
    <!-- instructor --> ... <!-- /instructor --> in any Markdown file (on lines of their own, or inside a line):
        removed, with what they hold (how to run a class, the planted faults)
    a region of the library marked "# >>> student edition: cut" (the textbook ring, ...): each function a
        stub that runs the student's own (``course_cut.py``), so the student's code is the library's there

    added
    SYLLABUS.md                             the weeks, what is due when, how to hand in, how points become a
                                            grade, working together: from the guide (``course_syllabus.py``)

Then it checks the copy, and refuses to finish if one check fails (a file someone adds later must
say which side it is on): no ``exercises/solutions``; no Python file that imports ``exercises.solutions``;
no mention of ``exercises/solutions`` or ``exercises.solutions`` in ``exercises/`` or ``tests/`` but where
the graded tests find their module (ALLOWED); no "Reference solution" left; no Markdown file names a
file the copy left out; no cut marker left; no answer left: no Python file or notebook holds most of the
lines of a function of ``exercises/solutions/`` or of a cut region (``course_cut.surviving_answers``).

In the copy, the README's install and test commands work as they are: the task tests are skipped there
unless ``--impl=student`` is given (``tests/conftest.py``), and ``python -m minifsdp course grade`` scores
them (the README says so); the library's own tests of a cut function test the student's, and fail
("Task 2.2a: ...") until that task is done, as minitorch's do.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from minifsdp.classroom.course_cut import cut_source, graded_bodies, marked, surviving_answers
from minifsdp.classroom.course_syllabus import write_syllabus
from minifsdp.classroom.points import CourseError

__all__ = ["INSTRUCTOR_ONLY", "AFTER_IT_PASSES", "student_copy", "student_files", "rewrite", "check_copy",
           "check_new_folder"]

INSTRUCTOR_ONLY = (
    "exercises/solutions/",
    "exercises/INSTRUCTOR.md",
    "tests/planted_faults/catalog.py",
    "tests/planted_faults/bug_lab.py",
    "tests/test_planted_faults.py",
    "tests/test_student_impl.py",
    "tests/_workers_student.py",
    "tests/test_exercise_solutions.py",
    "tests/test_course_instructor.py",
    "tests/test_student_edition.py",
)
# they say where the instructor's answers would be, and work without them
ALLOWED = ("tests/exercises/__init__.py", "tests/conftest.py", "tests/test_exercise_grading.py")
AFTER_IT_PASSES = "When your task passes, compare with how minifsdp does it: the chapter's \"Code to read\" names it."
_SKIPPED_DIRS = {".git", "__pycache__", ".ci-venv", ".venv", "out", "build", ".pytest_cache", ".ruff_cache",
                 ".ipynb_checkpoints"}
_INSTRUCTOR_LINES = re.compile(r"^[ \t]*<!-- instructor -->[ \t]*\n.*?^[ \t]*<!-- /instructor -->[ \t]*\n", re.S | re.M)
_INSTRUCTOR_INLINE = re.compile(r"<!-- instructor -->.*?<!-- /instructor -->", re.S)
_REFERENCE_START = re.compile(r"^(\s*)(\*\*)?Reference solution:")
_PATH = re.compile(r"(?<![\w/.])((?:minifsdp|tests|notebooks|exercises|chapters)/[\w./-]+"
                   r"\.(?:py|ipynb|md|json|txt|png|sh|csv))")
_IMPORTS_SOLUTIONS = re.compile(r"^\s*(?:from|import)\s+exercises\.solutions\b", re.M)


def _instructor_only(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in INSTRUCTOR_ONLY)


def student_files(root: Path) -> list[str]:
    """The repository's files (relative, posix): what git tracks or would track, else a walk of the folder."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, check=True).stdout
        files = sorted({f for f in out.split("\0") if f})
    except (OSError, subprocess.CalledProcessError):
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                       if p.is_file() and not _SKIPPED_DIRS & set(p.relative_to(root).parts))
    return [f for f in files if (root / f).is_file() and not _instructor_only(f)]


def _drop_reference_blocks(text: str) -> tuple[str, int]:
    """Each block that starts ``Reference solution:`` becomes :data:`AFTER_IT_PASSES`; the block ends at a blank
    line, at the next ``**Label:**`` line (Markdown) or at a docstring's closing quotes (Python)."""
    lines, out, n, i = text.splitlines(keepends=True), [], 0, 0
    while i < len(lines):
        m = _REFERENCE_START.match(lines[i])
        if m is None:
            out.append(lines[i])
            i += 1
            continue
        indent, bold = m.group(1), m.group(2)
        out.append(f"{indent}**After it passes:** {AFTER_IT_PASSES[len('When your task passes, '):]}\n" if bold
                   else f"{indent}{AFTER_IT_PASSES}\n")
        n, i = n + 1, i + 1
        while i < len(lines) and lines[i].strip() and not lines[i].lstrip().startswith(('"""', "**")):
            i += 1
    return "".join(out), n


def rewrite(rel: str, text: str) -> tuple[str, list[str]]:
    """The student edition of one text file: (new text, what was changed)."""
    changed = []
    if rel.endswith(".md"):
        text, n = _INSTRUCTOR_LINES.subn("", text)
        text, m = _INSTRUCTOR_INLINE.subn("", text)
        n += m
        if n:
            text = re.sub(r"\n{3,}", "\n\n", text)  # a block between two paragraphs leaves one blank line
            changed.append(f"{n} instructor block{'s' * (n > 1)} removed")
    if rel.startswith("exercises/") and rel.endswith((".py", ".md")):
        text, n = _drop_reference_blocks(text)
        if n:
            changed.append("the pointer to the answer replaced")
    return text, changed


def check_copy(root: Path, dest: Path) -> list[str]:
    """What in the copy at ``dest`` of ``root`` still gives an answer away, or names a file the copy left out
    (empty: the copy is clean)."""
    problems = surviving_answers(graded_bodies(root), dest)
    if (dest / "exercises" / "solutions").exists():
        problems.append("exercises/solutions/ is in the copy")
    for path in sorted(dest.rglob("*")):
        rel = path.relative_to(dest).as_posix()
        if not path.is_file() or ".git" in path.relative_to(dest).parts or path.suffix not in (".py", ".md", ".txt"):
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".py" and _IMPORTS_SOLUTIONS.search(text):
            problems.append(f"{rel} imports exercises.solutions (leave it out: add it to INSTRUCTOR_ONLY)")
        if rel.startswith(("exercises/", "tests/")) and rel not in ALLOWED and \
                re.search(r"exercises[./]solutions\b", text):
            problems.append(f"{rel} names exercises/solutions (say it in a 'Reference solution:' block)")
        if rel.startswith("exercises/") and "Reference solution" in text:
            problems.append(f"{rel} still has a 'Reference solution' pointer")
        if path.suffix == ".py" and marked(text):
            problems.append(f"{rel} still has a student-edition cut marker")
        if path.suffix == ".md" and ("<!-- instructor -->" in text or "<!-- /instructor -->" in text):
            problems.append(f"{rel}: an unmatched <!-- instructor --> marker")
        if path.suffix == ".md":
            gone = sorted({p for p in _PATH.findall(text) if (root / p).exists() and not (dest / p).exists()})
            problems += [f"{rel} names {p}, which the student edition leaves out" for p in gone]
    return problems


def check_new_folder(dest: Path, what: str) -> None:
    """``dest`` is a folder ``what`` can be written to: new, or empty (a file there, or above it, is refused)."""
    for p in (dest, *dest.parents):
        if p.exists() and not p.is_dir():
            raise CourseError(f"{p} is a file, not a folder: give a new folder for {what}")
    if dest.exists() and any(dest.iterdir()):
        raise CourseError(f"{dest} is not empty: give a new folder for {what}")


def _git(dest: Path, *args: str) -> str:
    ident = ["-c", "user.name=minifsdp course", "-c", "user.email=course@minifsdp.invalid"]
    return subprocess.run(["git", *ident, "-C", str(dest), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def student_copy(root: Path, dest: Path) -> str:
    """Write the student edition of ``root`` into ``dest`` (new or empty), commit it once; a summary to print."""
    root, dest = root.resolve(), dest.resolve()
    check_new_folder(dest, "the student edition")
    if dest == root or root in dest.parents:
        raise CourseError(f"{dest} is inside the repository {root}: give a folder outside it")
    if shutil.which("git") is None:
        raise CourseError("git is not installed: the student edition is a git repository (install git)")
    files = student_files(root)
    if "exercises/points.csv" not in files or not any(f.startswith("tests/exercises/") for f in files):
        raise CourseError(f"{root} has no exercises/points.csv or tests/exercises/: run from the repository root")
    changes = {}
    for rel in files:
        src, dst = root / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix in (".py", ".md"):
            text, changed = rewrite(rel, src.read_text())
            if rel.startswith("minifsdp/") and rel.endswith(".py"):
                text, cuts = cut_source(root, rel, text)
                changed += [f"{', '.join(f[0] for c in cuts for f in c.functions)} cut"] if cuts else []
            dst.write_text(text)
            if changed:
                changes[rel] = changed
        else:
            shutil.copy2(src, dst)
    write_syllabus(root, dest)
    problems = check_copy(root, dest)
    if problems:
        raise CourseError("the student edition would give answers away or point nowhere; fix these in the "
                          f"repository (the copy is in {dest}):\n  " + "\n  ".join(problems))
    _git(dest, "init", "-q")
    _git(dest, "symbolic-ref", "HEAD", "refs/heads/main")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "minifsdp, student edition")
    commit = _git(dest, "rev-parse", "--short", "HEAD")
    left_out = sorted({p for p in INSTRUCTOR_ONLY if (root / p).exists()})
    lines = [f"wrote the student edition to {dest}: {len(files) + 1} files (SYLLABUS.md written from the guide), "
             f"one commit ({commit}) on branch main",
             f"left out: {', '.join(left_out)}",
             f"rewritten: {len(changes)} files ({', '.join(sorted(changes))})",
             "its README's commands work as they are; students grade themselves with `python -m minifsdp course grade`"]
    return "\n".join(lines)
