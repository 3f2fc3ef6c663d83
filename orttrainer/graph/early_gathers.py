"""Gathers of rows moved above the row-wise ops that computed those rows, so that those ops compute only the rows
that are read.

A sequence classifier reads one position of its last layer's output (BERT's pooler takes the first token: a Gather
after the layer), yet that layer's feed-forward block, attention output projection, residual additions and layer
norms run over every position, forward and backward: about a sixth of the work of a 4-layer encoder. Every op a
Gather is moved above computes each row of its output from the same row of its inputs: elementwise ops (with
broadcasting), a MatMul's rows, a LayerNormalization or Softmax over other axes. So the rows the Gather keeps have
the values torch computes, and the weights' gradients lose only the zero rows of positions no loss reads.

A Gather moves above the op that wrote its input only where every reader of that tensor is a Gather of the same
rows (merged into one; so nothing else reads it, not what computes the indices), the tensor is no graph output, the
indices are a 0-d or 1-d tensor, and the op's other outputs are read by nothing. Which inputs of a broadcasting op carry the gathered axis is
read off the shapes of the batch the graph is built at: an input whose size there is the output's (and not 1) has
the axis, one of size 1 is broadcast along it; a size of 1 in the output leaves the Gather where it is.
"""

import onnx
from onnx import helper

from .graph_edits import node_inputs, remove_unused, sort_topologically
from .rewrites import node_attribute
from .tensor_facts import shapes_at

_ROW_BY_ROW = {"Identity", "Cast", "Erf", "Tanh", "Sigmoid", "Relu", "Sqrt", "Neg", "Exp", "Log", "Abs",
               "Reciprocal", "Softplus", "Dropout"}  # fmt: skip  (input 0 element by element)
_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Where"}
_OVER_AN_AXIS = {"LayerNormalization", "Softmax", "LogSoftmax"}  # each normalizes over its ``axis`` (LN: and after)


def gather_rows_early(model: onnx.ModelProto, sample_shapes: dict, kept=()) -> int:
    """Move, in place, each Gather of rows above the row-wise ops that computed them, as far as it goes; return how
    many moves were made. ``sample_shapes`` ({graph input: shape}) is the batch the graph is built at; ``kept``
    names Gathers never moved (embedding lookups: their gradient rules name them)."""
    shapes = shapes_at(model, sample_shapes)
    moves, touched = 0, set()
    while _move_one_gather(model.graph, shapes, set(kept), touched):
        moves += 1
    if moves:
        _merge_gathers_of_a_tensor(model.graph, set(kept))
        stale = [info for info in model.graph.value_info if info.name in touched]
        for info in stale:
            model.graph.value_info.remove(info)
        remove_unused(model.graph)
        sort_topologically(model.graph)
    return moves


def _move_one_gather(graph: onnx.GraphProto, shapes: dict, kept: set, touched: set) -> bool:
    """Move the first Gather that can move above the op that wrote its input (``_plan``); False if none can."""
    producer = {name: node for node in graph.node for name in node.output}
    readers = {}
    for node in graph.node:
        for name in set(node_inputs(node)):
            readers.setdefault(name, []).append(node)
    graph_outputs = {output.name for output in graph.output}
    for gather in graph.node:
        if gather.op_type != "Gather" or gather.domain not in ("", "ai.onnx") or gather.name in kept:
            continue
        data, indices = gather.input[0], gather.input[1]
        writer, rank = producer.get(data), len(shapes.get(data) or ())
        index_rank = len(shapes[indices]) if indices in shapes else None
        if writer is None or rank < 2 or index_rank not in (0, 1) or data in graph_outputs:
            continue
        axis = node_attribute(gather, "axis", 0) % rank
        same = [node for node in readers[data] if _gathers_alike(node, data, indices, axis, shapes)]
        if len(same) != len(readers[data]):  # read elsewhere, by what computes the indices too
            continue
        plan = _plan(writer, axis, index_rank == 0, shapes, readers, graph_outputs)
        if plan is None:
            continue
        _merge_gathers(same)
        _move_above(graph, gather, writer, plan, index_rank == 0, shapes, touched)
        return True
    return False


