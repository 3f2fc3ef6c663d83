"""GEMMs of a training graph against the same GEMMs run alone in ONNX Runtime.

    python benchmarks/gemm_efficiency.py --workload encoder [--steps 10] [--top 12]

Issue 17 asks the training graph's GEMMs to run at >= 90% of ONNX Runtime's own rate on the
same shapes. Every GEMM node of the graph ONNX Runtime ran (after its fusions: Gemm, MatMul,
FusedMatMul, FusedGemm) is timed in the trainer's run (session profiling, median over steps)
and alone: a one-node model with the same op, attributes and input shapes, the same session
options (threads, no spinning), its kernel time from session profiling too. Reported per node and in total: efficiency =
time alone / time in the graph.
"""

import argparse
import json
import os
import statistics
import tempfile
from collections import defaultdict

import numpy as np
import onnx
import onnxruntime
from onnx import helper
from op_profile import profiled_kernels
from workloads import workload_named

from orttrainer.runtime.session import session_options

GEMM_OPS = ("Gemm", "MatMul", "FusedMatMul", "FusedGemm")


def _shapes(types) -> list:
    """Profiler ``input_type_shape`` / ``output_type_shape`` ([{"float": [dims]}, ...]) as lists of dims."""
    return [list(entry.values())[0] for entry in types]


def _flops(node: onnx.NodeProto, inputs, output) -> float:
    attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
    a = inputs[0]
    if node.op_type in ("Gemm", "FusedGemm"):
        contraction = a[0] if attributes.get("transA", 0) else a[1]
    else:
        contraction = a[-2] if attributes.get("transA", 0) and not attributes.get("transBatchA", 0) else a[-1]
    return 2.0 * float(np.prod(output)) * contraction


def _alone_ms(node: onnx.NodeProto, input_shapes, opsets, runs: int) -> float:
    """Median kernel ms of ``node`` alone on random float32 inputs of ``input_shapes``."""
    names = [name for name in node.input if name]
    inputs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape) for name, shape in zip(names, input_shapes)]
    outputs = [helper.make_empty_tensor_value_info(name) for name in node.output if name]
    model = helper.make_model(helper.make_graph([node], "gemm", inputs, outputs), opset_imports=opsets, ir_version=9)
    options = session_options()  # as the trainer's sessions: torch's threads, no spinning
    options.enable_profiling = True
    generator = np.random.default_rng(0)
    feeds = {name: generator.standard_normal(shape).astype(np.float32) for name, shape in zip(names, input_shapes)}
    with tempfile.TemporaryDirectory() as folder:
        options.profile_file_prefix = os.path.join(folder, "alone")
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for _ in range(runs + 3):
            session.run(None, feeds)
        events = json.loads(open(session.end_profiling()).read())
    durations = [event["dur"] / 1e3 for event in events if event.get("cat") == "Node" and event["name"].endswith("_kernel_time")]
    return statistics.median(durations[3:])


def gemm_efficiency(workload, steps: int):
    """Rows (op, input shapes, ms in graph, ms alone, GFLOP) per GEMM node, heaviest first, and the
    median ms of the whole run."""
    with tempfile.TemporaryDirectory() as folder:
        optimized_path = os.path.join(folder, "optimized.onnx")
        runs, kernels = profiled_kernels(workload, steps, optimized_path)
        optimized = onnx.load(optimized_path)
    nodes = {node.name: node for node in optimized.graph.node}
    in_graph, shapes = defaultdict(list), {}
    for events in kernels:
        for event in events:
            name = event["name"][: -len("_kernel_time")]
            if event["args"]["op_name"] in GEMM_OPS and name in nodes:
                in_graph[name].append(event["dur"] / 1e3)
                shapes[name] = (_shapes(event["args"]["input_type_shape"]), _shapes(event["args"]["output_type_shape"])[0])
    rows = []
    for name, durations in in_graph.items():
        node, (inputs, output) = nodes[name], shapes[name]
        gflop = _flops(node, inputs, output) / 1e9
        rows.append((node.op_type, inputs, statistics.median(durations), _alone_ms(node, inputs, optimized.opset_import, 20), gflop))
    return sorted(rows, key=lambda row: -row[2]), statistics.median(run["dur"] / 1e3 for run in runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, help="substring of a workload name")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    workload = workload_named(args.workload)
    rows, run_ms = gemm_efficiency(workload, args.steps)
    graph_total, alone_total = sum(row[2] for row in rows), sum(row[3] for row in rows)
    print(f"{workload.name}: {len(rows)} GEMM nodes, {graph_total:.1f} ms per step in the graph (run {run_ms:.1f} ms), "
          f"{alone_total:.1f} ms alone: efficiency {alone_total / graph_total:.0%}")
    print("| op | input shapes | ms in graph | ms alone | efficiency | GFLOP/s in graph |\n|---|---|---|---|---|---|")
    for op, inputs, graph_ms, alone_ms, gflop in rows[: args.top]:
        print(f"| {op} | {' x '.join(map(str, inputs))} | {graph_ms:.2f} | {alone_ms:.2f} | {alone_ms / graph_ms:.0%} | "
              f"{gflop / graph_ms * 1e3:.0f} |")


if __name__ == "__main__":
    main()
