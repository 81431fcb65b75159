"""``python -m minifsdp course bug DIR --seed S``: the find-the-bug lab, and its grading.

``course bug`` writes a copy of the package with exactly one planted fault, drawn by the seed, and says
how to train against it; the student finds it with the book's tools and fixes it:

    DIR/minifsdp/      this repository's minifsdp with one line of one function changed (every file the
                       same age: the planted one is not the newest)
    DIR/BUG_LAB.md     what to run (the same commands for every seed), how to hand in, how it is graded
    DIR/bug_lab.json   {"seed": S}, all the grader needs besides this repository (it names nothing)
    DIR/ANSWER.txt     written by the student: the file and function they fixed, FILE:FUNCTION, e.g.
                       minifsdp/comm/ring.py:ring_all_gather (a method as Class.method, or the method alone)

The faults are the planted faults of ``tests/planted_faults/catalog.py``, read at run time (a fault's
target moves with the library), among those ``tests/planted_faults/bug_lab.py`` lists as ones that
``python -m minifsdp compare`` shows: its REVEALED_BY gives, per fault, compare's flags under which ours
stops agreeing bitwise with torch's.  The draw is ``random.Random(seed).choice`` over those that plant
cleanly today (``old`` once in the function, the edited file compiles), in name order.  Both files are
the instructor's: the student edition leaves them out.

``course grade --task bug --seed S --dir DIR`` (the seed defaults to DIR/bug_lab.json's) awards half the
points for each of:

    fixed   the student's version of the planted file, put into a clean copy of this repository's
            minifsdp, trains bitwise like torch again under the fault's compare flags (only that file
            counts: debug prints elsewhere are harmless, and a change elsewhere cannot pass for a fix)
    named   ANSWER.txt (or --answer) names the planted file and function

Note (a diff): DIR/minifsdp differs from a student's own copy of minifsdp in one line, which ``diff -r``
finds at once.  The lab teaches the tools (compare's table, the step table, the trace, the census); for a
graded exam, hand out DIR on machines without another copy.
"""

from __future__ import annotations

import filecmp
import importlib
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from minifsdp.tools.course import CourseError, read_points

__all__ = ["draw", "plant_file", "write_bug_lab", "grade_bug", "has_bug_lab", "named_place", "COMMANDS"]

# What BUG_LAB.md tells every student to try, whatever the seed (bug_lab.py's flags are among them: checked).
COMMANDS = [
    (),
    ("--world-size", "3", "--collectives", "torch"),
    ("--collectives", "textbook"),
    ("--impl", "fsdp2", "--world-size", "3", "--collectives", "torch"),
    ("--strategy", "ddp"),
]
BITWISE = "VERDICT: bitwise equal"


def _instructor_modules(root: Path):
    """The fault catalog, the planting code and the lab's list, imported from ``root``'s tests/."""
    if not (root / "tests" / "planted_faults" / "catalog.py").exists():
        raise CourseError("the find-the-bug lab draws from tests/planted_faults/catalog.py, which the student "
                          "edition leaves out: the instructor runs `course bug` and `course grade --task bug`")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return tuple(importlib.import_module(f"tests.planted_faults.{name}") for name in ("catalog", "plant", "bug_lab"))


def _planted_text(root: Path, fault, plant) -> tuple[str, str, str]:
    """(file relative to root, its text, its text with the fault) for one catalog entry."""
    plant.prepare(fault)  # `old` occurs once in the function, and the edited function compiles
    _, _, _, raw = plant._resolve(fault.target)
    func = plant._function_of(raw)
    path = Path(inspect.getsourcefile(func)).resolve()
    if root.resolve() / "minifsdp" not in path.parents:
        raise CourseError(f"{fault.target} was imported from {path}, not from {root}/minifsdp: run the course "
                          "command from the repository root (or put it first on PYTHONPATH)")
    text = path.read_text()
    lines, start = inspect.getsourcelines(func)
    before, body = "".join(text.splitlines(keepends=True)[: start - 1]), "".join(lines)
    after = text[len(before) + len(body):]
    indent = body[: len(body) - len(body.lstrip())]
    for old, new in ((fault.old, fault.new), (fault.old.replace("\n", "\n" + indent),
                                               fault.new.replace("\n", "\n" + indent))):
        if body.count(old) == 1:
            planted = before + body.replace(old, new) + after
            compile(planted, str(path), "exec")
            return path.relative_to(root.resolve()).as_posix(), text, planted
    raise CourseError(f"fault {fault.name}: its line is not found once in {path} as written")


