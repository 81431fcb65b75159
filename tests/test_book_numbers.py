"""The book keeps its word: a number a chapter quotes from a notebook is in the output of the cell it cites.

How a sentence cites a cell.  Either a tag on the line just before the block (a paragraph, a table, a code block:
the lines up to the next blank line, or the whole fenced block) names the notebook and its cells:

    <!-- numbers: 02_fsdp_core.ipynb#73d474e7 -->            one cell, by its id
    <!-- numbers: 02_fsdp_core.ipynb#73d474e7,2db51567 -->   any of several cells
    | peak KiB per rank | N = 2 ours | ...

or the paragraph names the cell by its id in a code span ("cell `dptime` times one step ...").  A paragraph may
also name a committed results file (`chapters/results/bench_scale.json`): its text counts as printed output.

What is checked.

* In a tagged block, every number (``1982.4``, ``1.03x``, ``49.8%``, ``169,088``, and whole numbers too: ``2
  cores``, ``8 collectives``) must appear among the numbers that the named cells printed in the committed
  notebook.  Commas are ignored on both sides (``169,088`` = ``169088``); code spans (identifiers, commands, cell
  ids) and section numbers (``2.3``, ``task 2.1a``) are not numbers.
* Everywhere else in a course chapter, every *figure* (a number with a decimal point, a thousands separator or an
  ``x``/``%`` suffix; a whole number followed by a unit of size, time or rate: ``72 MiB``, ``16 minutes``,
  ``25 s``; a duration in words: ``two minutes``) must be printed by a cell or results file that its paragraph
  cites, or be listed in ``NOT_MEASURED`` with what it is (a citation, the source's own claim, a setting the
  text states).  A figure that no cited cell prints fails, even if another cell of the notebook happens to print
  it.
* A question marked ``**At scale.**`` is a worked computation at a size no laptop runs (a 7B model on 512 GPUs):
  its numbers are its givens and its arithmetic, shown in its answer, and are not looked up.

Facts that are words, not figures (a CPU flag, a capability string), are tagged ``quotes`` instead:

    <!-- quotes: 04_advanced_topics.ipynb#c06e -->
    `/proc/cpuinfo` lists `avx512_bf16` ...

Every ``code span`` in a ``quotes`` block must appear verbatim in the named cells' committed output.  A block
may carry both tags, on consecutive lines.

What this proves and what it does not: a figure was printed by the cell its sentence cites, as committed; it does
not prove the figure belongs to the row it sits in.  The planted-fault tests below show the checks failing on a
changed digit or word, a changed whole number, a missing cell, an empty block and a figure its paragraph does
not cite.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"<!--\s*numbers:\s*([\w.\-]+\.ipynb)#([\w\-,]+)\s*-->")
QUOTE_TAG = re.compile(r"<!--\s*quotes:\s*([\w.\-]+\.ipynb)#([\w\-,]+)\s*-->")
ANY_TAG = re.compile(r"^\s*<!--\s*(?:numbers|quotes):")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
SECTION_NUMBER = re.compile(r"(?<![\w.])[1-5]\.[1-5](?:[a-c](?:-[a-c])?)?(?!\w|\.\d|%)")
NOT_PROSE = re.compile(r"```.*?```|arXiv:\S+|https?://\S+|pytorch/pytorch#\d+", re.S)
# A Markdown link's target (``[the tests](02_fsdp_core_deeper.md#21-going-deeper)``) is an address, not prose.
LINK_TARGET = re.compile(r"(?<=\])\([^()\s]+\)")
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+(?=x\b|%))(?:x\b|%)?")
ANY_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")
WHOLE = re.compile(r"(?<![\w.^⁰¹²³⁴⁵⁶⁷⁸⁹-])\d[\d,]*(?:\.\d+)?(?=x\b|%|(?![\w⁰¹²³⁴⁵⁶⁷⁸⁹]|[.,]\d))")
UNITS = (r"bytes|bits|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|s|ms|µs|us|sec|seconds?|min|minutes?|h|hours?|tokens/s|it/s|"
         r"steps/s|GFLOP/s|TFLOP/s|GB/s|MB/s|Gb/s")
UNIT_NUMBER = re.compile(rf"(?<![\w.,^-])(\d+)\s?({UNITS})(?![\w/])")
NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
WORD_DURATION = re.compile(rf"\b({'|'.join(NUMBER_WORDS)})\s+(seconds?|minutes?|hours?)\b", re.I)
# A run's settings written as a variable (N = 2, S = 4, M = 8) and a citation's year (Chen et al. 2016) are not
# what a cell measured.
SETTING = re.compile(r"(?<!\w)[A-Za-zΨ] = \d+(?!\d|[.,]\d)|et al\.,? (?:19|20)\d\d\b")


def figures(text: str) -> list[str]:
    """The figures with a decimal point, a thousands separator or an x/% suffix, normalised (no commas, no suffix)."""
    return [m.group(1).replace(",", "") for m in NUMBER.finditer(text)]


def measured_figures(text: str) -> list[tuple[str, str]]:
    """What prose outside a tagged block must source, as (how NOT_MEASURED names it, the number): ``figures``
    (``"72.6"``), whole numbers with a unit of size, time or rate (``"16 minutes"``, ``"25 s"``), durations in words
    (``"two minutes"``, the number ``2``).  Code spans are not prose."""
    text = CODE_SPAN.sub(" ", text)
    found = [(f, f) for f in figures(text)]
    found += [(f"{m.group(1)} {m.group(2)}", m.group(1)) for m in UNIT_NUMBER.finditer(text)]
    return found + [(m.group(0), NUMBER_WORDS[m.group(1).lower()]) for m in WORD_DURATION.finditer(text)]


def every_number(text: str) -> list[tuple[str, str]]:
    """Every number of a tagged block, whole numbers included, as (how NOT_MEASURED names it, the number); not code
    spans, section numbers, superscripts, settings (``N = 2``) or a citation's year."""
    text = SETTING.sub(" ", SECTION_NUMBER.sub(" ", CODE_SPAN.sub(" ", LINK_TARGET.sub("", text))))
    units = {m.start(1): f"{m.group(1)} {m.group(2)}" for m in UNIT_NUMBER.finditer(text)}
    out = []
    for m in WHOLE.finditer(text):
        number = m.group(0).rstrip(",").replace(",", "")
        out.append((units.get(m.start(), number), number))
    return out


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
        while k < len(lines) and ANY_TAG.match(lines[k]):  # the other tag of a block that carries both
            k += 1
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


