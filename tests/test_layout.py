"""The package's shape: chapters as subpackages, imports that run one way, modules a student can read.

Read from the source files (``ast``), not by importing them, so a cycle that Python
happens to tolerate today (a late import, an attribute looked up at call time) is
still caught.
"""

import ast
import io
import json
import re
import tokenize
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "minifsdp"

# Lower layers first.  A module may import its own layer or a lower one, never a higher one.
# comm sits below ddp although chapter 2.2 comes after chapter 1: DDP and FSDP both send their
# gradients through it, so it is the foundation the two build on.
LAYERS = {
    "minifsdp.launch": 0, "minifsdp.models": 0, "minifsdp.notebook": 0, "minifsdp.learner": 0,
    "minifsdp.comm": 1,
    "minifsdp.ddp": 2,
    "minifsdp.fsdp": 3, "minifsdp.memory": 3, "minifsdp.parallel": 3,
    "minifsdp.checkpoint": 4, "minifsdp.fsdp2": 4,
    # the programs around the book, each room named for what it holds
    "minifsdp.pictures": 5, "minifsdp.cells": 5, "minifsdp.fuzz": 5,
    "minifsdp.training": 6, "minifsdp.explorers": 6,
    "minifsdp.bench": 7, "minifsdp.classroom": 7,
    "minifsdp.commands": 8,
    "minifsdp.__main__": 9, "minifsdp": 9,
}
# the programs may import lazily (the command line's start-up time: a command imports only what it runs)
LOCAL_IMPORTS_ALLOWED = ("minifsdp.commands", "minifsdp.training", "minifsdp.bench", "minifsdp.classroom",
                         "minifsdp.pictures")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str, imported: str | None) -> str | None:
    """``from name import imported``: the module it names, if that module is ours."""
    if imported is not None and f"{name}.{imported}" in MODULES:
        return f"{name}.{imported}"
    return name if name in MODULES else None


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level imports, imports inside a function or class) of minifsdp modules."""
    return _imports_of(path.read_text())


def _imports_of(source: str) -> tuple[set[str], set[str]]:
    top, local = set(), set()
    tree = ast.parse(source)
    top_nodes = set(map(id, tree.body))

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [_resolve(node.module, a.name) for a in node.names]
        targets = {t for t in targets if t}
        (top if id(node) in top_nodes else local).update(targets)
    return top, local


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def test_the_graph_was_read():
    """A guard for the checks below: they would pass vacuously on an empty graph."""
    assert len(MODULES) > 40
    assert "minifsdp.fsdp.core.handle" in GRAPH["minifsdp.fsdp.core.fsdp"][0]
    assert "minifsdp.fsdp.core.units" in GRAPH["minifsdp.fsdp.fully_sharded"][0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: its strongly connected components of more than one node (Tarjan), each
    sorted; a node that imports itself is no circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    """No circle among the package's modules, counting an import inside a function as an import: a lazy import
    still means the module needs the other one, and DESIGN.md forbids one made to dodge a circle."""
    edges = {m: top | local for m, (top, local) in GRAPH.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_circle_made_of_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a", "b"}, "b": set()}) == []
    top, local = _imports_of("import minifsdp.launch\ndef f():\n    from minifsdp.models import TinyGPT\n")
    assert (top, local) == ({"minifsdp.launch"}, {"minifsdp.models"})


def _room(module: str) -> str:
    """The top-level room a module lives in (``minifsdp.fsdp.core.handle`` -> ``fsdp``); a module at the top of
    the package is a room of its own."""
    return module.split(".")[1] if module.count(".") else "(top)"


def test_rooms_import_one_way():
    """Between the package's top-level rooms, imports run one way (a room may import itself)."""
    edges: dict[str, set[str]] = {}
    for m, (top, local) in GRAPH.items():
        edges.setdefault(_room(m), set()).update(_room(t) for t in top | local if _room(t) != _room(m))
    cycles = _cycles(edges)
    assert not cycles, "rooms that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


ROOM_SHARE = 0.25  # no top-level room over a quarter of the package: its name must say what it holds


