"""The student edition's cuts: the library functions that answer graded tasks, out; the learner's, in.

A region of the library between two comments (``minifsdp/learner.py`` shows one) is cut from the student
edition.  Each function in it becomes a stub of the same signature that calls the learner's function of
the named exercise file, the one of the same name (or :data:`ALIASES`'s); a private helper (``_name``) in
the region goes with it.  The task a stub names is the one the exercise function's own stub names
(``NotImplementedError("Task 2.2a: ...")``, or "Task 2.2c" in its docstring)::

    def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op="sum", group=None) -> None:
        \"\"\"Task 2.2a, cut from the student edition: yours runs here,
        ``ring_reduce_scatter`` of ``exercises/ring_collectives.py``.\"\"\"
        if op not in ("sum", "avg"):
            raise ValueError(f"op is 'sum' or 'avg', got {op!r}")
        yours = learner_function("2.2a", "exercises.ring_collectives", "ring_reduce_scatter",
                                 ring_reduce_scatter)
        yours(output, input, group)
        if op == "avg":
            output.div_(dist.get_world_size(group))

Arguments go to the learner's function in its own order; one it lacks must have a default, which is all the
stub accepts, but a collective's ``op``: ``"avg"`` is the learner's sum divided in place by the group's size
(the first argument holds the result), the bits the library's ring gives.  A region that cannot be cut so
(a public function no exercise has, a missing argument without a default, anything but functions) stops
``course student-copy`` with what to fix.

:func:`graded_bodies` / :func:`surviving_answers`: the check that no answer survives in the copy, in any
Python file or notebook: every function of ``exercises/solutions/`` (but code the exercise hands out, as
2.2c's) and of the cut regions, each as its significant lines (the body unparsed: no comments, no
docstring, one formatting); a file of the copy that holds half of one function's lines (two at least) holds
that answer.  :data:`NOT_ANSWERS` names the few functions there that answer nothing (a measurement helper).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from minifsdp.classroom.points import CourseError

__all__ = ["START", "END", "ALIASES", "Cut", "marked", "find_cuts", "cut_source", "graded_bodies", "surviving_answers"]

START = re.compile(r"^# >>> student edition: cut; (exercises/[\w/]+\.py) runs here\b.*$", re.M)
END = "# <<< student edition"
# library function -> the exercise's function, where the names differ
ALIASES = {"fsdp_model_state_bytes": "fsdp_model_state_bytes_per_rank", "bytes_sent_per_step": "bytes_sent_per_rank"}
IMPORT = "from minifsdp.learner import learner_function  # the student edition: the cut functions call yours"
_TASK = re.compile(r"\bTask (\d+\.\d+[a-z]?)\b")
_SIGNIFICANT = 16  # characters: shorter lines (``return out``, ``n = len(x)``) say nothing about an answer
# functions of exercises/solutions/ that answer nothing, each with why (the copy may hold them)
NOT_ANSWERS = {
    "exercises/solutions/projects/noshard_accum/accumulate.py _settle":
        "waits for gloo's thread to let go of a tensor before a measurement, as the project's own test does",
}


@dataclass(frozen=True)
class Cut:
    """One region: the library file, its line span (1-based, markers included), the exercise file, and per
    function (library name, exercise name or None for a dropped helper, task or None)."""

    file: str
    first: int
    last: int
    exercise: str
    functions: tuple[tuple[str, str | None, str | None], ...]


def _exercise_functions(root: Path, exercise: str) -> dict[str, ast.FunctionDef]:
    path = root / exercise
    if not path.is_file():
        raise CourseError(f"a student-edition cut names {exercise}, which does not exist")
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def _task_of(node: ast.FunctionDef, where: str) -> str:
    m = _TASK.search(ast.unparse(node))  # the stub's NotImplementedError("Task 2.2a: ..."), else its docstring
    if m is None:
        raise CourseError(f"{where}: {node.name} names no task (a stub raises NotImplementedError('Task X: ...'))")
    return m.group(1)


def _regions(rel: str, text: str) -> list[tuple[int, int, str]]:
    """(first line, last line, exercise file) of each marked region of one file, 1-based, markers included."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = START.match(lines[i])
        if m is None:
            if lines[i].startswith(END):
                raise CourseError(f"{rel} line {i + 1}: '{END}' without a start")
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith((END, "# >>> student edition"))), None)
        if end is None or not lines[end].startswith(END):
            raise CourseError(f"{rel} line {i + 1}: a student-edition cut without its '{END}'")
        out.append((i + 1, end + 1, m.group(1)))
        i = end + 1
    return out


