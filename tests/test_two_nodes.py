"""Two torchrun agents (--nnodes=2, c10d rendezvous on this host, one process each) train as one agent with two processes."""

import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from conftest import subprocess_env
from test_distributed import HERE, assert_bitwise_equal

from orttrainer import checkpoint

SAMPLE = HERE.parent / "samples" / "torchrun_ddp.py"
FLAGS = ["--epochs", 2, "--global-batch", 256, "--checkpoint-every", 4]  # 5 steps per epoch
# One thread per process in every layout: torchrun sets OMP_NUM_THREADS=1 only for several processes per node, and
# kernels on more threads sum in another order. Each attempt of a restarted job gets a store of its own (pytorch#135712).
ENV = subprocess_env(HERE, OMP_NUM_THREADS=1, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
ONE_AGENT = [["--standalone", "--nproc-per-node=2"]]


def two_agents(restarts=0):
    """torchrun's arguments on each of two nodes of one job, as a user types them on each machine."""
    endpoint, job = f"localhost:{free_port()}", uuid.uuid4().hex
    node = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}",
            "--rdzv-conf=join_timeout=60", f"--max-restarts={restarts}"]  # fmt: skip
    return [node, node]


def free_port():
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def run_agents(agents, command, logs, timeout=240):
    """Start one torchrun agent per entry of ``agents`` (its arguments) on ``command``, all at once; return their
    stdout, joined, once all have ended with status 0. Past ``timeout`` seconds they are stopped (SIGTERM:
    an agent then ends its workers) and the test fails."""
    logs.mkdir()
    processes = []
    for node, arguments in enumerate(agents):
        with open(logs / f"{node}.out", "w") as out, open(logs / f"{node}.err", "w") as err:
            processes.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *arguments,
                                               f"--log-dir={logs / str(node)}", *map(str, command)],
                                              cwd=HERE, env=ENV, stdout=out, stderr=err))  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        codes = [process.wait(timeout=max(deadline - time.monotonic(), 1)) for process in processes]
    finally:
        for process in processes:
            stop(process)
    stdout, stderr = ("".join((logs / f"{node}.{kind}").read_text() for node in range(len(agents))) for kind in ("out", "err"))
    assert codes == [0] * len(agents), stderr[-4000:]
    return stdout


def stop(process):
    """End an agent still running: SIGTERM (it ends its workers), SIGKILL if it has not ended 30 s later."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def train(agents, tmp_path, name, job=(SAMPLE,), resume=False):
    """Run the sample (or ``job`` in front of its arguments) under ``agents``; its final checkpoint and stdout."""
    final = tmp_path / f"{name}.ortcp"
    command = [*job, *FLAGS, *(["--resume"] if resume else []), "--checkpoint-dir", tmp_path / name, "--checkpoint", final]
    stdout = run_agents(agents, command, tmp_path / f"{name}-logs")
    return checkpoint.load(final), stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The sample's final checkpoint from one agent with two processes."""
    return train(ONE_AGENT, tmp_path_factory.mktemp("one_agent"), "uninterrupted")[0]


def assert_same_training(expected, got):
    for group in ("model", "optimizer", "train_step_info"):
        assert_bitwise_equal(expected[group], got[group], group)


@pytest.mark.slow
def test_two_agents_of_one_process_each_train_as_one_agent_of_two_processes(tmp_path, uninterrupted):
    """The sample on two nodes, periodic checkpoints included: the weights and Adam's state of the one-agent run, bit for bit."""
    got, stdout = train(two_agents(), tmp_path, "two_nodes")
    assert stdout.count("2 ranks; consolidated checkpoint") == 1, stdout  # rank 0 reports, on either node
    assert sorted(path.name for path in (tmp_path / "two_nodes").glob("step-*")) == ["step-000004.ortcp", "step-000008.ortcp"]
    assert_same_training(uninterrupted, got)


@pytest.mark.slow
def test_a_two_node_job_torchrun_restarts_after_a_process_dies_ends_with_the_uninterrupted_weights(tmp_path, uninterrupted):
    """Rank 1 (the process of one node) is killed after step 6; torchrun restarts both nodes' processes, which resume
    from step 4's checkpoint and end with the weights and Adam's state of the one-agent run never interrupted."""
    marker = tmp_path / "killed"
    got, stdout = train(two_agents(restarts=1), tmp_path, "restarted", (HERE / "killed_rank_job.py", 6, marker), resume=True)
    assert marker.exists()
    assert f"resuming from {tmp_path / 'restarted' / 'step-000004.ortcp'} (step 4)" in stdout, stdout
    assert_same_training(uninterrupted, got)
