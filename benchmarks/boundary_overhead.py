"""What one graph boundary would cost: a graph run as two ONNX Runtime sessions against one.

    python benchmarks/boundary_overhead.py

Splitting the training graph around convolutions run by torch (issue 17) adds, per boundary,
one more session run whose input is the previous run's output, handed across by IO binding
on the same buffer (no copy). This times a chain of ``nodes`` ReLUs on a [32, 64, 8, 8] tensor
(the ResNet workload's last stage) run as one session and as two sessions of half the chain
each, alternating, with the trainer's session options; the difference is the boundary's cost.
"""

import statistics
import time

import numpy as np
import onnxruntime
import torch
from onnx import TensorProto, helper

from orttrainer.runtime.session import session_options

SHAPE = [32, 64, 8, 8]


def _chain(length):
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(length)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info(f"t{length}", TensorProto.FLOAT, SHAPE)])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = onnxruntime.InferenceSession(model.SerializeToString(), session_options(),
                                           providers=["CPUExecutionProvider"])  # fmt: skip
    return session, f"t{length}"


def _bound_run(session, output, value):
    binding = session.io_binding()
    binding.bind_ortvalue_input("t0", value)
    binding.bind_output(output, "cpu")
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0]


def main(nodes=8, repeats=300):
    whole, whole_output = _chain(nodes)
    half, half_output = _chain(nodes // 2)
    value = onnxruntime.OrtValue.ortvalue_from_numpy(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))
    one, two = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        _bound_run(whole, whole_output, value)
        one.append(time.perf_counter() - start)
        start = time.perf_counter()
        _bound_run(half, half_output, _bound_run(half, half_output, value))
        two.append(time.perf_counter() - start)
    one_ms, two_ms = statistics.median(one) * 1e3, statistics.median(two) * 1e3
    print(f"{torch.get_num_threads()} threads, {nodes} ReLUs on {SHAPE}: one session {one_ms:.3f} ms, "
          f"two sessions {two_ms:.3f} ms, per boundary {two_ms - one_ms:.3f} ms")


if __name__ == "__main__":
    main()
