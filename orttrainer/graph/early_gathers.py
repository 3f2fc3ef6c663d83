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
indices are a 0-d or 1-d tensor, and the op's other outputs are read by nothing.

A Gather of the rows of a 2-d flattening of a tensor (GPT-2's classifier reads each sequence's last token as
``logits.flatten(0, 1)[batch * length + last]``; its Conv1D layers flatten their input, compute, and reshape back)
moves as a Gather of the flattened rows of that tensor: above row-wise ops, and above a Reshape that keeps the last
(static) size. What reads only the shape of a tensor the rows leave (the index's arithmetic reads the logits' length)
reads it from the op's inputs instead (``_shape_from_inputs``). Which inputs of a broadcasting op carry the gathered axis is
read off the shapes of the batch the graph is built at: an input whose size there is the output's (and not 1) has
the axis, one of size 1 is broadcast along it; a size of 1 in the output leaves the Gather where it is.
"""

import math

import onnx
from onnx import helper

from .graph_edits import node_inputs, remove_unused, sort_topologically
from .rewrites import node_attribute, symbolic_shapes
from .tensor_facts import shapes_at

_ROW_BY_ROW = {"Identity", "Cast", "Erf", "Tanh", "Sigmoid", "Relu", "Sqrt", "Neg", "Exp", "Log", "Abs",
               "Reciprocal", "Softplus", "Dropout"}  # fmt: skip  (input 0 element by element)
_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Where"}
_OVER_AN_AXIS = {"LayerNormalization", "Softmax", "LogSoftmax"}  # each normalizes over its ``axis`` (LN: and after)
_OVER_THE_LAST_AXIS = {"ReduceMean", "ReduceMax", "ReduceMin"}  # with ``axes`` an attribute (opset < 18)


def gather_rows_early(model: onnx.ModelProto, sample_shapes: dict, kept=()) -> int:
    """Move, in place, each Gather of rows above the row-wise ops that computed them, as far as it goes; return how
    many moves were made. ``sample_shapes`` ({graph input: shape}) is the batch the graph is built at; ``kept``
    names Gathers never moved (embedding lookups: their gradient rules name them)."""
    shapes, static = shapes_at(model, sample_shapes), symbolic_shapes(model)
    moves, touched = 0, set()
    while _move_one_gather(model.graph, shapes, static, set(kept), touched):
        moves += 1
        remove_unused(model.graph)  # what only the moved ops read (a Reshape's target shape) reads nothing now
    if moves:
        _merge_gathers_of_a_tensor(model.graph, set(kept))
        stale = [info for info in model.graph.value_info if info.name in touched]
        for info in stale:
            model.graph.value_info.remove(info)
        remove_unused(model.graph)
        sort_topologically(model.graph)
    return moves


def _move_one_gather(graph: onnx.GraphProto, shapes: dict, static: dict, kept: set, touched: set) -> bool:
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
        others = [node for node in readers[data] if node not in same]  # read elsewhere: only its shape, or no move
        if any(node.op_type != "Shape" for node in others):
            continue
        flattened = _rows_flattened(writer, data, shapes, static) if axis == 0 and index_rank == 1 else None
        if flattened is not None:
            if _move_flattened_rows(graph, gather, writer, flattened, same + others, shapes, static, producer, readers,
                                    graph_outputs, touched):  # fmt: skip
                return True
            continue
        plan = _plan(writer, axis, index_rank == 0, shapes, readers, graph_outputs)
        if plan is None or not all(_shape_from_inputs(graph, node, writer, shapes) for node in others):
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
    if writer.op_type == "Gemm" and axis == 0 and not removes_axis and not node_attribute(writer, "transA", 0):
        bias = shapes.get(writer.input[2]) if len(writer.input) > 2 else []
        if bias is None or (len(bias) == 2 and bias[0] not in (1, output[0])):
            return None
        return {0: 0, **({2: 0} if len(bias) == 2 and bias[0] == output[0] else {})}
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
        gathered = _fresh_name(graph, f"{source}/rows/{gather.name}")
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


def _rows_flattened(writer, data: str, shapes: dict, static: dict):
    """The tensor whose rows the 2-d ``data`` lists in order (``writer``'s input: a Flatten before its last axis, or a
    Reshape to 2-d that keeps a static last size), or None."""
    if writer.op_type not in ("Flatten", "Reshape") or len(shapes[data]) != 2:
        return None
    source = writer.input[0]
    source_shape, last, own_last = shapes.get(source), (static.get(source) or [None])[-1], (static.get(data) or [None])[-1]
    if source_shape is None or len(source_shape) < 2:
        return None
    if writer.op_type == "Flatten":
        return source if node_attribute(writer, "axis", 1) % len(source_shape) == len(source_shape) - 1 else None
    return source if isinstance(last, int) and last == own_last else None


def _move_flattened_rows(graph, gather, flatten, source: str, same: list, shapes, static, producer, readers, graph_outputs,
                         touched) -> bool:  # fmt: skip
    """Move a Gather of the rows of ``flatten`` (``_rows_flattened``: the rows of ``source``) above the op that wrote
    ``source``, as Gathers of its inputs' flattened rows; False where it cannot (``_flat_plan``). ``same``: the alike
    Gathers of ``flatten``'s output, and the Shapes that read it."""
    shapes_of_flat = [node for node in same if node.op_type == "Shape"]
    same = [node for node in same if node.op_type != "Shape"]
    writer = producer.get(source)
    leading = shapes[source][:-1]
    if writer is None or source in graph_outputs or any(size is None or size < 2 for size in leading):
        return False
    dying = _dying_with(flatten, producer, readers, graph_outputs)
    others = [node for node in readers[source] if node is not flatten and id(node) not in dying]
    if any(node.op_type != "Shape" for node in others):
        return False
    plan = _flat_plan(writer, source, shapes, static, readers, graph_outputs)
    if plan is None or not all(_shape_from_inputs(graph, node, flatten, shapes) for node in shapes_of_flat):
        return False
    # the shapes just read from ``source`` (through ``flatten``) and those read before: from ``writer``'s inputs
    others = [node for node in graph.node if node.op_type == "Shape" and node.input[0] == source and id(node) not in dying]
    if not all(_shape_from_inputs(graph, node, writer, shapes) for node in others):
        return False
    _merge_gathers(same)
    indices = gather.input[1]
    if plan == "through":  # a Reshape that keeps the last size: the rows of its input, in the same order
        graph.node.append(_flattened_rows_node(graph, writer.input[0], indices, gather.output[0], shapes, gather.name))
    else:
        for index in plan:
            name = writer.input[index]
            gathered = _fresh_name(graph, f"{name}/rows/{gather.name}")
            graph.node.append(_flattened_rows_node(graph, name, indices, gathered, shapes, f"{gather.name}/{writer.name}.{index}"))
            writer.input[index] = gathered
        touched.update(writer.output)
        writer.output[0] = gather.output[0]
        for attribute in writer.attribute:
            if attribute.name == "axis" and writer.op_type in _OVER_AN_AXIS:
                attribute.i = -1
            if attribute.name == "axes" and writer.op_type in _OVER_THE_LAST_AXIS:
                attribute.ints[:] = [-1]
    graph.node.remove(gather)
    return True


