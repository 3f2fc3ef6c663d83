"""Binary arithmetic: Where, Add, Sub, Mul, Div and Pow with broadcast inputs expanded first where
onnxruntime-training's gradient would not reduce to the input's shape (``broadcast_gradient``), Max and Min of
two inputs with torch.maximum's / minimum's gradient, and an Add of two quotients kept from ONNX Runtime's
ScaledSum fusion (``quotients_kept_apart``). One family because all are broadcasting elementwise ops of several
inputs, sharing the broadcast shape computation.
"""

import numpy as np
import onnx

from ._building import RewriteError, node_attributes, node_output, replace_nodes, where


def _broadcast_dims(shapes):
    """The shape broadcasting gives ``shapes`` (symbolic_shapes' form; None where it is unknown)."""
    rank = max(len(shape) for shape in shapes)
    result = []
    for dims in zip(*([1] * (rank - len(shape)) + list(shape) for shape in shapes)):
        sizes = {dim for dim in dims if dim != 1}
        sizes_known = {dim for dim in sizes if isinstance(dim, int)}
        if len(sizes) <= 1:
            result.append(sizes.pop() if sizes else 1)
        else:  # a dim_param against a size > 1 must equal it (or be 1) for the op to run
            result.append(sizes_known.pop() if len(sizes_known) == 1 and None not in sizes else None)
    return result


def _axes_misread(first, second) -> bool:
    """Whether onnxruntime-training's broadcast-gradient axes can be wrong for these two input
    shapes: with both fully named, it takes two different dim_params, or a dim_param and a size
    > 1, to be equal, and then leaves a broadcast axis unreduced (with an unknown size it
    computes the axes at run time, correctly)."""
    if None in first or None in second:
        return False
    pairs = zip(reversed(first), reversed(second))
    return any(a != b and 1 not in (a, b) and (isinstance(a, str) or isinstance(b, str)) for a, b in pairs)


def _runtime_broadcast_shape(build, shapes):
    """The shape the node's inputs broadcast to, computed at run time from their Shapes."""
    rank = max(len(shape) for shape in shapes)
    target = None
    for name, shape in zip(build.node.input, shapes):
        size = build.op("Shape", [name])
        if len(shape) < rank:
            size = build.op("Concat", [build.const([1] * (rank - len(shape)), np.int64), size], axis=0)
        target = size if target is None else where(build, build.op("Equal", [target, build.const(1, np.int64)]), size, target)
    return target


def _tiled(build, name, shape, target, rank):
    """``name`` (of ``shape``) repeated along its size-1 axes up to the shape ``target`` of
    ``rank``. Tile's gradient reshapes and sums with shapes taken at run time, so no inferred
    dim_param can mislead it."""
    if len(shape) < rank:
        name = build.unsqueeze(name, list(range(rank - len(shape))))
    one = build.const(1, np.int64)
    repeats = where(build, build.op("Equal", [build.op("Shape", [name]), one]), target, one)
    return build.op("Tile", [name, repeats])


def _broadcast_inputs(build, shapes, output, expanded):
    """{input index: the input broadcast to the output's shape} for the ``expanded`` inputs.

    Expand when its gradient's axes are readable (each expanded size is 1 or the output's), to
    a constant shape when every size is known, else the Shape of an input that has the
    output's shape, else the run-time broadcast; otherwise Tile (_tiled).
    """
    readable = all(dim in (1, size) for index in expanded for dim, size in zip(reversed(shapes[index]), reversed(output)))
    full = next((name for name, shape in zip(build.node.input, shapes) if shape == output), None)
    if readable and all(isinstance(dim, int) for dim in output):
        target = build.const(output, np.int64)
    elif readable and full is not None:
        target = build.op("Shape", [full])
    else:
        target = _runtime_broadcast_shape(build, shapes)
    if readable:
        return {index: build.op("Expand", [build.node.input[index], target]) for index in expanded}
    return {index: _tiled(build, build.node.input[index], shapes[index], target, len(output)) for index in expanded}