def _plan(root: Path, rel: str, text: str, tree: ast.Module, first: int, last: int, exercise: str) -> Cut:
    theirs = _exercise_functions(root, exercise)
    inside = [n for n in tree.body if first < n.lineno < last]
    functions = []
    for node in inside:
        if not isinstance(node, ast.FunctionDef) or node.end_lineno >= last or \
                (node.decorator_list and node.decorator_list[0].lineno <= first):
            raise CourseError(f"{rel} line {node.lineno}: a student-edition cut holds whole functions only")
        name = ALIASES.get(node.name, node.name)
        if name in theirs:
            functions.append((node.name, name, _task_of(theirs[name], exercise)))
        elif node.name.startswith("_"):
            functions.append((node.name, None, None))
        else:
            raise CourseError(f"{rel}: {node.name} is cut from the student edition, but {exercise} has no "
                              f"{name} to run instead (name it there, or add it to course_cut.ALIASES)")
    if not any(f[1] for f in functions):
        raise CourseError(f"{rel} line {first}: a student-edition cut with no function {exercise} answers")
    return Cut(rel, first, last, exercise, tuple(functions))


def marked(text: str) -> bool:
    """Whether a file's text holds a cut marker (a comment at the start of a line)."""
    return bool(re.search(r"^# (>>>|<<<) student edition", text, re.M))


def find_cuts(root: Path) -> list[Cut]:
    """Every marked region of ``root``'s library, checked (each can be cut)."""
    cuts = []
    for path in sorted((root / "minifsdp").rglob("*.py")):
        text = path.read_text()
        if marked(text):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(text)
            cuts += [_plan(root, rel, text, tree, a, b, ex) for a, b, ex in _regions(rel, text)]
    return cuts


def _default(args: ast.arguments, name: str) -> str | None:
    """The source of parameter ``name``'s default (None: it has none)."""
    positional = args.posonlyargs + args.args
    if name in [a.arg for a in positional]:
        i = [a.arg for a in positional].index(name) - (len(positional) - len(args.defaults))
        return ast.unparse(args.defaults[i]) if i >= 0 else None
    i = [a.arg for a in args.kwonlyargs].index(name)
    d = args.kw_defaults[i]
    return None if d is None else ast.unparse(d)


def _stub(lines: list[str], node: ast.FunctionDef, mine: ast.FunctionDef, task: str, exercise: str, rel: str,
          has_dist: bool = False) -> str:
    """The student edition's text of library function ``node``: its signature, a call of the learner's ``mine``."""
    lib, ex = node.args, mine.args
    if lib.vararg or lib.kwarg or ex.vararg or ex.kwarg:
        raise CourseError(f"{rel}: {node.name} takes *args or **kwargs: cut it by hand")
    lib_names = [a.arg for a in lib.posonlyargs + lib.args + lib.kwonlyargs]
    call, keyword = [], False
    for a in ex.posonlyargs + ex.args:
        if a.arg not in lib_names:
            if _default(ex, a.arg) is None:
                raise CourseError(f"{exercise} {mine.name} needs {a.arg}, which the library's {node.name} lacks")
            keyword = True  # the rest by name
        else:
            call.append(f"{a.arg}={a.arg}" if keyword else a.arg)
    call += [f"{a.arg}={a.arg}" for a in ex.kwonlyargs if a.arg in lib_names]
    guards, after = [], ""
    for name in lib_names:
        if name not in [a.arg for a in ex.posonlyargs + ex.args + ex.kwonlyargs]:
            default = _default(lib, name)
            if default is None:
                raise CourseError(f"{rel}: {node.name} needs {name}, which {exercise} {mine.name} does not take")
            if name == "op" and default.strip("'\"") == "sum" and "group" in lib_names and has_dist:
                result = lib_names[0]  # a collective's mean: the learner's sum, divided in place by the ranks
                guards.append("    if op not in (\"sum\", \"avg\"):\n"
                              "        raise ValueError(f\"op is 'sum' or 'avg', got {op!r}\")\n")
                after = f"    if op == \"avg\":\n        {result}.div_(dist.get_world_size(group))\n"
                continue
            said = default.replace(chr(34), chr(39))
            guards.append(f"    if {name} != {default}:\n"
                          f"        raise NotImplementedError(\"Task {task}: {mine.name} -- \"\n"
                          f"                                  \"yours takes no {name}=, so the student edition's "
                          f"library passes only {name}={said}\")\n")
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    header = "".join(lines[start: node.body[0].lineno - 1])
    module = exercise.removesuffix(".py").replace("/", ".")
    doc = f"Task {task}, cut from the student edition: yours runs here,\n    ``{mine.name}`` of ``{exercise}``."
    return (f"{header}    \"\"\"{doc}\"\"\"\n" + "".join(guards)
            + f"    yours = learner_function(\"{task}\", \"{module}\", \"{mine.name}\",\n"
            + f"                             {node.name})\n"
            + (f"    yours({', '.join(call)})\n{after}" if after else f"    return yours({', '.join(call)})\n"))


