"""The README's Python examples run as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(python_blocks()) >= 5


@pytest.mark.timeout(240)
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index, capsys):
    block = python_blocks()[index]
    exec(compile(block, f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip(), "every example prints what it shows"
