"""Smoke tests of benchmarks/: bench.py on one workload, torch eager and orttrainer, one short round;
gemm_efficiency.py on the MLP; first_step.py, dynamic_lengths.py and resume_memory.py on one small row.

They check that the benchmark machinery runs and reports finite numbers (no timing
asserts). The full comparison is `make bench`; `bench.py --quick` runs every contender on
two workloads and took ~45 s of the suite, so it is not run here.
"""

import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

# Runs in a child started with -c: bench.py's workers use the spawn start method, and a
# child whose main module is a -c string spawns them without re-importing pytest.
SMOKE = """
import json, sys
sys.path.insert(0, "benchmarks")
import bench

bench.CONTENDERS = ["torch eager", "orttrainer"]
index, workload = 0, bench._workloads("quick")[0]
contenders = {"torch eager": ("torch eager", None), "orttrainer": ("orttrainer", {"utils": {"convolution_kernels": "torch"}})}
results = bench.measure(index, workload, rounds=1, steps=2, warmup=1, suite="quick", env={}, contenders=contenders)
report = {"date": "smoke", "machine": "smoke", "threads": 1, "gemm_gflops": bench.gemm_ceiling_gflops(256, 2),
          "variants": {"default malloc": {workload.name: bench.summarize(results, bench.step_gflop(index, "quick"))}}}
table = bench.markdown(report)
print(json.dumps({"report": report, "table": table}))
"""


@pytest.mark.slow
def test_benchmark_measures_one_workload_and_reports_finite_numbers():
    result = subprocess.run([sys.executable, "-c", SMOKE], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout.strip().splitlines()[-1])
    report = output["report"]
    assert len(report["gemm_gflops"]) == 2  # torch's and ONNX Runtime's
    assert all(math.isfinite(rate) and rate > 0 for rate in report["gemm_gflops"])
    (summary,) = report["variants"]["default malloc"].values()
    assert set(summary) == {"torch eager", "orttrainer"}
    for contender, entry in summary.items():
        assert "error" not in entry, (contender, entry)
        assert all(math.isfinite(entry[key]) and entry[key] > 0 for key in ("median_ms", "min_ms", "max_ms", "peak_rss_mb"))
        assert entry["optimizer_ms"] > 0
    assert "| MLP" in output["table"] and output["table"].count("|") > 6


