"""The benchmark runs end to end in quick mode and reports finite numbers (no timing asserts)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_quick_benchmark_produces_finite_results(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "benchmarks/bench.py", "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert math.isfinite(report["gemm_gflops"]) and report["gemm_gflops"] > 0
    for workload, summary in report["variants"]["default malloc"].items():
        for contender in ("torch eager", "orttrainer"):
            entry = summary[contender]
            assert "error" not in entry, (workload, contender, entry)
            assert all(math.isfinite(entry[key]) and entry[key] > 0 for key in ("median_ms", "min_ms", "max_ms", "peak_rss_mb"))
            assert entry["optimizer_ms"] > 0
    assert (tmp_path / "bench.md").read_text().count("|") > 10 and (tmp_path / "bench.png").stat().st_size > 0
