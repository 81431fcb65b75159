"""The package's shape: chapters as subpackages, imports that run one way, modules a student can read.

Read from the source files (``ast``), not by importing them, so a cycle that Python
happens to tolerate today (a late import, an attribute looked up at call time) is
still caught.
"""

import ast
import json
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "minifsdp"

# Lower layers first.  A module may import its own layer or a lower one, never a higher one.
# comm sits below ddp although chapter 2.2 comes after chapter 1: DDP and FSDP both send their
# gradients through it, so it is the foundation the two build on.
LAYERS = {
    "minifsdp.launch": 0, "minifsdp.models": 0, "minifsdp.notebook": 0,
    "minifsdp.comm": 1,
    "minifsdp.ddp": 2,
    "minifsdp.fsdp": 3, "minifsdp.memory": 3, "minifsdp.parallel": 3,
    "minifsdp.checkpoint": 4, "minifsdp.fsdp2": 4,
    "minifsdp.tools": 5,
    "minifsdp.__main__": 6, "minifsdp": 6,
}
LOCAL_IMPORTS_ALLOWED = ("minifsdp.tools",)  # command-line and bench code may import lazily (start-up time)


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
    top, local = set(), set()
    tree = ast.parse(path.read_text())
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


def test_no_import_cycles():
    edges = {m: {t for t in top if t != m} for m, (top, _) in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m, path):
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_function_local_imports_of_our_modules_outside_tools():
    offenders = [f"{m} imports {sorted(local)} inside a function" for m, (_, local) in GRAPH.items()
                 if local and not m.startswith(LOCAL_IMPORTS_ALLOWED)]
    assert not offenders, "\n".join(offenders)


def test_imports_never_climb_to_a_higher_layer():
    bad = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
           for m, (top, local) in GRAPH.items() for t in top | local if _layer(t) > _layer(m)]
    assert not bad, "\n".join(bad)


def test_chapter_subpackages_exist_and_the_top_stays_small():
    for pkg in ("comm", "ddp", "fsdp", "memory", "parallel", "checkpoint", "fsdp2", "tools"):
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
CORE_MAY_IMPORT = (CORE, "minifsdp.comm", "minifsdp.launch", "minifsdp.models")
CORE_BUDGET = 1600  # lines, docstrings included: what a learner reads in one sitting


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_core_imports_only_core_comm_launch_and_models():
    core = [m for m in MODULES if _in(m, [CORE])]
    assert len(core) >= 10, core
    bad = [f"{m} imports {t}" for m in core for t in GRAPH[m][0] | GRAPH[m][1] if not _in(t, CORE_MAY_IMPORT)]
    assert not bad, "\n".join(bad)


def test_the_core_fits_its_line_budget():
    lines = {p.name: len(p.read_text().splitlines()) for p in (PKG / "fsdp" / "core").glob("*.py")}
    assert sum(lines.values()) <= CORE_BUDGET, (sum(lines.values()), lines)


def test_the_reading_order_the_core_states_is_true():
    """The core's ``__init__`` lists its modules in reading order; each imports only those above it."""
    doc = ast.get_docstring(ast.parse((PKG / "fsdp" / "core" / "__init__.py").read_text()))
    order = [line.split()[0][:-3] for line in doc.splitlines() if line.startswith("    ") and
             line.split()[0].endswith(".py")]
    on_disk = sorted(p.stem for p in (PKG / "fsdp" / "core").glob("*.py") if p.stem != "__init__")
    assert sorted(order) == on_disk and len(order) == len(set(order)), (order, on_disk)
    for i, name in enumerate(order):
        above = {f"{CORE}.{n}" for n in order[:i]}
        inside = {t for t in GRAPH[f"{CORE}.{name}"][0] if _in(t, [CORE]) and t != CORE}
        assert inside <= above, f"{name} imports {sorted(inside - above)}, listed below it"


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
    assert {"launch.py", "fsdp/core/handle.py", "tools/cli.py"} <= shown, sorted(shown)[:10]  # the tree was read
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