def _flat_plan(writer, source: str, shapes: dict, static: dict, readers: dict, graph_outputs: set):
    """The inputs of ``writer`` (which wrote ``source``) whose flattened rows to gather for the rows of ``source``:
    a list of input indices, "through" for a Reshape that keeps the last size, or None where it cannot move."""
    if writer.domain not in ("", "ai.onnx") or any(readers.get(name) or name in graph_outputs for name in writer.output[1:]):
        return None
    shape = shapes[source]
    if writer.op_type in _ROW_BY_ROW:
        return [0]
    if writer.op_type in _OVER_AN_AXIS:
        normalized = node_attribute(writer, "axis", -1) % len(shape)
        return [0] if normalized == len(shape) - 1 else None
    if writer.op_type == "MatMul":
        left, right = shapes.get(writer.input[0]), shapes.get(writer.input[1])
        return [0] if left is not None and right is not None and len(right) == 2 and len(left) == len(shape) else None
    if writer.op_type == "Reshape":
        before, last = writer.input[0], (static.get(source) or [None])[-1]
        return "through" if isinstance(last, int) and (static.get(before) or [None])[-1] == last else None
    if writer.op_type in _OVER_THE_LAST_AXIS and node_attribute(writer, "keepdims", 1):
        axes = node_attribute(writer, "axes", None)
        return [0] if axes is not None and [axis % len(shape) for axis in axes] == [len(shape) - 1] else None
    if writer.op_type in _BROADCASTING:
        plan = []
        for index, name in enumerate(writer.input):
            own = shapes.get(name)
            if own is not None and len(own) == len(shape) and own[:-1] == shape[:-1] and own[-1] in (1, shape[-1]):
                plan.append(index)  # its rows, of the same width or one value each (an RMSNorm's scale)
            elif own is None or not (len(own) <= 1 or (len(own) == 2 and own[0] == 1)):
                return None
        return plan
    return None


