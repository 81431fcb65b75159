"""The book keeps its word: a number a chapter quotes from a notebook is in that notebook's committed output.

A chapter tags the block (a paragraph, a table, a code block: the lines up to the next blank line,
or the whole fenced block) whose figures come from a notebook, on the line just before it:

    <!-- numbers: 02_fsdp_core.ipynb#73d474e7 -->            one cell, by its id
    <!-- numbers: 02_fsdp_core.ipynb#73d474e7,2db51567 -->   any of several cells
    | peak KiB per rank | N = 2 ours | ...

Every decimal number in the block (``1982.4``, ``1.03x``, ``49.8%``, ``169,088``: a figure with a
decimal point, a thousands separator or an ``x``/``%`` suffix) must appear among the numbers that the
named cells printed in the committed notebook.  Plain small integers ("2 ranks", "step 3") are prose,
not measurements, and are not checked, except in a block that quotes no other figure (a table of
counts): there every whole number of two or more digits is checked.  Commas are ignored on both sides
(``169,088`` = ``169088``).

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


def whole_numbers(text: str) -> list[str]:
    """Whole numbers of two or more digits: what a tagged block of counts only (a table of 366, 66, 43) quotes."""
    return [m.group(0) for m in re.finditer(r"(?<![\w.])\d{2,}(?![\w.])", text)]


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
        quoted = figures(block) or whole_numbers(block)
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


# ---------------------------------------------------------------------------------------------------------------
# A section of the book is a course section.
#
# The chapters below are written as a course, section by section.
COURSE = {
    "01_parallel_training_overview.md": ["1"],
    "02_fsdp_core.md": ["2.1", "2.2", "2.3", "2.4", "2.5"],
    "03_fsdp_in_practice.md": ["3.1", "3.2", "3.3"],
    "04_advanced_topics.md": ["4.1", "4.2", "4.3", "4.4"],
    "05_fsdp_future.md": ["5.1", "5.2", "5.3"],
}

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
    assert tasks["1"] == ["task1_1"]
    assert tasks["3"] == ["task3_1", "task3_2a", "task3_2b", "task3_3"]
    assert tasks["4"] == ["task4_1a", "task4_1b", "task4_2", "task4_3a", "task4_3b", "task4_4a", "task4_4b"]
    assert tasks["5"] == ["task5_1", "task5_2"]
    assert tasks["2"][:3] == ["task2_1a", "task2_1b", "task2_1c"] and "task2_5b" in tasks["2"]


def test_the_book_does_not_tell_its_own_history():
    """The chapters speak of FSDP, not of this book's earlier versions (a fault that teaches is planted on purpose)."""
    past = re.compile(r"earlier version|used to (?:be|raise|say|post|hold)|as it was\b|ours used to|"
                      r"an? (?:earlier|previous|older) (?:draft|edition)", re.I)
    found = [f"{name}: {m.group(0)!r}" for name in sorted(COURSE)
             for m in past.finditer((ROOT / "chapters" / name).read_text())]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------------------------------------------
# Every figure a course chapter quotes is printed by a committed cell, or is listed here as not measured.
#
# Tagged blocks name their cells (above).  Outside them, a figure (as ``figures`` finds them) must be among the
# numbers that the chapter's own notebook printed, or in NOT_MEASURED with what it is: a citation, the source's
# own claim, or a setting the text states (a learning rate, a model size).  Not figures: fenced code (the source's
# snippets, commands), arXiv ids and addresses, and bare section numbers such as 2.3 or 4.4 (one digit, a point,
# one digit from 1 to 5, nothing but a sentence's full stop after it: "chapter 4.4", "task 2.1a").
NOT_MEASURED = {
    "01_parallel_training_overview.md": {"0.25": "a setting: notebook §3c's bucket_cap_mb"},
    "02_fsdp_core.md": {
        "0.8": "a setting: GPTConfig.small's size (0.8 M parameters)",
        "1.01": "a test's bound: tests/test_memory_vs_torch.py asserts ours <= 1.01x torch's",
        "1.5": "ZeRO's accounting (Rajbhandari et al.): stage 3 moves 3Ψ against DDP's 2Ψ",
        "60": "the source's table (checkpointing: 60% saved)", "30": "the source's table (+30% compute time)",
        "50": "the source's table (mixed precision: 50% saved)", "15": "the source's table (+15% throughput)",
    },
    "03_fsdp_in_practice.md": {
        "0.2": "a setting: --model mini's size (GPTConfig.mini, 210,304 parameters)",
        "0.8": "settings: --model small's size (GPTConfig.small), generate's default --temperature",
        "0.5": "a setting: the plateau schedule's factor (train.PLATEAU)",
    },
    "04_advanced_topics.md": {
        "4.2": "the source's table (FP16+FP32: 4.2 GB)", "70": "the source's claim (+70% throughput)",
        "312": "NVIDIA A100 datasheet", "19.5": "NVIDIA A100 datasheet",
        "22.7": "all-MiniLM-L6-v2's size, printed as 22,713,216 parameters",
        "0.8": "a setting: GPTConfig.small's size",
    },
    "05_fsdp_future.md": {
        "1.21": "the source's go.mod", "28.54": "SimpleFSDP paper (arXiv:2411.00284)",
        "68.67": "SimpleFSDP paper (arXiv:2411.00284)", "50257": "GPT-2's vocabulary size",
    },
}
SECTION_NUMBER = re.compile(r"(?<![\w.])[1-5]\.[1-5](?:[a-c](?:-[a-c])?)?(?!\w|\.\d|%)")
NOT_PROSE = re.compile(r"```.*?```|arXiv:\S+|https?://\S+|pytorch/pytorch#\d+", re.S)


def untagged_text(chapter_text: str) -> str:
    """The chapter without its tagged blocks, fenced code, addresses and section numbers."""
    for _, _, _, block in tagged_blocks(chapter_text) + tagged_blocks(chapter_text, QUOTE_TAG):
        chapter_text = chapter_text.replace(block, "", 1)
    return SECTION_NUMBER.sub(" ", NOT_PROSE.sub(" ", chapter_text))


def unprinted_figures(chapter: str, chapter_text: str, notebooks: Path) -> list[str]:
    nb = notebooks / chapter.replace(".md", ".ipynb")
    cells = [c.get("id") for c in json.loads(nb.read_text())["cells"]]
    shown = printed(cell_outputs(nb, cells))
    quoted = figures(untagged_text(chapter_text))
    return sorted({f for f in quoted if f not in shown and f not in NOT_MEASURED[chapter]})


@pytest.mark.parametrize("chapter", sorted(COURSE), ids=[c.removesuffix(".md") for c in sorted(COURSE)])
def test_every_figure_is_printed_or_cited(chapter):
    missing = unprinted_figures(chapter, (ROOT / "chapters" / chapter).read_text(), ROOT / "notebooks")
    assert not missing, (f"{chapter} quotes figures that no committed cell of its notebook prints and NOT_MEASURED "
                         f"does not list: {missing}")


def test_the_figure_check_catches_a_figure_from_nowhere():
    chapter = "03_fsdp_in_practice.md"
    text = (ROOT / "chapters" / chapter).read_text()
    assert unprinted_figures(chapter, text, ROOT / "notebooks") == []
    planted = text + "\nThe job ran at 12,345.6 tokens/s on a quiet afternoon.\n"
    assert unprinted_figures(chapter, planted, ROOT / "notebooks") == ["12345.6"]
    assert unprinted_figures(chapter, text + "\nSee chapter 4.4 and task 2.1a.\n", ROOT / "notebooks") == []
