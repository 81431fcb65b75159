"""Rank function for tests/test_fuzz.py: fuzz programs on both sides, every record kept (not only differences)."""

from __future__ import annotations

import warnings

from minifsdp.fuzz.program import Program
from minifsdp.fuzz.run import run_side
from minifsdp.fuzz.sides import RankContext


def both_sides(programs_json: list[str]) -> list[dict]:
    """Each program on torch, then on ours: ``{"torch": record, "ours": record}`` (``run.run_side``'s records)."""
    warnings.simplefilter("ignore")
    ctx = RankContext()
    return [{side: run_side(Program.from_json(text), side, ctx) for side in ("torch", "ours")}
            for text in programs_json]