def _room_lines() -> dict[str, int]:
    """Lines of ``.py`` per top-level folder of ``minifsdp/`` (the modules at the top together as ``(top)``)."""
    lines: dict[str, int] = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG).parts
        room = parts[0] if len(parts) > 1 else "(top)"
        lines[room] = lines.get(room, 0) + len(path.read_text().splitlines())
    return lines


def test_no_room_holds_over_a_quarter_of_the_package():
    lines = _room_lines()
    total = sum(lines.values())
    assert total > 20_000 and len(lines) >= 10, lines  # the package was read
    big = {room: f"{n / total:.0%}" for room, n in lines.items() if n > ROOM_SHARE * total}
    assert not big, f"rooms over {ROOM_SHARE:.0%} of minifsdp's {total} lines: {big}"


def test_every_room_says_what_it_holds_and_which_chapters_it_serves():
    """Each top-level folder of code is a package whose ``__init__`` docstring names a chapter of the book."""
    chapters = {p.name for p in (PKG.parent / "chapters").glob("*.md")}
    bad = []
    for folder in sorted(p for p in PKG.iterdir() if p.is_dir() and any(p.rglob("*.py"))):
        init = folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.is_file() else None
        if not doc:
            bad.append(f"minifsdp/{folder.name}/ has no __init__.py docstring")
        elif not re.search(r"\b(?:ch(?:apters?)?\.? ?\d|[0-6]\d_\w+\.md)", doc, re.I):
            bad.append(f"minifsdp/{folder.name}/__init__.py names no chapter")
    assert not bad, bad
    assert len(chapters) >= 6


def test_no_function_local_imports_of_our_modules_outside_the_programs():
    offenders = [f"{m} imports {sorted(local)} inside a function" for m, (_, local) in GRAPH.items()
                 if local and not m.startswith(LOCAL_IMPORTS_ALLOWED)]
    assert not offenders, "\n".join(offenders)


def test_imports_never_climb_to_a_higher_layer():
    bad = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
           for m, (top, local) in GRAPH.items() for t in top | local if _layer(t) > _layer(m)]
    assert not bad, "\n".join(bad)


def test_chapter_subpackages_exist_and_the_top_stays_small():
    for pkg in ("comm", "ddp", "fsdp", "memory", "parallel", "checkpoint", "fsdp2", "commands", "training", "bench",
                "classroom", "pictures", "cells"):
        assert (PKG / pkg / "__init__.py").is_file(), f"minifsdp/{pkg}/ is not a package"
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, f"{len(top)} modules at the top of minifsdp/: {top}"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_every_module_starts_with_a_docstring():
    missing = [m for m, p in MODULES.items()
               if m != "minifsdp.__main__" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing


def test_every_public_name_is_importable_from_the_top():
    import minifsdp

    missing = [n for n in minifsdp.__all__ if not hasattr(minifsdp, n)]
    assert not missing and len(minifsdp.__all__) >= 34, missing


# ----------------------------------------------------------------------------- the core a learner reads
CORE = "minifsdp.fsdp.core"
CORE_DIR = PKG / "fsdp" / "core"
CORE_MAY_IMPORT = (CORE, "minifsdp.comm", "minifsdp.launch", "minifsdp.models")
CORE_BUDGET = 1600  # lines, docstrings included: what a learner reads in one sitting
CORE_PROSE = 0.40  # the share of them that should explain (docstring lines, comment-only lines)
CORE_PROSE_FLOOR = 0.413  # the share they do today, counted strictly: it may rise, never fall
# torch FSDP1's corner cases live in minifsdp/fsdp/ and plug in through core/extension.py; the core names none
CORNER_CASES = ("use_orig_params", "orig_param", "ignored", "_module_classes_to_ignore", "align", "tracer",
                "param_init_fn", "sync_module_states", "cpu_offload", "device_mesh")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _core_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(CORE_DIR.glob("*.py"))}


