"""The student edition of this checkout, built once per test session and shared (building it takes seconds).

``tests/test_exercise_grading.py`` and ``tests/test_student_edition.py`` read it; a test that changes it works
on a copy.
"""

from pathlib import Path

from minifsdp.classroom.course_copy import student_copy

ROOT = Path(__file__).resolve().parents[1]
_BUILT: dict[str, Path] = {}


def student_edition(tmp_path_factory) -> Path:
    """The folder ``course student-copy`` wrote from this checkout (pytest's session ``tmp_path_factory``)."""
    if "edition" not in _BUILT:
        where = tmp_path_factory.mktemp("course") / "student"
        student_copy(ROOT, where)
        _BUILT["edition"] = where
    return _BUILT["edition"]