def disagreements(chapter_text: str, notebooks: Path, not_measured: dict | None = None) -> list[str]:
    """Every tagged figure not found in its cells' committed output (``not_measured``: numbers that are not
    measurements, by how ``every_number`` names them), and every empty or broken tag."""
    problems, not_measured = [], not_measured or {}
    for line, nb, ids, block in tagged_blocks(chapter_text):
        try:
            shown = printed(cell_outputs(notebooks / nb, ids))
        except (OSError, LookupError) as e:
            problems.append(f"line {line}: {e}")
            continue
        numbers = every_number(block)
        if not numbers:
            problems.append(f"line {line}: the tagged block quotes no figure")
        problems += [f"line {line}: {n} is not in the output of {nb}#{','.join(ids)}" for key, n in numbers
                     if n not in shown and key not in not_measured]
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
    problems = disagreements(chapter.read_text(), ROOT / "notebooks", NOT_MEASURED.get(chapter.name))
    assert not problems, f"{chapter.name} and its notebook disagree:\n" + "\n".join(problems)


def test_chapter_2_tags_its_measured_tables():
    """The tags are there (a chapter with none would pass the check above vacuously)."""
    blocks = tagged_blocks((ROOT / "chapters" / "02_fsdp_core.md").read_text())
    assert len(blocks) >= 8
    assert sum(len(figures(b)) for *_, b in blocks) >= 100


def test_the_check_catches_a_changed_digit_a_missing_cell_and_an_empty_block():
    text = (ROOT / "chapters" / "02_fsdp_core.md").read_text()
    nbs = ROOT / "notebooks"
    assert disagreements(text, nbs, NOT_MEASURED["02_fsdp_core.md"]) == []
    line, nb, ids, block = tagged_blocks(text)[0]
    raw = NUMBER.search(block).group(1)  # the first figure as written, e.g. "169,088"
    changed = text.replace(block, block.replace(raw, raw[:-1] + str((int(raw[-1]) + 1) % 10), 1), 1)
    assert changed != text
    assert any("is not in the output" in p for p in disagreements(changed, nbs))
    no_cell = text.replace(f"{nb}#{','.join(ids)}", f"{nb}#no-such-cell", 1)
    assert any("has no cell with id" in p for p in disagreements(no_cell, nbs))
    empty = f"<!-- numbers: {nb}#{ids[0]} -->\nno figures here\n"
    assert disagreements(empty, nbs) == ["line 1: the tagged block quotes no figure"]


def test_the_check_catches_a_changed_whole_number():
    """Whole numbers count too: a tagged block's "step 23" must be the step the cell printed."""
    text = (ROOT / "chapters" / "03_fsdp_in_practice.md").read_text()
    nbs, skip = ROOT / "notebooks", NOT_MEASURED["03_fsdp_in_practice.md"]
    assert disagreements(text, nbs, skip) == []
    line, nb, ids, block = next(b for b in tagged_blocks(text) if re.search(r"(?<![\w.,])\d{2,}(?![\w.,])", b[3]))
    whole = re.search(r"(?<![\w.,])\d{2,}(?![\w.,])", block).group(0)
    other = next(str(v) for v in range(int(whole) + 1, int(whole) + 10**6)
                 if str(v) not in printed(cell_outputs(nbs / nb, ids)))
    changed = text.replace(block, re.sub(rf"(?<![\w.,]){whole}(?![\w.,])", other, block, count=1), 1)
    assert f"line {line}: {other} is not in the output of {nb}#{','.join(ids)}" in disagreements(changed, nbs, skip)


