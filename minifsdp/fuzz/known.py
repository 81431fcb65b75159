"""Differences the fuzzer finds where torch is the one that is wrong: named, explained, pinned by a test.

A reimplementation that teaches must say where it parts from torch and why.  Each entry here is one such
place: a predicate on (program, difference) that recognises it, and the reason, with torch's source line.
Chapter 6's table "Where ours parts from torch, and why" lists the same entries, and each has a test that runs
the program on both and asserts both behaviours (``tests/test_fuzz.py``), so a torch release that fixes it
fails that test and the entry goes.

Nothing else may be explained away: a difference no entry matches is a finding, to be fixed in ours.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["Known", "KNOWN", "explain"]


@dataclasses.dataclass(frozen=True)
class Known:
    name: str
    why: str
    matches: Callable  # (program, difference) -> bool


KNOWN: list[Known] = []


def explain(program, diffs: list) -> dict:
    """{difference: the name of the known entry that explains it} for the differences some entry matches."""
    return {d: k.name for d in diffs for k in KNOWN if k.matches(program, d)}
