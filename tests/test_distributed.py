"""Data parallel training under torchrun (gloo, 2 processes on the CPU)."""

import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_env

from orttrainer import ORTTrainerOptions, checkpoint
from orttrainer.update.distributed import _warn_if_restarts_share_the_agent_store, owners, world_from

HERE = Path(__file__).parent
ENV = subprocess_env(HERE)
# a restarted attempt's workers must not share torchrun's store: they could read the dead attempt's gloo addresses
# (pytorch/pytorch#135712; without this, 3 restarts of 6 failed to connect here, torch 2.13, and 2 of 3 later)
RESTARTS_ENV = subprocess_env(HERE, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)


def launch(command, ranks, timeout, restarts=0):
    """``command`` (a script and its arguments) in this interpreter, or under torchrun on ``ranks``
    processes, restarted up to ``restarts`` times (its log folder removed after, not left in /tmp)."""
    with tempfile.TemporaryDirectory() as logs:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                    f"--max-restarts={restarts}", f"--log-dir={logs}"]
        return subprocess.run([*(torchrun if ranks > 1 else [sys.executable]), *map(str, command)], cwd=HERE,
                              env=RESTARTS_ENV if restarts else ENV, capture_output=True, text=True, timeout=timeout)


def run(*args, ranks=1, check=True, timeout=300):
    result = launch([HERE / "ddp_job.py", *args], ranks, timeout)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def assert_same_weights(path_a, path_b):
    a, b = np.load(path_a), np.load(path_b)
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
    for key in a.files:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-5, err_msg=key)


# the fast tier keeps ZeRO with accumulation and clipping, its checkpoints resumed and a crashing rank; the other torchrun
# jobs (5-30 s each) are marked slow
@pytest.mark.parametrize("zero", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["adam+accumulation", "zero1+adam+accumulation+clipping"])  # fmt: skip
def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(tmp_path, zero):
    flags = ["--steps", 6, "--accumulation", 2] + (["--zero", "--clip"] if zero else [])
    run(*flags, "--out", tmp_path / "single.npz")
    run(*flags, "--out", tmp_path / "two.npz", ranks=2)
    assert_same_weights(tmp_path / "single.npz", tmp_path / "two.npz")


@pytest.mark.slow
def test_ranks_with_batches_of_different_shapes_train_like_one_process_accumulating_them(tmp_path):
    """Each rank meets new shapes at its own steps and builds their graphs alone (no collective may
    wait for the other rank); the mean over ranks equals one process accumulating both parts."""
    flags = ["--steps", 4, "--uneven"]
    run(*flags, "--accumulation", 2, "--out", tmp_path / "single.npz")
    run(*flags, "--out", tmp_path / "two.npz", ranks=2)
    assert_same_weights(tmp_path / "single.npz", tmp_path / "two.npz")


def test_zero_checkpoints_aggregate_and_resume_in_one_process(tmp_path):
    checkpoint = tmp_path / "ckpt.{rank}.h5"
    flags = ["--steps", 7, "--zero", "--accumulation", 2]  # saved at the end of the second window
    run(*flags, "--save-at", 4, "--checkpoint", checkpoint, "--out", tmp_path / "two.npz", ranks=2)
    parts = [str(checkpoint).format(rank=rank) for rank in (0, 1)]
    run(*flags, "--first-step", 4, "--load", *parts, "--out", tmp_path / "resumed.npz")
    assert_same_weights(tmp_path / "two.npz", tmp_path / "resumed.npz")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["inside_window", "bad_directory", "rank_1_file_exists"])