def test_the_quotes_check_catches_a_changed_word_and_an_empty_block():
    text = (ROOT / "chapters" / "04_advanced_topics.md").read_text()
    nbs = ROOT / "notebooks"
    blocks = tagged_blocks(text, QUOTE_TAG)
    assert blocks and disagreements(text, nbs, NOT_MEASURED["04_advanced_topics.md"]) == []
    line, nb, ids, block = blocks[0]
    word = CODE_SPAN.findall(block)[0]
    changed = text.replace(block, block.replace(f"`{word}`", f"`{word}x`", 1), 1)
    assert changed != text
    assert any(f"`{word}x` is not in the output" in p for p in disagreements(changed, nbs))
    empty = f"<!-- quotes: {nb}#{ids[0]} -->\nno code spans here\n"
    assert disagreements(empty, nbs) == ["line 1: the tagged block quotes no `code span`"]


# ---------------------------------------------------------------------------------------------------------------
# A section of the book is a course section.
#
# The chapters below are written as a course, section by section.
COURSE = {
    "01_parallel_training_overview.md": ["1.1", "1.2", "1.3"],
    "02_fsdp_core.md": ["2.1", "2.2", "2.3", "2.4", "2.5"],
    "03_fsdp_in_practice.md": ["3.1", "3.2", "3.3"],
    "04_advanced_topics.md": ["4.1", "4.2", "4.3", "4.4"],
    "05_fsdp_future.md": ["5.1", "5.2", "5.3"],
    "06_when_fsdp_goes_wrong.md": ["6"],
}

# A chapter's optional parts, in a file of their own: the appendix -> its chapter, whose notebook prints its figures.
# An appendix is not a course (its parts hang off the chapter's sections), but its figures are checked as the
# chapter's are.
APPENDICES = {"02_fsdp_core_deeper.md": "02_fsdp_core.md"}

# What every course section holds, in this order, and how each part is recognised:
#   **You will be able to:**   what the learner can do after it (a list)
#   **Read first:**            what to have read before
#   ### Code to read           files and functions, in reading order (a numbered list of `paths`)
#   ### Cells to run           the companion notebook's cells, by id (each id must exist)
#   ### Exercise               the task(s), each with `pytest tests/exercises --impl=student -k taskN_M`
#   ### Questions              3 to 5 questions, each answered behind <details><summary>Answer</summary>
#   ### Summary                a short summary
OPENING = ("**You will be able to:**", "**Read first:**")
CLOSING = ("### Code to read", "### Cells to run", "### Exercise", "### Questions", "### Summary")
ANSWER = re.compile(r"<details><summary>Answer</summary>(.+?)</details>", re.S)
GRADING = re.compile(r"pytest tests/exercises --impl=student -k (task\d+_\d+[a-z]?)")


def course_sections(chapter_text: str, numbers: list[str]) -> dict[str, str]:
    """Section number -> its text.  ``"1"`` is a whole chapter of one section (``# Chapter 1: ...`` to the end);
    ``"3.2"`` runs from its ``## 3.2 `` heading to the next ``## `` heading."""
    lines, found = chapter_text.splitlines(), {}
    for number in numbers:
        if "." not in number:
            start = next((i for i, ln in enumerate(lines) if ln.startswith(f"# Chapter {number}:")), None)
            found[number] = None if start is None else "\n".join(lines[start:])
            continue
        start = next((i for i, ln in enumerate(lines) if ln.startswith(f"## {number} ")), None)
        if start is None:
            found[number] = None
            continue
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        found[number] = "\n".join(lines[start:end])
    return found


def part(section: str, heading: str) -> str:
    """The text under a ``### heading`` of a section, up to the next ``##``/``###`` heading."""
    m = re.search(rf"^{re.escape(heading)}\s*$(.*?)(?=^##|\Z)", section, re.S | re.M)
    return m.group(1).strip() if m else ""


def tasks_by_chapter() -> dict[str, list[str]]:
    """Every task of exercises/README.md's table, as test-name keys (``task4_1a``), by chapter number."""
    table = (ROOT / "exercises" / "README.md").read_text()
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"^\| (\d)\.(\d)([a-c]?)(?:-(?:(\d)\.(\d)|([a-c])))? ", table, re.M):
        ch, sec, first, _, sec2, last = m.groups()
        keys = [f"task{ch}_{sec}{first}"]
        if last and not sec2:  # 4.1a-b
            keys = [f"task{ch}_{sec}{chr(c)}" for c in range(ord(first or "a"), ord(last) + 1)]
        elif sec2:  # 5.1-5.2
            keys = [f"task{ch}_{s}" for s in range(int(sec), int(sec2) + 1)]
        out.setdefault(ch, []).extend(keys)
    return out


