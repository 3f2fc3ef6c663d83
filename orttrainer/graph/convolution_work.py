"""How much work a graph's convolutions do, per image and per batch: it chooses one intra-op thread for
small CNNs, and whether a graph is worth cutting for torch's convolution kernels (torch_convolutions.py)."""

import numpy as np
import onnx

from . import rewrites
from .tensor_facts import shapes_at


# Below this many multiply-accumulates per image, a convolution is cheaper on one CPU thread
# than the thread-pool wake-ups ONNX Runtime's Conv/ConvGrad pay per image (benchmarks/NOTES.md §8).
SMALL_CONVOLUTION_MACS = 1_000_000
# Below this many multiply-accumulates per convolution on a batch (their total over the batch divided by
# their number), a graph runs faster whole than cut for torch's convolutions: each convolution adds
# boundaries that cost the same at any batch size, while what torch's kernels save grows with the
# batch (benchmarks/NOTES.md §26, §34).
SPLIT_CONVOLUTION_MACS = 3_000_000


def _macs_per_sample(node: onnx.NodeProto, shapes: dict):
    """Multiply-accumulates of a Conv, Gemm or MatMul per sample (dim 0), or None if unknown."""
    output = shapes.get(node.output[0])
    if node.op_type == "Conv":
        weight = shapes.get(node.input[1])
        dims = (weight or [None]) + (output or [None, None])[2:]
    elif node.op_type in ("Gemm", "MatMul"):
        first = shapes.get(node.input[0])
        transposed = node.op_type == "Gemm" and rewrites.node_attribute(node, "transA", 0)
        contraction = None if not first else first[0] if transposed else first[-1]
        dims = (output or [None, None])[1:] + [contraction]
    else:
        return None
    return None if None in dims else int(np.prod(dims))


def _work_per_sample(model: onnx.ModelProto, sample_shapes: dict) -> list:
    """(node, multiply-accumulates per sample) of each Conv, Gemm and MatMul of known shapes on a batch of
    ``sample_shapes`` ({graph input: shape}; an input not given keeps its declared shape); [] for a graph without
    convolutions (the questions asked of it are about convolutions).

    The forward graph answers for the training and eval graphs built from it: they hold the
    same Conv, Gemm and MatMul nodes on tensors of the same shapes.
    """
    if not any(node.op_type == "Conv" for node in model.graph.node):
        return []
    shapes = shapes_at(model, sample_shapes)
    work = [(node, _macs_per_sample(node, shapes)) for node in model.graph.node]
    return [(node, macs) for node, macs in work if macs is not None]


def small_convolutions_dominate(model: onnx.ModelProto, sample_shapes: dict) -> bool:
    """True when convolutions below ``SMALL_CONVOLUTION_MACS`` per image do most of the work on a batch of
    ``sample_shapes`` (the first batch's: a graph generic in the image size serves the others as it chose).

    Such graphs (LeNet-sized CNNs) train faster with one intra-op thread: ONNX Runtime's
    CPU Conv and ConvGrad open a thread-pool section per image, and with spinning off
    each costs a wake-up of the second thread worth more than its share of the work.
    """
    work = _work_per_sample(model, sample_shapes)
    small = sum(macs for node, macs in work if node.op_type == "Conv" and macs < SMALL_CONVOLUTION_MACS)
    return small > sum(macs for _, macs in work) / 2


def convolutions_worth_splitting(model: onnx.ModelProto, sample_shapes: dict) -> bool:
    """True when the convolutions average at least ``SPLIT_CONVOLUTION_MACS`` each on a batch of
    ``sample_shapes`` ({graph input: shape}, the first batch's; an input not given keeps its declared
    shape, and a batch size still unknown counts as 1) (torch_convolutions.py).

    One graph may serve batches of other sizes (a shape-generic trace): the first batch chooses for them.
    """
    convolutions = [node for node in model.graph.node if node.op_type == "Conv"]
    shapes = shapes_at(model, sample_shapes) if convolutions else {}
    work = []
    for node in convolutions:
        per_sample = _macs_per_sample(node, shapes)
        if per_sample is not None:
            work.append(per_sample * (shapes[node.output[0]][0] or 1))
    return bool(work) and sum(work) >= SPLIT_CONVOLUTION_MACS * len(work)