def broadcast_gradient(build):
    """Where, Add, Sub, Mul, Div, Pow, Max, Min with their broadcast inputs expanded to the output's
    shape first, where onnxruntime-training 1.19's gradient would not reduce to the input's shape:
    Where's and Pow's (base) never do; the others' do unless _axes_misread. Expand's and Tile's
    gradients sum over the broadcast axes, as torch's does. Other nodes are kept (returns False)."""
    node = build.node
    shapes = [build.facts.symbols.get(name) for name in node.input]
    if any(shape is None for shape in shapes):
        if node.op_type == "Where":
            raise RewriteError(f"Where node '{node.name}': the rank of an input is unknown, so its gradient cannot be "
                               "reduced to that input's shape")  # fmt: skip
        return False
    output = _broadcast_dims(shapes)
    differentiable = [index for index, name in enumerate(node.input)
                      if name not in build.constants and not (node.op_type == "Where" and index == 0)]  # fmt: skip
    misread = node.op_type in ("Where", "Pow") or any(_axes_misread(shapes[i], shapes[j]) for i in differentiable for j in range(i))
    expanded = [index for index in differentiable if shapes[index] != output] if misread else []
    if not expanded:
        return False
    broadcast = _broadcast_inputs(build, shapes, output, expanded)
    inputs = [broadcast.get(index, name) for index, name in enumerate(node.input)]
    build.op(node.op_type, inputs, node_output(build), **node_attributes(node))
    return True


def pairwise_extreme(build):
    """Max / Min of two inputs with torch.maximum's / minimum's gradient: dy to the larger (smaller) input, half to
    each at a tie, and all to both where either is NaN. ONNX Runtime's divides dy by the number of inputs equal to the
    output: 0 / 0 = NaN at a NaN output, which a mask after it (a NaN padding masked by where(isnan)) could not stop.
    The NaN case is a + b (NaN), a tie a / 2 + b / 2, otherwise the chosen input; inputs are first broadcast to the
    output's shape (``_broadcast_inputs``: their gradients sum back). More inputs: ``broadcast_gradient``."""
    node = build.node
    if len(node.input) != 2:
        return broadcast_gradient(build)
    shapes = [build.facts.symbols.get(name) for name in node.input]
    if any(shape is None for shape in shapes):
        return False
    output = _broadcast_dims(shapes)
    expanded = [index for index in (0, 1) if shapes[index] != output and node.input[index] not in build.constants]
    broadcast = _broadcast_inputs(build, shapes, output, expanded) if expanded else {}
    a, b = (broadcast.get(index, name) for index, name in enumerate(node.input))
    wins = build.op("Greater" if node.op_type == "Max" else "Less", [a, b])
    tie = build.op("Add", [build.op("Mul", [a, build.const(0.5)]), build.op("Mul", [b, build.const(0.5)])])
    ordered = where(build, build.op("Equal", [a, b]), tie, where(build, wins, a, b))
    nan = build.op("Or", [build.op("IsNaN", [a]), build.op("IsNaN", [b])])
    where(build, nan, build.op("Add", [a, b]), ordered, node_output(build))
    return True


def sum_of_quotients(build):
    """Add(a, b) as Sub(a, Neg(b)): the same values bit for bit (IEEE subtraction adds the negation) and gradients.
    For an Add of two Div outputs, which ONNX Runtime's training optimizer (ScaledSumFusion, inside
    ``get_optimized_model``, which takes no list of transformers to skip) fuses into a ScaledSum when the divisors
    are constant scalars: it has no CPU kernel (``a / 2 + b / 4`` was refused), multiplies by the reciprocal where
    torch divides, and with a third Add after it reads the input of that Add's other producer instead of its output."""
    a, b = build.node.input
    build.op("Sub", [a, build.op("Neg", [b])], node_output(build))
    return True


def quotients_kept_apart(model: onnx.ModelProto) -> list:
    """Replace, in place, each Add of two Div outputs by ``sum_of_quotients``' form; return the rewritten node names.
    For every training graph, before ONNX Runtime's training optimizer sees it."""
    producers = {output: node.op_type for node in model.graph.node for output in node.output}
    targets = [node for node in model.graph.node
               if node.op_type == "Add" and all(producers.get(name) == "Div" for name in node.input)]  # fmt: skip
    return replace_nodes(model, {"Add": sum_of_quotients}, targets) if targets else []