def course_problems(chapter: str, chapter_text: str, notebooks: Path) -> list[str]:
    """What each course section of ``chapter`` lacks; empty when every part is there."""
    problems = []
    nb = notebooks / chapter.replace(".md", ".ipynb")
    cell_ids = {c.get("id") for c in json.loads(nb.read_text())["cells"]} if nb.exists() else set()
    linked = set()
    for number, section in course_sections(chapter_text, COURSE[chapter]).items():
        if section is None:
            problems.append(f"{number}: no heading for this section")
            continue
        for label in OPENING:
            if label not in section:
                problems.append(f"{number}: no '{label}'")
        where = [section.find(h) for h in CLOSING]
        for h, at in zip(CLOSING, where):
            if at < 0:
                problems.append(f"{number}: no '{h}'")
            elif not part(section, h):
                problems.append(f"{number}: '{h}' is empty")
        if all(at >= 0 for at in where) and where != sorted(where):
            problems.append(f"{number}: the closing parts are not in the order {CLOSING}")
        if not re.search(r"^\d+\. .*`[\w/.\-]+\.(py|md)", part(section, "### Code to read"), re.M):
            problems.append(f"{number}: 'Code to read' lists no file in a numbered list")
        cells = [c for c in CODE_SPAN.findall(part(section, "### Cells to run")) if not c.endswith(".ipynb")]
        if not cells:
            problems.append(f"{number}: 'Cells to run' names no cell id")
        problems += [f"{number}: cell `{c}` is not in {nb.name}" for c in cells if c not in cell_ids]
        graded = GRADING.findall(part(section, "### Exercise"))
        if not graded:
            problems.append(f"{number}: the exercise has no `pytest tests/exercises --impl=student -k taskN_M`")
        linked |= set(graded)
        questions = part(section, "### Questions")
        answers = ANSWER.findall(questions)
        if not 3 <= len(answers) <= 5 or any(not a.strip() for a in answers):
            problems.append(f"{number}: {len(answers)} answered questions (want 3 to 5, each answer non-empty)")
        if questions.count("<details>") != len(answers):
            problems.append(f"{number}: a <details> block without '<summary>Answer</summary>' or not closed")
    chapter_number = chapter[1] if chapter.startswith("0") else chapter[0]
    problems += [f"task {t}: no section of the chapter links it with its grading command"
                 for t in tasks_by_chapter().get(chapter_number, []) if t not in linked]
    return problems


@pytest.mark.parametrize("chapter", sorted(COURSE), ids=[c.removesuffix(".md") for c in sorted(COURSE)])
def test_every_section_is_a_course_section(chapter):
    problems = course_problems(chapter, (ROOT / "chapters" / chapter).read_text(), ROOT / "notebooks")
    assert not problems, f"{chapter} is not yet a course:\n" + "\n".join(problems)


def test_the_course_check_catches_each_missing_part():
    chapter = "03_fsdp_in_practice.md"
    text, nbs = (ROOT / "chapters" / chapter).read_text(), ROOT / "notebooks"
    assert course_problems(chapter, text, nbs) == []
    section = course_sections(text, ["3.2"])["3.2"]
    for cut, expected in [("**You will be able to:**", "no '**You will be able to:**'"),
                          ("**Read first:**", "no '**Read first:**'"),
                          ("### Summary", "no '### Summary'"),
                          ("### Cells to run", "no '### Cells to run'")]:
        broken = text.replace(section, section.replace(cut, "", 1), 1)
        assert any(expected in p for p in course_problems(chapter, broken, nbs)), cut
    first_answer = ANSWER.search(section).group(0)
    hint = first_answer.replace("<summary>Answer</summary>", "<summary>Hint</summary>")
    no_answer = text.replace(first_answer, hint, 1)
    assert any("a <details> block without" in p for p in course_problems(chapter, no_answer, nbs))
    questions = part(section, "### Questions")
    unanswered = text.replace(questions, "1. A question without an answer?\n", 1)
    assert any("answered questions (want 3 to 5" in p for p in course_problems(chapter, unanswered, nbs))
    cells = part(section, "### Cells to run")
    cell = [c for c in CODE_SPAN.findall(cells) if not c.endswith(".ipynb")][0]
    no_cell = text.replace(cells, cells.replace(f"`{cell}`", "`no-such-cell`"), 1)
    assert any("`no-such-cell` is not in" in p for p in course_problems(chapter, no_cell, nbs))
    grading = GRADING.search(part(section, "### Exercise")).group(0)
    no_link = text.replace(grading, grading.replace("--impl=student", "--impl=somebody"))
    assert any("no section of the chapter links it" in p or "the exercise has no" in p
               for p in course_problems(chapter, no_link, nbs))


def test_the_task_table_is_read_whole():
    """The chapter-task map comes from exercises/README.md: every task of chapters 1, 3, 4, 5 is in it."""
    tasks = tasks_by_chapter()
    assert tasks["1"] == ["task1_1", "task1_3"]
    assert tasks["3"] == ["task3_1", "task3_2a", "task3_2b", "task3_3"]
    assert tasks["4"] == ["task4_1a", "task4_1b", "task4_2", "task4_3a", "task4_3b", "task4_4a", "task4_4b"]
    assert tasks["5"] == ["task5_1", "task5_2", "task5_3"]
    assert tasks["2"][:3] == ["task2_1a", "task2_1b", "task2_1c"] and "task2_5b" in tasks["2"]


# Questions that make the reader compute at real scale (a 7B or 70B model on 8 to 512 GPUs), marked **At scale.**:
# at least one per course section and a third of the chapter's questions, in the chapters written that way.
AT_SCALE_CHAPTERS = ("01_parallel_training_overview.md", "02_fsdp_core.md", "03_fsdp_in_practice.md",
                     "04_advanced_topics.md", "05_fsdp_future.md", "06_when_fsdp_goes_wrong.md")


