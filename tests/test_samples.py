"""The samples run end to end in a short mode, so CI keeps them working."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env


def run_sample(*args, cwd=ROOT):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=subprocess_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_char_lm_learns_exports_samples_and_resumes(tmp_path):
    common = ["--eval-every", 10, "--checkpoint-every", 10, "--max-chars", 100_000, "--out-dir", tmp_path]
    first = run_sample(ROOT / "samples/char_lm.py", "--steps", 20, *common)
    assert "(learned)" in first, first
    for name in ("checkpoint_10.ortcp", "checkpoint_20.ortcp", "history.json", "char_lm.onnx", "loss_curve.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "sample from the exported model" in first
    rate = re.search(r"trained 20 steps in [\d.]+ s \(([\d.]+) steps/s", first)
    assert rate and float(rate.group(1)) > 0, first
    second = run_sample(ROOT / "samples/char_lm.py", "--steps", 30, *common)
    assert f"resuming from {tmp_path / 'checkpoint_20.ortcp'} at step 20" in second
    sizes = {(tmp_path / f"checkpoint_{step}.ortcp").stat().st_size for step in (10, 20, 30)}
    assert len(sizes) == 1, f"checkpoints grow with the run: {sizes}"


@pytest.mark.slow
def test_digits_classifier_trains():
    output = run_sample(ROOT / "samples/digits_classifier.py", "--epochs", 3)
    accuracy = float(output.rsplit("test accuracy: ", 1)[1].split("%")[0])
    assert accuracy > 80, output


def test_legacy_script_ported_as_from_legacy_md_shows_runs_here(tmp_path):
    text = (ROOT / "samples/from_legacy.md").read_text()
    after = text.split("## After", 1)[1]
    (script,) = re.findall(r"```python\n(.*?)```", after.split("\n## ", 1)[0], re.S)
    assert "from orttrainer import" in script
    assert not any('"device"' in line.split("#", 1)[0] for line in script.splitlines()), "the port as shown asks for a device"
    (tmp_path / "ported.py").write_text(script)
    run_sample(tmp_path / "ported.py", cwd=tmp_path)
    assert (tmp_path / "model.ortcp").stat().st_size > 0 and (tmp_path / "model.onnx").stat().st_size > 0


@pytest.mark.slow
def test_torchrun_sample_trains_on_two_ranks_with_zero(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--log-dir={tmp_path / 'logs'}", str(ROOT / "samples/torchrun_ddp.py"), "--epochs", "3", "--zero", "--checkpoint", str(tmp_path / "d.ortcp")]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
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


@pytest.mark.slow
def test_hf_text_classifier_trains_the_transformers_way_and_saves_a_loadable_model(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the sample trains a transformers model (test extra)")
    output = run_sample(ROOT / "samples/hf_text_classifier.py", "--epochs", 1, "--max-files", 6, "--out-dir", tmp_path)
    first, last = map(float, re.search(r"of the first \d+ logs ([\d.]+), of the last \d+ ([\d.]+)", output).groups())
    assert last < first, output
    assert "final held-out accuracy" in output and (tmp_path / "loss_curve.png").stat().st_size > 0
    model = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "model")
    assert model.config.num_labels == 6