def test_gemm_efficiency_times_every_gemm_of_the_mlp_and_counts_its_flops():
    """Forward: three layers; backward: three weight gradients and the input gradients of the last two."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gemm_efficiency import gemm_efficiency
    from workloads import WORKLOADS

    (workload,) = [w for w in WORKLOADS if w.name == "MLP 784-1024-1024-10 (8)"]
    rows, run_ms = gemm_efficiency(workload, steps=2)
    layers = [784 * 1024, 1024 * 1024, 1024 * 10]
    expected = 2 * 8 * (3 * sum(layers) - layers[0]) / 1e9
    assert sum(row[4] for row in rows) == pytest.approx(expected, rel=1e-9)
    assert len(rows) == 8 and all(row[2] > 0 and row[3] > 0 for row in rows) and run_ms > 0


@pytest.mark.slow
def test_every_zoo_workload_takes_its_benchmark_batch():
    """`bench.py --zoo` stops at the first model that refuses its batch (CLIP's 32 tokens over 16 positions did):
    each model's loss on its benchmark batch, in eager torch."""
    pytest.importorskip("transformers", reason="the Hugging Face zoo needs transformers (the test extra)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from bench import _loss
    from workloads import zoo_workloads

    for workload in zoo_workloads():
        loss = _loss(workload.make_model(), workload, workload.make_batch(torch.Generator().manual_seed(0)))
        assert torch.isfinite(loss), workload.name


@pytest.mark.slow
def test_first_step_times_both_contenders_and_the_phases_of_orttrainer():
    command = [sys.executable, "benchmarks/first_step.py", "--row", "mlp-tiny", "--rounds", "1"]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("    exported Sequential") for line in lines), result.stdout
    rows = [line for line in lines if line.startswith("| torch eager") or line.startswith("| orttrainer")]
    assert len(rows) == 2 and not any("fails" in row for row in rows), result.stdout


@pytest.mark.slow
def test_dynamic_lengths_quick_row_reports_time_memory_graphs_and_losses(tmp_path):
    """dynamic_lengths.py --quick on the CNN (no transformers; three image sizes): both contenders' whole-run times,
    peak RSS, every step's loss and the shapes they saw, orttrainer's graphs built; the JSON, table and chart."""
    command = [sys.executable, "benchmarks/dynamic_lengths.py", "--quick", "--rows", "cnn-three-sizes", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "dynamic_lengths.json").read_text())
    assert report["settings"] == {"batches": 6, "batch": 4, "lengths": [8, 24]} and report["rounds"] == 1
    (row,) = report["rows"]
    assert row["name"] == "cnn-three-sizes"
    for contender in ("torch eager", "orttrainer"):
        entry = row[contender]
        assert "error" not in entry, (contender, entry)
        assert all(math.isfinite(entry[key]) and entry[key] > 0 for key in ("wall_s", "cpu_s", "peak_rss_mib", "first_step_s"))
        assert len(entry["losses"]) == 6 and all(math.isfinite(loss) for loss in entry["losses"])
        assert entry["shapes"] == [[32], [48], [64]] * 2 and entry["distinct_lengths"] == 3
    assert 1 <= row["orttrainer"]["graphs_built"] <= 3
    assert row["orttrainer"]["phases"]["export"][0] >= 1
    assert row["speed_ratio"] > 0 and row["rss_ratio"] > 0
    assert row["max_loss_rel_diff"] < 1e-3  # dropout off: the same losses
    table = (tmp_path / "dynamic_lengths.md").read_text()
    assert table.count("| cnn-three-sizes") == 1 and "graphs built" in table
    assert (tmp_path / "dynamic_lengths.png").stat().st_size > 0


def test_dynamic_lengths_quick_run_never_writes_the_results_directory():
    command = [sys.executable, "benchmarks/dynamic_lengths.py", "--quick", "--out", "benchmarks/results"]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--quick does not write to" in result.stderr, result.stderr


@pytest.mark.slow
def test_resume_memory_quick_row_measures_every_contender_and_each_resume_gives_trains_next_loss(tmp_path):
    command = [sys.executable, "benchmarks/resume_memory.py", "--quick", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads((tmp_path / "resume_memory.json").read_text())["runs"]
    for contender in ("train", "resume", "resume before first step", "held state_dict"):
        assert "error" not in run[contender] and run[contender]["peak_rss_gib"] > 0, (contender, run[contender])
        assert contender == "train" or run[contender]["same_loss"], contender
    assert (tmp_path / "resume_memory.md").read_text().count("| mlp-tiny") == 1


def test_bfloat16_report_gives_each_contender_its_ratio_to_autocast_and_keeps_errors(tmp_path):
    """benchmarks/bfloat16.py's table and chart from its stored runs: a median over every step, the ratio to
    torch.autocast's median, peak RSS, and a contender that failed reported as such, not dropped."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bfloat16

    stored = {"a workload": {"rounds": 2, "steps": 2, "threads": 2, "measured": "2026-12-06 14:00", "runs": 2, "results": {
        "torch autocast bfloat16": {"durations": [2.0, 2.0, 3.0], "peak_rss_mb": 100.0},
        "orttrainer bfloat16 (products on torch)": {"durations": [1.0, 9.0, 1.0], "peak_rss_mb": 250.4},
        "orttrainer float32": {"error": "RuntimeError: no kernel"}}}}  # fmt: skip
    table = bfloat16.report(stored)
    assert "| orttrainer bfloat16 (products on torch) | 1.000 | 0.50 | 250 |" in table
    assert "| torch autocast bfloat16 | 2.000 | 1.00 | 100 |" in table
    assert "| orttrainer float32 | RuntimeError: no kernel | | |" in table
    assert "contenders measured in 2 runs" in table
    bfloat16.bar_chart(stored, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 1000