def test_a_failed_save_ends_every_rank_promptly_with_its_cause(tmp_path, case):
    """Every rank raises the same cause within seconds, none waits for the collective timeout."""
    if case == "inside_window":  # each rank refuses on its own, before anything is written
        path, flags = tmp_path / "ckpt.h5", ["--accumulation", 2, "--steps", 2, "--save-at", 1]
        causes = [f"orttrainer.update.checkpoint.CheckpointError: cannot save checkpoint {path}: step 1 of rank {rank} (of 2) is inside a "
                  "gradient-accumulation window" for rank in (0, 1)]  # fmt: skip
    elif case == "bad_directory":  # rank 0 writes the merged checkpoint
        path, flags = tmp_path / "missing" / "ckpt.h5", ["--zero", "--consolidate", "--steps", 1, "--save-at", 1]
        causes = [f"orttrainer.update.distributed.RankWriteError: saving checkpoint {path} at step 1 failed on rank 0: FileNotFoundError: "
                  "[Errno 2] No such file or directory"] * 2  # fmt: skip
    else:  # every rank writes its own file: rank 0 succeeds, rank 1 cannot
        path, flags = tmp_path / "ckpt.{rank}.h5", ["--zero", "--steps", 1, "--save-at", 1]
        (tmp_path / "ckpt.1.h5").write_text("an older file")
        causes = [f"orttrainer.update.distributed.RankWriteError: saving checkpoint {path} at step 1 failed on rank 1: FileExistsError: "
                  f"{tmp_path / 'ckpt.1.h5'} exists; pass overwrite=True"] * 2  # fmt: skip
    start = time.monotonic()
    result = run(*flags, "--checkpoint", path, "--out", tmp_path / "x.npz", ranks=2, check=False, timeout=240)
    assert result.returncode != 0
    for rank, cause in enumerate(causes):
        assert f"[rank{rank}]: {cause}" in result.stderr, result.stderr[-4000:]  # torch prefixes each rank's traceback
    assert time.monotonic() - start < 60
    assert not (tmp_path / "x.npz").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing_on_rank_1", "other_on_rank_1"])
def test_a_checkpoint_only_some_ranks_can_load_ends_every_rank_promptly_before_any_loads(tmp_path, case):
    """A file only rank 0's node holds, or another file on rank 1: every rank raises the same error at
    load_checkpoint (none trains on, none waits at the next collective, no replica differs)."""
    saved, other = tmp_path / "ckpt.h5", tmp_path / "other.h5"
    run("--steps", 1, "--save-at", 1, "--checkpoint", saved, "--out", tmp_path / "saved.npz")
    if case == "missing_on_rank_1":
        on_rank_1 = tmp_path / "absent.h5"
        cause = f"failed on rank 1: FileNotFoundError: checkpoint {on_rank_1} does not exist"
    else:
        on_rank_1 = other
        run("--steps", 2, "--save-at", 2, "--checkpoint", other, "--out", tmp_path / "other.npz")
        cause = "rank(s) [1] read other values than rank 0; every rank must load the same checkpoint"
    start = time.monotonic()
    result = run("--steps", 3, "--first-step", 1, "--load", saved, "--load-on-rank-1", on_rank_1, "--out", tmp_path / "x.npz",
                 ranks=2, check=False, timeout=240)  # fmt: skip
    assert result.returncode != 0
    for rank in (0, 1):
        where = saved if rank == 0 else on_rank_1
        assert f"[rank{rank}]: orttrainer.update.checkpoint.CheckpointError: loading checkpoint {where}" in result.stderr, result.stderr[-4000:]
        assert cause in result.stderr.split(f"[rank{rank}]: orttrainer.update.checkpoint.CheckpointError")[1].split("\n")[0]
    assert time.monotonic() - start < 60
    assert not (tmp_path / "x.npz").exists()


@pytest.mark.slow
def test_every_rank_loading_the_same_checkpoint_resumes_as_one_process(tmp_path):
    saved = tmp_path / "ckpt.h5"
    run("--steps", 4, "--save-at", 2, "--checkpoint", saved, "--out", tmp_path / "single.npz")
    run("--steps", 4, "--first-step", 2, "--load", saved, "--out", tmp_path / "two.npz", ranks=2)
    assert_same_weights(tmp_path / "single.npz", tmp_path / "two.npz")