def test_the_core_imports_only_core_comm_launch_and_models():
    core = [m for m in MODULES if _in(m, [CORE])]
    assert len(core) >= 10, core
    bad = [f"{m} imports {t}" for m in core for t in GRAPH[m][0] | GRAPH[m][1] if not _in(t, CORE_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_the_core_fits_its_line_budget():
    lines = {name: len(src.splitlines()) for name, src in _core_sources().items()}
    assert sum(lines.values()) <= CORE_BUDGET, (sum(lines.values()), lines)


def _prose_lines(src: str) -> set[int]:
    """The line numbers of a module that explain: inside a docstring (module, class, function), or holding
    only a comment.  A line of code with a comment after it is code: it counts as a line, not as prose."""
    lines, text = set(), src.splitlines()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT and text[tok.start[0] - 1].lstrip().startswith("#"):
            lines.add(tok.start[0])
    return lines


def _prose_share(sources) -> float:
    total = sum(len(src.splitlines()) for src in sources)
    return sum(len(_prose_lines(src)) for src in sources) / max(total, 1)


def test_the_core_is_at_least_40_percent_prose():
    """Why each step happens is part of the algorithm a learner reads: docstrings and comments, counted."""
    share = _prose_share(_core_sources().values())
    assert share >= CORE_PROSE, f"fsdp/core is {share:.1%} docstrings and comments, under {CORE_PROSE:.0%}"


def test_the_core_never_loses_prose():
    """Past its 40%, the core's share of explanation only goes up: code added brings its explanation."""
    share = _prose_share(_core_sources().values())
    assert share >= CORE_PROSE_FLOOR, f"fsdp/core is {share:.1%} docstrings and comments, under {CORE_PROSE_FLOOR:.1%}"


def test_the_prose_count_sees_code_without_prose():
    """The count above can fail: bare code is 0% prose, a docstring and a comment line are counted; a string
    is not, nor a line of code with a comment after it."""
    assert _prose_share(["x = 1\ny = 'not a docstring'\n"]) == 0
    assert _prose_share(["x = 1  # a trailing comment\ny = 2  # another\n"]) == 0
    assert _prose_share(['"""What and why."""\n\n# why x\nx = 1  # a comment\ny = 2\n']) == 2 / 5
    assert _prose_share(['def f():\n    """Doc,\n    two lines."""\n    return 1\n']) == 2 / 4


def test_the_reading_order_the_core_states_is_true():
    """The core's ``__init__`` lists its modules in reading order, the idea (``flat_param.py``, which imports no
    other core module) first, then the step (``fsdp.py``); after the idea, each module imports only the modules
    listed below it (and the idea), so every name a file uses is explained further up or further down."""
    doc = ast.get_docstring(ast.parse((CORE_DIR / "__init__.py").read_text()))
    order = [line.split()[0][:-3] for line in doc.splitlines() if line.startswith("    ") and
             line.split()[0].endswith(".py")]
    on_disk = sorted(p.stem for p in CORE_DIR.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == on_disk and len(order) == len(set(order)), (order, on_disk)
    assert order[:2] == ["flat_param", "fsdp"], order
    for i, name in enumerate(order):
        below = {f"{CORE}.{n}" for n in order[i + 1:]} | ({f"{CORE}.{order[0]}"} if i else set())
        inside = {t for t in GRAPH[f"{CORE}.{name}"][0] if _in(t, [CORE]) and t != CORE}
        assert inside <= below, f"{name} imports {sorted(inside - below)}, listed above it"


def _strategy_names(src: str) -> list[str]:
    """Where code (not prose) names a ShardingStrategy member: ``ShardingStrategy.NO_SHARD``, a bare name, a string."""
    tree = ast.parse(src)
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)}
    found = []
    for node in ast.walk(tree):
        name = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                else node.value if isinstance(node, ast.Constant) and id(node) not in docs else None)
        if isinstance(name, str) and name in STRATEGIES:
            found.append(f"line {node.lineno}: {name}")
    return found


def test_the_step_never_branches_on_a_strategy_name():
    """A strategy is data: only ``strategy.py`` (the plan's own module) names ShardingStrategy's members."""
    named = {name: found for name, src in _core_sources().items()
             if name != "strategy.py" and (found := _strategy_names(src))}
    assert not named, named
    assert len(_strategy_names(_core_sources()["strategy.py"])) >= 5  # the scan sees the plans' own table


