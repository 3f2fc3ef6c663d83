"""Rewrite ops onnxruntime-training cannot differentiate into equivalent ops it can.

Each rewrite is a small function ``(build) -> None`` that emits, through ``build``, nodes
computing the node's output from its inputs with ops that have gradient builders (and
fast CPU gradient kernels) in onnxruntime-training 1.19; one that returns ``False``
leaves this node as it is. Values and gradients match torch
(tests/test_rewrites.py). ``rewrite_for_training`` applies them to a whole graph; only the
training graph is rewritten, inference keeps the original (faster) ops.
"""

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper


def node_attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of ``node``'s attribute ``name`` (strings as str), or ``default``."""
    for attribute in node.attribute:
        if attribute.name == name:
            value = helper.get_attribute_value(attribute)
            return value.decode() if isinstance(value, bytes) else value
    return default


class RewriteError(ValueError):
    """An op could be rewritten in general, but not this instance (e.g. a dynamic dimension)."""


@dataclass
class GraphFacts:
    """What a rewrite may know about the whole graph besides the node it replaces."""

    opset: int
    shapes: dict  # tensor name -> static shape (None for dynamic dims)
    constants: dict  # tensor name -> value known before the run
    producers: dict  # tensor name -> the node that outputs it
    consumers: dict  # tensor name -> the nodes that read it, in graph order
    targets: set  # names of the nodes being replaced


class NodeBuilder:
    """Emits the nodes replacing one node: unique names, constants, opset-aware reductions."""

    def __init__(self, node: onnx.NodeProto, facts: GraphFacts):
        self.node, self.facts = node, facts
        self.opset, self.shapes, self.constants = facts.opset, facts.shapes, facts.constants
        self.nodes, self.initializers = [], []
        self._count = 0

    def fresh_name(self):
        """A node/tensor name no other replacement uses."""
        self._count += 1
        return f"{self.node.name}_rewritten_{self._count}"  # same scope, so error messages keep the module path

    def op(self, op_type, inputs, output=None, **attributes):
        name = self.fresh_name()
        self.nodes.append(helper.make_node(op_type, inputs, [output or name], name=name, **attributes))
        return output or name

    def const(self, value, dtype=np.float32):
        name = self.fresh_name()
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def attribute(self, name, default=None):
        return node_attribute(self.node, name, default)

    def shape(self, name):
        """Static shape (None for dynamic dims) of a tensor, from ONNX shape inference."""
        if name not in self.shapes:
            raise RewriteError(f"{self.node.op_type} node '{self.node.name}': the shape of '{name}' is unknown")
        return self.shapes[name]

    def static_dims(self, name, dims):
        shape = self.shape(name)
        if any(shape[dim] is None for dim in dims):
            raise RewriteError(
                f"{self.node.op_type} node '{self.node.name}' needs static dimensions {list(dims)} of '{name}', got {shape}"
            )
        return [shape[dim] for dim in dims]

    def constant_input(self, index):
        name = self.node.input[index] if len(self.node.input) > index else ""
        if name not in self.constants:
            raise RewriteError(f"{self.node.op_type} node '{self.node.name}': input {index} must be a constant")
        return self.constants[name]

    def reduce(self, op_type, x, axes, keepdims, output=None):
        """ReduceX with ``axes`` as attribute or input, whichever this opset wants."""
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes is None:
            return self.op(op_type, [x], output, keepdims=keepdims)
        if axes_as_input:
            return self.op(op_type, [x, self.const(axes, np.int64)], output, keepdims=keepdims)
        return self.op(op_type, [x], output, axes=list(axes), keepdims=keepdims)

    def unsqueeze(self, x, axes):
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.const(axes, np.int64)])
        return self.op("Unsqueeze", [x], axes=list(axes))

    def squeeze(self, x, axes, output=None):
        if self.opset >= 13:
            return self.op("Squeeze", [x, self.const(axes, np.int64)], output)
        return self.op("Squeeze", [x], output, axes=list(axes))

    def reduce_axes(self):
        """(axes, keepdims) of the Reduce node being replaced, wherever its opset keeps them."""
        keepdims = self.attribute("keepdims", 1)
        axes = self.attribute("axes")
        if axes is None and len(self.node.input) > 1 and self.node.input[1]:
            axes = [int(axis) for axis in self.constant_input(1).reshape(-1)]
        return axes, keepdims


