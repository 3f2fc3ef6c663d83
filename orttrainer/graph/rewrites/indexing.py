"""Indexing and slicing: ops that move values to other positions, written so that their gradients are the cheap
or working ones: a Gather of one constant index as Split or Slice, a reversing Slice (torch.flip) and reflect or
edge Pad as Gathers or Slices of constant positions (``gathered``), DepthToSpace and SpaceToDepth as Reshape and
Transpose, and a Scatter with reduction 'add' in a form whose data gradient is torch's.
"""

import numpy as np
from onnx import helper, numpy_helper

from ._building import RewriteError, node_attribute, node_output


def depth_to_space(build):
    x = build.node.input[0]
    block = build.attribute("blocksize")
    channels, height, width = build.static_dims(x, [1, 2, 3])
    depth = channels // (block * block)
    if build.attribute("mode", "DCR") == "CRD":
        split, perm = [0, depth, block, block, height, width], [0, 1, 4, 2, 5, 3]
    else:
        split, perm = [0, block, block, depth, height, width], [0, 3, 4, 1, 5, 2]
    moved = build.op("Transpose", [build.op("Reshape", [x, build.const(split, np.int64)])], perm=perm)
    build.op("Reshape", [moved, build.const([0, depth, height * block, width * block], np.int64)], node_output(build))


