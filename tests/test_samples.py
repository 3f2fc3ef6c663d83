"""The samples run end to end in a short mode, so CI keeps them working."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_sample(*args):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_char_lm_learns_exports_samples_and_resumes(tmp_path):
    common = ["--eval-every", 20, "--checkpoint-every", 20, "--max-chars", 300_000, "--out-dir", tmp_path]
    first = run_sample(ROOT / "samples/char_lm.py", "--steps", 40, *common)
    assert "(learned)" in first, first
    for name in ("checkpoint_20.ortcp", "checkpoint_40.ortcp", "char_lm.onnx", "loss_curve.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "sample from the exported model" in first
    second = run_sample(ROOT / "samples/char_lm.py", "--steps", 60, *common)
    assert f"resuming from {tmp_path / 'checkpoint_40.ortcp'} at step 40" in second
    assert (tmp_path / "checkpoint_60.ortcp").exists()


def test_digits_classifier_trains():
    output = run_sample(ROOT / "samples/digits_classifier.py", "--epochs", 3)
    accuracy = float(output.rsplit("test accuracy: ", 1)[1].split("%")[0])
    assert accuracy > 80, output


def test_torchrun_sample_trains_on_two_ranks_with_zero(tmp_path):
    env = {key: value for key, value in ENV.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "samples/torchrun_ddp.py"), "--epochs", "3", "--zero", "--checkpoint", str(tmp_path / "d.ortcp")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("test accuracy") == 1, "only rank 0 reports"
    accuracy = float(result.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 80, result.stdout
    from orttrainer import checkpoint

    state = checkpoint.load(tmp_path / "d.ortcp")
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    weights = {name for name in state["model"]["full_precision"] if not name.endswith(buffers)}
    assert state["trainer_options"]["world_size"] == 1
    assert set(state["optimizer"]) == weights, "the consolidated file holds every rank's part of Adam's state"