def _output(build):
    return build.node.output[0]


def _negative_part(build, x):
    """min(x, 0) as x - relu(x) (differentiable everywhere torch's ops are)."""
    return build.op("Sub", [x, build.op("Relu", [x])])


def softplus(build):
    """log(1 + exp(x)) = relu(x) + log(1 + exp(-|x|)): no overflow for large |x|."""
    x = build.node.input[0]
    tail = build.op("Log", [build.op("Add", [build.op("Exp", [build.op("Neg", [build.op("Abs", [x])])]), build.const(1.0)])])
    build.op("Add", [build.op("Relu", [x]), tail], _output(build))


def _elu_like(build, x, alpha, inner_scale, output):
    """relu(x) + alpha * (exp(min(x, 0) * inner_scale) - 1): ELU, CELU; exp never sees x > 0."""
    negative = _negative_part(build, x)
    if inner_scale != 1.0:
        negative = build.op("Mul", [negative, build.const(inner_scale)])
    curve = build.op("Mul", [build.op("Sub", [build.op("Exp", [negative]), build.const(1.0)]), build.const(alpha)])
    return build.op("Add", [build.op("Relu", [x]), curve], output)


def elu(build):
    _elu_like(build, build.node.input[0], build.attribute("alpha", 1.0), 1.0, _output(build))


def celu(build):
    alpha = build.attribute("alpha", 1.0)
    _elu_like(build, build.node.input[0], alpha, 1.0 / alpha, _output(build))


def selu(build):
    alpha = build.attribute("alpha", 1.6732632423543772)
    gamma = build.attribute("gamma", 1.0507009873554805)
    inner = _elu_like(build, build.node.input[0], alpha, 1.0, None)
    build.op("Mul", [inner, build.const(gamma)], _output(build))


def _hard_sigmoid(build, x, alpha, beta, output=None):
    """clip(alpha * x + beta, 0, 1) as relu(t) - relu(t - 1)."""
    t = build.op("Add", [build.op("Mul", [x, build.const(alpha)]), build.const(beta)])
    return build.op("Sub", [build.op("Relu", [t]), build.op("Relu", [build.op("Sub", [t, build.const(1.0)])])], output)


def hard_sigmoid(build):
    _hard_sigmoid(build, build.node.input[0], build.attribute("alpha", 0.2), build.attribute("beta", 0.5), _output(build))


def hard_swish(build):
    x = build.node.input[0]
    build.op("Mul", [x, _hard_sigmoid(build, x, 1.0 / 6.0, 0.5)], _output(build))


def prelu(build):
    """relu(x) + slope * min(x, 0); the slope keeps its gradient."""
    x, slope = build.node.input[0], build.node.input[1]
    build.op("Add", [build.op("Relu", [x]), build.op("Mul", [slope, _negative_part(build, x)])], _output(build))


def instance_normalization(build):
    """(x - mean) / sqrt(var + eps) * scale + bias, statistics over the spatial axes."""
    x, scale, bias = build.node.input
    rank = len(build.shape(x))
    axes = list(range(2, rank))
    mean = build.reduce("ReduceMean", x, axes, 1)
    centered = build.op("Sub", [x, mean])
    variance = build.reduce("ReduceMean", build.op("Mul", [centered, centered]), axes, 1)
    std = build.op("Sqrt", [build.op("Add", [variance, build.const(build.attribute("epsilon", 1e-5))])])
    normalized = build.op("Div", [centered, std])
    channel_axes = list(range(1, rank - 1))
    scaled = build.op("Mul", [normalized, build.unsqueeze(scale, channel_axes)])
    build.op("Add", [scaled, build.unsqueeze(bias, channel_axes)], _output(build))


