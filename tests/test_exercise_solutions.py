"""The instructor's answers themselves (``exercises/solutions/``; the student edition leaves this file out).

* By construction, copying an answer over its stub gives a module the task tests grade as they grade the
  reference (``module_name`` gives them ``exercises.solutions.X`` or ``exercises.X``): every stub module
  that raises ``NotImplementedError`` has an answer of the same name (projects' included), defining every
  function and class the stub does, importing only the library, torch and the starter code the student
  edition keeps (a project's model, never another answer or a stub), so it runs where the stub was.
  ``tests/test_exercise_grading.py`` copies some into the student edition and grades them; this is why the
  others need not be run there a second time (the rules that read each file read the answers too:
  ``tests/test_course.py``).
* Exercise 2.1c's answer all-reduces the gradient norm on the collective's device, on a rank with no
  shards too (a CPU zero would fail on NCCL).  With no GPU here, a "meta" tensor stands in for the device
  ``collective_device`` answers for a plain "nccl" group.
"""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minifsdp.classroom.course_cut import find_cuts
from tests.exercises import impl_module

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"
SOLUTIONS = EXERCISES / "solutions"


def _stubs() -> list[Path]:
    return sorted(p for p in EXERCISES.rglob("*.py") if SOLUTIONS not in p.parents and p.name != "__init__.py"
                  and "NotImplementedError" in p.read_text())


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for n in tree.body:  # re-exports: from minifsdp.x import f as g
        if isinstance(n, ast.ImportFrom):
            names |= {a.asname or a.name for a in n.names}
    return names


def test_every_stub_has_an_answer_that_can_replace_it():
    stubs = _stubs()
    assert len(stubs) >= 11, stubs  # the eleven task modules at least
    for stub in stubs:
        rel = stub.relative_to(EXERCISES)
        answer = SOLUTIONS / rel
        assert answer.exists(), f"{stub.relative_to(ROOT)} has no answer at {answer.relative_to(ROOT)}"
        tree = ast.parse(stub.read_text())
        wanted = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and
                  not n.name.startswith("_")}
        missing = wanted - _top_level_names(answer)
        assert not missing, f"{answer.relative_to(ROOT)} lacks {sorted(missing)} of its stub"
        imports = [n for n in ast.walk(ast.parse(answer.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        mods = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names] + \
               [n.module or "" for n in imports if isinstance(n, ast.ImportFrom)]
        given = {".".join(q.relative_to(ROOT).with_suffix("").parts) for q in EXERCISES.rglob("*.py")
                 if SOLUTIONS not in q.parents and q not in stubs}  # starter code the student edition keeps
        assert not [m for m in mods if m.split(".")[0] in ("exercises", "tests") and m not in given], (answer, mods)
        dotted = ".".join(rel.with_suffix("").parts)
        module = impl_module(dotted, "reference")
        assert all(callable(getattr(module, name)) for name in wanted), (dotted, wanted)


@pytest.fixture
def nccl_on_meta(monkeypatch):
    """collective_device answers "meta" for "nccl"; every all-reduce's tensor device is recorded."""
    seen = []
    answer = impl_module("fsdp_tasks", "reference")

    def fake_device(group=None, like=None):
        assert group == "nccl"
        return torch.device("meta")

    monkeypatch.setattr(answer, "collective_device", fake_device)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    return seen, answer


def test_no_answer_imports_the_library_function_the_student_edition_cuts_for_it():
    """Pasted into the student edition, such an answer would be the library's stub, which calls the answer back.
    (Another task's cut function is fine: project-hybrid's answer runs on the library's ring, theirs in the copy.)"""
    cut = {}
    for c in find_cuts(ROOT):
        cut.setdefault(c.exercise, set()).update((c.file.removesuffix(".py").replace("/", "."), lib)
                                                 for lib, _, _ in c.functions)
    assert sum(map(len, cut.values())) >= 10, cut
    for path in SOLUTIONS.rglob("*.py"):
        mine = cut.get(f"exercises/{path.relative_to(SOLUTIONS).as_posix()}", set())
        imported = {(n.module, a.name) for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not imported & mine, (path.name, sorted(imported & mine))


def test_reference_clip_without_shards_all_reduces_on_the_collective_device(nccl_on_meta):
    seen, answer = nccl_on_meta
    total = answer.clip_grad_norm_sharded_([], 1.0, group="nccl")
    assert seen == [torch.device("meta")]
    assert total.device.type == "meta"
