"""``python -m minifsdp course bug``: the find-the-bug lab, one per student, graded from the instructor's key.

    course bug --roster students.csv DIR [--seed S] [--shared-faults]
                        one lab per student (DIR/<student>/) and the key (DIR/key.json): the instructor keeps
                        the key and hands out each lab folder
    course bug DIR --seed S [--key FILE]
                        one lab, its key beside it (DIR-key.json)
    course grade --task bug --dir LAB --key KEY [--student NAME]      (or --seed S for a lab of one seed)
    course grade --submissions class/ --key KEY                       every copy's bug/ folder

A lab is a copy of this repository's library with one planted fault, the library's tests, and BUG_LAB.md:

    LAB/minifsdp/      minifsdp with one line of one function changed (every file the same age)
    LAB/tests/         the tests the student edition carries (no catalog), pyproject.toml for pytest
    LAB/BUG_LAB.md     the tools to look with (the same for every lab), how to hand in, how it is graded
    LAB/bug_lab.json   {"student": name}: which lab it is, nothing about the fault (grading never reads it)
    LAB/ANSWER.txt     written by the student: the file and function they fixed, FILE:FUNCTION, e.g.
                       minifsdp/comm/ring.py:ring_all_gather (a method as Class.method, or the method alone)

The key holds, per lab: the student, the seed, the fault, its chapter, the planted file and function, the
line as it was and as planted, how it shows and the test that catches it.  Grading reads only the key for
what was planted, and awards half the points for each of:

    fixed   the student's planted function (only it: ``course_bug_fix.py``), in a clean copy of this repository's
            library and tests, passes the fault's test (the catalog's: tests/test_planted_faults.py)
    named   ANSWER.txt (or --answer) names the planted file and function

A malformed ANSWER.txt, a missing file, a lab the key does not know: that student's row says so, the others
are graded.  The faults are ``tests/planted_faults/bug_lab.py``'s (chapters 2-5, each with the way its chapter
shows it), among those that plant cleanly today, in name order.  The seed draws one: seeds ``k*P`` to
``k*P + P - 1`` (P faults) give each fault once, in an order the block ``k`` shuffles, so a roster of up to P
students gets P different faults (``--seed k`` picks the block); more students than faults share some, only
with ``--shared-faults``.

Note (a diff): a lab differs from another copy of minifsdp in one line, which ``diff -r`` finds at once.  The
lab teaches the tools; for a graded exam, hand it out on machines without another copy.
"""

from __future__ import annotations

import csv
import filecmp
import functools
import importlib
import importlib.util
import inspect
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from minifsdp.classroom.course_bug_fix import graded_fix
from minifsdp.classroom.course_copy import _instructor_only, check_new_folder
from minifsdp.classroom.points import CourseError, read_points

__all__ = ["COMMANDS", "SEEDS", "check_seed", "lab_faults", "draw", "plant_file", "read_roster", "write_bug_lab",
           "write_roster_labs", "read_key", "grade_bug", "has_bug_lab", "named_place"]

# compare's runs BUG_LAB.md lists for every lab (the flags of bug_lab.py's compare entries are among them)
COMMANDS = [(), ("--world-size", "3", "--collectives", "torch"), ("--collectives", "textbook"),
            ("--impl", "fsdp2", "--world-size", "3", "--collectives", "torch"), ("--strategy", "ddp")]
SEEDS = 2**31  # a seed is a whole number in [0, SEEDS)
KEY_FIELDS = ("student", "folder", "seed", "fault", "chapter", "file", "function", "old", "new", "way", "shows", "test")


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEEDS:
        raise CourseError(f"a lab's seed is a whole number from 0 to {SEEDS - 1}, got {seed!r}")
    return seed


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


@functools.lru_cache(maxsize=4)
def _faults_of(root: str) -> tuple:
    catalog, plant, lab = _instructor_modules(Path(root))
    faults = []
    for name in sorted(lab.LAB):
        try:
            fault = catalog.by_name(name)
            if not fault.pending:
                _planted_text(Path(root), fault, plant)
                faults.append(fault)
        except (KeyError, plant.PlantError, CourseError, SyntaxError):
            continue  # renamed, pending or out of date in the catalog: not drawn (tests/test_course_instructor.py)
    if not faults:
        raise CourseError("no fault of tests/planted_faults/bug_lab.py plants cleanly: update its LAB")
    return tuple(faults)


def lab_faults(root: Path) -> list:
    """The faults a lab can get, in name order: bug_lab.py's that plant cleanly today."""
    return list(_faults_of(str(root.resolve())))


