"""The first picture a learner reads says what a step does: each core's step timeline against a recorded step.

The pictures: the FSDP1 core's (``minifsdp/fsdp/core/fsdp.py``, module docstring) and the FSDP2 core's
(``minifsdp/fsdp2/core/param_group.py``, module docstring).  Each is read into the list of events it draws, in
order: hooks (``pre x:``, ``post x:`` in the forward or the backward, ``final callback``) and what they do (``AG x``,
``prefetch AG x``, ``wait AG x``, ``copy-out x``, ``free x``, ``RS x``, ``queue the final callback``); text in
parentheses is what computes meanwhile, not an event, and any other word is refused.

Oracle: one spawn (2 ranks; TinyGPT, its two blocks wrapped and the root around them; FULL_SHARD and fully_shard,
BACKWARD_PRE, on CPU; two steps with an optimizer step between) records every hook and collective of ours and,
in the same run, of torch FSDP1 and torch's ``fully_shard`` (``tests/_workers_step_picture.py``).  Exact: the
picture is the recorded sequence, on each rank, at each step; ours is torch's (FSDP1: without our waits, since
torch gathers synchronously on a CPU and so has none; FSDP2: event for event, copy-outs included).  A picture
with two lines swapped fails (checked below for every pair of neighbouring lines).
"""

import ast
import re
from pathlib import Path

import pytest

import minifsdp
from tests import _workers_step_picture as W

ROOT = Path(__file__).resolve().parent.parent
PICTURES = {"fsdp1": ROOT / "minifsdp" / "fsdp" / "core" / "fsdp.py",
            "fsdp2": ROOT / "minifsdp" / "fsdp2" / "core" / "param_group.py"}
SECTIONS = ("forward", "backward", "end")
HOOKS = {("forward", "pre"): "pre-forward", ("forward", "post"): "post-forward",
         ("backward", "pre"): "pre-backward", ("backward", "post"): "post-backward", ("end", "post"): "post-backward"}
ACTION = re.compile(r"(prefetch AG|wait AG|AG|copy-out|free|RS) (\w+)")
# a collective and its completion drawn as one event when nothing comes between them
DONE = {"AG": ("wait AG", "copy-out"), "RS": ("wait RS",)}


def picture_lines(path: Path) -> list[str]:
    """The timeline in ``path``'s module docstring: from the line that starts with ``forward`` to a blank line."""
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False).splitlines()
    starts = [k for k, line in enumerate(doc) if re.match(r"    forward +\S", line)]
    assert len(starts) == 1, f"{path.name}: {len(starts)} timelines"
    lines = []
    for line in doc[starts[0]:]:
        if not line.strip():
            break
        lines.append(line)
    return lines


def drawn(lines: list[str]) -> list[tuple]:
    """The events the picture's ``lines`` draw, in order."""
    events, section = [], None
    for line in lines:
        head = line[:14].strip()
        if head:
            if head not in SECTIONS:
                raise ValueError(f"not a section of the step: {head!r}")
            section = head
        elif section is None:
            raise ValueError(f"a continuation before any section: {line!r}")
        text, before = line[14:], None
        while text != before:  # comments in parentheses, nested ones too
            before, text = text, re.sub(r"\([^()]*\)", "", text)
        if "(" in text or ")" in text:
            raise ValueError(f"unbalanced parentheses: {line!r}")
        for segment in filter(None, (s.strip() for s in text.split("|"))):
            hook = re.fullmatch(r"(pre|post) (\w+)(?::(.*))?", segment)
            final = re.fullmatch(r"final callback(?::(.*))?", segment)
            if hook:
                if (section, hook[1]) not in HOOKS:
                    raise ValueError(f"no {hook[1]} hook in the {section}: {segment!r}")
                events.append((HOOKS[section, hook[1]], hook[2]))
                actions = hook[3]
            elif final:
                events.append(("final callback",))
                actions = final[1]
            else:
                actions = segment
            for action in filter(None, (a.strip() for a in (actions or "").split(","))):
                if action == "queue the final callback":
                    events.append((action,))
                elif m := ACTION.fullmatch(action):
                    events.append((m[1], m[2]))
                else:
                    raise ValueError(f"not an event of the step: {action!r}")
    return events