def test_the_strategy_scan_sees_a_branch_on_a_name():
    assert _strategy_names("if plan.strategy is ShardingStrategy.NO_SHARD:\n    pass\n") == ["line 1: NO_SHARD"]
    assert _strategy_names("free = name == 'FULL_SHARD'\n") == ["line 1: FULL_SHARD"]
    assert _strategy_names('"""FULL_SHARD frees after the forward."""\n') == []


def _corner_case_lines(sources: dict[str, str]) -> list[str]:
    return [f"{name}:{i}: {line.strip()}" for name, src in sources.items()
            for i, line in enumerate(src.splitlines(), 1) if any(w in line for w in CORNER_CASES)]


def test_the_core_names_none_of_torchs_corner_cases():
    """use_orig_params, ignored modules, alignment, the tracer, ...: in minifsdp/fsdp/ as extensions; one line
    of the core may say where they live."""
    lines = _corner_case_lines(_core_sources())
    assert len(lines) <= 1, "\n".join(lines)
    assert _corner_case_lines({"x.py": "if unit.use_orig_params:\n    keep = not ignored\n"}) == [
        "x.py:1: if unit.use_orig_params:", "x.py:2: keep = not ignored"]


def _empty_functions(src: str) -> list[str]:
    """Functions whose body does nothing (a docstring, ``...``, ``pass``), outside a ``Protocol`` class."""
    tree, out = ast.parse(src), []
    protocols = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                 and any(getattr(b, "id", getattr(b, "attr", None)) == "Protocol" for b in c.bases) for f in c.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in protocols:
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if all(isinstance(s, ast.Pass) for s in body):
                out.append(f"{node.name} (line {node.lineno})")
    return out


def test_no_core_function_exists_only_to_be_overridden():
    """The step is never overridden: the public class composes extensions (core/extension.py), whose
    ``Protocol`` is the one place where a method may do nothing."""
    found = {name: f for name, src in _core_sources().items() if (f := _empty_functions(src))}
    assert not found, found
    assert _empty_functions("class H:\n    def after_forward(self): ...\n") == ["after_forward (line 2)"]
    assert _empty_functions("class E(Protocol):\n    def after_forward(self): ...\n") == []


def _readme_map() -> set[str]:
    """Every path the README's module map shows under ``minifsdp/``, from its indentation."""
    text = (PKG.parent / "README.md").read_text()
    block = text.split("```\nminifsdp/\n", 1)[1].split("```", 1)[0]
    paths, stack = set(), []  # stack: (indent, directory)
    for line in block.splitlines():
        stripped = line.lstrip()
        if not stripped:
            continue
        name, indent = stripped.split()[0], len(line) - len(stripped)
        if not (name.endswith(".py") or name.endswith("/")):
            continue  # a description's continuation line
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([d for _, d in stack] + [name.rstrip("/")])
        paths.add(path)
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
    return paths


def test_the_readme_map_names_every_module():
    shown = _readme_map()
    assert {"launch.py", "fsdp/core/handle.py", "commands/cli.py"} <= shown, sorted(shown)[:10]  # the tree was read
    modules = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    missing = sorted(modules - shown)
    assert not missing, f"modules the README's map does not name: {missing}"
    gone = sorted(p for p in shown if p.endswith(".py") and p not in modules)
    assert not gone, f"the README's map names modules that do not exist: {gone}"


ROOT = PKG.parent
_PATH = re.compile(r"(?<![\w/.])((?:minifsdp|tests|notebooks|exercises|chapters)/[\w./-]+"
                   r"\.(?:py|ipynb|md|json|txt|png|sh))(?:::(\w+))?")


def _named_paths(text: str) -> list[tuple[str, str | None]]:
    """Every repository file a text names (``tests/test_x.py`` or ``tests/test_x.py::test_y``)."""
    return [(m.group(1), m.group(2)) for m in _PATH.finditer(text)]


def _missing(text: str) -> list[str]:
    out = []
    for path, test in _named_paths(text):
        file = ROOT / path
        if not file.exists():
            out.append(path)
        elif test and not re.search(rf"^\s*(?:async )?def {test}\b", file.read_text(), re.M):
            out.append(f"{path}::{test}")
    return out