def draw(root: Path, seed: int):
    """The fault ``seed`` plants (seeds k*P .. k*P + P - 1 give each of the P faults once)."""
    faults = lab_faults(root)
    block, at = divmod(check_seed(seed), len(faults))
    return random.Random(block).sample(faults, len(faults))[at]


def plant_file(root: Path, fault) -> tuple[str, str, str]:
    """(the planted file relative to root, its text, its text with ``fault`` planted)."""
    return _planted_text(root, fault, _instructor_modules(root)[1])


def _differing(a: Path, b: Path) -> list[str]:
    """Files (relative) whose bytes differ between two folder trees, or that only one holds."""
    out = []
    for path in sorted(set(p.relative_to(a) for p in a.rglob("*.py")) | set(p.relative_to(b) for p in b.rglob("*.py"))):
        x, y = a / path, b / path
        if not (x.exists() and y.exists() and filecmp.cmp(x, y, shallow=False)):
            out.append(path.as_posix())
    return out


def _copy_library(root: Path, dest: Path) -> None:
    """``root``'s minifsdp, its tests as the student edition has them (no tests/exercises), pyproject.toml."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")

    def leave_out(folder: str, names: list[str]) -> set[str]:
        rel = Path(folder).relative_to(root).as_posix()
        return set(skip(folder, names)) | {n for n in names if f"{rel}/{n}" == "tests/exercises"
                                           or _instructor_only(f"{rel}/{n}")}

    shutil.copytree(root / "minifsdp", dest / "minifsdp", ignore=skip)
    shutil.copytree(root / "tests", dest / "tests", ignore=leave_out)
    shutil.copy2(root / "pyproject.toml", dest / "pyproject.toml")


def _lab_text(root: Path, student: str) -> str:
    """BUG_LAB.md: the same tools and test files for every lab (those of every fault a lab can get)."""
    catalog, _, lab = _instructor_modules(root)
    chapters: dict[str, set[str]] = {}
    for name, (chapter, _, _) in lab.LAB.items():
        chapters.setdefault(chapter.split(".")[0], set()).add(catalog.by_name(name).test.split("::")[0])
    tests = "\n".join(f"    # chapter {ch}\n    python -m pytest -x -q " + " \\\n        ".join(sorted(files))
                      for ch, files in sorted(chapters.items()))
    runs = "\n".join("    python -m minifsdp compare" + "".join(f" {f}" for f in flags) for flags in COMMANDS)
    return f"""# Find the bug ({student})

`minifsdp/` here is minifsdp with one realistic bug planted in one function: one line changed.  Every lab of
your class has its own.  Find it with the tools chapters 2-5 teach, fix it, and say where it was.  Run every
command from this folder, so that `python` imports this copy (`PYTHONPATH=.` if you installed another).

1. Look for it, the way the chapters do:
   - compare ours with torch (which run stops agreeing bitwise, at which step, the loss or the parameters):

{runs}

   - the step table: `python -m minifsdp train --steps 4 --log-json ours.jsonl` against the same with
     `--impl torch-fsdp1 --log-json torch.jsonl` (and with `--mixed-precision`, `--strategy`, ...);
   - the trace: `python -m minifsdp train --steps 4 --profile out/trace` (the order of the collectives);
   - the census and the bytes: the memory and `count_bytes()` cells of the chapters' notebooks,
     `python -m minifsdp plan`;
   - the tests, chapter by chapter (each compares with torch; a failure names what it expected):

{tests}

2. Fix the bug in `minifsdp/` here: the test or the run that showed it agrees again.
3. Write the file and function you fixed into `ANSWER.txt`, one line, e.g.

       minifsdp/comm/ring.py:ring_all_gather