def _gathers_alike(node, data: str, indices: str, axis: int, shapes: dict) -> bool:
    """Whether ``node`` gathers ``indices`` along ``axis`` of ``data``."""
    if node.op_type != "Gather" or node.input[0] != data or node.input[1] != indices:
        return False
    return node_attribute(node, "axis", 0) % len(shapes[data]) == axis


def _plan(writer, axis: int, removes_axis: bool, shapes: dict, readers: dict, graph_outputs: set):
    """{input index: axis of that input to gather} for moving a Gather along ``axis`` of ``writer``'s first output
    above ``writer``; None where it cannot move (``removes_axis``: a 0-d index, which drops the axis)."""
    if writer.domain not in ("", "ai.onnx") or any(readers.get(name) or name in graph_outputs for name in writer.output[1:]):
        return None
    output = shapes.get(writer.output[0])
    if output is None or output[axis] in (None, 1):
        return None
    if writer.op_type in _ROW_BY_ROW:
        return {0: axis}
    if writer.op_type in _OVER_AN_AXIS:
        normalized = node_attribute(writer, "axis", -1) % len(output)
        moves = axis < normalized if writer.op_type == "LayerNormalization" else axis != normalized
        return {0: axis} if moves else None
    if writer.op_type == "MatMul":
        left, right = shapes.get(writer.input[0]), shapes.get(writer.input[1])
        moves = left is not None and right is not None and len(right) == 2 and len(left) == len(output)
        return {0: axis} if moves and axis <= len(left) - 2 else None
    if writer.op_type in _BROADCASTING:
        return _broadcast_plan(writer, axis, removes_axis, output, shapes)
    return None


def _broadcast_plan(writer, axis: int, removes_axis: bool, output: list, shapes: dict):
    """``_plan`` of an elementwise op with broadcasting: gather each input that has the axis (its size the output's),
    leave one that lacks it; an input broadcast along it (size 1) stays only where the Gather keeps the axis."""
    plan = {}
    for index, name in enumerate(writer.input):
        shape = shapes.get(name)
        if shape is None:
            return None
        own_axis = axis - (len(output) - len(shape))
        if own_axis < 0:
            continue
        if shape[own_axis] == output[axis]:
            plan[index] = own_axis
        elif shape[own_axis] != 1 or removes_axis:
            return None
    return plan


def _merge_gathers(same: list) -> None:
    """Keep the first of the alike Gathers ``same``; each other becomes an Identity of its output."""
    first = same[0]
    for other in same[1:]:
        other.op_type, other.input[:] = "Identity", [first.output[0]]
        del other.attribute[:]


def _merge_gathers_of_a_tensor(graph: onnx.GraphProto, kept: set) -> None:
    """One Gather for the Gathers of the same rows of the same tensor (moves leave two where a residual and the op
    beside it read one input)."""
    alike = {}
    for node in graph.node:
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.name not in kept:
            alike.setdefault((node.input[0], node.input[1], node_attribute(node, "axis", 0)), []).append(node)
    for same in alike.values():
        _merge_gathers(same)


def _move_above(graph, gather, writer, plan: dict, removes_axis: bool, shapes: dict, touched: set) -> None:
    """Gather each input of ``plan`` instead, have ``writer`` write the Gather's output, drop the Gather."""
    indices, count = gather.input[1], shapes[gather.input[1]]  # [] for a 0-d index, [n] for n indices
    for index, own_axis in plan.items():
        source = writer.input[index]
        gathered = f"{source}/rows/{gather.name}"
        graph.node.append(helper.make_node("Gather", [source, indices], [gathered], name=f"{gather.name}/{writer.name}.{index}",
                                           axis=own_axis))  # fmt: skip
        shape = list(shapes[source])
        shape[own_axis : own_axis + 1] = count
        shapes[gathered] = shape
        writer.input[index] = gathered
    touched.update([writer.output[0], *writer.output[1:]])
    writer.output[0] = gather.output[0]
    if removes_axis and writer.op_type in _OVER_AN_AXIS:
        axis_attribute = next((attribute for attribute in writer.attribute if attribute.name == "axis"), None)
        if axis_attribute is not None and axis_attribute.i > node_attribute(gather, "axis", 0) % (len(shapes[gather.input[0]])):
            axis_attribute.i -= 1
    graph.node.remove(gather)