def at_scale_problems(chapter: str, chapter_text: str) -> list[str]:
    problems, total, computing = [], 0, 0
    for number, section in course_sections(chapter_text, COURSE[chapter]).items():
        questions = part(section or "", "### Questions")
        items = re.findall(r"^\d+\. .*", questions, re.M)
        scale = [q for q in items if AT_SCALE.match(q)]
        total, computing = total + len(items), computing + len(scale)
        if not scale:
            problems.append(f"{number}: no question marked **At scale.**")
    if 3 * computing < total:
        problems.append(f"{computing} of {total} questions compute at scale (want at least a third)")
    return problems


@pytest.mark.parametrize("chapter", AT_SCALE_CHAPTERS, ids=[c.removesuffix(".md") for c in AT_SCALE_CHAPTERS])
def test_questions_compute_at_real_scale(chapter):
    problems = at_scale_problems(chapter, (ROOT / "chapters" / chapter).read_text())
    assert not problems, f"{chapter}:\n" + "\n".join(problems)


def test_the_at_scale_check_catches_a_section_without_one():
    text = (ROOT / "chapters" / "01_parallel_training_overview.md").read_text()
    assert at_scale_problems("01_parallel_training_overview.md", text) == []
    plain = text.replace("**At scale.** ", "")
    assert "1.1: no question marked **At scale.**" in at_scale_problems("01_parallel_training_overview.md", plain)


# The book states what is, with its measurement; how the code came to be is git's to tell.  These words tell it.
HISTORY = re.compile("|".join([
    r"\bthis branch\b", r"\bmain branch\b", r"\bthe old (?:code|version|one|ring|runs?|layout)\b", r"\bold = ",
    r"\bcommits?\b[^.\n]{0,20}`?[0-9a-f]{7,40}\b", r"\b[0-9a-f]{7,40}\^", r"\bgit show\b",
    r"\bas it was\b", r"\bused to (?:be|raise|say|post|hold|sit)\b", r"\bours used to\b",
    r"\b(?:an? |the )?(?:earlier|previous|older) (?:draft|edition|version)\b",
    r"\b(?:before|after) the (?:fix|change|split|refactor\w*)\b", r"\bgone with this change\b",
    r"\bwe (?:fixed|changed)\b", r"\(chapter \d follows\)",
]), re.I)