def as_drawn(recorded: list[tuple]) -> list[tuple]:
    """The recorded events as the picture draws them: a collective with its completion right after it is one event;
    an all-gather whose completion comes later (in another hook) is a prefetch."""
    out, k = [], 0
    while k < len(recorded):
        event, after = recorded[k], recorded[k + 1] if k + 1 < len(recorded) else None
        if event[0] in DONE and after is not None and after[0] in DONE[event[0]] and after[1] == event[1]:
            out.append(tuple(event))
            k += 2
            continue
        out.append(("prefetch AG", event[1]) if event[0] == "AG" else tuple(event))
        k += 1
    return out


@pytest.fixture(scope="module")
def steps():
    return minifsdp.spawn(W.both_steps, world_size=2, timeout_s=300)


def _each_step(steps, impl, side):
    runs = [(rank, k, events) for rank, res in enumerate(steps) for k, events in enumerate(res[impl][side])]
    assert len(runs) == 2 * W.STEPS, len(runs)
    return runs


@pytest.mark.parametrize("impl", ["fsdp1", "fsdp2"])
def test_the_step_picture_is_the_recorded_step(steps, impl):
    picture = drawn(picture_lines(PICTURES[impl]))
    assert len(picture) > 20, picture
    for rank, k, events in _each_step(steps, impl, "ours"):
        assert picture == as_drawn(events), (f"{PICTURES[impl].name}'s timeline is not rank {rank}'s step {k}:\n"
                                             f"drawn    {picture}\nrecorded {as_drawn(events)}")


def test_fsdp1_step_is_torchs(steps):
    """torch FSDP1 on a CPU gathers synchronously: no wait, and a prefetch is an all-gather its _prefetch_handle
    issued.  Ours without its waits, a prefetch marked the same way, is torch's list."""
    for (rank, k, ours), (_, _, theirs) in zip(_each_step(steps, "fsdp1", "ours"), _each_step(steps, "fsdp1", "torch"),
                                               strict=True):
        mine = [("AG", e[1], "prefetch") if e[0] == "prefetch AG" else e for e in as_drawn(ours) if e[0] != "wait AG"]
        assert mine == [tuple(e) for e in theirs], f"rank {rank} step {k}:\nours  {mine}\ntorch {theirs}"
        assert any(len(e) == 3 for e in theirs), theirs  # torch's prefetches were seen


def test_fsdp2_step_is_torchs(steps):
    for (rank, k, ours), (_, _, theirs) in zip(_each_step(steps, "fsdp2", "ours"), _each_step(steps, "fsdp2", "torch"),
                                               strict=True):
        assert [tuple(e) for e in ours] == [tuple(e) for e in theirs], f"rank {rank} step {k}:\n{ours}\n{theirs}"


@pytest.mark.parametrize("impl", ["fsdp1", "fsdp2"])
def test_a_picture_with_two_lines_swapped_fails(steps, impl):
    """The check can fail: every swap of two neighbouring lines of the timeline is caught."""
    lines, recorded = picture_lines(PICTURES[impl]), as_drawn(steps[0][impl]["ours"][0])
    assert len(lines) >= 4
    for k in range(len(lines) - 1):
        swapped = lines[:k] + [lines[k + 1], lines[k]] + lines[k + 2:]
        try:
            assert drawn(swapped) != recorded, f"lines {k} and {k + 1} swapped still match"
        except ValueError:
            pass  # unreadable is caught too


def test_the_picture_reader_refuses_words_it_does_not_know():
    assert drawn(["    forward   pre a: AG a (runs) | post a: free a"]) == [("pre-forward", "a"), ("AG", "a"),
                                                                          ("post-forward", "a"), ("free", "a")]
    for bad in ["    forward   pre a: gather a", "    backward  pre a: AG a, then b", "    forward   (a",
                "              pre a: AG a", "    step      post a", "    forward   final b"]:
        with pytest.raises(ValueError):
            drawn([bad])
