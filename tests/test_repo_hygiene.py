"""Repository-wide checks: lint clean, README commands in step with CI, a test run leaves the checkout as it was."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    proc = subprocess.run([ruff, "check", "minifsdp", "tests", "exercises"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fenced_commands(text: str) -> list[str]:
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_install_and_test_commands():
    readme = _fenced_commands((ROOT / "README.md").read_text())
    ci = (ROOT / ".ci" / "run").read_text()
    install = next(c for c in readme if c.startswith("pip install -e"))
    test = next(c for c in readme if "pytest" in c and "--impl" not in c)
    assert install in ci, f"CI does not run the README install command: {install}"
    assert test in ci, f"CI does not run the README test command: {test}"


def test_no_file_cites_an_issue_number():
    """Readers have no issue tracker: a test or a text says what it proves, not which issue asked for it."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.ipynb", "*.toml", "*.txt"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 100, len(files)
    cite = re.compile(r"\bissues?\s+#?\d+\b(?!\s*(?:all-|reduce|collective|send|message))", re.IGNORECASE)
    hits = [f"{f}:{n}: {line.strip()[:100]}" for f in files for n, line in
            enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if cite.search(line)]
    assert not hits, "\n".join(hits[:30])


def _code_cells(nb: Path) -> list[str]:
    cells = json.loads(nb.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def test_notebooks_save_figures_into_the_checkout_only_when_asked(tmp_path, monkeypatch):
    """Running the tests runs every notebook (nbval): a test run must leave the checkout as it was.

    The notebooks write files in two ways only: the chapters' figures, through ``save_figure``, which writes
    into ``chapters/figures/`` only with ``MINIFSDP_SAVE_FIGURES=1`` (checked here, on a repository of its own
    in ``tmp_path``), and their jobs' output, into folders from ``tempfile`` (checked: no other call that
    saves or writes appears in a notebook's code).  The README's commands write ``out/``, which git ignores."""
    from matplotlib.figure import Figure

    from minifsdp.pictures import plots

    (tmp_path / "chapters").mkdir()
    fig = Figure(figsize=(1, 1))
    monkeypatch.delenv(plots.SAVE_FIGURES_ENV, raising=False)
    path = plots.save_figure(fig, "hygiene_probe", root=tmp_path)
    assert path.exists() and tmp_path not in path.parents, path
    assert not (tmp_path / "chapters" / "figures").exists()
    monkeypatch.setenv(plots.SAVE_FIGURES_ENV, "1")
    want = tmp_path / "chapters" / "figures" / "hygiene_probe.png"
    assert plots.save_figure(fig, "hygiene_probe", root=tmp_path) == want and want.exists()

    writes = re.compile(r"\.savefig\(|\bimsave\(|torch\.save\(|np\.save|\.to_csv\(|open\([^)]*['\"][wa]b?['\"]")
    unsafe = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for src in _code_cells(nb):
            unsafe += [f"{nb.name}: {line.strip()[:100]}" for line in src.splitlines() if writes.search(line)]
            if ("write_text(" in src or "checkpoint.save(" in src or "--profile" in src) and "TMP" not in src \
                    and "WORK" not in src and "workdir" not in src:
                unsafe.append(f"{nb.name}: a cell writes files but names no temporary folder: {src[:100]!r}")
    assert not unsafe, "\n".join(unsafe)
    written = ["out/run/log.jsonl", "out/compare_losses.png", "out/bench_fsdp.json", "out/browser/01.png"]
    ignored = subprocess.run(["git", "check-ignore", *written], cwd=ROOT, capture_output=True, text=True)
    assert sorted(ignored.stdout.split()) == sorted(written), "git does not ignore out/, where the README's " \
        f"commands write: {ignored.stdout!r}"