def _prose_files() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "chapters").glob("*.md"), *(ROOT / "exercises").rglob("*.md"),
                   *(ROOT / "notebooks").glob("*.ipynb")])


def _prose(file: Path) -> str:
    """A Markdown file's text; a notebook's Markdown cells (its code builds paths the regex cannot judge)."""
    if file.suffix != ".ipynb":
        return file.read_text()
    cells = json.loads(file.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_every_file_and_test_the_prose_names_exists():
    """Chapters, exercise texts and the README send the learner to files and tests: each must be there."""
    files = _prose_files()
    assert len(files) >= 13 and sum(len(_named_paths(_prose(f))) for f in files) > 50  # the texts were read
    missing = {str(f.relative_to(ROOT)): m for f in files if (m := _missing(_prose(f)))}
    assert not missing, f"paths named in the prose that do not exist (renamed or moved?): {missing}"


def test_the_path_check_catches_a_moved_file_and_a_renamed_test():
    assert _missing("read `minifsdp/fsdp/core/handle.py` and `tests/test_layout.py::test_no_import_cycles`") == []
    assert _missing("see tests/test_fsdp_hardening.py") == ["tests/test_fsdp_hardening.py"]
    assert _missing("see tests/test_layout.py::test_gone") == ["tests/test_layout.py::test_gone"]


def test_the_public_class_composes_and_overrides_no_step():
    """``minifsdp.FSDP`` adds torch's API as methods and the corner cases as extensions: it defines none of the
    core step's methods, and its ``__init__`` touches ``self`` only after the core's ``__init__``."""
    core = next(n for n in ast.parse((CORE_DIR / "fsdp.py").read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == "FullyShardedDataParallel")
    api = {"__init__", "state_dict", "clip_grad_norm_", "no_sync", "module", "flat_param", "is_root"}
    step = {f.name for f in core.body if isinstance(f, ast.FunctionDef)} - api
    assert {"forward", "_pre_forward", "_post_backward_hook", "_post_backward_final_callback"} <= step, step
    public = next(n for n in ast.parse((PKG / "fsdp" / "fully_sharded.py").read_text()).body
                  if isinstance(n, ast.ClassDef) and n.name == "FullyShardedDataParallel")
    overridden = {f.name for f in public.body if isinstance(f, ast.FunctionDef)} & step
    assert not overridden, f"minifsdp.FSDP overrides the core's step: {sorted(overridden)}"
    init = next(f for f in public.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    super_line = next(n.lineno for n in ast.walk(init) if isinstance(n, ast.Call)
                      and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__")
    early = [n.lineno for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "self" and n.lineno < super_line]
    assert not early, f"minifsdp.FSDP.__init__ uses self before the core's __init__ (lines {early})"


# ----------------------------------------------------------------------------- fully_shard's core (FSDP2)
FSDP2_CORE = "minifsdp.fsdp2.core"
FSDP2_CORE_DIR = PKG / "fsdp2" / "core"
FSDP2_CORE_MAY_IMPORT = (FSDP2_CORE, "minifsdp.comm", "minifsdp.launch", "minifsdp.models")
FSDP2_CORE_BUDGET = 1000  # lines, docstrings included
# torch's fully_shard options and methods that live above the core, in minifsdp/fsdp2/ (plugged in by core/plugin.py)
FSDP2_WIDER = re.compile(r"shard_placement_fn|offload|pin_memory|fsdp_(pre|post)_all_gather|all-gather extension"
                         r"|register_fsdp_forward_method|\bset_[a-z_]+\(?|HSDP|replicate|to_empty|meta.device"
                         r"|reshard_after_forward=\d|all_reduce_hook|FSDPModule|UnshardHandle", re.I)


def _fsdp2_core_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(FSDP2_CORE_DIR.glob("*.py"))}


def test_the_fsdp2_core_imports_nothing_above_it():
    core = [m for m in MODULES if _in(m, [FSDP2_CORE])]
    assert len(core) >= 7, core
    bad = [f"{m} imports {t}" for m in core for t in GRAPH[m][0] | GRAPH[m][1] if not _in(t, FSDP2_CORE_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_the_fsdp2_core_fits_its_line_budget():
    lines = {name: len(p.read_text().splitlines()) for name, p in _fsdp2_core_files().items()}
    assert sum(lines.values()) <= FSDP2_CORE_BUDGET, (sum(lines.values()), lines)


def test_the_fsdp2_core_reading_order_is_true():
    """``fsdp2/core/__init__.py`` lists every module once, in reading order; each imports only those above it."""
    doc = ast.get_docstring(ast.parse((FSDP2_CORE_DIR / "__init__.py").read_text()))
    order = [line.split()[0][:-3] for line in doc.splitlines() if line.startswith("    ") and
             line.split()[0].endswith(".py")]
    on_disk = sorted(n for n in _fsdp2_core_files() if n != "__init__")
    assert sorted(order) == on_disk and len(order) == len(set(order)), (order, on_disk)
    for i, name in enumerate(order):
        above = {f"{FSDP2_CORE}.{n}" for n in order[:i]}
        inside = {t for t in GRAPH[f"{FSDP2_CORE}.{name}"][0] if _in(t, [FSDP2_CORE]) and t != FSDP2_CORE}
        assert inside <= above, f"{name} imports {sorted(inside - above)}, listed below it"


def _wider_api_mentions(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if FSDP2_WIDER.search(line)]


def test_the_fsdp2_core_names_none_of_the_wider_api_but_in_one_line():
    """The core's text never names what sits above it, except one line of its ``__init__`` saying where it lives."""
    named = {name: _wider_api_mentions(p.read_text()) for name, p in _fsdp2_core_files().items()}
    pointer = named.pop("__init__")
    assert len(pointer) == 1 and "minifsdp/fsdp2/" in pointer[0], pointer
    assert not {k: v for k, v in named.items() if v}, named


def test_the_wider_api_check_sees_a_named_feature():
    """A guard for the check above: it must flag each feature's usual spelling, and pass plain core words."""
    for line in ["if offload_to_cpu:", "p.shard_placement_fn(param)", "model.set_requires_gradient_sync(False)",
                 "hasattr(local, 'fsdp_pre_all_gather')", "HSDP: all-reduce", "register_fsdp_forward_method(m, 'f')"]:
        assert _wider_api_mentions(line) == [line], line
    assert _wider_api_mentions("self.reshard_after_forward = True\nfoo.to_sharded()\nsettings the setters change") == []


def test_the_fsdp2_core_has_no_function_that_does_nothing_outside_its_protocol():
    """No hook exists only to be overridden: a function whose body is a docstring, ``pass`` or ``...`` may only be a
    method of a ``Protocol`` (the interface the layer above plugs in by)."""
    empty = []
    for name, path in _fsdp2_core_files().items():
        tree = ast.parse(path.read_text())
        protocols = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                     and any(getattr(b, "id", None) == "Protocol" for b in c.bases)
                     for f in c.body if isinstance(f, ast.FunctionDef)}
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or id(f) in protocols:
                continue
            body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if all(isinstance(s, ast.Pass) for s in body):
                empty.append(f"{name}.py:{f.lineno} {f.name}")
    assert not empty, empty
    assert any("class Plugin(Protocol)" in p.read_text() for p in _fsdp2_core_files().values())


def test_every_explorer_names_its_chapter_and_has_the_four_functions():
    """An explorer serves one section of the book: its docstring's first line names the chapter (and section), and
    it has ``compute`` (tested), ``panel``, ``fallback`` and ``show`` (what a notebook cell calls)."""
    explorers = {m: p for m, p in MODULES.items()
                 if m.startswith("minifsdp.explorers.") and m != "minifsdp.explorers.panel"}
    assert len(explorers) >= 3, sorted(explorers)
    bad = []
    for name, path in explorers.items():
        tree = ast.parse(path.read_text())
        first = (ast.get_docstring(tree) or "").splitlines()[0]
        functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if not re.match(r"Chapter \d(\.\d)?\b", first):
            bad.append(f"{name}: first docstring line names no chapter: {first!r}")
        if missing := {"compute", "panel", "fallback", "show"} - functions:
            bad.append(f"{name}: no {sorted(missing)}")
    assert not bad, bad