def book_texts() -> dict[str, str]:
    """The chapters, their results files and the notebooks' Markdown cells, by path."""
    files = sorted((ROOT / "chapters").glob("*.md")) + sorted((ROOT / "chapters" / "results").rglob("*.md"))
    texts = {str(f.relative_to(ROOT)): f.read_text() for f in files}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        markdown = ("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        texts[str(nb.relative_to(ROOT))] = "\n".join(markdown)
    return texts


def history_words(texts: dict[str, str]) -> list[str]:
    return [f"{name}: {m.group(0)!r}" for name, text in texts.items() for m in HISTORY.finditer(text)]


def test_the_book_does_not_tell_its_own_history():
    """The chapters, results and notebooks speak of FSDP, not of this book's earlier code (a fault that teaches is
    planted on purpose, and named as such)."""
    texts = book_texts()
    assert len(texts) >= 15 and any("results/" in name for name in texts)
    found = history_words(texts)
    assert not found, "history belongs in git; say what is, with its measurement:\n" + "\n".join(found)


def test_the_history_check_catches_a_planted_sentence():
    planted = {"chapters/results/x.md": "The ring as it was (commit `280aea7`), driven by this branch's bench.py."}
    assert history_words(planted) == ["chapters/results/x.md: 'as it was'", "chapters/results/x.md: 'commit `280aea7'",
                                      "chapters/results/x.md: 'this branch'"]
    assert history_words({"chapters/01.md": "cell `345c0848` prints the buckets; commit the figures with it"}) == []


# ---------------------------------------------------------------------------------------------------------------
# Every figure a course chapter quotes is printed by the cell (or results file) its paragraph cites, or is listed
# here as not measured.
#
# Tagged blocks name their cells (above).  Outside them, a figure (as ``measured_figures`` finds them) must be
# among the numbers that the cells its paragraph names by id (or the results files it names) printed, or in
# NOT_MEASURED with what it is: a citation, the source's own claim, or a setting the text states (a learning rate,
# a model size).  Not figures: fenced code (the source's snippets, commands), arXiv ids and addresses, bare section
# numbers such as 2.3 or 4.4 (one digit, a point, one digit from 1 to 5, nothing but a sentence's full stop after
# it: "chapter 4.4", "task 2.1a"), and the givens and arithmetic of a question marked **At scale.**.
NOT_MEASURED = {
    "01_parallel_training_overview.md": {
        "0.25": "a setting: notebook §3c's bucket_cap_mb",
        "16 bytes": "ZeRO's accounting (Rajbhandari et al.): mixed-precision Adam keeps 16 bytes per parameter",
        "1.5": "ZeRO's accounting (Rajbhandari et al.): stage 3 moves 3Ψ against DDP's 2Ψ",
        "2.13": "torch's version (the first cell prints 2.13.0)",
        "25 MiB": "torch DDP's default bucket_cap_mb (torch/nn/parallel/distributed.py)",
        "1 MiB": "torch DDP's first bucket after the rebuild, dist._DEFAULT_FIRST_BUCKET_BYTES",
        "1.0": "the source's max_norm=1.0 (chapter 3.2's clipping), quoted",
    },
    "02_fsdp_core.md": {
        "0.8": "a setting: GPTConfig.small's size (0.8 M parameters)",
        "1.5": "ZeRO's accounting (Rajbhandari et al.): stage 3 moves 3Ψ against DDP's 2Ψ",
        "60": "the source's table (checkpointing: 60% saved)", "30": "the source's table (+30% compute time)",
        "50": "the source's table (mixed precision: 50% saved)", "15": "the source's table (+15% throughput)",
        "29568": "the tiny GPT's size, a property of the model (GPTConfig.tiny)",
        "4160": "the tiny GPT's root unit, 4,160 elements (a property of the model; cell layout21gpt prints it)",
        "12704": "the tiny GPT's block unit, 12,704 elements (a property of the model; cell layout21gpt prints it)",
        "16 KB": "the root unit in fp32 (4,160 numbers x 4 bytes)", "50 KB": "a block unit in fp32 (12,704 x 4 bytes)",
        "4 bytes": "fp32's size (Adam's m and v: 8 bytes)", "16 bits": "bf16's and fp16's width",
        "12 bytes": "worked: three AdamW step tensors of 4 bytes", "28 bytes": "worked: 157,724 - 157,696",
        "0 bytes": "torch's code resizes the freed storage to 0; test_a_dropped_model_is_freed asserts exactly 0",
        "1 MiB": "a question's given (a ring all-reduce of 1 MiB at N = 4)",
        "63 MiB": "worked: (N-1)·S at N = 64, S = 1 MiB", "64 MiB": "worked: 2·63/64 MiB",
        "2.13": "torch's version (cell setup02 prints 2.13.0)",
    },
    "02_fsdp_core_deeper.md": {
        "1.01": "a test's bound: tests/test_memory_vs_torch.py asserts ours <= 1.01x torch's",
        "16 bytes": "ZeRO's 16 bytes per parameter; torch FSDP1 aligns each parameter to 16 bytes (_flat_param.py)",
        "0 bytes": "torch's code resizes the freed storage to 0; test_a_dropped_model_is_freed asserts exactly 0",
        "64 KB": "a message size of the collectives bench (a setting)",
        "4 ms": "a scheduler tick at Linux's common CONFIG_HZ=250 (a kernel setting)",
        "1 MB": "settings: the tuned ring's CARRY_BYTES and PIECE_BYTES (minifsdp/comm/tuned/)",
        "64 bytes": "a setting: the tuned ring's HEADER_BYTES (minifsdp/comm/tuned/header.py)",
        "256 MiB": "a setting: bench scale's address-space cap per rank",
        "2.13": "torch's version (cell setup02 prints 2.13.0)",
    },
    "03_fsdp_in_practice.md": {
        "0.2": "a setting: --model mini's size (GPTConfig.mini, 210,304 parameters)",
        "0.8": "settings: --model small's size (GPTConfig.small), generate's default --temperature",
        "0.5": "a setting: the plateau schedule's factor (train.PLATEAU)",
        "1.0": "a setting: the job's --clip 1.0, and the source's max_norm=1.0",
        "1000": "a setting: the first job's --steps 1000",
        "29568": "the tiny GPT's size, a property of the model (GPTConfig.tiny)",
        "19 KB": "the bundled corpus's size (minifsdp/data/corpus.txt, 19,012 bytes)",
        "96": "the tiny GPT's vocabulary size (GPTConfig.vocab_size): an untrained model's loss is about ln 96",
    },
    "04_advanced_topics.md": {
        "4.2": "the source's table (FP16+FP32: 4.2 GB)", "70": "the source's claim (+70% throughput)",
        "312": "NVIDIA A100 datasheet", "19.5": "NVIDIA A100 datasheet",
        "22.7": "all-MiniLM-L6-v2's size, printed as 22,713,216 parameters",
        "0.8": "a setting: GPTConfig.small's size",
        "29568": "the tiny GPT's size, a property of the model (GPTConfig.tiny)",
        "8 GB": "the source's table (FP32: 8 GB)", "2 bytes": "bf16's size", "4 bytes": "fp32's size",
        "16 bits": "bf16's and fp16's width",
        "50 ms": "a setting: the pipeline stages' delay per F and B (cell c44h)",
    },
    "05_fsdp_future.md": {
        "1.21": "the source's go.mod", "28.54": "SimpleFSDP paper (arXiv:2411.00284)",
        "68.67": "SimpleFSDP paper (arXiv:2411.00284)", "50257": "GPT-2's vocabulary size",
        "32": "a TinyGPT dimension (n_embd, block_size)", "96": "TinyGPT's 3 x n_embd (the qkv rows) and vocabulary",
        "128": "TinyGPT's 4 x n_embd (the MLP's rows)",
        "4 bytes": "an fp32 scale per row (its size)",
        "2.6": "a torch version (fully_shard public in torch.distributed.fsdp from 2.6 on)",
        "2.13": "torch's version, the one the book pins (cell c5setup prints 2.13.0)",
        "16 bytes": "ZeRO's accounting (Rajbhandari et al.): mixed-precision Adam keeps 16 bytes per parameter",
    },
    "06_when_fsdp_goes_wrong.md": {
        "2.13": "torch's version, the one the book pins (cell c6setup prints 2.13.0)",
    },
}


AT_SCALE = re.compile(r"^\d+\. \*\*At scale\.\*\*")
RESULTS = re.compile(r"chapters/results/[\w./-]+\.(?:md|json|txt)")


def paragraphs(chapter_text: str) -> list[tuple[int, str]]:
    """(first line, text) of every paragraph that no tag covers: fenced code, tagged blocks and ``**At scale.**``
    questions (a worked computation, up to the next question or heading) left out."""
    lines, out, current, skip_to_item, k = chapter_text.splitlines(), [], [], False, 0
    while k < len(lines):
        line = lines[k]
        if skip_to_item and not re.match(r"^\d+\. |^#", line):
            k += 1
            continue
        skip_to_item = False
        if AT_SCALE.match(line):
            skip_to_item = True
        elif line.startswith("```"):  # fenced code: to its closing fence
            k += 1
            while k < len(lines) and not lines[k].startswith("```"):
                k += 1
        elif ANY_TAG.match(line):  # the tagged block: up to a blank line, or its whole fence
            k += 1
            while k < len(lines) and ANY_TAG.match(lines[k]):
                k += 1
            if k < len(lines) and lines[k].startswith("```"):
                k += 1
                while k < len(lines) and not lines[k].startswith("```"):
                    k += 1
            else:
                while k < len(lines) and lines[k].strip():
                    k += 1
        elif line.strip():
            current.append((k + 1, line))
            k += 1
            continue
        if current:
            out.append((current[0][0], "\n".join(t for _, t in current)))
            current = []
        k += 1
    if current:
        out.append((current[0][0], "\n".join(t for _, t in current)))
    return out


def uncited_figures(chapter: str, chapter_text: str, notebooks: Path, root: Path = ROOT) -> list[str]:
    """Every figure outside the tagged blocks that no cell or results file its paragraph cites prints, and that
    ``NOT_MEASURED`` does not list."""
    nb = notebooks / APPENDICES.get(chapter, chapter).replace(".md", ".ipynb")
    cells = {c.get("id") for c in json.loads(nb.read_text())["cells"]}
    problems = []
    for line, text in paragraphs(chapter_text):
        prose = SETTING.sub(" ", SECTION_NUMBER.sub(" ", NOT_PROSE.sub(" ", LINK_TARGET.sub("", text))))
        quoted = [n for key, n in measured_figures(prose) if key not in NOT_MEASURED[chapter]]
        if not quoted:
            continue
        cited = [c for c in dict.fromkeys(CODE_SPAN.findall(text)) if c in cells]
        files = list(dict.fromkeys(RESULTS.findall(text)))
        shown = printed(cell_outputs(nb, cited)) if cited else set()
        for f in files:
            shown |= printed((root / f).read_text()) if (root / f).is_file() else set()
        sources = ", ".join([f"`{c}`" for c in cited] + files) or "no cell"
        problems += [f"line {line}: {q} is not printed by what its paragraph cites ({sources})"
                     for q in dict.fromkeys(quoted) if q not in shown]
    return problems


def slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def appendix_problems(appendix: str, appendix_text: str, chapter_text: str) -> list[str]:
    """Each part (``## `` heading) of an appendix that its chapter does not link, and each link from the chapter into
    the appendix whose anchor is no heading there."""
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", appendix_text, re.M)}
    parts = [slug(h) for h in re.findall(r"^## (.+)$", appendix_text, re.M)]
    linked = set(re.findall(rf"\]\({re.escape(appendix)}#([\w-]+)\)", chapter_text))
    return ([f"part #{a} is not linked from the chapter" for a in parts if a not in linked]
            + [f"the chapter links #{a}, which is no heading of {appendix}" for a in sorted(linked - anchors)])


@pytest.mark.parametrize("appendix", sorted(APPENDICES), ids=[a.removesuffix(".md") for a in sorted(APPENDICES)])
def test_every_part_of_an_appendix_is_linked_from_its_chapter(appendix):
    text = (ROOT / "chapters" / appendix).read_text()
    chapter = (ROOT / "chapters" / APPENDICES[appendix]).read_text()
    assert len(re.findall(r"^## ", text, re.M)) >= 5  # the parts were read
    problems = appendix_problems(appendix, text, chapter)
    assert not problems, f"{appendix} and {APPENDICES[appendix]}:\n" + "\n".join(problems)
    # the check catches a part nobody links and a link to a part that is gone
    first = re.search(r"^## (.+)$", text, re.M).group(1)
    unlinked = chapter.replace(f"]({appendix}#{slug(first)})", "](elsewhere.md)")
    assert f"part #{slug(first)} is not linked from the chapter" in appendix_problems(appendix, text, unlinked)
    renamed = text.replace(f"## {first}\n", "## Renamed\n", 1)
    assert f"the chapter links #{slug(first)}, which is no heading of {appendix}" in appendix_problems(
        appendix, renamed, chapter)


BOOK = sorted(COURSE) + sorted(APPENDICES)


@pytest.mark.parametrize("chapter", BOOK, ids=[c.removesuffix(".md") for c in BOOK])
def test_every_figure_is_printed_by_the_cell_it_cites(chapter):
    missing = uncited_figures(chapter, (ROOT / "chapters" / chapter).read_text(), ROOT / "notebooks")
    assert not missing, (f"{chapter} quotes figures that no cell or results file cited in their paragraph prints "
                         f"(cite it by its id, tag the block, or list a citation in NOT_MEASURED):\n"
                         + "\n".join(missing))


def test_the_figure_check_catches_a_figure_from_nowhere_and_one_its_paragraph_does_not_cite():
    chapter = "03_fsdp_in_practice.md"
    text, nbs = (ROOT / "chapters" / chapter).read_text(), ROOT / "notebooks"
    assert uncited_figures(chapter, text, nbs) == []
    lines = len(text.splitlines())
    planted = text + "\nThe job ran at 12,345.6 tokens/s on a quiet afternoon.\n"
    assert uncited_figures(chapter, planted, nbs) == [
        f"line {lines + 2}: 12345.6 is not printed by what its paragraph cites (no cell)"]
    # 29,573 tokens/s is printed by cell mfu33, not by prof33time: citing the wrong cell fails, the right one passes
    said = "\n\nThe main run's median was 29,573 tokens/s (cell `{}`).\n"
    assert uncited_figures(chapter, text + said.format("prof33time"), nbs) == [
        f"line {lines + 3}: 29573 is not printed by what its paragraph cites (`prof33time`)"]
    assert uncited_figures(chapter, text + said.format("mfu33"), nbs) == []
    # whole numbers with a unit, and durations in words, are figures too
    assert [p.split(": ")[1].split()[0] for p in uncited_figures(
        chapter, text + "\nThe cell takes 16 minutes, the notebook about two minutes.\n", nbs)] == ["16", "2"]
    # section numbers, task names and worked questions at scale are not looked up
    assert uncited_figures(chapter, text + "\nSee chapter 4.4 and task 2.1a.\n", nbs) == []
    worked = text + "\n1. **At scale.** A 7B model holds 112 GB at 16 bytes per parameter.\n"
    assert uncited_figures(chapter, worked, nbs) == []


def campaign_claims(chapter_text: str, campaign_md: str, merged: dict) -> list[str]:
    """What chapter 6's campaign paragraph and the campaign file say that the merged record does not."""
    wrong = []
    name = merged["impl"].upper()
    first, last = merged["seeds"][0][0], merged["seeds"][-1][1]
    explained, unexplained = len(merged["explained"]), len(merged["unexplained"])
    said = f"{merged['programs']:,} {name} programs (seeds {first}-{last}"
    if said not in chapter_text:
        wrong.append(f"chapter 6 does not say {said!r}")
    elif merged["equal"] == merged["programs"]:
        if f"all {merged['programs']:,} equal" not in chapter_text:
            wrong.append(f"chapter 6 does not say all {merged['programs']:,} {name} programs are equal")
    else:
        for words in (f"{merged['equal']:,} equal to torch's bit for bit",
                      f"{explained:,} that differ only where", f"{unexplained:,} unexplained when"):
            if words not in chapter_text:
                wrong.append(f"chapter 6 does not say {words!r} of {name}")
    row = (f"| {merged['impl']} | {first}-{last} | {merged['programs']} | {merged['equal']} | {explained} | "
           f"{unexplained} | {merged['ran_every_step_on_both']} |")
    if row not in campaign_md:
        wrong.append(f"fuzz_campaign.md has no merged row {row!r}")
    return wrong


def _merged_records() -> list[dict]:
    out = []
    for path in sorted((ROOT / "chapters" / "results" / "fuzz").glob("*-*.json")):
        merged = json.loads(path.read_text())
        merged["seeds"] = [tuple(s) for s in merged["seeds"]] if isinstance(merged["seeds"][0], list) \
            else [tuple(merged["seeds"])]
        out.append(merged)
    return out


def test_the_campaign_numbers_in_chapter_6_are_the_merged_records():
    """A number in the book is the record's: chapter 6 and fuzz_campaign.md against the merged campaign files."""
    chapter = next((ROOT / "chapters").glob("06_*.md")).read_text()
    campaign_md = (ROOT / "chapters" / "results" / "fuzz_campaign.md").read_text()
    merged = _merged_records()
    assert sorted(m["impl"] for m in merged) == ["fsdp1", "fsdp2"]
    for m in merged:
        assert campaign_claims(chapter, campaign_md, m) == [], m["impl"]
    # and the check can fail: one number changed in the record
    changed = dict(merged[0], equal=merged[0]["equal"] - 1)
    assert campaign_claims(chapter, campaign_md, changed)