def average_pool(build):
    """AveragePool as a depthwise Conv with constant 1/k weights.

    ONNX Runtime's AveragePoolGrad CPU kernel takes its output shape from the graph, so
    it breaks with a dynamic batch dimension; ConvGrad does not.
    """
    x = build.node.input[0]
    if build.attribute("ceil_mode", 0) or build.attribute("auto_pad", "NOTSET") != "NOTSET":
        raise RewriteError(f"AveragePool node '{build.node.name}' with ceil_mode or auto_pad cannot be rewritten")
    kernel = list(build.attribute("kernel_shape"))
    (channels,) = build.static_dims(x, [1])
    pads = list(build.attribute("pads", [0] * 2 * len(kernel)))
    attributes = {"kernel_shape": kernel, "strides": list(build.attribute("strides", [1] * len(kernel))), "pads": pads,
                  "group": channels}
    ones = build.const(np.ones([channels, 1, *kernel]))
    summed = build.op("Conv", [x, ones], **attributes)
    if build.attribute("count_include_pad", 0) or not any(pads):
        build.op("Mul", [summed, build.const(1.0 / np.prod(kernel))], _output(build))
        return
    # count only real (unpadded) positions: pool a tensor of ones shaped like one channel of x
    shape = build.op("Shape", [x])
    one_channel = build.op("Concat", [build.op("Slice", [shape, build.const([0], np.int64), build.const([1], np.int64)]),
                                      build.const([1], np.int64),
                                      build.op("Slice", [shape, build.const([2], np.int64), build.const([len(kernel) + 2], np.int64)])],
                           axis=0)  # fmt: skip
    ones_like = build.op("ConstantOfShape", [one_channel], value=numpy_helper.from_array(np.ones([1], np.float32)))
    counts = build.op("Conv", [ones_like, build.const(np.ones([1, 1, *kernel]))], **{**attributes, "group": 1})
    build.op("Div", [summed, counts], _output(build))


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
    build.op("Reshape", [moved, build.const([0, depth, height * block, width * block], np.int64)], _output(build))


