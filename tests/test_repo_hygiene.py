"""Repository-wide checks: lint clean, README commands in step with CI."""

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
