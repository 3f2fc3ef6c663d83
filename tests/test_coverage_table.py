"""The coverage table of docs/layers.md is what benchmarks/coverage.py measures now.

Every case of the table trains one step in a worker process: 12-26 s of the suite in
runs on 2026-11-23 on 2 busy cores, so it stays in the whole suite (make test-all), marked
slow: out of make test. `make coverage` runs the same check and prints the table to paste
when it differs.
"""

import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env


@pytest.mark.slow
def test_layers_coverage_table_is_current():
    result = subprocess.run([sys.executable, "benchmarks/coverage.py", "--check", "docs/layers.md"], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "| **total of" in result.stdout