def space_to_depth(build):
    x = build.node.input[0]
    block = build.attribute("blocksize")
    channels, height, width = build.static_dims(x, [1, 2, 3])
    split = build.op("Reshape", [x, build.const([0, channels, height // block, block, width // block, block], np.int64)])
    moved = build.op("Transpose", [split], perm=[0, 3, 5, 1, 2, 4])
    shape = [0, channels * block * block, height // block, width // block]
    build.op("Reshape", [moved, build.const(shape, np.int64)], _output(build))


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
        build.squeeze(part, [axis], _output(build))
        return True
    bounds = [build.const([index], np.int64), build.const([index + 1], np.int64), build.const([axis], np.int64)]
    build.squeeze(build.op("Slice", [data, *bounds]), [axis], _output(build))
    return True


def nearest_upsample(build):
    """Resize by whole-number factors in nearest mode as Reshape + Expand + Reshape
    (ONNX Runtime has no CPU kernel for ResizeGrad)."""
    x = build.node.input[0]
    mode = build.attribute("mode", "nearest")
    if mode != "nearest":
        raise RewriteError(f"Resize node '{build.node.name}': only mode 'nearest' can be rewritten, got {mode!r}")
    shape = build.shape(x)
    rank = len(shape)
    dims = build.static_dims(x, range(1, rank))
    if len(build.node.input) > 2 and build.node.input[2] and build.constant_input(2).size:
        scales = [float(scale) for scale in build.constant_input(2)]
    else:
        sizes = build.constant_input(3)
        scales = [float(size) / dim for size, dim in zip(sizes[1:], dims)]
        scales = [1.0] + scales
    factors = [int(scale) for scale in scales]
    if scales[:2] != [1.0, 1.0] or any(factor != scale or factor < 1 for factor, scale in zip(factors, scales)):
        raise RewriteError(f"Resize node '{build.node.name}': scales {scales} are not whole-number spatial factors")
    spatial = list(zip(dims[1:], factors[2:]))
    split = [0, dims[0]] + [value for dim, _ in spatial for value in (dim, 1)]
    expanded = [1, dims[0]] + [value for dim, factor in spatial for value in (dim, factor)]
    grown = build.op("Expand", [build.op("Reshape", [x, build.const(split, np.int64)]), build.const(expanded, np.int64)])
    merged = [0, dims[0]] + [dim * factor for dim, factor in spatial]
    build.op("Reshape", [grown, build.const(merged, np.int64)], _output(build))


def cumsum(build):
    """CumSum along a static axis as a MatMul with a triangular 0/1 matrix."""
    x = build.node.input[0]
    rank = len(build.shape(x))
    axis = int(build.constant_input(1).reshape(-1)[0]) % rank
    (length,) = build.static_dims(x, [axis])
    source, target = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
    reverse, exclusive = build.attribute("reverse", 0), build.attribute("exclusive", 0)
    if reverse:
        include = source > target if exclusive else source >= target
    else:
        include = source < target if exclusive else source <= target
    matrix = build.const(include.astype(np.float32))
    if axis == rank - 1:
        build.op("MatMul", [x, matrix], _output(build))
        return
    perm = [dim for dim in range(rank) if dim != axis] + [axis]
    summed = build.op("MatMul", [build.op("Transpose", [x], perm=perm), matrix])
    build.op("Transpose", [summed], _output(build), perm=list(np.argsort(perm)))


def reduce_extreme(build):
    """ReduceMax/ReduceMin with torch.amax's gradient: shared evenly among the tied extremes."""
    x = build.node.input[0]
    axes, keepdims = build.reduce_axes()
    extreme = build.reduce(build.node.op_type, x, axes, 1)
    mask = build.op("Cast", [build.op("Equal", [x, extreme])], to=onnx.TensorProto.FLOAT)
    picked = build.reduce("ReduceSum", build.op("Mul", [x, mask]), axes, keepdims)
    build.op("Div", [picked, build.reduce("ReduceSum", mask, axes, keepdims)], _output(build))


def reduce_sum_square(build):
    axes, keepdims = build.reduce_axes()
    x = build.node.input[0]
    build.reduce("ReduceSum", build.op("Mul", [x, x]), axes, keepdims, _output(build))


def reduce_l1(build):
    axes, keepdims = build.reduce_axes()
    build.reduce("ReduceSum", build.op("Abs", [build.node.input[0]]), axes, keepdims, _output(build))


def reduce_log_sum(build):
    axes, keepdims = build.reduce_axes()
    build.op("Log", [build.reduce("ReduceSum", build.node.input[0], axes, keepdims)], _output(build))


def variadic_sum(build):
    total = build.node.input[0]
    for index, name in enumerate(build.node.input[1:], 2):
        total = build.op("Add", [total, name], _output(build) if index == len(build.node.input) else None)
    if len(build.node.input) == 1:
        build.op("Identity", [total], _output(build))


def variadic_mean(build):
    total = build.node.input[0]
    for name in build.node.input[1:]:
        total = build.op("Add", [total, name])
    build.op("Mul", [total, build.const(1.0 / len(build.node.input))], _output(build))


def sinh(build):
    x = build.node.input[0]
    difference = build.op("Sub", [build.op("Exp", [x]), build.op("Exp", [build.op("Neg", [x])])])
    build.op("Mul", [difference, build.const(0.5)], _output(build))


def cosh(build):
    x = build.node.input[0]
    total = build.op("Add", [build.op("Exp", [x]), build.op("Exp", [build.op("Neg", [x])])])
    build.op("Mul", [total, build.const(0.5)], _output(build))


def asinh(build):
    x = build.node.input[0]
    root = build.op("Sqrt", [build.op("Add", [build.op("Mul", [x, x]), build.const(1.0)])])
    build.op("Log", [build.op("Add", [x, root])], _output(build))


def acosh(build):
    x = build.node.input[0]
    root = build.op("Sqrt", [build.op("Sub", [build.op("Mul", [x, x]), build.const(1.0)])])
    build.op("Log", [build.op("Add", [x, root])], _output(build))


def atanh(build):
    x = build.node.input[0]
    ratio = build.op("Div", [build.op("Add", [build.const(1.0), x]), build.op("Sub", [build.const(1.0), x])])
    build.op("Mul", [build.op("Log", [ratio]), build.const(0.5)], _output(build))


def sign(build):
    """sign(x) = [x > 0] - [x < 0]; its gradient is zero, as torch's."""
    x = build.node.input[0]
    positive = build.op("Cast", [build.op("Greater", [x, build.const(0.0)])], to=onnx.TensorProto.FLOAT)
    negative = build.op("Cast", [build.op("Less", [x, build.const(0.0)])], to=onnx.TensorProto.FLOAT)
    build.op("Sub", [positive, negative], _output(build))


def _einsum_terms(build):
    equation = build.attribute("equation").replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise RewriteError(f"Einsum node '{build.node.name}': equation '{equation}' needs an explicit '->' and no '...'")
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if any(len(set(term)) != len(term) for term in terms):
        raise RewriteError(f"Einsum node '{build.node.name}': repeated indices in '{equation}' (diagonals) are not supported")
    return terms, output, equation


def _sum_out(build, x, term, keep):
    """Sum over the indices of ``term`` not in ``keep``; return (tensor, remaining indices)."""
    axes = [index for index, letter in enumerate(term) if letter not in keep]
    if not axes:
        return x, term
    return build.reduce("ReduceSum", x, axes, 0), "".join(letter for letter in term if letter in keep)


def _transpose(build, x, term, order, output=None):
    if term == order:
        return build.op("Identity", [x], output) if output else x
    return build.op("Transpose", [x], output, perm=[term.index(letter) for letter in order])


def _aligned(build, x, term, output):
    """x with its indices in output order and size-1 axes where it lacks an output index."""
    present = "".join(letter for letter in output if letter in term)
    x = _transpose(build, x, term, present)
    missing = [position for position, letter in enumerate(output) if letter not in term]
    return build.unsqueeze(x, missing) if missing else x


def _broadcast_product(build, a, term_a, b, term_b, output):
    """Einsum without a summed index: an elementwise product after aligning both operands."""
    build.op("Mul", [_aligned(build, a, term_a, output), _aligned(build, b, term_b, output)], _output(build))


def einsum(build):
    """Einsum with one or two operands as ReduceSum/Transpose/MatMul (or Mul without a summed
    index); with a contraction, at most one free index per side and one summed index."""
    terms, output, equation = _einsum_terms(build)
    if len(terms) == 1:
        x, term = _sum_out(build, build.node.input[0], terms[0], output)
        _transpose(build, x, term, output, _output(build))
        return
    if len(terms) != 2:
        raise RewriteError(f"Einsum node '{build.node.name}': '{equation}' has {len(terms)} operands (1 or 2 supported)")
    (a, term_a), (b, term_b) = (
        _sum_out(build, name, term, set(output) | set(other))
        for name, term, other in ((build.node.input[0], terms[0], terms[1]), (build.node.input[1], terms[1], terms[0]))
    )
    contracted = [letter for letter in term_a if letter in term_b and letter not in output]
    if not contracted:
        _broadcast_product(build, a, term_a, b, term_b, output)
        return
    batch = [letter for letter in output if letter in term_a and letter in term_b]
    left = [letter for letter in output if letter in term_a and letter not in term_b]
    right = [letter for letter in output if letter in term_b and letter not in term_a]
    if len(left) > 1 or len(right) > 1 or len(contracted) > 1:
        raise RewriteError(f"Einsum node '{build.node.name}': '{equation}' needs reshapes (several free or summed indices)")
    a = _transpose(build, a, term_a, "".join(batch + left + contracted))
    b = _transpose(build, b, term_b, "".join(batch + contracted + right))
    position = len(batch)
    if not left:
        a = build.unsqueeze(a, [position])
    if not contracted:
        a = build.unsqueeze(a, [position + 1])
        b = build.unsqueeze(b, [position])
    if not right:
        b = build.unsqueeze(b, [position + 1])
    product = build.op("MatMul", [a, b])
    squeezed = [axis for axis, missing in ((position, not left), (position + 1, not right)) if missing]
    if squeezed:
        product = build.squeeze(product, squeezed)
    _transpose(build, product, "".join(batch + left + right), output, _output(build))


REWRITES = {
    "Softplus": softplus,
    "Elu": elu,
    "Celu": celu,
    "Selu": selu,
    "HardSigmoid": hard_sigmoid,
    "HardSwish": hard_swish,
    "PRelu": prelu,
    "InstanceNormalization": instance_normalization,
    "AveragePool": average_pool,
    "Resize": nearest_upsample,
    "Gather": constant_index_gather,
    "DepthToSpace": depth_to_space,
    "SpaceToDepth": space_to_depth,
    "CumSum": cumsum,
    "ReduceMax": reduce_extreme,
    "ReduceMin": reduce_extreme,
    "ReduceSumSquare": reduce_sum_square,
    "ReduceL1": reduce_l1,
    "ReduceLogSum": reduce_log_sum,
    "Sum": variadic_sum,
    "Mean": variadic_mean,
    "Sinh": sinh,
    "Cosh": cosh,
    "Asinh": asinh,
    "Acosh": acosh,
    "Atanh": atanh,
    "Sign": sign,
    "Einsum": einsum,
}


def static_shapes(model: onnx.ModelProto) -> dict:
    """Tensor name -> shape from ONNX shape inference (None for dynamic dims)."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    shapes = {}
    for info in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor_type.shape.dim]
    for initializer in model.graph.initializer:
        shapes[initializer.name] = list(initializer.dims)
    return shapes


_NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Dropout"}


def _constants(model: onnx.ModelProto) -> dict:
    """Values known before the run: initializers, Constant nodes, and what only they feed
    (the exporter computes e.g. Resize scales with small chains of such nodes)."""
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    values = {initializer.name: numpy_helper.to_array(initializer) for initializer in graph.initializer}
    graph_inputs = {graph_input.name for graph_input in graph.input}
    opsets = list(model.opset_import)
    for node in graph.node:
        if node.op_type in _NOT_FOLDED or node.domain not in ("", "ai.onnx") or any(a.HasField("g") for a in node.attribute):
            continue
        inputs = [name for name in node.input if name]
        if any(name not in values or name in graph_inputs for name in inputs):
            continue
        single = helper.make_model(
            helper.make_graph([node], "fold", [helper.make_tensor_value_info(n, 0, None) for n in inputs],
                              [helper.make_tensor_value_info(n, 0, None) for n in node.output]),
            opset_imports=opsets,
        )  # fmt: skip
        try:
            results = ReferenceEvaluator(single).run(None, {name: values[name] for name in inputs})
        except Exception:  # the reference evaluator lacks some ops; such values just stay unknown
            continue
        values.update(zip(node.output, results))
    return values


def opset(model: onnx.ModelProto) -> int:
    return next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def rewrite_for_training(model: onnx.ModelProto, only_between=None) -> list:
    """Replace, in place, every node whose op type has a rewrite; return the rewritten node names.

    ``only_between`` (a set of node names) limits the rewrite to nodes on a gradient path.
    """
    targets = [node for node in model.graph.node if node.op_type in REWRITES and (only_between is None or node.name in only_between)]
    if not targets:
        return []
    return replace_nodes(model, REWRITES, targets, static_shapes(model), _constants(model))


def replace_nodes(model: onnx.ModelProto, table: dict, targets, shapes=None, constants=None) -> list:
    """Replace, in place, each of ``targets`` by what ``table[op_type]`` builds; return their names.

    A table function that returns ``False`` keeps its node; ``shapes`` and ``constants``
    go into the :class:`GraphFacts` the functions see.
    """
    consumers = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    producers = {output: node for node in model.graph.node for output in node.output}
    facts = GraphFacts(opset(model), shapes or {}, constants or {}, producers, consumers, {node.name for node in targets})
    target_ids = {id(node) for node in targets}
    rebuilt, rewritten = [], []
    for node in model.graph.node:
        build = NodeBuilder(node, facts) if id(node) in target_ids else None
        if build is not None and table[node.op_type](build) is not False:
            rebuilt.extend(build.nodes)
            model.graph.initializer.extend(build.initializers)
            rewritten.append(node.name)
        else:
            rebuilt.append(node)
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
    return rewritten