Hand in this whole folder as `bug/` at the top of your repository.  Graded by your instructor: half the points
for the fixed function passing the test that catches the bug (in a clean copy of the library: only the planted
function counts, and a fix uses that function's own words), half for naming the place.
"""


def write_lab(root: Path, dest: Path, seed: int, student: str) -> dict:
    """Write one lab for ``seed`` into ``dest`` (new or empty): its entry of the key."""
    root, dest = root.resolve(), dest.resolve()
    check_new_folder(dest, "the lab")
    fault = draw(root, seed)
    rel, _, planted = plant_file(root, fault)
    dest.mkdir(parents=True, exist_ok=True)
    _copy_library(root, dest)
    (dest / rel).write_text(planted)
    changed = _differing(root / "minifsdp", dest / "minifsdp")
    if changed != [rel.removeprefix("minifsdp/")]:
        raise CourseError(f"the lab must differ from minifsdp in exactly one file, not in {changed}")
    when = (root / "minifsdp" / "__init__.py").stat().st_mtime
    for path in (dest / "minifsdp").rglob("*"):
        os.utime(path, (when, when))  # the planted file is not the newest
    (dest / "bug_lab.json").write_text(json.dumps({"student": student}) + "\n")
    (dest / "BUG_LAB.md").write_text(_lab_text(root, student))
    chapter, way, shows = _instructor_modules(root)[2].LAB[fault.name]
    entry = dict(student=student, folder=dest.name, seed=seed, fault=fault.name, chapter=chapter, file=rel,
                 function=fault.target.partition(":")[2], old=fault.old, new=fault.new, way=way, shows=shows,
                 test=fault.test)
    return {k: entry[k] for k in KEY_FIELDS}


def _write_key(path: Path, entries: list[dict]) -> None:
    path.write_text(json.dumps({"what": "the find-the-bug lab's key: keep it, hand out the labs only",
                                "labs": entries}, indent=1) + "\n")


def write_bug_lab(root: Path, dest: Path, seed: int, key: Path | None = None) -> str:
    """One lab for ``seed`` in ``dest``, its key at ``key`` (default: beside it, DEST-key.json); what to print."""
    dest = dest.resolve()
    key = (key or dest.parent / f"{dest.name}-key.json").resolve()
    if key.exists() or dest in key.parents:
        raise CourseError(f"{key} exists or is inside the lab: give another --key file")
    entry = write_lab(root, dest, seed, dest.name)
    _write_key(key, [entry])
    return (f"wrote the find-the-bug lab to {dest} (seed {seed}) and its key to {key} (keep it; grade with "
            f"`course grade --task bug --dir {dest} --key {key}`); hand out the folder with its BUG_LAB.md")


def read_roster(path: Path) -> list[str]:
    """The students of a roster CSV: its ``student`` (or ``name``) column, else its first; unique, not blank."""
    if not path.is_file():
        raise CourseError(f"--roster {path}: no such file (a CSV, one student per line)")
    rows = [r for r in csv.reader(path.read_text(errors="replace").splitlines()) if any(c.strip() for c in r)]
    if not rows:
        raise CourseError(f"--roster {path}: no students in it")
    header = [c.strip().lower() for c in rows[0]]
    col = next((header.index(h) for h in ("student", "name") if h in header), None)
    names = [r[col or 0].strip() if len(r) > (col or 0) else "" for r in (rows[1:] if col is not None else rows)]
    bad = [n for n in names if not n or n.startswith(".") or re.search(r"[/\\\x00-\x1f]", n) or len(n) > 100]
    if bad or not names:
        raise CourseError(f"--roster {path}: a name is a folder's name (no / or \\, not starting with a dot, "
                          f"not blank): {', '.join(map(repr, bad[:5])) or 'none given'}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CourseError(f"--roster {path}: listed twice: {', '.join(twice)}")
    return names


def write_roster_labs(root: Path, roster: Path, dest: Path, seed: int = 0, shared: bool = False) -> str:
    """One lab per student of ``roster`` in ``dest/<student>/``, the key in ``dest/key.json``; what to print."""
    root, dest = root.resolve(), dest.resolve()
    names = read_roster(roster)
    check_new_folder(dest, "the labs")
    faults = lab_faults(root)
    if len(names) > len(faults) and not shared:
        raise CourseError(f"{len(names)} students and {len(faults)} faults: some would share a fault; give "
                          "--shared-faults to allow it")
    base = check_seed(seed) * len(faults)
    if base + len(names) > SEEDS:
        raise CourseError(f"--seed {seed} is too large for {len(names)} labs")
    entries = [write_lab(root, dest / name.replace(" ", "_"), base + i, name) for i, name in enumerate(names)]
    _write_key(dest / "key.json", entries)
    kinds = len({e["fault"] for e in entries})
    return (f"wrote {len(entries)} labs to {dest} ({kinds} different faults) and the key {dest / 'key.json'}: "
            "move the key somewhere safe, hand out each student's folder; grade with "
            f"`course grade --submissions DIR --key KEY` (each copy's bug/ folder)")


def read_key(path: Path) -> dict[str, dict]:
    """The key's labs by student name and by folder name."""
    try:
        labs = json.loads(path.read_text())["labs"]
        out = {}
        for e in labs:
            entry = {k: e[k] for k in KEY_FIELDS}
            out[entry["student"]] = out[entry["folder"]] = entry
        return out
    except FileNotFoundError:
        raise CourseError(f"--key {path}: no such file (the key `course bug` wrote)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CourseError(f"--key {path} is not a key `course bug` wrote ({type(e).__name__}: {e})") from None


def has_bug_lab(folder: Path) -> bool:
    return (folder / "bug_lab.json").is_file() or (folder / "BUG_LAB.md").is_file()


def named_place(answer: str) -> tuple[str, str]:
    """``FILE:FUNCTION`` -> (file relative to the lab, e.g. ``minifsdp/comm/ring.py``; the function)."""
    file, sep, function = answer.strip().rpartition(":")
    if not sep or not file.strip() or not function.strip():
        raise CourseError(f"the answer {answer.strip()[:80]!r} is not FILE:FUNCTION, e.g. "
                          "minifsdp/comm/ring.py:ring_step")
    file = file.strip().replace("\\", "/")
    file = file[file.index("minifsdp/"):] if "minifsdp/" in file else file
    return file, function.strip()


def _answer(folder: Path, answer: str | None) -> str | None:
    if answer is not None:
        return answer
    path = folder / "ANSWER.txt"
    if not path.is_file():
        return None
    return next((ln for ln in path.read_text(errors="replace").splitlines() if ln.strip() and
                 not ln.startswith("#")), None)


def _passes(root: Path, entry: dict, fixed: Path) -> tuple[bool, str]:
    """The student's planted function (``course_bug_fix``) in a clean copy of the library and tests: (its
    fault's test passes, what went wrong)."""
    rel, test = entry["file"], entry["test"]
    planted = plant_file(root, _instructor_modules(root)[0].by_name(entry["fault"]))[2]
    text, why = graded_fix((root / rel).read_text(), planted, fixed.read_text(errors="replace"), entry["function"], rel)
    if text is None:
        return not why, why
    with tempfile.TemporaryDirectory(prefix="minifsdp-bug-") as tmp:
        where = Path(tmp)
        _copy_library(root, where)
        (where / rel).write_text(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MINIFSDP_PLANT_")}
        env.update(PYTHONPATH=str(where), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd[3:3] = ["-p", "pytest_timeout", "--timeout", "600"]
        try:
            proc = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return False, "the test that catches the bug ran past 900 s (a hang?)"
    last = ([ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()] or ["no output"])[-1]
    ok = proc.returncode == 0 and " passed" in last and "failed" not in last
    return ok, "" if ok else f"the test that catches the bug still fails ({last[:200]})"


def grade_bug(root: Path, folder: Path, seed: int | None = None, answer: str | None = None,
              key: Path | None = None, student: str | None = None) -> dict:
    """The lab in ``folder`` graded from the key (or the instructor's ``seed``): ``{"task": "bug", "points",
    "possible", "failed"}``, as ``course grade``.  What the student got wrong is in ``failed``; what the
    instructor must fix (no key, no such lab folder) raises CourseError."""
    root = root.resolve()
    possible = next((r.points for r in read_points(root) if r.task == "bug"), 0)
    row = {"task": "bug", "points": 0, "possible": possible, "failed": ""}
    if not folder.is_dir():
        raise CourseError(f"--dir {folder}: no such lab folder (the folder `course bug` wrote, with the fix)")
    if key is not None:
        labs = read_key(key)
        names = [n for n in (student, folder.name, folder.parent.name if folder.name == "bug" else None) if n]
        entry = next((labs[n] for n in names if n in labs), None)
        if entry is None:
            row["failed"] = f"no lab of {' or '.join(map(repr, names))} in the key {key}"
            return row
    elif seed is not None:
        fault = draw(root, seed)
        entry = dict(file=plant_file(root, fault)[0], function=fault.target.partition(":")[2], test=fault.test,
                     fault=fault.name)
    else:
        raise CourseError("grading reads what was planted from the instructor's key: give --key KEY "
                          "(or --seed S, the lab's seed)")
    rel, problems, points = entry["file"], [], 0
    if not (folder / rel).is_file():
        problems.append(f"not fixed: {folder} has no {rel}")
    else:
        ok, said = _passes(root, entry, folder / rel)
        points += possible - possible // 2 if ok else 0
        if not ok:
            problems.append(f"not fixed: {said}")
    given = _answer(folder, answer)
    try:
        if given is None:
            raise CourseError("no place named: write FILE:FUNCTION into ANSWER.txt")
        file, function = named_place(given)
        qualname = entry["function"]
        if file == rel and function in (qualname, qualname.rpartition(".")[2]):
            points += possible // 2
        else:
            problems.append(f"{given.strip()[:80]} is not where the bug was planted")
    except CourseError as e:
        problems.append(f"ANSWER.txt: {e}" if given is not None else str(e))
    row.update(points=points, failed="; ".join(problems))
    return row
