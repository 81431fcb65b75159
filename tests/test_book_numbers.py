"""The book keeps its word: a number a chapter quotes from a notebook is in that notebook's committed output.

A chapter tags the block (a paragraph, a table, a code block: the lines up to the next blank line,
or the whole fenced block) whose figures come from a notebook, on the line just before it:

    <!-- numbers: 02_fsdp_core.ipynb#73d474e7 -->            one cell, by its id
    <!-- numbers: 02_fsdp_core.ipynb#73d474e7,2db51567 -->   any of several cells
    | peak KiB per rank | N = 2 ours | ...

Every decimal number in the block (``1982.4``, ``1.03x``, ``49.8%``, ``169,088``: a figure with a
decimal point, a thousands separator or an ``x``/``%`` suffix) must appear among the numbers that the
named cells printed in the committed notebook.  Plain small integers ("2 ranks", "step 3") are prose,
not measurements, and are not checked.  Commas are ignored on both sides (``169,088`` = ``169088``).

Facts that are words, not figures (a CPU flag, a capability string), are tagged ``quotes`` instead:

    <!-- quotes: 04_advanced_topics.ipynb#c06e -->
    `/proc/cpuinfo` lists `avx512_bf16` ...

Every ``code span`` in a ``quotes`` block must appear verbatim in the named cells' committed output.

What this proves and what it does not: a tagged figure was printed by the notebook as committed; it
does not prove the figure belongs to the row it sits in.  The planted-fault tests below show the checks
failing on a changed digit or word, a missing cell and an empty block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"<!--\s*numbers:\s*([\w.\-]+\.ipynb)#([\w\-,]+)\s*-->")
QUOTE_TAG = re.compile(r"<!--\s*quotes:\s*([\w.\-]+\.ipynb)#([\w\-,]+)\s*-->")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+(?=x\b|%))(?:x\b|%)?")
ANY_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def figures(text: str) -> list[str]:
    """The checked figures in ``text``, normalised (no commas, no suffix)."""
    return [m.group(1).replace(",", "") for m in NUMBER.finditer(text)]


def printed(text: str) -> set[str]:
    """Every number in a notebook's output, integers too, normalised as ``figures`` does."""
    return {m.group(0).rstrip(",").replace(",", "") for m in ANY_NUMBER.finditer(text)}


def cell_outputs(notebook: Path, cell_ids: list[str]) -> str:
    """The text the named cells printed in the committed notebook (stream and text/plain)."""
    cells = {c.get("id"): c for c in json.loads(notebook.read_text())["cells"]}
    missing = [i for i in cell_ids if i not in cells]
    if missing:
        raise LookupError(f"{notebook.name} has no cell with id {missing}")
    out = []
    for cid in cell_ids:
        for o in cells[cid].get("outputs", []):
            out.append("".join(o.get("text", "")))
            out.append("".join(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


def tagged_blocks(chapter_text: str, tag: re.Pattern = TAG) -> list[tuple[int, str, list[str], str]]:
    """(line number, notebook, cell ids, block text) for every ``tag`` (numbers, or quotes) in a chapter."""
    lines, found = chapter_text.splitlines(), []
    for n, line in enumerate(lines):
        m = tag.search(line)
        if not m:
            continue
        block, k = [], n + 1
        fenced = k < len(lines) and lines[k].startswith("```")
        while k < len(lines):
            if fenced and block and lines[k].startswith("```"):
                block.append(lines[k])
                break
            if not fenced and not lines[k].strip():
                break
            block.append(lines[k])
            k += 1
        found.append((n + 1, m.group(1), m.group(2).split(","), "\n".join(block)))
    return found


def disagreements(chapter_text: str, notebooks: Path) -> list[str]:
    """Every tagged figure not found in its cells' committed output, and every empty or broken tag."""
    problems = []
    for line, nb, ids, block in tagged_blocks(chapter_text):
        try:
            shown = printed(cell_outputs(notebooks / nb, ids))
        except (OSError, LookupError) as e:
            problems.append(f"line {line}: {e}")
            continue
        quoted = figures(block)
        if not quoted:
            problems.append(f"line {line}: the tagged block quotes no figure")
        problems += [f"line {line}: {q} is not in the output of {nb}#{','.join(ids)}" for q in quoted
                     if q not in shown]
    for line, nb, ids, block in tagged_blocks(chapter_text, QUOTE_TAG):
        try:
            shown = cell_outputs(notebooks / nb, ids)
        except (OSError, LookupError) as e:
            problems.append(f"line {line}: {e}")
            continue
        quoted = CODE_SPAN.findall(block)
        if not quoted:
            problems.append(f"line {line}: the tagged block quotes no `code span`")
        problems += [f"line {line}: `{q}` is not in the output of {nb}#{','.join(ids)}" for q in quoted
                     if q not in shown]
    return problems


CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_tagged_figures_are_the_committed_outputs(chapter):
    problems = disagreements(chapter.read_text(), ROOT / "notebooks")
    assert not problems, f"{chapter.name} and its notebook disagree:\n" + "\n".join(problems)


def test_chapter_2_tags_its_measured_tables():
    """The tags are there (a chapter with none would pass the check above vacuously)."""
    blocks = tagged_blocks((ROOT / "chapters" / "02_fsdp_core.md").read_text())
    assert len(blocks) >= 8
    assert sum(len(figures(b)) for *_, b in blocks) >= 100


def test_the_check_catches_a_changed_digit_a_missing_cell_and_an_empty_block():
    text = (ROOT / "chapters" / "02_fsdp_core.md").read_text()
    nbs = ROOT / "notebooks"
    assert disagreements(text, nbs) == []
    line, nb, ids, block = tagged_blocks(text)[0]
    raw = NUMBER.search(block).group(1)  # the first figure as written, e.g. "169,088"
    changed = text.replace(block, block.replace(raw, raw[:-1] + str((int(raw[-1]) + 1) % 10), 1), 1)
    assert changed != text
    assert any("is not in the output" in p for p in disagreements(changed, nbs))
    no_cell = text.replace(f"{nb}#{','.join(ids)}", f"{nb}#no-such-cell", 1)
    assert any("has no cell with id" in p for p in disagreements(no_cell, nbs))
    empty = f"<!-- numbers: {nb}#{ids[0]} -->\nno figures here\n"
    assert disagreements(empty, nbs) == ["line 1: the tagged block quotes no figure"]


def test_the_quotes_check_catches_a_changed_word_and_an_empty_block():
    text = (ROOT / "chapters" / "04_advanced_topics.md").read_text()
    nbs = ROOT / "notebooks"
    blocks = tagged_blocks(text, QUOTE_TAG)
    assert blocks and disagreements(text, nbs) == []
    line, nb, ids, block = blocks[0]
    word = CODE_SPAN.findall(block)[0]
    changed = text.replace(block, block.replace(f"`{word}`", f"`{word}x`", 1), 1)
    assert changed != text
    assert any(f"`{word}x` is not in the output" in p for p in disagreements(changed, nbs))
    empty = f"<!-- quotes: {nb}#{ids[0]} -->\nno code spans here\n"
    assert disagreements(empty, nbs) == ["line 1: the tagged block quotes no `code span`"]
