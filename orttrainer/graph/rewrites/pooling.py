"""Pooling: AveragePool as a depthwise Conv (ONNX Runtime's AveragePoolGrad breaks with a dynamic batch), and
``torch_pools``, which makes ceil_mode pools compute torch's windows and divisors in the exported forward. One
family because both follow torch's ceil_mode window count (``_ceil_mode_count``), which differs from ONNX's.
"""

import numpy as np
import onnx
from onnx import numpy_helper

from ._building import RewriteError, SizesNeeded, node_attribute, node_output, replace_nodes
from .shapes import static_shapes, structure_for_inference, symbolic_dim


def _onnx_ceil_mode_count(length: int, kernel: int, stride: int, before: int, after: int) -> int:
    """ONNX's (and ONNX Runtime's kernels') ceil_mode output count over an axis: a window for a partial one at
    the end, even one that would start in the end padding."""
    return -(-(length + before + after - kernel) // stride) + 1


def _ceil_mode_count(length: int, kernel: int, stride: int, before: int, after: int) -> int:
    """torch's ceil_mode output count over an axis: ONNX's, less a last window that would start in the end padding."""
    count = _onnx_ceil_mode_count(length, kernel, stride, before, after)
    return count - 1 if (count - 1) * stride >= length + before else count


def _ceil_mode_extra(length: int, kernel: int, stride: int, before: int, after: int) -> int:
    """Zeros to add after an axis so that a pooling Conv makes torch's ceil_mode output count."""
    count = _ceil_mode_count(length, kernel, stride, before, after)
    return max((count - 1) * stride + kernel - (length + before + after), 0)


def average_pool(build):
    """AveragePool as a depthwise Conv with constant 1/k weights (ceil_mode: zeros added at the end for
    the partial last windows, which divide by what they cover of the input and its padding, as torch's).

    ONNX Runtime's AveragePoolGrad CPU kernel takes its output shape from the graph, so
    it breaks with a dynamic batch dimension; ConvGrad does not.
    """
    x = build.node.input[0]
    if build.attribute("auto_pad", "NOTSET") != "NOTSET" or any(d != 1 for d in build.attribute("dilations", [1])):
        raise RewriteError(f"AveragePool node '{build.node.name}' with auto_pad or dilations cannot be rewritten")
    kernel = list(build.attribute("kernel_shape"))
    dims = len(kernel)
    strides = list(build.attribute("strides", [1] * dims))
    (channels,) = build.static_dims(x, [1])
    pads = list(build.attribute("pads", [0] * 2 * dims))
    extra = [0] * dims
    if build.attribute("ceil_mode", 0):
        lengths = build.static_dims(x, range(2, dims + 2))
        # a window longer than the padded input (EfficientNet's AvgPool2d(1280, ceil_mode=True) over 4x4) is
        # torch's only one on that axis (it could not run otherwise): a kernel of the padded length sums the same
        kernel = [min(size, length + before + after) for size, length, before, after in zip(kernel, lengths, pads[:dims], pads[dims:])]
        extra = [_ceil_mode_extra(*axis) for axis in zip(lengths, kernel, strides, pads[:dims], pads[dims:])]
    conv_pads = pads[:dims] + [after + more for after, more in zip(pads[dims:], extra)]
    attributes = {"kernel_shape": kernel, "strides": strides, "pads": conv_pads, "group": channels}
    summed = build.op("Conv", [x, build.const(np.ones([channels, 1, *kernel]))], **attributes)
    include_pad = build.attribute("count_include_pad", 0)
    if not any(extra) and (include_pad or not any(pads)):
        build.op("Mul", [summed, build.const(1.0 / np.prod(kernel))], node_output(build))
        return
    # the divisor per output: pool ones shaped like one channel of x (its padding counted as ones with count_include_pad)
    shape = build.op("Shape", [x])
    one_channel = build.op("Concat", [build.op("Slice", [shape, build.const([0], np.int64), build.const([1], np.int64)]),
                                      build.const([1], np.int64),
                                      build.op("Slice", [shape, build.const([2], np.int64), build.const([dims + 2], np.int64)])],
                           axis=0)  # fmt: skip
    ones_like = build.op("ConstantOfShape", [one_channel], value=numpy_helper.from_array(np.ones([1], np.float32)))
    if include_pad:
        ones_like = build.op("Pad", [ones_like, build.const([0, 0, *pads[:dims], 0, 0, *pads[dims:]], np.int64), build.const(1.0)])
        attributes["pads"] = [0] * dims + extra
    counts = build.op("Conv", [ones_like, build.const(np.ones([1, 1, *kernel]))], **{**attributes, "group": 1})
    build.op("Div", [summed, counts], node_output(build))


def _drops_a_window(node: onnx.NodeProto, shapes: dict) -> bool:
    """Whether torch makes fewer ceil_mode windows than this pool's ONNX Runtime kernel (one that would start in
    the end padding, e.g. size 4, kernel 2, stride 3, padding 1: 2 windows, not 3). SizesNeeded where an axis whose
    size is not known can drop one at some sizes (``_can_drop_a_window``)."""
    dims = len(node_attribute(node, "kernel_shape"))
    dilations = list(node_attribute(node, "dilations", [1] * dims))
    kernel = [(size - 1) * dilation + 1 for size, dilation in zip(node_attribute(node, "kernel_shape"), dilations)]
    lengths = (shapes.get(node.input[0]) or [None] * (dims + 2))[2:]
    strides = list(node_attribute(node, "strides", [1] * dims))
    pads = list(node_attribute(node, "pads", [0] * 2 * dims))
    if node_attribute(node, "auto_pad", "NOTSET") != "NOTSET":
        return False
    for length, size, stride, before, after in zip(lengths, kernel, strides, pads[:dims], pads[dims:]):
        if length is None and _can_drop_a_window(size, stride, after):
            raise SizesNeeded(f"{node.op_type} node '{node.name}' (ceil_mode): torch makes one window fewer than ONNX "
                              "Runtime's kernel over some input sizes, and this pool's are not known (dynamic); give "
                              "model_desc fixed sizes for the input's axes that reach it")  # fmt: skip
        axis = (length, size, stride, before, after)
        if length is not None and _ceil_mode_count(*axis) < _onnx_ceil_mode_count(*axis):
            return True
    return False


def _can_drop_a_window(kernel: int, stride: int, after: int) -> bool:
    """Whether torch's ceil_mode count falls short of ONNX's over some length of an axis: ONNX's last window starts
    before ``length + before + after - kernel + stride``, and torch drops it where it starts at ``length + before``
    or later, which only a stride and end padding longer than the kernel leave room for."""
    return stride + after > kernel


def _declare_inferred_output_sizes(model: onnx.ModelProto) -> None:
    """Give the graph outputs the sizes ONNX's shape inference finds now, where they declare other ones (the
    exporter took them from ONNX's AveragePool, with the window torch drops)."""
    structure = structure_for_inference(model)
    for output in structure.graph.output:
        output.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(structure, data_prop=True).graph.output
    sizes = {output.name: [symbolic_dim(dim) for dim in output.type.tensor_type.shape.dim] for output in inferred}
    for output in model.graph.output:
        dims, found = output.type.tensor_type.shape.dim, sizes.get(output.name)
        if found and len(found) == len(dims):
            for dim, size in zip(dims, found):
                if dim.HasField("dim_value") and isinstance(size, int) and size != dim.dim_value:
                    dim.dim_value = size


_TORCH_POOLS = ("AveragePool", "MaxPool")


def torch_pools(model: onnx.ModelProto) -> list:
    """Make, in place, each ceil_mode pool ONNX Runtime's kernel would compute otherwise than torch compute
    torch's; return their names. ONNX Runtime's AveragePool divides a partial last window by the whole kernel,
    torch's by what it covers of the input and its padding (nn.AvgPool2d(3, 2, ceil_mode=True) over 4x4: 4.33
    where torch gives 6.5), and both its pools make a last window starting in the end padding, which torch's do
    not (``_drops_a_window``; nn.AvgPool2d(2, 3, 1, ceil_mode=True) over 4x4: 3x3 outputs, torch 2x2). Such an
    AveragePool (and one with count_include_pad) is replaced by ``average_pool``; such a MaxPool gets ceil_mode
    off: torch drops a window only where the ceil count exceeds the floor count (a pad is shorter than the
    kernel), so it keeps the floor count, and the windows are torch's. The exported forward changes, so the eval
    graph and a saved model compute torch's values too, and the graph outputs declare torch's sizes. Pools are
    taken in graph order, the sizes inferred again after each (a pool changes the sizes after it). A pool whose
    windows depend on input sizes the graph does not know (dynamic ones) raises SizesNeeded: it is torch's at the
    sizes it is rewritten for only (a MaxPool that can drop a window at some sizes, an AveragePool with
    count_include_pad)."""
    if not any(node.op_type in _TORCH_POOLS and node_attribute(node, "ceil_mode", 0) for node in model.graph.node):
        return []
    changed, dropped = [], False
    while True:
        shapes = static_shapes(model)
        pool = next((node for node in model.graph.node if _pool_differs(node, shapes)), None)
        if pool is None:
            break
        dropped = dropped or _drops_a_window(pool, shapes)
        if pool.op_type == "MaxPool":
            next(attribute for attribute in pool.attribute if attribute.name == "ceil_mode").i = 0
            changed.append(pool.name)
            continue
        failed = {}
        changed += replace_nodes(model, {"AveragePool": average_pool}, [pool], shapes=shapes, failed=failed)
        if failed:
            raise SizesNeeded(f"{failed[pool.name]}: its ceil_mode windows and divisors are torch's at known sizes only")
    if dropped:
        _declare_inferred_output_sizes(model)
    return changed


def _pool_differs(node: onnx.NodeProto, shapes: dict) -> bool:
    """Whether ``torch_pools`` changes this node: a ceil_mode pool that makes a window torch's does not, or an
    AveragePool with ceil_mode and count_include_pad."""
    if node.op_type not in _TORCH_POOLS or not node_attribute(node, "ceil_mode", 0):
        return False
    averaging_padding = node.op_type == "AveragePool" and node_attribute(node, "count_include_pad", 0)
    return averaging_padding or _drops_a_window(node, shapes)
