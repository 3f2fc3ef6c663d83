"""The ranges of the integer indices a graph reads (embedding rows, class indices), as torch checks them:
the trainer checks each batch's indices against them before ONNX Runtime runs it."""

from dataclasses import dataclass

import onnx

from . import rewrites
from .graph_errors import describe_node
from .tensor_facts import shapes_at


@dataclass(frozen=True)
class IndexRange:
    """A graph input of integer indices and the range the op it feeds accepts, as torch checks it."""

    input: str
    size: int  # valid values are 0 .. size - 1
    ignore_index: object  # a value also accepted (a loss's ignore_index), or None
    consumer: str  # the op and module, for the error message


# Ops that pass indices through unchanged in value (a language model's labels.view(-1)).
_VALUE_PRESERVING = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Transpose"}


def index_ranges(model: onnx.ModelProto, sample_shapes: dict) -> list:
    """Integer graph inputs that reach an embedding lookup (Gather) or a class-index loss as
    indices, with the range torch accepts there: 0 .. rows - 1, 0 .. classes - 1 (or ignore_index).
    ``sample_shapes`` ({input: shape} of one batch) let shape inference find sizes a reshape
    computes (``logits.view(-1, vocab)``); the sizes used are those that do not depend on the batch.

    ONNX Runtime would accept negative indices (counted from the end) where torch raises,
    and fails out-of-range ones with a C++ message naming its own node; the trainer checks
    these ranges before each run instead (cheap: one comparison per index tensor).
    """
    integer_types = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    integer_inputs = [i.name for i in model.graph.input if i.name in sample_shapes and i.type.tensor_type.elem_type in integer_types]
    readers = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, position))
    shapes = shapes_at(model, sample_shapes)
    grown = {name: [size + 1 for size in shape] for name, shape in sample_shapes.items()}
    other = shapes_at(model, grown)  # a size that moves with the batch's shape is no fixed bound
    shapes = {name: [size if size == other.get(name, [None] * len(shape))[index] else None for index, size in enumerate(shape)]
              for name, shape in shapes.items() if len(other.get(name, [])) == len(shape)}  # fmt: skip
    found = []
    for name in integer_inputs:
        pending, seen = [name], set()
        while pending:
            tensor = pending.pop()
            for node, position in readers.get(tensor, []):
                if node.op_type in _VALUE_PRESERVING and position == 0 and id(node) not in seen:
                    seen.add(id(node))
                    pending.extend(node.output)
                    continue
                bound = _index_bound(node, position, shapes)
                if bound is not None:
                    found.append(IndexRange(name, bound[0], bound[1], describe_node(node)))
    return found


def _index_bound(node: onnx.NodeProto, position: int, shapes: dict):
    """(size, ignore_index) when ``node`` reads input ``position`` as indices into a static dimension."""
    if node.op_type == "Gather" and position == 1:
        axis = rewrites.node_attribute(node, "axis", 0)
        data = shapes.get(node.input[0])
        size = data[axis] if data and len(data) > axis else None
        return (size, None) if size else None
    if node.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and position == 1:
        scores = shapes.get(node.input[0])
        size = scores[1] if scores and len(scores) > 1 else None
        return (size, rewrites.node_attribute(node, "ignore_index")) if size else None
    return None