def _flattened_rows_node(graph, name: str, indices: str, output: str, shapes: dict, node_name: str):
    """A Gather of rows ``indices`` of ``name`` flattened to 2-d before its last axis (a Flatten first where it has
    more than 2 dims); the Gather is returned, the Flatten appended. Where those rows are gathered already (a
    residual and the op beside it read one tensor), an Identity of them."""
    shape = shapes[name]
    existing = _flattened_rows_of(graph, name, indices, len(shape))
    if existing is not None:
        return helper.make_node("Identity", [existing], [output], name=node_name)
    flat = name
    if len(shape) > 2:
        flat = _fresh_name(graph, f"{name}/flattened/{node_name}")
        graph.node.append(helper.make_node("Flatten", [name], [flat], name=f"{node_name}/flatten", axis=len(shape) - 1))
        shapes[flat] = [math.prod(shape[:-1]), shape[-1]]
    shapes[output] = shapes[indices] + shapes[flat][1:]
    return helper.make_node("Gather", [flat, indices], [output], name=node_name, axis=0)


def _flattened_rows_of(graph, name: str, indices: str, rank: int):
    """The output of a Gather of rows ``indices`` of ``name`` flattened before its last axis, if the graph has one."""
    flattened = {name} if rank == 2 else {node.output[0] for node in graph.node if node.op_type == "Flatten"
                                          and node.input[0] == name and node_attribute(node, "axis", 1) == rank - 1}  # fmt: skip
    return next((node.output[0] for node in graph.node if node.op_type == "Gather" and node.input[0] in flattened
                 and node.input[1] == indices and node_attribute(node, "axis", 0) == 0), None)  # fmt: skip


def _fresh_name(graph, name: str) -> str:
    """``name``, or it with a suffix where a node of the graph already writes a tensor of that name."""
    taken = {output for node in graph.node for output in node.output}
    fresh, count = name, 0
    while fresh in taken:
        count += 1
        fresh = f"{name}.{count}"
    return fresh


def _dying_with(node, producer: dict, readers: dict, graph_outputs: set) -> set:
    """ids of ``node`` and the nodes that compute only what it reads (a Reshape's target shape)."""
    dying, pending = {id(node)}, [node]
    while pending:
        for name in pending.pop().input:
            source = producer.get(name)
            if source is None or id(source) in dying or any(output in graph_outputs for output in source.output):
                continue
            if all(id(reader) in dying for output in source.output for reader in readers.get(output, [])):
                dying.add(id(source))
                pending.append(source)
    return dying