def space_to_depth(build):
    x = build.node.input[0]
    block = build.attribute("blocksize")
    channels, height, width = build.static_dims(x, [1, 2, 3])
    split = build.op("Reshape", [x, build.const([0, channels, height // block, block, width // block, block], np.int64)])
    moved = build.op("Transpose", [split], perm=[0, 3, 5, 1, 2, 4])
    shape = [0, channels * block * block, height // block, width // block]
    build.op("Reshape", [moved, build.const(shape, np.int64)], node_output(build))


def _gather_index(build, node):
    """The index of a Gather of one constant scalar index (negatives resolved), else None."""
    if node.op_type != "Gather":
        return None
    data, indices = node.input
    value = build.constants.get(indices)
    if value is None or value.ndim != 0:
        return None
    index = int(value)
    if index < 0:
        (size,) = build.static_dims(data, [node_attribute(node, "axis", 0)])
        index += size
    return index


def constant_index_gather(build):
    """Gather of one constant index as Split or Slice, + Squeeze (nn.MultiheadAttention's q/k/v).

    Its GatherGrad locks a mutex per element (about 70 ms of a 2-layer encoder step).
    When such Gathers take indices 0..k-1 of one axis, one Split into k parts serves
    them all, the last part holding the rest of the axis (its gradient is one Concat,
    where k Slices need k padded copies and a Sum); otherwise each becomes a Slice.
    Other Gathers are kept (returns False).
    """
    index = _gather_index(build, build.node)
    if index is None:
        return False
    data, axis = build.node.input[0], build.attribute("axis", 0)
    siblings = [
        node for node in build.facts.consumers[data]
        if node.name in build.facts.targets and node.input[0] == data and node_attribute(node, "axis", 0) == axis
        and _gather_index(build, node) is not None
    ]  # fmt: skip
    count = len(siblings)
    if build.opset >= 13 and count > 1 and sorted(_gather_index(build, node) for node in siblings) == list(range(count)):
        parts = [f"{data}_split_{part}" for part in range(count)]
        if siblings[0] is build.node:  # the last part also holds the rest of the axis, if any
            size = build.op("Gather", [build.op("Shape", [data]), build.const([axis], np.int64)])
            rest = build.op("Sub", [size, build.const([count - 1], np.int64)])
            sizes = build.op("Concat", [build.const([1] * (count - 1), np.int64), rest], axis=0)
            build.nodes.append(helper.make_node("Split", [data, sizes], parts, name=build.fresh_name(), axis=axis))
        part = parts[index]
        if index == count - 1:
            part = build.op("Slice", [part, build.const([0], np.int64), build.const([1], np.int64), build.const([axis], np.int64)])
        build.squeeze(part, [axis], node_output(build))
        return True
    bounds = [build.const([index], np.int64), build.const([index + 1], np.int64), build.const([axis], np.int64)]
    build.squeeze(build.op("Slice", [data, *bounds]), [axis], node_output(build))
    return True


def gathered(build, x, axis, indices, output=None):
    return build.op("Gather", [x, build.const(np.asarray(indices, np.int64), np.int64)], output, axis=axis)


def _slice_indices(length: int, start: int, end: int, step: int) -> np.ndarray:
    """The indices ONNX Slice takes along an axis of ``length`` (negative bounds count from the end, then clamp)."""
    start, end = (bound + length if bound < 0 else bound for bound in (int(start), int(end)))
    if step > 0:
        start, end = min(max(start, 0), length), min(max(end, 0), length)
    else:
        start, end = min(max(start, 0), length - 1), min(max(end, -1), length - 1)
    return np.arange(start, end, step, dtype=np.int64)


def reversing_slice(build):
    """Slice with a negative step (torch.flip) as a Gather of constant indices per sliced axis
    (SliceGrad fails on such a Slice with a narrowing_error); a Slice of positive steps is kept."""
    if build.opset < 10:
        return False
    inputs = list(build.node.input) + [""] * (5 - len(build.node.input))
    if not inputs[4] or all(step > 0 for step in build.constant_input(4).reshape(-1)):
        return False
    starts, ends, steps = (build.constant_input(index).reshape(-1) for index in (1, 2, 4))
    rank = len(build.shape(build.node.input[0]))
    axes = build.constant_input(3).reshape(-1) if inputs[3] else np.arange(len(starts))
    sliced = build.node.input[0]
    for position, (axis, start, end, step) in enumerate(zip(axes, starts, ends, steps)):
        axis = int(axis) % rank
        output = node_output(build) if position == len(axes) - 1 else None
        length = build.shape(build.node.input[0])[axis]
        if length is None and (start, step) == (-1, -1) and end <= -_FLIPPED_TO:
            sliced = _reversed_at_run(build, sliced, axis, output)
            continue
        if length is None:
            raise RewriteError(f"Slice node '{build.node.name}' with step {step} (torch.flip, x[::-k]) along an axis whose "
                               "size changes with the batch: only a whole reversal (torch.flip) is taken there")  # fmt: skip
        sliced = gathered(build, sliced, axis, _slice_indices(length, start, end, int(step)), output)


# torch.flip's Slice ends at -2^63 + 1 or lower: before the first element of any axis
_FLIPPED_TO = 2**62


def _reversed_at_run(build, x, axis, output=None):
    """``x`` reversed along an ``axis`` whose size the graph does not fix: a Gather of size - 1 down to 0. The
    indices are size - 1 minus 0, 1, ...: ONNX Runtime's optimizer turns a Gather of Range(size - 1, -1, -1) into a
    Slice ending at -1, which reads as the last index, and the result came out empty (docs/stack_facts.md)."""
    size = build.op("Gather", [build.op("Shape", [x]), build.const(axis, np.int64)])
    counted = build.op("Range", [build.const(0, np.int64), size, build.const(1, np.int64)])
    indices = build.op("Sub", [build.op("Sub", [size, build.const(1, np.int64)]), counted])
    return build.op("Gather", [x, indices], output, axis=axis)


def _padding_indices(mode: str, length: int, before: int, after: int) -> np.ndarray:
    """The indices along an axis of ``length`` that ONNX Pad's reflect or edge mode reads (negative pads crop)."""
    if mode == "reflect" and max(before, after) > length - 1:
        raise RewriteError(f"reflect padding of {max(before, after)} on an axis of {length} (at most {length - 1})")
    if mode == "reflect":
        head, tail = np.arange(max(before, 0), 0, -1), np.arange(length - 2, length - 2 - max(after, 0), -1)
    else:
        head, tail = np.zeros(max(before, 0), np.int64), np.full(max(after, 0), length - 1)
    indices = np.concatenate([head, np.arange(length), tail]).astype(np.int64)
    return indices[max(-before, 0) : len(indices) - max(-after, 0)]


_SLICED_PADDING = 4  # at most this many positions a side are copied as one-wide Slices, more by a Gather


def _copied_along(build, x, axis, indices, head, length, output=None):
    """x's positions ``indices`` along ``axis``, the first ``head`` of them before x's own: for a padding
    of a few positions, one-wide Slices of those and x itself, concatenated (their gradients are cheap
    copies; a Gather's is a scatter); else (a long or cropping padding) a Gather."""
    middle = indices[head : head + length]
    tail = indices[head + length :]
    if head > _SLICED_PADDING or len(tail) > _SLICED_PADDING or not np.array_equal(middle, np.arange(length)):
        return gathered(build, x, axis, indices, output)
    axes = build.const([axis], np.int64)

    def position(index):
        return build.op("Slice", [x, build.const([int(index)], np.int64), build.const([int(index) + 1], np.int64), axes])

    pieces = [position(index) for index in indices[:head]] + [x] + [position(index) for index in tail]
    return build.op("Concat", pieces, output, axis=axis)


def edge_pad(build):
    """Pad in reflect or edge mode (torch's reflection and replication padding) as copies of constant
    positions per padded axis (``_copied_along``): ONNX Runtime's Pad gradient takes constant padding only.
    Constant padding is kept."""
    mode = build.attribute("mode", "constant")
    if mode == "constant":
        return False
    if mode not in ("reflect", "edge") or build.opset < 11 or (len(build.node.input) > 3 and build.node.input[3]):
        raise RewriteError(f"Pad node '{build.node.name}': mode {mode!r} (or its axes input) cannot be rewritten")
    x = build.node.input[0]
    rank = len(build.shape(x))
    pads = [int(pad) for pad in build.constant_input(1).reshape(-1)]
    padded_axes = [axis for axis in range(rank) if pads[axis] or pads[axis + rank]]
    padded = x
    for axis in padded_axes:
        (length,) = build.static_dims(x, [axis])
        try:
            indices = _padding_indices(mode, length, pads[axis], pads[axis + rank])
        except RewriteError as error:
            raise RewriteError(f"Pad node '{build.node.name}': {error}") from None
        output = node_output(build) if axis == padded_axes[-1] else None
        padded = _copied_along(build, padded, axis, indices, max(pads[axis], 0), length, output)
    if not padded_axes:
        build.op("Identity", [x], node_output(build))


def scatter_with_reduction(build):
    """ScatterElements / ScatterND with reduction 'add' (torch's scatter_add, index_add, index_put with
    accumulate=True, scatter_reduce 'sum') in a form whose data gradient is the output's: onnxruntime-training
    1.19.2's gradients of both ops ignore the reduction and clear the data's gradient where updates land, as for
    an overwrite. The updates are added into zeros, then the data: the zeros are -0, the identity of +, so where no
    update lands the output is the data itself (-0 and NaN kept); where some land it differs from torch's in-order
    sum by rounding only. 'mul', 'max' and 'min' (scatter_reduce's prod, amax, amin), whose gradients depend on the
    values, are refused."""
    reduction = build.attribute("reduction", "none")
    if reduction == "none":
        return False
    if reduction != "add":
        raise RewriteError(f"{build.node.op_type} with reduction='{reduction}' (torch's scatter_reduce with 'prod', "
                           "'amax' or 'amin'): onnxruntime-training's gradient of it ignores the reduction, so it would "
                           "not be torch's; compute it with torch outside the trained module, or from ops without "
                           "reduction")  # fmt: skip
    data, indices, updates = build.node.input
    negative_zero = numpy_helper.from_array(np.array([-0.0], np.float32))  # rewrites run before any float16 conversion
    zeros = build.op("ConstantOfShape", [build.op("Shape", [data])], value=negative_zero)
    axis = {"axis": build.attribute("axis", 0)} if build.node.op_type == "ScatterElements" else {}
    added = build.op(build.node.op_type, [zeros, indices, updates], reduction="add", **axis)
    build.op("Add", [data, added], node_output(build))
