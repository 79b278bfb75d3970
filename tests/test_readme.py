"""The README and the pages under docs/: their Python examples run as written, their links lead somewhere.

Each example runs in a fresh interpreter because the examples are meant to be pasted into a new session:
one block must not lean on names or thread settings another left behind. A relative link must name a file
of the repository, and a ``#heading`` in it one of that page's headings (as GitHub makes their anchors).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [(page, block) for page in PAGES
          for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_the_readme_is_a_front_page_with_one_library_example():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    example = [b for p, b in BLOCKS if p.name == "README.md"]
    assert len(example) == 1 and len([line for line in example[0].splitlines() if line.strip()]) <= 10


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(CODE.sub("", FENCE.sub("", page.read_text()))):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_pages_have_python_examples():
    assert {p.name for p, _ in BLOCKS} >= {"README.md", "library.md", "engine.md", "hybridize.md"}


@pytest.mark.subprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)),
                         ids=[f"{p.relative_to(ROOT)}:{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_example_runs(index, tmp_path):
    page, block = BLOCKS[index]
    script = tmp_path / "example.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, f"{page.relative_to(ROOT)} example failed:\n{block}\n{done.stderr[-3000:]}"
