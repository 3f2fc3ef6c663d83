"""Per-op time of one train step: orttrainer's ONNX Runtime run against torch eager, side by side.

    python benchmarks/op_profile.py --workload resnet [--steps 10] [--top 25]

ONNX Runtime: session profiling of the training graph's run, every convolution on ONNX Runtime
(utils.convolution_kernels "onnxruntime": one session to profile) (node kernel times, summed per op
type, median over steps). torch: the autograd profiler's self CPU time per aten op over the
same steps (forward, backward and the AdamW step). Both train the same model on the same batches.
"""

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import onnxruntime
import torch
from workloads import train_on, workload_named

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


def _batches(workload):
    generator = torch.Generator().manual_seed(0)
    return [workload.make_batch(generator) for _ in range(4)]


def profiled_kernels(workload, steps, optimized_model_path=""):
    """Train ``steps`` + 2 steps with session profiling of the training graph (one session: every
    convolution on ONNX Runtime); return the runs after the first two and, per run, its kernel
    events ({"name", "dur" us, "args": op_name, input_type_shape, ...}). With ``optimized_model_path``
    ONNX Runtime also writes the graph it ran there (fused nodes, their attributes)."""
    torch.manual_seed(0)
    options = onnxruntime.SessionOptions()
    options.enable_profiling = True
    saved = {"graph_save_paths": {"model_with_training_graph_after_optimization_path": optimized_model_path}}
    batches = _batches(workload)
    with tempfile.TemporaryDirectory() as folder:
        options.profile_file_prefix = os.path.join(folder, "train")
        trainer = ORTTrainer(workload.make_model(), None, optim.AdamConfig(lr=1e-4, lambda_coef=0.01), loss_fn=workload.loss_fn,
                             options=ORTTrainerOptions({"device": {"id": "cpu"},
                                                        "utils": {"grad_norm_clip": False, "convolution_kernels": "onnxruntime"},
                                                        "session_options": options, "debug": saved}))  # fmt: skip
        for step in range(steps + 2):
            train_on(trainer, batches[step % len(batches)])
        events = json.loads(open(trainer._train_session.session.end_profiling()).read())
    runs = [event for event in events if event.get("name") == "model_run"][2:]
    kernels = [[] for _ in runs]
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        index = next((i for i, run in enumerate(runs) if run["ts"] <= event["ts"] <= run["ts"] + run["dur"]), None)
        if index is not None:
            kernels[index].append(event)
    return runs, kernels


def onnxruntime_ops(workload, steps, match=""):
    """{op type: median ms per step}, {op type: nodes}, median ms of the whole run per step, and
    the median ms per step of the nodes whose names contain ``match`` (a rewritten node's
    replacements keep its name as a prefix)."""
    runs, kernels = profiled_kernels(workload, steps)
    per_step = [defaultdict(float) for _ in runs]
    matched = [0.0 for _ in runs]
    nodes = defaultdict(set)
    for index, events in enumerate(kernels):
        for event in events:
            op = event["args"]["op_name"]
            per_step[index][op] += event["dur"] / 1e3
            matched[index] += event["dur"] / 1e3 if match and match in event["name"] else 0.0
            nodes[op].add(event["name"])
    ops = {op: statistics.median(step.get(op, 0.0) for step in per_step) for op in nodes}
    run_ms = statistics.median(run["dur"] / 1e3 for run in runs)
    return ops, {op: len(names) for op, names in nodes.items()}, run_ms, statistics.median(matched)


def torch_ops(workload, steps):
    """{aten op: ms per step} (self CPU time), and the median step ms without the profiler."""
    import time

    torch.manual_seed(0)
    model = workload.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    batches = _batches(workload)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(model(*batch[:-1]), batch[-1]).backward()
        optimizer.step()

    times = []
    for index in range(steps + 2):
        start = time.perf_counter()
        step(batches[index % len(batches)])
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for index in range(steps):
            step(batches[index % len(batches)])
    ops = {event.key: event.self_cpu_time_total / 1e3 / steps for event in profile.key_averages()}
    return ops, statistics.median(times[2:]) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, help="substring of a workload name")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default="", help="also sum the ONNX Runtime nodes whose names contain this")
    parser.add_argument("--no-torch", action="store_true", help="profile ONNX Runtime only")
    args = parser.parse_args()
    workload = workload_named(args.workload)
    ort, counts, run_ms, matched_ms = onnxruntime_ops(workload, args.steps, args.match)
    aten, step_ms = ({}, float("nan")) if args.no_torch else torch_ops(workload, args.steps)
    print(f"{workload.name}: ONNX Runtime run {run_ms:.1f} ms (kernels {sum(ort.values()):.1f}"
          + (f", nodes named *{args.match}* {matched_ms:.1f}" if args.match else "")
          + f"); torch eager step {step_ms:.1f} ms (profiled self CPU {sum(aten.values()):.1f})")
    left = sorted(ort.items(), key=lambda item: -item[1])[: args.top]
    right = sorted(aten.items(), key=lambda item: -item[1])[: args.top]
    print("| ONNX Runtime op (nodes) | ms/step | torch op | ms/step |\n|---|---|---|---|")
    for index in range(max(len(left), len(right))):
        a = f"{left[index][0]} ({counts[left[index][0]]}) | {left[index][1]:.2f}" if index < len(left) else " | "
        b = f"{right[index][0]} | {right[index][1]:.2f}" if index < len(right) else " | "
        print(f"| {a} | {b} |")


if __name__ == "__main__":
    main()