def _eligible(root: Path) -> list:
    catalog, plant, lab = _instructor_modules(root)
    faults = []
    for name in sorted(lab.REVEALED_BY):
        try:
            fault = catalog.by_name(name)
            if not fault.pending:
                _planted_text(root, fault, plant)
                faults.append(fault)
        except (KeyError, plant.PlantError, CourseError, SyntaxError):
            continue  # renamed, pending or out of date in the catalog: not drawn (tests/test_course_instructor.py)
    if not faults:
        raise CourseError("no fault of tests/planted_faults/bug_lab.py plants cleanly: update its REVEALED_BY")
    return faults


def draw(root: Path, seed: int):
    """The fault the seed draws, and compare's flags that show it: (fault, flags)."""
    fault = random.Random(seed).choice(_eligible(root))
    return fault, tuple(_instructor_modules(root)[2].REVEALED_BY[fault.name])


def plant_file(root: Path, fault) -> tuple[str, str, str]:
    """(the planted file relative to root, its text, its text with ``fault`` planted)."""
    return _planted_text(root, fault, _instructor_modules(root)[1])


def _copy_package(root: Path, dest: Path) -> None:
    shutil.copytree(root / "minifsdp", dest / "minifsdp", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _same_age(folder: Path, when: float) -> None:
    for path in folder.rglob("*"):
        os.utime(path, (when, when))


def _differing(a: Path, b: Path) -> list[str]:
    """Files (relative) whose bytes differ between two folder trees, or that only one holds."""
    out = []
    for path in sorted(set(p.relative_to(a) for p in a.rglob("*.py")) | set(p.relative_to(b) for p in b.rglob("*.py"))):
        x, y = a / path, b / path
        if not (x.exists() and y.exists() and filecmp.cmp(x, y, shallow=False)):
            out.append(path.as_posix())
    return out


def _command(flags) -> str:
    return "python -m minifsdp compare" + "".join(f" {f}" for f in flags)


def write_bug_lab(root: Path, dest: Path, seed: int) -> str:
    """Write the lab for ``seed`` into ``dest`` (new or empty); what to tell the student."""
    root, dest = root.resolve(), dest.resolve()
    if dest.exists() and any(dest.iterdir()):
        raise CourseError(f"{dest} is not empty: give a new folder for the lab")
    fault, _ = draw(root, seed)
    rel, _, planted = plant_file(root, fault)
    dest.mkdir(parents=True, exist_ok=True)
    _copy_package(root, dest)
    (dest / rel).write_text(planted)
    changed = _differing(root / "minifsdp", dest / "minifsdp")
    if changed != [rel.removeprefix("minifsdp/")]:
        raise CourseError(f"the lab must differ from minifsdp in exactly one file, not in {changed}")
    _same_age(dest / "minifsdp", (root / "minifsdp" / "__init__.py").stat().st_mtime)
    (dest / "bug_lab.json").write_text(json.dumps({"seed": seed}) + "\n")
    runs = "\n".join(f"    cd {dest} && PYTHONPATH=. {_command(f)}" for f in COMMANDS)
    text = f"""# Find the bug (seed {seed})

`minifsdp/` here is minifsdp with one realistic bug planted in one function: one line changed.  Find it with
the tools the book teaches, fix it, and say where it was.

1. Train against torch with this copy.  One of these shows ours and torch's stop agreeing bitwise (run them
   from this folder, so that `python` imports this copy):

{runs}

   Read the step table (which step, the loss or the parameters), then narrow it down: `train --impl student`,
   `--profile` traces, the memory census, the chapters' notebooks, the tests that cover the code you suspect.
2. Fix the bug in `minifsdp/` here, until that command prints "{BITWISE}" again.
3. Write the file and function you fixed into `ANSWER.txt`, one line, e.g.

       minifsdp/comm/ring.py:ring_all_gather

Graded (`python -m minifsdp course grade --task bug --dir DIR`, by your instructor): half the points for
the fixed file training bitwise like torch again, half for naming the place.
"""
    (dest / "BUG_LAB.md").write_text(text)
    return f"wrote the find-the-bug lab to {dest} (seed {seed}); hand it out with its BUG_LAB.md:\n\n{text}"


def has_bug_lab(folder: Path) -> bool:
    return (folder / "bug_lab.json").exists()


def named_place(answer: str) -> tuple[str, str]:
    """``FILE:FUNCTION`` -> (file relative to the lab, e.g. ``minifsdp/comm/ring.py``; the function)."""
    file, sep, function = answer.strip().rpartition(":")
    if not sep or not file or not function:
        raise CourseError(f"the answer {answer.strip()!r} is not FILE:FUNCTION, e.g. minifsdp/comm/ring.py:ring_step")
    file = file.replace("\\", "/")
    file = file[file.index("minifsdp/"):] if "minifsdp/" in file else file
    return file, function.strip()


def _answer(folder: Path, answer: str | None) -> str | None:
    if answer is not None:
        return answer
    path = folder / "ANSWER.txt"
    if not path.exists():
        return None
    return next((ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")), None)


def _trains_bitwise(root: Path, rel: str, fixed: Path, flags) -> tuple[bool, str]:
    """The student's ``rel`` in a clean copy of minifsdp, trained by compare: (bitwise like torch, the verdict)."""
    with tempfile.TemporaryDirectory(prefix="minifsdp-bug-") as tmp:
        where = Path(tmp)
        _copy_package(root, where)
        shutil.copy2(fixed, where / rel)
        env = dict(os.environ, PYTHONPATH=str(where))
        env.pop("MINIFSDP_PLANT_FAULT", None)
        cmd = [sys.executable, "-m", "minifsdp", "compare", *flags, "--out", str(where / "out")]
        try:
            proc = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return False, "compare ran past 600 s (a hang?)"
        log = proc.stdout + proc.stderr
    verdict = next((ln for ln in log.splitlines() if ln.startswith("VERDICT")), None)
    if verdict is None:
        last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return False, f"compare failed: {last[0][:200]}"
    return verdict.startswith(BITWISE), verdict


def grade_bug(root: Path, folder: Path, seed: int | None = None, answer: str | None = None) -> dict:
    """The lab in ``folder`` graded: ``{"task": "bug", "points", "possible", "failed"}`` (as ``course grade``)."""
    root = root.resolve()
    possible = next((r.points for r in read_points(root) if r.task == "bug"), 0)
    row = {"task": "bug", "points": 0, "possible": possible, "failed": ""}
    if seed is None:
        if not has_bug_lab(folder):
            raise CourseError(f"{folder} has no bug_lab.json: give the lab's seed with --seed")
        seed = int(json.loads((folder / "bug_lab.json").read_text())["seed"])
    fault, flags = draw(root, seed)
    rel, _, _ = plant_file(root, fault)
    problems, points = [], 0
    if not (folder / rel).exists():
        problems.append(f"not fixed: {folder} has no {rel}")
    else:
        ok, verdict = _trains_bitwise(root, rel, folder / rel, flags)
        points += possible - possible // 2 if ok else 0
        if not ok:
            problems.append(f"not fixed: `{_command(flags)}` says {verdict}")
    given = _answer(folder, answer)
    if given is None:
        problems.append("no place named: write FILE:FUNCTION into ANSWER.txt")
    else:
        file, function = named_place(given)
        qualname = fault.target.partition(":")[2]
        if file == rel and function in (qualname, qualname.rpartition(".")[2]):
            points += possible // 2
        else:
            problems.append(f"{given.strip()} is not where the bug was planted")
    row.update(points=points, failed="; ".join(problems))
    return row
