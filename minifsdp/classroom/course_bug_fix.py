"""What of a find-the-bug lab's fix is graded: the planted function, in the library's words, and nothing else.

Why: grading a fix runs the fault's test on the student's version of the planted file, in the grader's own
pytest.  A whole file taken from the student could do anything there at import time (print "1 passed" and
leave, rewrite the test); a fix never needs to.  So the grader takes from the student's file only the planted
function (a function, or ``Class.method``), puts it in the instructor's clean copy of the file, and reads it
first:

* the same code as the library's (its syntax tree equal): fixed, with nothing to run;
* otherwise it must use only the words of the function as the library has it or as it was planted (its
  names and attributes), the builtins any arithmetic needs, and its own local variables: a fix puts the
  planted line right, and ``os``, ``print`` or ``sys.exit`` are in no planted function.  What passes that
  runs the fault's test, the rest of the file the library's.

:func:`graded_fix` returns the file to test (or why there is none).
"""

from __future__ import annotations

import ast

__all__ = ["BUILTINS", "find_function", "words", "graded_fix"]

# builtins a one-line fix may reach for (no I/O, no introspection, no way out of the process)
BUILTINS = frozenset({"len", "range", "min", "max", "abs", "sum", "int", "float", "bool", "list", "tuple", "dict",
                      "set", "enumerate", "zip", "reversed", "sorted", "any", "all", "isinstance", "round", "divmod",
                      "ValueError", "RuntimeError", "TypeError"})


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The top-level function, or ``Class.method``, named ``qualname`` in ``tree`` (None: not there)."""
    body = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if body is None:
            return None
    return next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


def words(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names it reads, attributes it uses) in a function, decorators and defaults included."""
    names, attrs = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            attrs.add(n.attr)
    return names, attrs


def _locals(node: ast.AST) -> set[str]:
    """Names the function binds itself: arguments, assignment targets, loop and ``with`` variables."""
    bound = {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
    bound |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    return bound


def _span(node: ast.AST) -> tuple[int, int]:
    """(first line, last line), 1-based, decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


def graded_fix(clean: str, planted: str, theirs: str, qualname: str, rel: str) -> tuple[str | None, str]:
    """(the text to test, ``""``) for a fix that must run; (None, ``""``) when the student's function is the
    library's; (None, why) when it cannot be graded as a fix (the message is the student's)."""
    try:
        their_tree = ast.parse(theirs)
    except SyntaxError as e:
        return None, f"{rel} does not parse (line {e.lineno}: {e.msg})"
    clean_tree, planted_tree = ast.parse(clean), ast.parse(planted)
    mine, lib, bad = (find_function(t, qualname) for t in (their_tree, clean_tree, planted_tree))
    if lib is None or bad is None:
        raise ValueError(f"{qualname} is not a function of {rel} (the key and the library disagree)")
    if mine is None:
        return None, f"{rel} has no {qualname} any more"
    if ast.dump(mine) == ast.dump(lib):
        return None, ""
    allowed_names, allowed_attrs = (a | b for a, b in zip(words(lib), words(bad)))
    names, attrs = words(mine)
    new = sorted((names - allowed_names - BUILTINS - _locals(mine)) | {f".{a}" for a in attrs - allowed_attrs})
    if new:
        return None, (f"your {qualname} uses {', '.join(new[:5])}, which the function never did: a fix puts the "
                      "planted line right, in the function's own words")
    lines = clean.splitlines(keepends=True)
    first, last = _span(lib)
    a, b = _span(mine)
    spliced = "".join(lines[: first - 1] + theirs.splitlines(keepends=True)[a - 1: b] + lines[last:])
    try:
        compile(spliced, rel, "exec")
    except SyntaxError as e:
        return None, f"your {qualname} does not compile in the library's {rel} (line {e.lineno}: {e.msg})"
    return spliced, ""
