"""The route tool counts what it says: the turns one traced FSDP1 step takes through the core's files.

Oracle: the tool itself on a planted call chain whose route is known by construction (two small files, calls
that cross between them a counted number of times), then on the real step (2 ranks, TinyGPT, FULL_SHARD), where
the numbers it prints must be the route's own.  Exact; no tolerance.
"""

import importlib
import re
import sys
from pathlib import Path

from minifsdp.pictures.route import Route, step_route, trace


def test_the_tool_counts_a_planted_extra_hop(tmp_path, monkeypatch):
    (tmp_path / "route_a.py").write_text(
        "import route_b\n"
        "def start(hop):\n    helper()\n    route_b.middle(hop)\n    return end()\n"
        "def helper():\n    return [x for x in range(2)]\n"
        "def end():\n    return route_b.last()\n"
        "def back():\n    return route_b.detour()\n")
    (tmp_path / "route_b.py").write_text(
        "import route_a\n"
        "def middle(hop):\n    return route_a.back() if hop else None\n"
        "def last():\n    return 2\n"
        "def detour():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a = importlib.import_module("route_a")
    files = [tmp_path / "route_a.py", tmp_path / "route_b.py"]
    try:
        plain = trace(lambda: a.start(False), files)
        hop = trace(lambda: a.start(True), files)
    finally:
        sys.modules.pop("route_a"), sys.modules.pop("route_b")
    # a.start, a.helper (its list comprehension is not a stop), b.middle, a.end, b.last
    assert plain.stops == [("route_a.py", "start"), ("route_a.py", "helper"), ("route_b.py", "middle"),
                           ("route_a.py", "end"), ("route_b.py", "last")]
    assert [f for f, _ in plain.visits] == ["route_a.py", "route_b.py", "route_a.py", "route_b.py"]
    assert plain.switches == 3
    # the planted hop: b.middle calls back into a, which calls b again, before a.end: two more turns
    assert hop.stops[3:5] == [("route_a.py", "back"), ("route_b.py", "detour")]
    assert hop.switches == plain.switches + 2
    assert Route([]).switches == 0


def test_the_step_route_prints_its_own_count():
    route = step_route()
    text = route.text()
    lines = text.splitlines()
    assert len(lines) == len(route.visits) + 2
    assert lines[-2].endswith(f"{len(route.visits)} visits, {route.switches} file switches")
    assert route.switches == len(route.visits) - 1
    stops = [fn for line in lines[:-2] for fn in line[26:].split(", ")]
    assert stops == [fn for _, fn in route.stops]
    # the step's phases, in the order it runs them
    names = [fn for _, fn in route.stops]
    phases = ["FullyShardedDataParallel.__init__", "FullyShardedDataParallel._pre_forward",
              "FullyShardedDataParallel._pre_backward_hook", "FullyShardedDataParallel._post_backward_hook",
              "FullyShardedDataParallel._post_backward_final_callback"]
    assert [names.index(p) for p in phases] == sorted(names.index(p) for p in phases)
    # chapter 2's reading guide quotes the count: it stays the tool's
    chapter = (Path(__file__).resolve().parents[1] / "chapters" / "02_fsdp_core.md").read_text()
    quoted = re.findall(r"`python -m minifsdp route` prints the route.*?: (\d+) file switches", chapter, re.S)
    assert quoted == [str(route.switches)], (quoted, route.switches)
    # and the files it quotes, visit by visit
    told = re.search(r"File by file, (.*?) \(the end\)", chapter, re.S)
    assert told and re.findall(r"`(\w+)`", told.group(1)) == [f.removesuffix(".py") for f, _ in route.visits]
