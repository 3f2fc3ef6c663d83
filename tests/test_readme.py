"""Every ```python block of README.md runs as written, twice in a row in the same directory.

Each block runs in a fresh interpreter in a temporary directory, then again in that
directory: a snippet must survive the files its first run left (a checkpoint that
already exists, say).
"""

import re
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def run_block(code, directory):
    result = subprocess.run([sys.executable, "-c", code], cwd=directory, env=subprocess_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{result.stderr[-3000:]}"
    return result.stdout


def test_readme_has_python_blocks():
    assert BLOCKS, "no ```python block found in README.md"


# the Hugging Face snippets (15-60 s each, run twice) are marked slow: tests/test_hf_models.py is their fast tier
@pytest.mark.parametrize("code", [pytest.param(code, marks=pytest.mark.slow) if "transformers" in code else code
                                  for code in BLOCKS], ids=[f"block{index}" for index in range(len(BLOCKS))])  # fmt: skip
def test_readme_block_runs_twice(code, tmp_path):
    outputs = [run_block(code, tmp_path) for _ in range(2)]
    if "lr_scheduler" in code:  # the quick start: its schedule must end with its loop, near 0
        peak = float(re.search(r"AdamConfig\(lr=([0-9.e+-]+)\)", code).group(1))
        for output in outputs:
            last_lr = re.search(r"last learning rate ([0-9.e+-]+)", output)
            assert last_lr and float(last_lr.group(1)) < 0.05 * peak, output