def test_a_crashing_rank_ends_the_job_in_bounded_time(tmp_path):
    start = time.monotonic()
    result = run("--steps", 50, "--crash-at", 2, "--out", tmp_path / "x.npz", ranks=2, check=False, timeout=240)
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_a_job_torchrun_restarts_after_a_rank_dies_ends_with_the_uninterrupted_weights(tmp_path):
    """samples/torchrun_ddp.py, 10 steps, a checkpoint every 4: rank 1 is killed after step 6, torchrun restarts
    both ranks, which pass over a corrupt newer file and a cut-short write's temporary file, resume from step 4's
    checkpoint and end with the weights and Adam's state of a run never interrupted, bit for bit."""
    flags = ["--epochs", 2, "--global-batch", 256, "--checkpoint-every", 4]  # 5 steps per epoch
    sample = HERE.parent / "samples" / "torchrun_ddp.py"
    uninterrupted = [sample, *flags, "--checkpoint-dir", tmp_path / "a", "--checkpoint", tmp_path / "uninterrupted.ortcp"]
    result = launch(uninterrupted, 2, 240)
    assert result.returncode == 0, result.stderr[-4000:]
    restarted = tmp_path / "b"
    restarted.mkdir()
    cut_short = (tmp_path / "a" / "step-000008.ortcp").read_bytes()[:20000]
    for name in ("step-000008.ortcp", ".step-000008.ortcp.x1y2z3.tmp"):
        (restarted / name).write_bytes(cut_short)
    result = launch([HERE / "killed_rank_job.py", 6, tmp_path / "killed", *flags, "--resume", "--checkpoint-dir", restarted, "--checkpoint",
                     tmp_path / "restarted.ortcp"], 2, 240, restarts=1)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count(f"skipping {restarted / 'step-000008.ortcp'}") == 2, result.stdout  # once per attempt
    assert f"resuming from {restarted / 'step-000004.ortcp'} (step 4)" in result.stdout, result.stdout
    assert sorted(path.name for path in restarted.glob("step-*")) == ["step-000004.ortcp", "step-000008.ortcp"]
    expected, got = (checkpoint.load(tmp_path / f"{run}.ortcp") for run in ("uninterrupted", "restarted"))
    for group in ("model", "optimizer", "train_step_info"):
        assert_bitwise_equal(expected[group], got[group], group)


def assert_bitwise_equal(expected, got, where):
    """Nested dicts of arrays (as checkpoint.load returns them) with the same keys, shapes, dtypes and bytes."""
    assert isinstance(got, dict) == isinstance(expected, dict), where
    if isinstance(expected, dict):
        assert sorted(expected) == sorted(got), where
        for key in expected:
            assert_bitwise_equal(expected[key], got[key], f"{where}/{key}")
    else:
        expected, got = np.asarray(expected), np.asarray(got)
        assert (expected.shape, expected.dtype, expected.tobytes()) == (got.shape, got.dtype, got.tobytes()), where


def test_world_from_environment_and_options(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    world = world_from(ORTTrainerOptions({"device": {"id": "cpu"}}))
    assert (world.rank, world.size, world.local_rank) == (1, 4, 1)
    assert world_from(ORTTrainerOptions({"distributed": {"world_size": 4, "world_rank": 1}})).size == 4
    with pytest.raises(ValueError, match=r"distributed.world_size is 2 but the environment says WORLD_SIZE=4"):
        world_from(ORTTrainerOptions({"distributed": {"world_size": 2}}))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match=r"world_rank 3 is outside 0..1"):
        world_from(ORTTrainerOptions({"distributed": {"world_size": 2, "world_rank": 3}}))


@pytest.mark.parametrize("max_restarts, shared, warns", [("1", "True", True), ("0", "True", False), ("1", "False", False)])
def test_a_job_that_may_restart_with_the_agents_store_is_warned(monkeypatch, max_restarts, shared, warns):
    """As torchrun sets them: TORCHELASTIC_USE_AGENT_STORE is "False" under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", max_restarts)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_if_restarts_share_the_agent_store()
    messages = [str(warning.message) for warning in caught]
    expected = ["torchrun may restart this job (--max-restarts=1) and its workers share the agent's store, where a restarted attempt can "
                "read the dead attempt's addresses and fail to connect (pytorch#135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
                "torchrun on every node"]  # fmt: skip
    assert messages == (expected if warns else [])


def test_zero_ownership_balances_elements():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    owner = owners(sizes, 2)
    load = [sum(size for name, size in sizes.items() if owner[name] == rank) for rank in (0, 1)]
    assert load == [110, 110] and set(owner) == set(sizes)


@pytest.mark.slow
def test_mismatched_models_across_ranks_are_detected(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(f"""
import os, sys, torch, torch.nn.functional as F
sys.path.insert(0, {str(HERE)!r})
from models import MLP, mlp_batch
from orttrainer import ORTTrainer, ORTTrainerOptions, optim
rank = int(os.environ["RANK"])
model = MLP(hidden=64 if rank == 0 else 32)
trainer = ORTTrainer(model, None, optim.SGDConfig(), loss_fn=F.cross_entropy, options=ORTTrainerOptions({{"device": {{"id": "cpu"}}}}))
trainer.train_step(*mlp_batch())
""")
    result = launch([script], 2, timeout=240)
    assert result.returncode != 0
    assert "the model's weights (names, shapes, dtypes, which train) or the options differ between rank 0 and rank(s) [1]" in result.stderr