def cut_source(root: Path, rel: str, text: str) -> tuple[str, list[Cut]]:
    """The student edition's text of library file ``rel`` (unchanged without a marked region), and its cuts."""
    regions = _regions(rel, text) if marked(text) else []
    if not regions:
        return text, []
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    nodes = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    has_dist = "import torch.distributed as dist" in text
    cuts = [_plan(root, rel, text, tree, a, b, ex) for a, b, ex in regions]
    out, at = [], 0
    for cut in cuts:
        theirs = _exercise_functions(root, cut.exercise)
        stubs = [_stub(lines, nodes[lib], theirs[ex], task, cut.exercise, rel, has_dist)
                 for lib, ex, task in cut.functions if ex is not None]
        out += lines[at: cut.first - 1] + ["\n\n".join(stubs)]
        at = cut.last
    out += lines[at:]
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    last_import = max(n.end_lineno for n in imports if n.lineno < cuts[0].first)
    new = "".join(out).splitlines(keepends=True)
    new.insert(last_import, IMPORT + "\n")
    return "".join(new), cuts


# ----------------------------------------------------------------------------- no answer survives in the copy
def _significant(code: str) -> set[str]:
    return {ln.strip() for ln in code.splitlines() if len(ln.strip()) >= _SIGNIFICANT}


def _body(node: ast.FunctionDef) -> str:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return "\n".join(ast.unparse(s) for s in body)


def graded_bodies(root: Path) -> dict[str, set[str]]:
    """``{"exercises/solutions/x.py f": significant lines}``: every answer the student edition must not hold."""
    out = {}
    solutions = root / "exercises" / "solutions"
    for path in sorted(solutions.rglob("*.py")):
        given = root / "exercises" / path.relative_to(solutions)  # the stub module: code it hands out is no answer
        handed_out = set()
        if given.is_file():
            handed_out = {_body(n) for n in ast.walk(ast.parse(given.read_text())) if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and _body(node) not in handed_out:
                out[f"{path.relative_to(root).as_posix()} {node.name}"] = _significant(_body(node))
    for cut in find_cuts(root):
        tree = ast.parse((root / cut.file).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and cut.first < node.lineno < cut.last:
                out[f"{cut.file} {node.name}"] = _significant(_body(node))
    return {k: v for k, v in out.items() if v and k not in NOT_ANSWERS}


def _code_of(path: Path) -> str | None:
    """A Python file's code, or a notebook's code cells, in one formatting (None: not code, or not parseable)."""
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        try:
            cells = json.loads(text).get("cells", [])
        except ValueError:
            return None
        sources = ["".join(c.get("source", [])) for c in cells if c.get("cell_type") == "code"]
        text = "\n".join(s for s in sources if not s.lstrip().startswith(("%", "!")))
    try:
        return ast.unparse(ast.parse(text))
    except (SyntaxError, ValueError):
        return text if path.suffix == ".ipynb" else None


def surviving_answers(answers: dict[str, set[str]], dest: Path, share: float = 0.5) -> list[str]:
    """Files under ``dest`` (``.py``, ``.ipynb``) holding most of one answer's significant lines (at least 2)."""
    found = []
    for path in sorted(p for p in dest.rglob("*") if p.suffix in (".py", ".ipynb") and ".git" not in p.parts):
        code = _code_of(path)
        if code is None:
            continue
        lines = _significant(code)
        for name, want in answers.items():
            if len(want & lines) >= max(2, math.ceil(share * len(want))):
                found.append(f"{path.relative_to(dest).as_posix()} holds the answer {name} "
                             f"({len(want & lines)} of its {len(want)} lines)")
    return found
