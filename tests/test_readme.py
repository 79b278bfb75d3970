"""The README's Python examples run as written, each in a fresh interpreter.

A fresh process per block because the examples are meant to be pasted into a new session: one
block must not lean on names or thread settings another left behind.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i + 1}")
def test_readme_example_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index + 1}.py"
    script.write_text(BLOCKS[index])
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, f"README block {index + 1} failed:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
