"""Every Python block of the README and of the docs pages runs, as written, on the bundled model (issue 29):
the docs cannot drift from the API. Each block is self-contained and runs in a fresh namespace, in a temporary
working directory (a block that writes ``runs/...`` writes there)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), number, code)
    for page in PAGES
    for number, code in enumerate(
        re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE), 1
    )
]


def test_the_docs_have_python_blocks():
    assert sum(page == "README.md" for page, _, _ in BLOCKS) >= 1
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize(("page", "number", "code"), BLOCKS, ids=[f"{p}-{n}" for p, n, _ in BLOCKS])
def test_docs_block_runs(page, number, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page} python block {number}", "exec"), {"__name__": f"docs_block_{number}"})  # noqa: S102
