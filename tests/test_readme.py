"""Every ```python block of README.md and of docs/*.md runs as written, twice in a row in the same directory.

Each block runs in a fresh interpreter in a temporary directory, then again in that
directory: a snippet must survive the files its first run left (a checkpoint that
already exists, say).
"""

import re
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page):
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


# (page relative to the repository, block index, code) for every block of every page
BLOCKS = [(page.relative_to(ROOT).as_posix(), index, code) for page in PAGES
          for index, code in enumerate(python_blocks(page))]  # fmt: skip


def run_block(code, directory, page):
    result = subprocess.run([sys.executable, "-c", code], cwd=directory, env=subprocess_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{page} block failed:\n{code}\n--- stderr:\n{result.stderr[-3000:]}"
    return result.stdout


def test_readme_has_python_blocks():
    assert python_blocks(ROOT / "README.md"), "no ```python block found in README.md"


# the Hugging Face snippets (15-60 s each, run twice) are marked slow: tests/test_hf_models.py is their fast tier
@pytest.mark.parametrize("page, code", [
    pytest.param(page, code, marks=[pytest.mark.slow] if "transformers" in code else [], id=f"{page}-block{index}")
    for page, index, code in BLOCKS])  # fmt: skip
def test_snippet_runs_twice(page, code, tmp_path):
    outputs = [run_block(code, tmp_path, page) for _ in range(2)]
    if "lr_scheduler" in code:  # the quick start: its schedule must end with its loop, near 0
        peak = float(re.search(r"AdamConfig\(lr=([0-9.e+-]+)\)", code).group(1))
        for output in outputs:
            last_lr = re.search(r"last learning rate ([0-9.e+-]+)", output)
            assert last_lr and float(last_lr.group(1)) < 0.05 * peak, output
