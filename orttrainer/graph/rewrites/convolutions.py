"""Convolutions: ConvTranspose as a Conv of the zero-interleaved input (no CPU gradient kernel for
ConvTranspose), a Conv's ``auto_pad`` written out as pads (ONNX Runtime's ConvGrad ignores it), and grouped
1-d and 3-d Convs in forms whose gradients ONNX Runtime's CPU kernel computes in bounds; with the graph-wide
passes ``explicit_convolution_pads`` and ``grouped_convolutions``. One family because they share the Conv
attribute reading and the Split of a tensor into groups.
"""

import numpy as np
import onnx
from onnx import helper

from ._building import RewriteError, node_attribute, node_output, replace_nodes
from .shapes import static_shapes, symbolic_shapes


def _transposed_kernel(build, weight, shape, groups):
    """ConvTranspose's weight [C_in, C_out / g, k...] (of static ``shape``) as the equivalent Conv's
    [C_out, C_in / g, k...], spatially flipped; computed in the graph, so the trained tensor
    stays the original weight."""
    spatial = list(range(2, len(shape)))
    parts = _split(build, weight, 0, [shape[0] // groups] * groups) if groups > 1 else [weight]
    merged = build.op("Concat", [build.op("Transpose", [part], perm=[1, 0, *spatial]) for part in parts], axis=0)
    for axis, size in zip(spatial, shape[2:]):
        merged = _reversed(build, merged, axis, size)
    return merged


def _reversed(build, x, axis, size):
    """x in reverse order along ``axis`` (of static ``size``), as a Split and a Concat: exact both
    ways (a Slice with step -1 has no working SliceGrad in ONNX Runtime 1.19)."""
    return x if size == 1 else build.op("Concat", _split(build, x, axis, [1] * size)[::-1], axis=axis)


def _split(build, x, axis, sizes):
    """The parts of x along ``axis`` of the given sizes (a Split node)."""
    parts = [build.fresh_name() for _ in sizes]
    if build.opset >= 13:
        split = helper.make_node("Split", [x, build.const(sizes, np.int64)], parts, name=build.fresh_name(), axis=axis)
    else:
        split = helper.make_node("Split", [x], parts, name=build.fresh_name(), axis=axis, split=list(sizes))
    build.nodes.append(split)
    return parts


def _interleaved_with_zeros(build, x, strides):
    """x with stride - 1 zeros after each value along each spatial axis (also after the last)."""
    rank = len(strides) + 2
    gaps = [2 * axis + 1 for axis in range(1, rank - 1)]  # a new axis after each spatial one
    spread = build.unsqueeze(x, gaps)
    pads = [0] * (2 * (rank + len(gaps)))
    for gap, stride in zip(gaps, strides):
        pads[rank + len(gaps) + gap] = stride - 1
    padded = build.op("Pad", [spread, build.const(pads, np.int64)])
    size = build.op("Mul", [build.op("Shape", [x]), build.const([1, 1, *strides], np.int64)])
    return build.op("Reshape", [padded, size])


def conv_transpose(build):
    """ConvTranspose as a Conv (ONNX Runtime 1.19 has no CPU kernel for ConvTranspose's gradient):
    the input interleaved with stride - 1 zeros, padded by dilation * (kernel - 1) - pads (plus
    output_padding at the end; a negative amount crops), convolved with the flipped, transposed
    kernel at the same dilation and groups. The stride's zeros cost stride^dims times torch's
    multiply-adds."""
    x, weight = build.node.input[:2]
    if build.attribute("auto_pad", "NOTSET") != "NOTSET" or build.attribute("output_shape") is not None:
        raise RewriteError(f"ConvTranspose node '{build.node.name}' with auto_pad or output_shape cannot be rewritten")
    shape = build.static_dims(weight, range(len(build.shape(weight))))
    dims = len(shape) - 2
    strides, dilations, pads, extra = (list(build.attribute(name, [default] * count)) for name, default, count in
                                       (("strides", 1, dims), ("dilations", 1, dims), ("pads", 0, 2 * dims),
                                        ("output_padding", 0, dims)))  # fmt: skip
    kernel, groups = shape[2:], build.attribute("group", 1)
    if any(stride > 1 for stride in strides):
        x = _interleaved_with_zeros(build, x, strides)
    reach = [dilation * (size - 1) for dilation, size in zip(dilations, kernel)]
    before = [r - pad for r, pad in zip(reach, pads[:dims])]
    after = [r - pad + more - (stride - 1) for r, pad, more, stride in zip(reach, pads[dims:], extra, strides)]
    if any(before + after):
        x = build.op("Pad", [x, build.const([0, 0, *before, 0, 0, *after], np.int64)])
    inputs = [x, _transposed_kernel(build, weight, shape, groups), *build.node.input[2:3]]
    build.op("Conv", inputs, node_output(build), dilations=dilations, group=groups, kernel_shape=kernel, pads=[0] * 2 * dims,
             strides=[1] * dims)  # fmt: skip


def _conv_attributes(build, x, weight) -> dict:
    """The Conv being replaced's kernel_shape, strides, dilations and pads, all explicit: ``auto_pad`` (SAME_UPPER,
    SAME_LOWER, VALID) turned into the pads ONNX defines for it. A stride above 1 needs x's spatial sizes for SAME,
    a Conv without ``kernel_shape`` its weight's."""
    kernel = build.attribute("kernel_shape")
    kernel = list(kernel) if kernel else build.static_dims(weight, range(2, len(build.shape(weight))))
    dims = len(kernel)
    strides, dilations = list(build.attribute("strides", [1] * dims)), list(build.attribute("dilations", [1] * dims))
    auto_pad = build.attribute("auto_pad", "NOTSET")
    pads = list(build.attribute("pads", [0] * 2 * dims)) if auto_pad == "NOTSET" else [0] * 2 * dims
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        lengths = build.static_dims(x, range(2, dims + 2)) if any(stride > 1 for stride in strides) else [None] * dims
        for axis, (length, size, stride, dilation) in enumerate(zip(lengths, kernel, strides, dilations)):
            reach = (size - 1) * dilation + 1
            total = reach - 1 if stride == 1 else max(0, (-(-length // stride) - 1) * stride + reach - length)
            less, more = total // 2, total - total // 2  # the odd one at the end for SAME_UPPER, at the start for SAME_LOWER
            pads[axis], pads[dims + axis] = (less, more) if auto_pad == "SAME_UPPER" else (more, less)
    return {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "pads": pads}


def convolution_pads(build):
    """A Conv with ``auto_pad`` SAME_UPPER or SAME_LOWER (torch's ``padding='same'``) written with the pads it means:
    onnxruntime-training 1.19.2's ConvGrad ignores ``auto_pad``, pads by nothing, and reads memory it never wrote
    (docs/stack_facts.md), so a 'same' convolution's gradients were garbage. Same values."""
    if build.attribute("auto_pad", "NOTSET") in ("NOTSET", "VALID"):
        return False
    x, weight = build.node.input[:2]
    build.op("Conv", list(build.node.input), node_output(build), group=build.attribute("group", 1),
             **_conv_attributes(build, x, weight))  # fmt: skip
    return True


def _as_two_dimensional(build, inputs, attributes):
    """A 1-d Conv as a 2-d one over [N, C, 1, L]: its input and weight get a unit axis 2, which the output loses."""
    spread = {**attributes, "pads": [0, attributes["pads"][0], 0, attributes["pads"][1]]}
    for name in ("kernel_shape", "strides", "dilations"):
        spread[name] = [1, *attributes[name]]
    x, weight, *bias = inputs
    result = build.op("Conv", [build.unsqueeze(x, [2]), build.unsqueeze(weight, [2]), *bias], **spread)
    build.squeeze(result, [2], node_output(build))


def grouped_convolution(build):
    """A grouped Conv of one or three spatial axes, in a form whose gradient ONNX Runtime computes in
    bounds: its CPU ConvGrad (onnxruntime-training 1.19.2) clears C x (input length) values of the input's
    gradient from each group's start, so it writes zeros past the gradient's end, into whatever the
    memory holds next (docs/stack_facts.md). A 1-d one becomes a 2-d one over [N, C, 1, L] (one Conv: the
    kernel's 2-d path is right); a 3-d one, one Conv per group, concatenated. Same values either way."""
    groups = build.attribute("group", 1)
    x, weight, *bias = build.node.input
    shape = build.static_dims(weight, range(len(build.shape(weight))))
    if groups == 1 or len(shape) == 4:
        return False
    attributes = _conv_attributes(build, x, weight)
    if len(shape) == 3:
        _as_two_dimensional(build, build.node.input, {**attributes, "group": groups})
        return True
    outputs = shape[0] // groups
    parts = zip(_split(build, x, 1, [shape[1]] * groups), _split(build, weight, 0, [outputs] * groups),
                _split(build, bias[0], 0, [outputs] * groups) if bias else [None] * groups)  # fmt: skip
    results = [build.op("Conv", [part for part in group if part], **attributes) for group in parts]
    build.op("Concat", results, node_output(build), axis=1)
    return True


def grouped_convolutions(model: onnx.ModelProto) -> list:
    """Replace, in place, each grouped Conv of one or three spatial axes by ``grouped_convolution``'s form; return the
    rewritten node names. For training graphs whose convolution gradients ONNX Runtime's CPU kernels compute."""
    return _convolutions_rewritten(model, grouped_convolution, lambda node: node_attribute(node, "group", 1) > 1)


def explicit_convolution_pads(model: onnx.ModelProto) -> list:
    """Replace, in place, each Conv with ``auto_pad`` SAME_UPPER or SAME_LOWER by ``convolution_pads``' form; return the
    rewritten node names. For every graph the trainer builds: ONNX Runtime's gradient ignores ``auto_pad``, and its
    forward refuses it with a dilation (torch's ``padding='same', dilation=2``)."""
    return _convolutions_rewritten(model, convolution_pads,
                                   lambda node: node_attribute(node, "auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"))


def _convolutions_rewritten(model: onnx.ModelProto, function, wanted) -> list:
    """``function`` (a NodeBuilder rewrite) applied, in place, to the Conv nodes ``wanted(node)`` picks; their names."""
    targets = [node for node in model.graph.node if node.op_type == "Conv" and wanted(node)]
    if not targets:
        return []
    return replace_nodes(model, {"Conv": function}, targets, static_shapes(model, symbolic_shapes(model)))