def _shape_from_inputs(graph, shape_node, writer, shapes: dict) -> bool:
    """Have ``shape_node`` (a Shape of ``writer``'s first output) compute that shape from ``writer``'s inputs, so that it
    reads nothing the moved rows leave; False where no rule knows the op (then nothing is changed)."""
    output = writer.output[0]
    if writer.op_type in _ROW_BY_ROW or writer.op_type in _OVER_AN_AXIS:
        shape_node.input[0] = writer.input[0]
        return True
    if writer.op_type in _BROADCASTING:  # an input of the output's shape, every size known and above 1 (not broadcast)
        known = shapes.get(output) is not None and all(isinstance(size, int) and size > 1 for size in shapes[output])
        alike = [name for name in writer.input if known and shapes.get(name) == shapes[output]]
        if alike:
            shape_node.input[0] = alike[0]
        return bool(alike)
    if writer.op_type == "MatMul":
        left, right = writer.input[0], writer.input[1]
        if len(shapes.get(right) or ()) != 2 or len(shapes.get(left) or ()) != len(shapes[output]):
            return False
        full = _new_node(graph, "Concat", [_new_node(graph, "Shape", [left], end=-1), _new_node(graph, "Shape", [right], start=1)], axis=0)
    elif writer.op_type == "Gemm":
        rows = 1 if node_attribute(writer, "transA", 0) else 0
        columns = 0 if node_attribute(writer, "transB", 0) else 1
        full = _new_node(graph, "Concat", [_new_node(graph, "Shape", [writer.input[0]], start=rows, end=rows + 1),
                                           _new_node(graph, "Shape", [writer.input[1]], start=columns, end=columns + 1)],
                         axis=0)  # fmt: skip
    elif writer.op_type == "Flatten":
        axis = node_attribute(writer, "axis", 1) % max(len(shapes.get(writer.input[0]) or ()), 1)
        full = _new_node(graph, "Concat", [_new_node(graph, "ReduceProd", [_new_node(graph, "Shape", [writer.input[0]], end=axis)],
                                                     keepdims=1),
                                           _new_node(graph, "ReduceProd", [_new_node(graph, "Shape", [writer.input[0]], start=axis)],
                                                     keepdims=1)], axis=0)  # fmt: skip
    elif writer.op_type == "Reshape" and not node_attribute(writer, "allowzero", 0):
        full = _reshaped_shape(graph, writer)
    else:
        return False
    start, end = node_attribute(shape_node, "start", 0), node_attribute(shape_node, "end", None)
    del shape_node.attribute[:]
    if start == 0 and end is None:
        shape_node.op_type, shape_node.input[:] = "Identity", [full]
    else:
        bounds = [_constant(graph, [start]), _constant(graph, [end if end is not None else 2**62])]
        shape_node.op_type, shape_node.input[:] = "Slice", [full, *bounds]
    return True


def _reshaped_shape(graph, reshape):
    """The shape a Reshape (allowzero 0) gives, from its input's shape and its target: a 0 copies the input's size,
    a -1 takes what the other sizes leave of the input's count."""
    data, target = reshape.input[0], reshape.input[1]
    data_shape = _new_node(graph, "Shape", [data])
    count = _new_node(graph, "ReduceProd", [data_shape], keepdims=1)
    target_length = _new_node(graph, "Shape", [target])
    # the input's sizes lined up with the target's (a 0 past the input's rank is no valid Reshape: 1s there)
    padded = _new_node(graph, "Concat", [data_shape, _new_node(graph, "Expand", [_constant(graph, [1]), target_length])], axis=0)
    copied = _new_node(graph, "Where", [_new_node(graph, "Equal", [target, _constant(graph, [0])]),
                                        _new_node(graph, "Slice", [padded, _constant(graph, [0]), target_length]),
                                        target])  # fmt: skip
    inferred = _new_node(graph, "Equal", [copied, _constant(graph, [-1])])
    known = _new_node(graph, "ReduceProd", [_new_node(graph, "Where", [inferred, _constant(graph, [1]), copied])], keepdims=1)
    return _new_node(graph, "Where", [inferred, _new_node(graph, "Div", [count, known]), copied])


def _new_node(graph, op_type: str, inputs: list, **attributes) -> str:
    """Append a node of a fresh name; its output."""
    name = f"early_gathers/{op_type}_{len(graph.node)}"
    while any(node.name == name for node in graph.node):
        name += "_"
    graph.node.append(helper.make_node(op_type, inputs, [name], name=name, **attributes))
    return name


def _constant(graph, values) -> str:
    return _new_node(graph, "Constant", [], value=helper.make_tensor("value", onnx.TensorProto.INT64, [len(values)], values))
