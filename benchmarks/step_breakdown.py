"""Where a train_step's time goes: the training graph's run, optimizer update, everything else.

    python benchmarks/step_breakdown.py [--steps 30] [--workload encoder]

The run is the training session's (for a graph split for torch's kernels, segments and torch
steps together). The optimizer's share is measured by timing ORTTrainer's update call inside real steps
(AdamW hyper-parameters as in the main benchmark).
"""

import argparse
import statistics
import time

import torch
from workloads import WORKLOADS, train_on, zoo_workloads

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


def _timed(function, sink):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return result

    return wrapper


def breakdown(workload, steps):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [workload.make_batch(generator) for _ in range(4)]
    trainer = ORTTrainer(
        workload.make_model(), None, optim.AdamConfig(lr=1e-4, lambda_coef=0.01), loss_fn=workload.loss_fn,
        options=ORTTrainerOptions({"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False}}),
    )
    for batch in batches:  # warm-up, includes export and the first backward
        train_on(trainer, batch)
    run_times, update_times, step_times = [], [], []
    session = trainer._train_session  # a TorchBoundSession, or a SplitSession (its torch steps included)
    session.run = _timed(session.run, run_times)
    trainer._optimizer.step = _timed(trainer._optimizer.step, update_times)
    for step in range(steps):
        start = time.perf_counter()
        train_on(trainer, batches[step % len(batches)])
        step_times.append(time.perf_counter() - start)
    step, run, update = (statistics.median(times) * 1e3 for times in (step_times, run_times, update_times))
    return step, run, update


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workload", default="", help="substring of a workload name (default: all of bench.py's)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    print("| workload | step ms | graph run ms | optimizer ms (share) | other ms |")
    print("|---|---|---|---|---|")
    for workload in WORKLOADS + (zoo_workloads() if args.workload else []):
        if args.workload.lower() not in workload.name.lower():
            continue
        step, run, update = breakdown(workload, args.steps)
        print(f"| {workload.name} | {step:.2f} | {run:.2f} | {update:.2f} ({update / step:.0%}) | {step - run - update:.2f} |")


if __name__ == "__main__":
    main()
