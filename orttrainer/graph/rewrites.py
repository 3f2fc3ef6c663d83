"""Rewrite ops onnxruntime-training cannot differentiate into equivalent ops it can.

Each rewrite is a small function ``(build) -> None`` that emits, through ``build``, nodes
computing the node's output from its inputs with ops that have gradient builders (and
fast CPU gradient kernels) in onnxruntime-training 1.19; one that returns ``False``
leaves this node as it is. Values and gradients match torch, also at 0, tiny, huge, infinite
and NaN inputs, ties and kinks (tests/test_rewrites.py, tests/test_boundary_values.py); each
docstring names what cannot match exactly. ``rewrite_for_training`` applies them to a whole
graph; only the training graph is rewritten, inference keeps the original (faster) ops.
"""

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper


def node_attributes(node: onnx.NodeProto) -> dict:
    """``node``'s attributes by name (strings as str)."""
    return {attribute.name: _decoded(helper.get_attribute_value(attribute)) for attribute in node.attribute}


def node_attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of ``node``'s attribute ``name`` (strings as str), or ``default``."""
    for attribute in node.attribute:
        if attribute.name == name:
            return _decoded(helper.get_attribute_value(attribute))
    return default


def _decoded(value):
    return value.decode() if isinstance(value, bytes) else value


class RewriteError(ValueError):
    """An op could be rewritten in general, but not this instance (e.g. a dynamic dimension)."""

    node_name = ""  # the node whose rewrite failed, set by the rewrite's caller


@dataclass
class GraphFacts:
    """What a rewrite may know about the whole graph besides the node it replaces."""

    opset: int
    shapes: dict  # tensor name -> static shape (None for dynamic dims)
    constants: dict  # tensor name -> value known before the run
    producers: dict  # tensor name -> the node that outputs it
    consumers: dict  # tensor name -> the nodes that read it, in graph order
    targets: set  # names of the nodes being replaced
    symbols: dict = field(default_factory=dict)  # tensor name -> shape with dim_param names (str) kept


class OpEmitter:
    """Opset-aware reductions and (un)squeezes over ``op`` and ``const``.

    The formulas below are written against this interface, so that symbolics/ emits the
    same constructions into torch's export graph as the rewrites emit into an ONNX graph.
    """

    opset: int

    def op(self, op_type, inputs, output=None, **attributes):
        raise NotImplementedError

    def const(self, value, dtype=np.float32):
        raise NotImplementedError

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


class NodeBuilder(OpEmitter):
    """Emits the nodes replacing one node: unique names, constants, the node's facts."""

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

    def reduce_axes(self):
        """(axes, keepdims) of the Reduce node being replaced, wherever its opset keeps them."""
        keepdims = self.attribute("keepdims", 1)
        axes = self.attribute("axes")
        if axes is None and len(self.node.input) > 1 and self.node.input[1]:
            axes = [int(axis) for axis in self.constant_input(1).reshape(-1)]
        return axes, keepdims


def _output(build):
    return build.node.output[0]


def where(build, condition, if_true, if_false, output=None):
    """Where(condition, if_true, if_false); a float operand becomes a constant.

    A piecewise function is a Where of branches. ONNX Runtime gives the branch not taken a
    zero incoming gradient, and multiplies it by that branch's local derivatives: a branch
    that is inf or NaN where it is not taken, or has an infinite derivative there, turns the
    gradient into 0 * inf = NaN. So each branch below reads its input through a Where that
    replaces the values of the other branches by a safe constant.
    """
    operands = [build.const(value) if isinstance(value, float) else value for value in (if_true, if_false)]
    return build.op("Where", [condition, *operands], output)


def mask(build, condition):
    """1.0 where ``condition`` holds, else 0.0 (a float tensor), to select a branch by multiplying with it.

    In onnxruntime-training 1.19 a Where between tensors and its gradient (two more Wheres) cost
    about ten times a Mul, so the frequent activations select this way; the branch must be
    finite everywhere, 0 * inf being NaN. The mask itself is a Where between two constants
    (nothing to differentiate): ONNX Runtime's bool-to-float Cast and bool Not are scalar loops,
    about 5x slower for the same mask (benchmarks/NOTES.md §18).
    """
    return build.op("Where", [condition, build.const(1.0), build.const(0.0)])


def _nonpositive_part(build, x):
    """min(x, 0) with derivative 1 for x <= 0, 0 included (Relu's derivative there is 0,
    Min's 1/2), and 0 for x > 0; finite wherever x is not NaN (+inf gives 0).

    FLT_MIN - relu(FLT_MIN - x) is min(x, FLT_MIN), exact for x <= 0, its kink just above 0;
    the mask of x <= 0 drops the values in (0, FLT_MIN].
    """
    tiny = build.const(np.finfo(np.float32).tiny)
    clamped = build.op("Sub", [tiny, build.op("Relu", [build.op("Sub", [tiny, x])])])
    return build.op("Mul", [clamped, mask(build, _compare(build, "LessOrEqual", x, 0.0))])


def _compare(build, op_type, x, value):
    """Greater/Less/GreaterOrEqual/LessOrEqual/Equal of ``x`` and a float constant."""
    return build.op(op_type, [x, build.const(value)])


def _magnitude(build, x):
    """(x < 0, |x|) with |x| as a Where, so that its derivative at 0 is 1, not Abs's 0."""
    negative = _compare(build, "Less", x, 0.0)
    return negative, where(build, negative, build.op("Neg", [x]), x)


def _with_sign(build, negative, magnitude, output=None):
    """-magnitude where ``negative``, else magnitude: an odd function from its x >= 0 half."""
    return where(build, negative, build.op("Neg", [magnitude]), magnitude, output)


def _polynomial(build, x, coefficients):
    """c0 + c1 x + c2 x^2 + ... by Horner's rule."""
    result = build.const(coefficients[-1])
    for coefficient in reversed(coefficients[:-1]):
        result = build.op("Add", [build.op("Mul", [result, x]), build.const(coefficient)])
    return result


def log1p(build, u, reaches_minus_one=True):
    """log(1 + u) to float32 accuracy, value and gradient, for finite u >= -1 (NaN stays NaN).

    w = 1 + u is rounded, and log(w) alone is 0 for |u| below float32's epsilon. For
    |u| <= 1 the rounding error (w - 1) - u is exact, so log(w) - ((w - 1) - u) / w is
    log1p(u) to within about 2 ulp (second-order remainder (u - w + 1)^2 / 2); for u > 1 the
    correction is below an ulp of the result. Its gradient is 1/w + ((w - 1) - u) / w^2 =
    1 / (1 + u) to the same accuracy, +inf at u = -1. If u ``reaches_minus_one``, the
    divisor is max(w, 0.5), to avoid 0/0 there (for u <= -0.5, w is exact and the
    correction 0); a Max and its gradient cost as much as the rest, so callers whose u
    stays >= 0 say so.
    """
    w = build.op("Add", [u, build.const(1.0)])
    error = build.op("Sub", [build.op("Sub", [w, build.const(1.0)]), u])
    divisor = build.op("Max", [w, build.const(0.5)]) if reaches_minus_one else w
    return build.op("Sub", [build.op("Log", [w]), build.op("Div", [error, divisor])])


# detached(): |v| below each bound is first multiplied by the power of two after it; |v| from 2^62 on by 2^-70
_DETACH_SCALES = [(2.0**-97, 2.0**120), (2.0**-57, 2.0**80), (2.0**-17, 2.0**40)]
_DETACH_LARGE = (2.0**62, 2.0**-70)
STOP_GRADIENT = "orttrainer: detach, no gradient"  # the doc_string of an Identity standing for torch's detach


def detached(build, v, output=None):
    """float32 v's value on no gradient path, exactly: ±0, denormals, ±inf and NaN included.

    ONNX Runtime's gradient builder stops at a Cast to an integer type, and has no op that
    passes a float unchanged without a gradient. So v, scaled by a power of two into
    [2^-17, 2^62), passes as its integer part and its fraction in steps of 2^-40, each through
    int64 (with 24 significant bits, both are exact), then is scaled back. ±inf and NaN, which
    have no integer part, and -0, which comes back +0, are selected from constants by masks,
    which carry no gradient either. (ONNX Runtime's Where turns a -0 it takes from its first
    branch into +0, from its second it keeps it.)
    """
    magnitude = build.op("Abs", [v])
    scale = where(build, build.op("GreaterOrEqual", [magnitude, build.const(_DETACH_LARGE[0])]), _DETACH_LARGE[1], 1.0)
    for bound, factor in reversed(_DETACH_SCALES):
        scale = where(build, build.op("Less", [magnitude, build.const(bound)]), factor, scale)
    scaled = build.op("Mul", [v, scale])
    whole = build.op("Cast", [build.op("Cast", [scaled], to=onnx.TensorProto.INT64)], to=onnx.TensorProto.FLOAT)
    fraction = build.op("Mul", [build.op("Sub", [scaled, whole]), build.const(2.0**40)])
    steps = build.op("Cast", [build.op("Cast", [fraction], to=onnx.TensorProto.INT64)], to=onnx.TensorProto.FLOAT)
    finite = build.op("Div", [build.op("Add", [whole, build.op("Mul", [steps, build.const(2.0**-40)])]), scale])
    infinite = where(build, build.op("Greater", [v, build.const(0.0)]), float("inf"), float("-inf"))
    kept = where(build, build.op("IsNaN", [v]), float("nan"), where(build, build.op("IsInf", [v]), infinite, finite))
    return where(build, build.op("Not", [is_negative_zero(build, v)]), kept, -0.0, output)


def is_negative_zero(build, v):
    """Where v is -0 (a bool tensor): equal to 0, with a reciprocal below 0."""
    zero = build.op("Equal", [v, build.const(0.0)])
    return build.op("And", [zero, build.op("Less", [build.op("Reciprocal", [v]), build.const(0.0)])])


def sign_bit(build, v):
    """Where v's sign bit is set (a bool tensor): below 0, or -0."""
    return build.op("Or", [build.op("Less", [v, build.const(0.0)]), is_negative_zero(build, v)])


def stop_gradient(build, elem_type=onnx.TensorProto.FLOAT):
    """torch's detach of the node's input (an Identity marked ``STOP_GRADIENT``): ``detached``, through float32
    for a float16 input (which float32 holds exactly)."""
    x, output = build.node.input[0], build.node.output[0]
    if elem_type == onnx.TensorProto.FLOAT:
        detached(build, x, output)
    else:
        build.op("Cast", [detached(build, build.op("Cast", [x], to=onnx.TensorProto.FLOAT))], output, to=elem_type)


def softplus(build):
    """log(1 + exp(x)) as Max(x, 0) + log1p(exp(-|x|)), gradient sigmoid(x) everywhere.

    At x = 0 the gradient is 1/2 = sigmoid(0): onnxruntime-training's Max shares the
    gradient between tied inputs (1/2 each) and Abs's derivative is 0 there (Relu's is 0
    too, which gave 0). exp only sees -|x| <= 0: no overflow, and exp(-inf) = 0 gives x and
    0 at ±inf with gradients 1 and 0. Values within about 2 ulp (log1p), also far below 0
    where the result is exp(x) (denormal results may flush to 0).
    """
    x = build.node.input[0]
    tail = log1p(build, build.op("Exp", [build.op("Neg", [build.op("Abs", [x])])]), reaches_minus_one=False)
    build.op("Add", [build.op("Max", [x, build.const(0.0)]), tail], _output(build))


def _expm1_nonpositive(build, z):
    """exp(z) - 1 for z <= 0 (-inf included) to float32 accuracy, value and gradient.

    On [-1, 0] it is 2t / (1 - t) with t = tanh(z / 2): no cancellation near 0, where
    exp(z) - 1 loses every digit (ELU(-1e-30) would be 0), and within about 6 ulp (ONNX
    Runtime's Tanh is within 5). Below -1, exp(z) - 1 has no cancellation and its gradient
    exp(z) stays exact where tanh'(z / 2) = 1 - t^2 would round to 0.
    """
    near = mask(build, _compare(build, "GreaterOrEqual", z, -1.0))
    t = build.op("Tanh", [build.op("Mul", [z, build.const(0.5)])])
    ratio = build.op("Div", [build.op("Mul", [t, build.const(2.0)]), build.op("Sub", [build.const(1.0), t])])
    far = build.op("Sub", [build.op("Exp", [z]), build.const(1.0)])  # both finite for every z <= 0
    beyond = build.op("Sub", [build.const(1.0), near])
    return build.op("Add", [build.op("Mul", [ratio, near]), build.op("Mul", [far, beyond])])


def _elu_like(build, x, alpha, inner_scale, output):
    """relu(x) + alpha * (exp(inner_scale * min(x, 0)) - 1): ELU, CELU (and SELU, scaled).

    As torch's branches: at x = 0 the gradient is the exponential's, alpha * inner_scale
    (_nonpositive_part); the exponential never sees x > 0 (+inf gave inf - inf = NaN).
    """
    z = _nonpositive_part(build, x)
    if inner_scale != 1.0:
        z = build.op("Mul", [z, build.const(inner_scale)])
    curve = build.op("Mul", [_expm1_nonpositive(build, z), build.const(alpha)])
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


def is_torch_hard_sigmoid(node: onnx.NodeProto) -> bool:
    """A HardSigmoid with torch's alpha 1/6 and beta 1/2 (``nn.Hardsigmoid``), whose gradient
    defined_gradients.py gives the builder."""
    alpha, beta = node_attribute(node, "alpha", 0.2), node_attribute(node, "beta", 0.5)
    return node.op_type == "HardSigmoid" and alpha == float(np.float32(1 / 6)) and beta == 0.5


def hard_sigmoid(build):
    """clip(alpha * x + beta, 0, 1) with torch's hardsigmoid gradient: alpha strictly between
    the kinks, 0 at and beyond them (Clip's is 1 at them); NaN gives NaN.

    The kinks are compared on x (at -beta/alpha and (1 - beta)/alpha, ±3 for torch), not on
    the rounded alpha * x + beta, which reaches 1 one float below 3; the line is
    (x - low) * alpha, exact near the low kink as torch's (x + 3) / 6. torch's own form is
    left as it is: its gradient is defined and its forward spelled as torch's after the build
    (defined_gradients.py).
    """
    if is_torch_hard_sigmoid(build.node):
        return False
    x, alpha, beta = build.node.input[0], build.attribute("alpha", 0.2), build.attribute("beta", 0.5)
    if alpha <= 0:
        raise RewriteError(f"HardSigmoid node '{build.node.name}': alpha {alpha} <= 0 cannot be rewritten")
    low, high = float(np.float32(-beta / alpha)), float(np.float32((1.0 - beta) / alpha))
    line = build.op("Mul", [build.op("Sub", [x, build.const(low)]), build.const(alpha)])
    clipped = build.op("Clip", [line, build.const(0.0), build.const(1.0)])  # finite, also for x = ±inf
    inside = build.op("And", [_compare(build, "Greater", x, low), _compare(build, "Less", x, high)])
    outside = mask(build, _compare(build, "GreaterOrEqual", x, high))
    build.op("Add", [build.op("Mul", [clipped, mask(build, inside)]), outside], _output(build))


def prelu(build):
    """relu(x) + slope * min(x, 0): gradient slope at x = 0, as torch's (_nonpositive_part);
    the slope is multiplied only by the x <= 0 values, so +inf gives it gradient 0, not
    0 * inf, and the value inf, not inf - inf."""
    x, slope = build.node.input[0], build.node.input[1]
    negative = build.op("Mul", [slope, _nonpositive_part(build, x)])
    build.op("Add", [build.op("Relu", [x]), negative], _output(build))


def _batch_norm_trains(node: onnx.NodeProto, opset_version: int) -> bool:
    """Whether a BatchNormalization computes batch statistics (training_mode from opset 14,
    the optional statistics outputs before)."""
    if opset_version >= 14:
        return bool(node_attribute(node, "training_mode", 0))
    return any(node.output[1:])


def inference_batch_norm(build):
    """BatchNormalization in inference mode (a BatchNorm the user put in eval(), inside a model
    trained in train()) as (x - mean) * (scale / sqrt(var + epsilon)) + bias.

    ONNX Runtime's training optimizer turns every BatchNormalization into its training-mode
    BatchNormInternal, which normalizes with the batch's statistics and overwrites the
    running ones in place (measured on 1.19.2), on a gradient path or not; so
    rewrite_for_training replaces these wherever they are. The running statistics are read,
    never trained; x, scale and bias get torch's gradients. Training-mode nodes are kept.
    """
    if _batch_norm_trains(build.node, build.opset):
        return False
    x, scale, bias, mean, variance = build.node.input[:5]
    channel_axes = list(range(1, len(build.shape(x)) - 1))  # [C] -> [C, 1, ...] against [N, C, ...]
    epsilon = build.const(build.attribute("epsilon", 1e-5))
    factor = build.op("Div", [scale, build.op("Sqrt", [build.op("Add", [variance, epsilon])])])
    if channel_axes:
        factor, bias, mean = (build.unsqueeze(tensor, channel_axes) for tensor in (factor, bias, mean))
    build.op("Add", [build.op("Mul", [build.op("Sub", [x, mean]), factor]), bias], _output(build))
    return True


def batch_statistics_batch_norm(build):
    """A training-mode BatchNormalization as its value, (x - mean) / sqrt(var + epsilon) * scale + bias
    with the batch's mean and biased variance over every axis but the channels': the inference graph
    of a BatchNorm without running statistics, which a plain (not training) ONNX Runtime build runs."""
    if not _batch_norm_trains(build.node, build.opset):
        return False
    x, scale, bias = build.node.input[:3]
    rank = len(build.shape(x))
    axes = [0] + list(range(2, rank))
    centered = build.op("Sub", [x, build.reduce("ReduceMean", x, axes, 1)])
    variance = build.reduce("ReduceMean", build.op("Mul", [centered, centered]), axes, 1)
    std = build.op("Sqrt", [build.op("Add", [variance, build.const(build.attribute("epsilon", 1e-5))])])
    channel_axes = list(range(1, rank - 1))
    scale, bias = (build.unsqueeze(tensor, channel_axes) if channel_axes else tensor for tensor in (scale, bias))
    build.op("Add", [build.op("Mul", [build.op("Div", [centered, std]), scale]), bias], _output(build))


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
        build.op("Mul", [summed, build.const(1.0 / np.prod(kernel))], _output(build))
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
    build.op("Div", [summed, counts], _output(build))


def _drops_a_window(node: onnx.NodeProto, shapes: dict) -> bool:
    """Whether torch makes fewer ceil_mode windows than this pool's ONNX Runtime kernel (one that would start in
    the end padding, e.g. size 4, kernel 2, stride 3, padding 1: 2 windows, not 3); False where sizes are unknown."""
    dims = len(node_attribute(node, "kernel_shape"))
    dilations = list(node_attribute(node, "dilations", [1] * dims))
    kernel = [(size - 1) * dilation + 1 for size, dilation in zip(node_attribute(node, "kernel_shape"), dilations)]
    lengths = (shapes.get(node.input[0]) or [None] * (dims + 2))[2:]
    strides = list(node_attribute(node, "strides", [1] * dims))
    pads = list(node_attribute(node, "pads", [0] * 2 * dims))
    if node_attribute(node, "auto_pad", "NOTSET") != "NOTSET" or None in lengths:
        return False
    for length, size, stride, before, after in zip(lengths, kernel, strides, pads[:dims], pads[dims:]):
        if _ceil_mode_count(length, size, stride, before, after) < _onnx_ceil_mode_count(length, size, stride, before, after):
            return True
    return False


def _declare_inferred_output_sizes(model: onnx.ModelProto) -> None:
    """Give the graph outputs the sizes ONNX's shape inference finds now, where they declare other ones (the
    exporter took them from ONNX's AveragePool, with the window torch drops)."""
    structure = structure_for_inference(model)
    for output in structure.graph.output:
        output.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(structure, data_prop=True).graph.output
    sizes = {output.name: [_symbolic_dim(dim) for dim in output.type.tensor_type.shape.dim] for output in inferred}
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
    taken in graph order, the sizes inferred again after each (a pool changes the sizes after it); an
    AveragePool whose input sizes shape inference does not know stays (a training graph's build then names it)."""
    if not any(node.op_type in _TORCH_POOLS and node_attribute(node, "ceil_mode", 0) for node in model.graph.node):
        return []
    changed, kept, dropped = [], set(), False
    while True:
        shapes = static_shapes(model)
        pool = next((node for node in model.graph.node if node.name not in kept and _pool_differs(node, shapes)), None)
        if pool is None:
            break
        dropped = dropped or _drops_a_window(pool, shapes)
        if pool.op_type == "MaxPool":
            next(attribute for attribute in pool.attribute if attribute.name == "ceil_mode").i = 0
            changed.append(pool.name)
            continue
        rewritten = replace_nodes(model, {"AveragePool": average_pool}, [pool], shapes=shapes, failed={})
        changed += rewritten
        if not rewritten:
            kept.add(pool.name)
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


# ONNX Resize's coordinate transformations: output index -> input coordinate, for an axis of
# ``length`` values resized by ``factor``; then the nearest-mode roundings.
_RESIZE_COORDINATES = {
    "half_pixel": lambda out, length, factor: (out + 0.5) / factor - 0.5,
    "pytorch_half_pixel": lambda out, length, factor: (out + 0.5) / factor - 0.5 if length * factor > 1 else 0 * out,
    "align_corners": lambda out, length, factor: out * (length - 1) / max(length * factor - 1, 1),
    "asymmetric": lambda out, length, factor: out / factor,
    "tf_half_pixel_for_nn": lambda out, length, factor: (out + 0.5) / factor,
}
_NEAREST_ROUNDINGS = {
    "round_prefer_floor": lambda coordinate: np.ceil(coordinate - 0.5),
    "round_prefer_ceil": lambda coordinate: np.floor(coordinate + 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
}


def _repeats_each_value(build, length, factor):
    """Whether this Resize's coordinate transformation and nearest mode read input i for the
    outputs i * factor ... i * factor + factor - 1 (what Reshape + Expand computes); e.g.
    torch's nearest (asymmetric, floor) does, align_corners or ceil rounding does not."""
    transform = _RESIZE_COORDINATES.get(build.attribute("coordinate_transformation_mode", "half_pixel"))
    rounding = _NEAREST_ROUNDINGS.get(build.attribute("nearest_mode", "round_prefer_floor"))
    if transform is None or rounding is None:
        return False
    coordinates = transform(np.arange(length * factor, dtype=np.float64), length, factor)
    sources = np.clip(rounding(coordinates), 0, length - 1)
    return np.array_equal(sources, np.repeat(np.arange(length), factor))


def resize(build):
    """Resize (ONNX Runtime has no CPU kernel for ResizeGrad): nearest by whole-number factors
    (``nearest_upsample``), linear and cubic as torch's interpolations (``interpolating_resize``)."""
    mode = build.attribute("mode", "nearest")
    if mode == "nearest":
        return nearest_upsample(build)
    if mode in _INTERPOLATIONS:
        return interpolating_resize(build)
    raise RewriteError(f"Resize node '{build.node.name}': only modes 'nearest', 'linear' and 'cubic' can be rewritten, got {mode!r}")


def _resize_scales(build, dims):
    """(scale per axis, whether they came from the ``scales`` input) of a Resize over ``x`` of ``dims``
    (None for the batch and channel axes). Sizes computed from the input's shape (``F.interpolate(size=...)``
    with a dynamic batch) are read off the output's inferred shape."""
    if len(build.node.input) > 2 and build.node.input[2] and build.constant_input(2).size:
        return [float(scale) for scale in build.constant_input(2)], True
    if build.node.input[3] in build.constants:
        sizes = list(build.constant_input(3))
    else:
        sizes = build.static_dims(build.node.output[0], range(2, len(dims)))
        sizes = [None, None] + sizes
    return [1.0 if size is None or dim is None else float(size) / dim for size, dim in zip(sizes, dims)], False


def _resized_length(length: int, scale: float, from_scales: bool) -> int:
    """An axis's output length: ONNX's floor(length * scale) for a Resize given scales (5 by 1.5 is 7, as torch's
    interpolate gives: rounding gave 8 taps for 7 outputs), the size itself for one given sizes."""
    return int(np.floor(np.float32(length) * np.float32(scale))) if from_scales else int(round(length * scale))


def nearest_upsample(build):
    """Resize by whole-number factors in nearest mode as Reshape + Expand + Reshape."""
    x = build.node.input[0]
    shape = build.shape(x)
    rank = len(shape)
    dims = build.static_dims(x, range(1, rank))
    scales = [1.0] + _resize_scales(build, [None] + dims)[0][1:]
    factors = [int(scale) for scale in scales]
    if scales[:2] != [1.0, 1.0] or any(factor != scale or factor < 1 for factor, scale in zip(factors, scales)):
        raise RewriteError(f"Resize node '{build.node.name}': scales {scales} are not whole-number spatial factors")
    spatial = list(zip(dims[1:], factors[2:]))
    if build.attribute("axes") is not None or not all(_repeats_each_value(build, dim, factor) for dim, factor in spatial):
        raise RewriteError(
            f"Resize node '{build.node.name}': its coordinate transformation, nearest mode or axes do not repeat each "
            "value factor times"
        )
    split = [0, dims[0]] + [value for dim, _ in spatial for value in (dim, 1)]
    expanded = [1, dims[0]] + [value for dim, factor in spatial for value in (dim, factor)]
    grown = build.op("Expand", [build.op("Reshape", [x, build.const(split, np.int64)]), build.const(expanded, np.int64)])
    merged = [0, dims[0]] + [dim * factor for dim, factor in spatial]
    build.op("Reshape", [grown, build.const(merged, np.int64)], _output(build))


def _gathered(build, x, axis, indices, output=None):
    return build.op("Gather", [x, build.const(np.asarray(indices, np.int64), np.int64)], output, axis=axis)


def _source_coordinates(transform: str, length: int, size: int, scale: float, from_scales: bool, cubic: bool):
    """torch's upsample source coordinate of each of ``size`` outputs on an axis of ``length``, in float32 as
    torch computes it: its scale is 1 / scale_factor when the export carries scales, else length / size
    (align_corners: (length - 1) / (size - 1)); negative coordinates clamp to 0 but for cubic interpolation."""
    outputs = np.arange(size, dtype=np.float32)
    if transform == "align_corners":
        ratio = np.float32((length - 1) / (size - 1)) if size > 1 else np.float32(0.0)
        return ratio * outputs
    ratio = np.float32(1.0 / scale) if from_scales else np.float32(np.float32(length) / np.float32(size))
    if transform == "asymmetric":
        return ratio * outputs
    if transform == "pytorch_half_pixel" and size == 1:
        return np.zeros(1, np.float32)
    source = ratio * (outputs + np.float32(0.5)) - np.float32(0.5)
    return source if cubic else np.maximum(source, np.float32(0.0))


def _linear_taps(source: np.ndarray, length: int, _a=None) -> list:
    """(indices, weights) of torch's linear interpolation: x[i0] (1 - t) + x[i1] t, i1 = i0 + 1 but at the last index."""
    first = np.minimum(np.floor(source).astype(np.int64), length - 1)
    second = first + (first < length - 1)
    weight = source - first.astype(np.float32)
    return [(first, np.float32(1.0) - weight), (second, weight)]


def _cubic_taps(source: np.ndarray, length: int, a: float) -> list:
    """(indices, weights) of torch's bicubic interpolation (upsample_bicubic2d): the four inputs around the source,
    clamped to the axis, weighted by Keys' cubic convolution with coefficient ``a`` at torch's float32 fraction t.
    The weights are evaluated in float64 and rounded: the far lobes' polynomial cancels (terms near 3 for a weight
    near -0.04), and torch's float32 evaluation is a few ulps off either way (its compiler contracts it)."""
    floor = np.floor(source)
    t = (source - floor).astype(np.float32).astype(np.float64)

    def near(x):  # cubic_convolution1: |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # cubic_convolution2: 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = [far(t + 1), near(t), near(1 - t), far(2 - t)]
    start = floor.astype(np.int64) - 1
    return [(np.clip(start + offset, 0, length - 1), weight.astype(np.float32)) for offset, weight in enumerate(weights)]


_INTERPOLATIONS = {"linear": _linear_taps, "cubic": _cubic_taps}


def interpolating_resize(build):
    """Resize in linear or cubic mode as torch's upsample_(bi/tri)linear and upsample_bicubic2d: along each resized
    axis, the last first, y = sum of w_k * x[i_k] with a Gather of constant indices and constant weights per tap
    (two for linear, the second the first + 1 but at the last index; four for cubic, clamped to the axis). Only
    the inputs torch's kernel reads are read, so an inf or NaN reaches the outputs next to it only (an
    interpolation matrix would multiply it by 0). Weights computed in float32 as torch does; the sum's
    rounding may differ from torch's by an ulp."""
    x, mode = build.node.input[0], build.attribute("mode")
    transform = build.attribute("coordinate_transformation_mode", "half_pixel")
    if transform not in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"):
        raise RewriteError(f"Resize node '{build.node.name}': coordinate transformation {transform!r} cannot be rewritten")
    if build.attribute("axes") is not None or build.attribute("antialias", 0) or build.attribute("exclude_outside", 0):
        raise RewriteError(f"Resize node '{build.node.name}': axes, antialias or exclude_outside cannot be rewritten")
    rank = len(build.shape(x))
    dims = build.static_dims(x, range(2, rank))
    scales, from_scales = _resize_scales(build, [None, None] + dims)
    if scales[:2] != [1.0, 1.0]:
        raise RewriteError(f"Resize node '{build.node.name}': scales {scales} resize the batch or channel axis")
    resized = x
    sizes = {axis: _resized_length(dims[axis - 2], scales[axis], from_scales) for axis in range(2, rank)}
    axes = [axis for axis in range(rank - 1, 1, -1) if sizes[axis] != dims[axis - 2]]
    for axis in axes:
        length, size = dims[axis - 2], sizes[axis]
        source = _source_coordinates(transform, length, size, scales[axis], from_scales, cubic=mode == "cubic")
        taps = _INTERPOLATIONS[mode](source, length, build.attribute("cubic_coeff_a", -0.75))
        along = [size] + [1] * (rank - 1 - axis)
        terms = [build.op("Mul", [_gathered(build, resized, axis, index), build.const(weight.reshape(along))]) for index, weight in taps]
        for term in terms[1:-1]:  # added left to right, as torch's kernel does (Sum has no gradient builder)
            terms[0] = build.op("Add", [terms[0], term])
        resized = build.op("Add", [terms[0], terms[-1]], _output(build) if axis == axes[-1] else None)
    if not axes:
        build.op("Identity", [x], _output(build))


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
        output = _output(build) if position == len(axes) - 1 else None
        length = build.shape(build.node.input[0])[axis]
        if length is None and (start, step) == (-1, -1) and end <= -_FLIPPED_TO:
            sliced = _reversed_at_run(build, sliced, axis, output)
            continue
        if length is None:
            raise RewriteError(f"Slice node '{build.node.name}' with step {step} (torch.flip, x[::-k]) along an axis whose "
                               "size changes with the batch: only a whole reversal (torch.flip) is taken there")  # fmt: skip
        sliced = _gathered(build, sliced, axis, _slice_indices(length, start, end, int(step)), output)


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
        return _gathered(build, x, axis, indices, output)
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
        output = _output(build) if axis == padded_axes[-1] else None
        padded = _copied_along(build, padded, axis, indices, max(pads[axis], 0), length, output)
    if not padded_axes:
        build.op("Identity", [x], _output(build))


def reduce_keeping_dims(build):
    """ReduceLogSumExp / ReduceL2 with keepdims=0 as the same op with keepdims=1 and a Squeeze:
    onnxruntime-training's gradients of these emit an opset-11 Unsqueeze for keepdims=0, which an
    opset-13+ graph rejects. keepdims=1 is kept."""
    axes, keepdims = build.reduce_axes()
    if keepdims:
        return False
    x = build.node.input[0]
    axes = list(range(len(build.shape(x)))) if axes is None else axes
    build.squeeze(build.reduce(build.node.op_type, x, axes, 1), axes, _output(build))


def _shifted(build, x, axis, rank, length, shift, reverse):
    """x moved ``shift`` places along ``axis``, towards its end (its start if ``reverse``), zeros coming in."""
    bounds = ([shift], [length]) if reverse else ([0], [length - shift])
    kept = build.op("Slice", [x, *(build.const(bound, np.int64) for bound in bounds), build.const([axis], np.int64)])
    pads = [0] * (2 * rank)
    pads[axis + (rank if reverse else 0)] = shift
    return build.op("Pad", [kept, build.const(pads, np.int64)])


def cumsum(build):
    """CumSum along a static axis as a scan in float64: y += y shifted by 1, 2, 4, ... (ceil(log2 n) steps).

    Each output sums exactly the inputs torch's does, so an inf or NaN reaches only the
    positions after it (a triangular MatMul multiplied every input by 0 or 1, and inf * 0 =
    NaN). torch accumulates a float32 cumsum in float64 on the CPU (1e8 + 1 - 1e8 = 1), so
    the scan runs in float64 too and rounds once.
    """
    if build.opset < 11:
        raise RewriteError(f"CumSum node '{build.node.name}': opset {build.opset} < 11 has no Pad with a pads input")
    x = build.node.input[0]
    rank = len(build.shape(x))
    axis = int(build.constant_input(1).reshape(-1)[0]) % rank
    length = build.shape(x)[axis]
    if length is None:
        raise RewriteError(f"CumSum node '{build.node.name}' (torch.cumsum) along axis {axis}, whose size changes with the "
                           "batch: its exact form is written for a fixed length; cumulate along a fixed axis, or pad "
                           "that axis to a fixed length")  # fmt: skip
    reverse = build.attribute("reverse", 0)
    total = build.op("Cast", [x], to=onnx.TensorProto.DOUBLE)
    if build.attribute("exclusive", 0):
        total = _shifted(build, total, axis, rank, length, 1, reverse)
    for step in range(max(length - 1, 0).bit_length()):
        total = build.op("Add", [total, _shifted(build, total, axis, rank, length, 1 << step, reverse)])
    build.op("Cast", [total], _output(build), to=onnx.TensorProto.FLOAT)  # rewrites run before any float16 conversion


def _extreme_positions(build, x, axes, op_type):
    """(ties, nan, has_nan), all bool and shaped like x or its slices with kept dims: where x
    equals its slice's ReduceMax/ReduceMin, where x is NaN, whether the slice holds a NaN.

    torch's max/min/amax/amin return NaN for a slice holding one; ONNX Runtime's ReduceMax
    and ArgMax skip a NaN unless it comes first, so NaN is handled explicitly.
    """
    nan = build.op("IsNaN", [x])
    any_nan = build.reduce("ReduceMax", build.op("Cast", [nan], to=onnx.TensorProto.FLOAT), axes, 1)
    has_nan = _compare(build, "Greater", any_nan, 0.0)
    ties = build.op("Equal", [x, build.reduce(op_type, x, axes, 1)])
    return ties, nan, has_nan


def first_extreme_index(build, x, axis, op_type, floating=True):
    """Where torch.max(x, dim) / torch.min(x, dim) and torch.argmax / argmin look along ``axis``: the
    first NaN if the slice holds one, else the first extreme (``op_type`` ReduceMax or ReduceMin);
    int64 indices with the axis kept. An integer ``x`` (not ``floating``) holds no NaN, and gets no ArgMax
    of its own (ONNX Runtime has no CPU kernel for an int64 one)."""
    if floating:
        ties, nan, has_nan = _extreme_positions(build, x, [axis], op_type)
        at_nan, at_ties = build.op("And", [has_nan, nan]), build.op("And", [build.op("Not", [has_nan]), ties])
        chosen = build.op("Or", [at_nan, at_ties])
    else:
        chosen = build.op("Equal", [x, build.reduce(op_type, x, [axis], 1)])
    positions = build.op("Cast", [chosen], to=onnx.TensorProto.FLOAT)
    return build.op("ArgMax", [positions], axis=axis, keepdims=1)  # the first of the 1s


def first_extreme(build, x, axis, keepdims, op_type, output=None, floating=True):
    """torch.max(x, dim) / torch.min(x, dim): (values, indices) at the first extreme along
    ``axis`` (the first NaN if there is one), which alone gets the gradient, as in torch."""
    indices = first_extreme_index(build, x, axis, op_type, floating)
    if keepdims:
        return build.op("GatherElements", [x, indices], output, axis=axis), indices
    values = build.op("GatherElements", [x, indices], axis=axis)
    return build.squeeze(values, [axis], output), build.squeeze(indices, [axis])


def reduce_extreme(build):
    """ReduceMax/ReduceMin with torch.amax/amin's value and gradient: shared evenly among the
    tied extremes (the tie mask selects with Where: a multiplication by it turned a slice
    holding -inf, as masked attention scores do, into NaN); a slice holding NaN gives NaN
    and, as torch's 0/0 tie count does, a NaN gradient to each of its elements.

    torch.max(x, dim) / min(x, dim), whose gradient goes to the first extreme only, are
    exported by symbolics/ as first_extreme, never as ReduceMax: so a ReduceMax next to an
    ArgMax of the same axis comes from amax + argmax and keeps amax's gradient. Ties of more
    than two values that are not exactly divisible by their count may round an ulp off.
    """
    x = build.node.input[0]
    axes, keepdims = build.reduce_axes()
    ties, _, has_nan = _extreme_positions(build, x, axes, build.node.op_type)
    count = build.reduce("ReduceSum", build.op("Cast", [ties], to=onnx.TensorProto.FLOAT), axes, 1)
    picked = where(build, build.op("Or", [ties, has_nan]), x, 0.0)
    shares = build.op("Div", [picked, where(build, has_nan, float("nan"), count)])
    build.reduce("ReduceSum", shares, axes, keepdims, _output(build))


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


# Taylor coefficients of sinh(x) / x and cosh(x) in x^2, up to the x^8 term: on |x| < 1/2
# the first omitted term is below 1.2e-8 relative (a tenth of an ulp).
_SINH_OVER_X = [1.0, 1 / 6, 1 / 120, 1 / 5040, 1 / 362880]
_COSH = [1.0, 1 / 2, 1 / 24, 1 / 720, 1 / 40320]
_SERIES_BELOW = 0.5
_SHIFTED_FROM = 44.0  # exp(a - 44) from here on; a - 44 is exact for 44 <= a < 128


def _half_exp(build, a):
    """exp(a) / 2 for a >= 0, finite up to exp(a) = 2 * FLT_MAX (where sinh and cosh overflow;
    exp(a) alone overflows from 88.7) and with a gradient that overflows no earlier: from 44
    on it is exp(a - 44) * (exp(44) / 2), never exp(a) or exp(a / 2)^2, whose gradients
    pass through 2 * exp(a) / 2 before halving."""
    shifted = _compare(build, "GreaterOrEqual", a, _SHIFTED_FROM)
    low = build.op("Mul", [build.op("Exp", [where(build, shifted, 0.0, a)]), build.const(0.5)])
    high_exponent = build.op("Sub", [where(build, shifted, a, _SHIFTED_FROM), build.const(_SHIFTED_FROM)])
    high = build.op("Mul", [build.op("Exp", [high_exponent]), build.const(np.exp(_SHIFTED_FROM) / 2)])
    return where(build, shifted, high, low)


def _hyperbolic(build, x, odd, output):
    """sinh (``odd``) or cosh of x, to float32 accuracy in value and gradient.

    Below |x| = 1/2 a Taylor polynomial: (exp(x) -/+ exp(-x)) / 2 cancels there, for
    sinh's value and cosh's gradient (sinh(1e-30) would be 0). From 1/2 on, h -/+ 1 / (4h)
    with h = exp(|x|) / 2 (_half_exp), finite up to sinh's own overflow at 89.4 (exp(x)
    overflowed from 88.7). Each branch reads only its own inputs (see where).
    """
    negative, magnitude = _magnitude(build, x)
    near = _compare(build, "Less", magnitude, _SERIES_BELOW)
    small = where(build, near, x, 0.0)
    square = build.op("Mul", [small, small])
    if odd:
        series = build.op("Mul", [small, _polynomial(build, square, _SINH_OVER_X)])
    else:
        series = _polynomial(build, square, _COSH)
    half = _half_exp(build, where(build, near, _SERIES_BELOW, magnitude))
    reciprocal = build.op("Div", [build.const(0.25), half])
    exponentials = build.op("Sub" if odd else "Add", [half, reciprocal])
    if odd:
        exponentials = _with_sign(build, negative, exponentials)
    return where(build, near, series, exponentials, output)


def sinh(build):
    _hyperbolic(build, build.node.input[0], True, _output(build))


def cosh(build):
    _hyperbolic(build, build.node.input[0], False, _output(build))


# From here on sqrt(x^2 ± 1) = |x| in float32 (to 3e-8), so asinh and acosh are log(2|x|):
# no overflow of x^2 (beyond 1.8e19) and gradient 1/|x|.
_LOGARITHMIC_FROM = 4096.0


def _log_twice(build, x):
    """log(2x) as log(x) + log 2 (2x would overflow for x beyond FLT_MAX / 2)."""
    return build.op("Add", [build.op("Log", [x]), build.const(np.log(2.0))])


def asinh(build):
    """asinh(x) = sign(x) * log1p(a + a^2 / (1 + sqrt(1 + a^2))), a = |x| (no cancellation:
    log(x + sqrt(x^2 + 1)) lost every digit for x << 0 and near 0); log(a) + log 2 from
    a = 4096 on. Gradient 1 at 0 (|x| is a Where)."""
    negative, magnitude = _magnitude(build, build.node.input[0])
    large = _compare(build, "GreaterOrEqual", magnitude, _LOGARITHMIC_FROM)
    a = where(build, large, 0.0, magnitude)
    square = build.op("Mul", [a, a])
    root = build.op("Sqrt", [build.op("Add", [square, build.const(1.0)])])
    shift = build.op("Add", [a, build.op("Div", [square, build.op("Add", [root, build.const(1.0)])])])
    logarithmic = _log_twice(build, where(build, large, magnitude, _LOGARITHMIC_FROM))
    _with_sign(build, negative, where(build, large, logarithmic, log1p(build, shift)), _output(build))


def acosh(build):
    """acosh(x) = log1p(d + sqrt(d) * sqrt(x + 1)) with d = x - 1, exact near 1 (gradient +inf
    at 1, as torch); log(x) + log 2 from x = 4096 on. NaN below 1 as torch; torch's gradient
    there is NaN too on (-1, 1) but finite below -1, where this one is NaN."""
    x = build.node.input[0]
    large = _compare(build, "GreaterOrEqual", x, _LOGARITHMIC_FROM)
    near = where(build, large, 2.0, x)
    excess = build.op("Sub", [near, build.const(1.0)])
    root = build.op("Mul", [build.op("Sqrt", [excess]), build.op("Sqrt", [build.op("Add", [near, build.const(1.0)])])])
    logarithmic = _log_twice(build, where(build, large, x, _LOGARITHMIC_FROM))
    where(build, large, logarithmic, log1p(build, build.op("Add", [excess, root])), _output(build))


def atanh(build):
    """atanh(x) = (log1p(x) - log1p(-x)) / 2: no cancellation near 0 (log((1 + x) / (1 - x))
    was 0 below 6e-8), ±inf at ±1 with gradient +inf, NaN beyond (gradient -1 / (x^2 - 1),
    torch's)."""
    x = build.node.input[0]
    difference = build.op("Sub", [log1p(build, x), log1p(build, build.op("Neg", [x]))])
    build.op("Mul", [difference, build.const(0.5)], _output(build))


def sign(build):
    """sign(x) = [x > 0] - [x < 0] (NaN gives 0, as torch); its gradient is 0, as torch's.

    A Where that never selects x keeps x on a (zero) gradient path, so that a weight read
    only through sign gets a zero gradient, as in torch, instead of none.
    """
    x = build.node.input[0]
    positive = build.op("Cast", [_compare(build, "Greater", x, 0.0)], to=onnx.TensorProto.FLOAT)
    negative = build.op("Cast", [_compare(build, "Less", x, 0.0)], to=onnx.TensorProto.FLOAT)
    never = where(build, _compare(build, "Less", x, -np.inf), x, 0.0)
    build.op("Add", [build.op("Sub", [positive, negative]), never], _output(build))


def _einsum_terms(build):
    """(each operand's indices, the output's, the equation) of the Einsum being replaced; an ellipsis becomes
    letters of its own for the axes it stands for (right-aligned, as einsum broadcasts them), which needs each
    operand's rank."""
    equation = build.attribute("equation").replace(" ", "")
    if "->" not in equation:
        raise RewriteError(f"Einsum node '{build.node.name}': equation '{equation}' needs an explicit '->'")
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if "..." in equation:
        ranks = [len(build.shape(name)) for name in build.node.input]
        spans = [rank - (len(term) - 3) if "..." in term else 0 for term, rank in zip(terms, ranks)]
        unused = [letter for letter in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if letter not in equation][: max(spans)]
        terms = [term.replace("...", "".join(unused[len(unused) - span :]) if span else "") for term, span in zip(terms, spans)]
        output = output.replace("...", "".join(unused))
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


def _merged_axes(build, x, shape, start, groups):
    """x reshaped so that, from axis ``start`` on, each of ``groups`` consecutive axes (counts; 0 for none) becomes
    one axis of their sizes' product (1 for none); ``shape`` is x's Shape."""
    sizes, at = [_shape_slice(build, shape, 0, start)], start
    for count in groups:
        sizes.append(build.reduce("ReduceProd", _shape_slice(build, shape, at, at + count), [0], 1) if count
                     else build.const([1], np.int64))  # fmt: skip
        at += count
    return build.op("Reshape", [x, build.op("Concat", sizes, axis=0)])


def _shape_slice(build, shape, start, end):
    return build.op("Slice", [shape, build.const([start], np.int64), build.const([end], np.int64)])


def einsum(build):
    """Einsum with one or two operands as ReduceSum/Transpose/MatMul (or Mul without a summed index): the
    indices of each side lined up as (shared, own free, summed), each group reshaped into one axis, a batched
    MatMul, and the free axes reshaped back."""
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
    a = _transpose(build, a, term_a, "".join(batch + left + contracted))
    b = _transpose(build, b, term_b, "".join(batch + contracted + right))
    a_shape, b_shape = build.op("Shape", [a]), build.op("Shape", [b])
    start = len(batch)
    product = build.op("MatMul", [_merged_axes(build, a, a_shape, start, [len(left), len(contracted)]),
                                  _merged_axes(build, b, b_shape, start, [len(contracted), len(right)])])  # fmt: skip
    sizes = [_shape_slice(build, build.op("Shape", [product]), 0, start),  # shared axes as MatMul broadcast them
             _shape_slice(build, a_shape, start, start + len(left)),
             _shape_slice(build, b_shape, start + len(contracted), start + len(contracted) + len(right))]  # fmt: skip
    product = build.op("Reshape", [product, build.op("Concat", sizes, axis=0)])
    _transpose(build, product, "".join(batch + left + right), output, _output(build))


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
    build.op("Conv", inputs, _output(build), dilations=dilations, group=groups, kernel_shape=kernel, pads=[0] * 2 * dims,
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
    build.op("Conv", list(build.node.input), _output(build), group=build.attribute("group", 1),
             **_conv_attributes(build, x, weight))  # fmt: skip
    return True


def _as_two_dimensional(build, inputs, attributes):
    """A 1-d Conv as a 2-d one over [N, C, 1, L]: its input and weight get a unit axis 2, which the output loses."""
    spread = {**attributes, "pads": [0, attributes["pads"][0], 0, attributes["pads"][1]]}
    for name in ("kernel_shape", "strides", "dilations"):
        spread[name] = [1, *attributes[name]]
    x, weight, *bias = inputs
    result = build.op("Conv", [build.unsqueeze(x, [2]), build.unsqueeze(weight, [2]), *bias], **spread)
    build.squeeze(result, [2], _output(build))


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
    build.op("Concat", results, _output(build), axis=1)
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


ZERO_GRADIENT_AT_BOUNDS = "orttrainer: hardtanh, gradient 0 at the bounds"  # the doc_string of such a Clip


def _singular_at_zero(consumer: onnx.NodeProto, name: str, constants: dict) -> bool:
    """Whether ``consumer``'s gradient with respect to its input ``name`` can be infinite where that input is 0: a
    Sqrt, Log or Reciprocal of it, a Pow of it by an exponent below 1 (or one not known), a Div by it."""
    if consumer.op_type in ("Sqrt", "Log", "Reciprocal"):
        return True
    if consumer.op_type == "Pow" and consumer.input[0] == name:
        exponent = constants.get(consumer.input[1])
        return exponent is None or float(np.min(exponent)) < 1
    return consumer.op_type == "Div" and consumer.input[1] == name


# Ops that carry a 0 of their input to their output unchanged or scaled: a singular op after them still sees it
_CARRY_ZEROS = ("Add", "Sub", "Mul", "Neg", "Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Expand",
                "Slice", "Concat", "Gather")  # fmt: skip


def _feeds_singular(build, name: str, depth: int = 4) -> bool:
    """Whether a singular-at-zero op (``_singular_at_zero``) reads ``name``, directly or through ``_CARRY_ZEROS`` ops."""
    for consumer in build.facts.consumers[name]:
        if _singular_at_zero(consumer, name, build.constants):
            return True
        if depth and consumer.op_type in _CARRY_ZEROS and _feeds_singular(build, consumer.output[0], depth - 1):
            return True
    return False


def select_before_singular(build):
    """A Relu or a Clip of constant bounds whose output a square root (a Pow below 1, a Log, a division) reads, as a
    Where between x and constants: its gradient then selects dy where x passes, where the mask multiplication of
    ReluGrad's and Clip's gradients gave inf * 0 = NaN at the masked elements (sqrt's gradient is infinite at the
    0 they put out), and torch's select gives 0 (``sqrt(relu(x))``, ``x.clamp(min=0).sqrt()``). x passes where
    torch's backward lets dy through: a Relu where not x <= 0 (NaN included); a clamp where lo <= x <= hi, a hardtanh
    (``ZERO_GRADIENT_AT_BOUNDS``) where lo < x < hi. The others take their values from constants: the bound, NaN, and
    -0 for a -0 held at a bound of 0, as torch keeps it. Other Relu and Clip nodes are kept: their gradients cost less.
    Whichever of x and the held values can be -0 is the Where's second branch: ONNX Runtime's Where turns a -0 it
    takes from its first branch into +0 (``detached``)."""
    node, x = build.node, build.node.input[0]
    if not _feeds_singular(build, node.output[0]):
        return False
    if node.op_type == "Relu":
        low, high, strict = 0.0, float("inf"), True
    else:
        given = [name for name in node.input[1:3] if name]
        if any(name not in build.constants for name in given):  # bounds computed in the run: the Clip is kept
            return False
        low, high = [float(build.constants[node.input[index]].reshape(-1)[0]) if len(node.input) > index and node.input[index]
                     else default for index, default in ((1, float("-inf")), (2, float("inf")))]  # fmt: skip
        strict = node.doc_string == ZERO_GRADIENT_AT_BOUNDS
    at_low = _compare(build, "LessOrEqual" if strict else "Less", x, low)  # held at the low bound
    held = where(build, at_low, low, high)
    held = where(build, build.op("Not", [build.op("IsNaN", [x])]), held, float("nan"))
    if 0.0 in (low, high):
        held = where(build, build.op("Not", [is_negative_zero(build, x)]), held, -0.0)
    zero_passes = low < 0.0 < high if strict else low <= 0.0 <= high
    if zero_passes:  # a -0 of x is put out as it is: x in the second branch (no Not: ONNX Runtime swaps the branches)
        at_high = _compare(build, "GreaterOrEqual" if strict else "Greater", x, high)
        where(build, build.op("Or", [build.op("Or", [at_low, at_high]), build.op("IsNaN", [x])]), held, x, _output(build))
        return True
    # a -0 of x is held: the held values in the second branch
    if node.op_type == "Relu":  # NaN passes, as torch's threshold_backward lets it (not x <= 0)
        passes = build.op("Not", [at_low])
    else:
        above, below = ("Greater", "Less") if strict else ("GreaterOrEqual", "LessOrEqual")
        passes = build.op("And", [_compare(build, above, x, low), _compare(build, below, x, high)])
    where(build, passes, x, held, _output(build))
    return True


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
    build.op("Add", [data, added], _output(build))


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
    build.op(node.op_type, inputs, _output(build), **node_attributes(node))
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
    where(build, nan, build.op("Add", [a, b]), ordered, _output(build))
    return True


def sum_of_quotients(build):
    """Add(a, b) as Sub(a, Neg(b)): the same values bit for bit (IEEE subtraction adds the negation) and gradients.
    For an Add of two Div outputs, which ONNX Runtime's training optimizer (ScaledSumFusion, inside
    ``get_optimized_model``, which takes no list of transformers to skip) fuses into a ScaledSum when the divisors
    are constant scalars: it has no CPU kernel (``a / 2 + b / 4`` was refused), multiplies by the reciprocal where
    torch divides, and with a third Add after it reads the input of that Add's other producer instead of its output."""
    a, b = build.node.input
    build.op("Sub", [a, build.op("Neg", [b])], _output(build))
    return True


def quotients_kept_apart(model: onnx.ModelProto) -> list:
    """Replace, in place, each Add of two Div outputs by ``sum_of_quotients``' form; return the rewritten node names.
    For every training graph, before ONNX Runtime's training optimizer sees it."""
    producers = {output: node.op_type for node in model.graph.node for output in node.output}
    targets = [node for node in model.graph.node
               if node.op_type == "Add" and all(producers.get(name) == "Div" for name in node.input)]  # fmt: skip
    return replace_nodes(model, {"Add": sum_of_quotients}, targets) if targets else []


REWRITES = {
    "Softplus": softplus,
    "Elu": elu,
    "Celu": celu,
    "Selu": selu,
    "HardSigmoid": hard_sigmoid,
    "PRelu": prelu,
    "BatchNormalization": inference_batch_norm,
    "InstanceNormalization": instance_normalization,
    "AveragePool": average_pool,
    "Resize": resize,
    "Slice": reversing_slice,
    "Pad": edge_pad,
    "ReduceLogSumExp": reduce_keeping_dims,
    "ReduceL2": reduce_keeping_dims,
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
    "ConvTranspose": conv_transpose,
    "ScatterElements": scatter_with_reduction,
    "Relu": select_before_singular,
    "Clip": select_before_singular,
    "ScatterND": scatter_with_reduction,
    **dict.fromkeys(("Where", "Add", "Sub", "Mul", "Div", "Pow"), broadcast_gradient),
    "Max": pairwise_extreme,
    "Min": pairwise_extreme,
}


def _symbolic_dim(dim):
    """A dimension's size, its dim_param, or None: also for the names onnx's inference makes up
    for sizes it cannot tell (unk__N), which ONNX Runtime's own inference leaves unnamed."""
    if dim.HasField("dim_value"):
        return dim.dim_value
    return dim.dim_param if dim.dim_param and not dim.dim_param.startswith("unk__") else None


# Initializers larger than this are weights to shape inference: their shape is what it reads (the
# values it propagates are shape-sized integer tensors).
_INFERENCE_READS_VALUES_UP_TO = 1024


def copy_with_inputs_for(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of ``model`` in which the initializers ``names`` are graph inputs of their type and shape;
    their data is not copied (a model's weights can be most of a process's memory)."""
    wanted = set(names)
    copied = _copy_without(model, "graph")
    graph = copied.graph
    graph.CopyFrom(_copy_without(model.graph, "initializer"))
    declared = {graph_input.name for graph_input in graph.input}
    for initializer in model.graph.initializer:
        if initializer.name not in wanted:
            graph.initializer.add().CopyFrom(initializer)
        elif initializer.name not in declared:
            graph.input.append(helper.make_tensor_value_info(initializer.name, initializer.data_type, list(initializer.dims)))
    return copied


def _constant_node_value(node) -> np.ndarray:
    """The value of a Constant node (None for anything else)."""
    if node is None or node.op_type != "Constant" or node_attribute(node, "value") is None:
        return None
    return numpy_helper.to_array(node_attribute(node, "value"))


def _inline_decided_ifs(model: onnx.ModelProto) -> list:
    """Replace, in place, each If whose condition is a Constant node (``fold_static_sizes`` makes one of the
    exporter's squeeze() of a dimension it could not size, e.g. after a split) by the nodes of the branch
    it always takes; return the If nodes' names. The gradient builder takes no control flow; the values
    are the If's own."""
    ifs = [node for node in model.graph.node if node.op_type == "If"]
    if not ifs:
        return []
    producers = {name: node for node in model.graph.node for name in node.output}
    taken = {}
    for node in ifs:
        condition = _constant_node_value(producers.get(node.input[0]))
        if condition is not None and condition.size == 1:
            taken[id(node)] = node_attribute(node, "then_branch" if condition.reshape(-1)[0] else "else_branch")
    nodes = []
    for node in model.graph.node:
        branch = taken.get(id(node))
        if branch is None:
            nodes.append(node)
            continue
        results = {output.name: mine for output, mine in zip(branch.output, node.output)}
        for inner in branch.node:
            copied = onnx.NodeProto()
            copied.CopyFrom(inner)
            copied.name = f"{node.name}/{inner.name or inner.op_type}"
            copied.output[:] = [results.get(name, name) for name in inner.output]
            copied.input[:] = [results.get(name, name) for name in inner.input]
            nodes.append(copied)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return [node.name for node in ifs if id(node) in taken]


def structure_for_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as shape inference needs it: the weights' shapes without their data (``copy_with_inputs_for``)."""
    large = [init.name for init in model.graph.initializer if np.prod(init.dims) > _INFERENCE_READS_VALUES_UP_TO]
    return copy_with_inputs_for(model, large)


def _copy_without(message, skipped: str):
    """A copy of a protobuf ``message`` without its field ``skipped``."""
    copied = type(message)()
    for descriptor, value in message.ListFields():
        if descriptor.name == skipped:
            continue
        # protobuf >= 5.28 says is_repeated; older ones only label (removed in 7)
        repeated = descriptor.is_repeated if hasattr(descriptor, "is_repeated") else descriptor.label == descriptor.LABEL_REPEATED
        if repeated:
            getattr(copied, descriptor.name).extend(value)
        elif descriptor.type == descriptor.TYPE_MESSAGE:
            getattr(copied, descriptor.name).CopyFrom(value)
        else:
            setattr(copied, descriptor.name, value)
    return copied


def shapes_in(value_infos) -> dict:
    """Tensor name -> shape of the value infos that have one (None for a dynamic dimension)."""
    return {
        info.name: [dim.dim_value if dim.HasField("dim_value") else None for dim in info.type.tensor_type.shape.dim]
        for info in value_infos
        if info.type.tensor_type.HasField("shape")
    }


def symbolic_shapes(model: onnx.ModelProto) -> dict:
    """Tensor name -> shape from ONNX shape inference: sizes, dim_param names, None where unknown."""
    inferred = onnx.shape_inference.infer_shapes(structure_for_inference(model), data_prop=True).graph  # sizes from Shape ops too
    shapes = {}
    for info in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = [_symbolic_dim(dim) for dim in tensor_type.shape.dim]
    for initializer in model.graph.initializer:
        shapes[initializer.name] = list(initializer.dims)
    return shapes


def static_shapes(model: onnx.ModelProto, symbols: dict = None) -> dict:
    """Tensor name -> shape from ONNX shape inference (None for dynamic dims)."""
    symbols = symbolic_shapes(model) if symbols is None else symbols
    return {name: [dim if isinstance(dim, int) else None for dim in shape] for name, shape in symbols.items()}


_NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
               "Dropout"}  # fmt: skip
_FOLDED_UP_TO = 64  # elements of a value fold_static_sizes folds: sizes and their arithmetic, not data


def _known_values(model: onnx.ModelProto, symbols: dict = None, excluded=()) -> dict:
    """Tensor name -> value known before the run: initializers but ``excluded``, Constant nodes, with
    ``symbols`` (``symbolic_shapes``) the sizes of static dimensions (Shape, Size, a Gather or Slice of a Shape's
    static elements), and what only these feed (the exporter computes e.g. Resize scales with small chains
    of such nodes), evaluated by ONNX's reference implementation."""
    graph = model.graph
    graph_inputs = {graph_input.name for graph_input in graph.input}
    values = {initializer.name: numpy_helper.to_array(initializer) for initializer in graph.initializer
              if initializer.name not in excluded and initializer.name not in graph_inputs}  # fmt: skip
    shape_elements = {}  # a Shape's output -> its elements, None where a size is dynamic
    for node in graph.node:
        if node.op_type in _NOT_FOLDED or node.domain not in ("", "ai.onnx") or any(a.HasField("g") for a in node.attribute):
            continue
        if symbols is not None and node.op_type in ("Shape", "Size", "Gather", "Slice"):
            size_values = _static_sizes(node, symbols, shape_elements, values, list(model.opset_import))
            if size_values is not None:
                values.update(size_values)
                continue
        inputs = [name for name in node.input if name]
        if all(name in values for name in inputs):
            values.update(_evaluated(node, {name: values[name] for name in inputs}, list(model.opset_import)))
    return values


def _static_sizes(node: onnx.NodeProto, symbols: dict, shape_elements: dict, values: dict, opsets):
    """{output: value} of a Shape or Size, or a Gather or Slice of a Shape's elements, whose sizes ``symbols``
    has as numbers; None if they are not all static. What a Shape, Gather or Slice picks is kept in
    ``shape_elements`` (None for a dynamic size), for the next Gather or Slice."""
    if node.op_type in ("Gather", "Slice"):
        elements, positions = shape_elements.get(node.input[0]), None
        others = {name: values.get(name) for name in node.input[1:] if name}
        if elements is not None and all(value is not None for value in others.values()):
            positions = _evaluated(node, {node.input[0]: np.arange(len(elements)), **others}, opsets).get(node.output[0])
        if positions is None:
            return None
        sizes = np.asarray(np.asarray(elements, dtype=object)[positions], dtype=object)  # 0-d for a scalar index
    else:
        dims = symbols.get(node.input[0])
        if dims is None:
            return None
        sizes = np.asarray([dim if isinstance(dim, int) else None for dim in dims], dtype=object)
        if node.op_type == "Size":
            return None if None in sizes else {node.output[0]: np.array(int(np.prod(sizes)), np.int64)}
        sizes = sizes[node_attribute(node, "start", 0) : node_attribute(node, "end", len(sizes))]
    if sizes.ndim == 1:
        shape_elements[node.output[0]] = list(sizes)
    return None if any(size is None for size in sizes.ravel()) else {node.output[0]: sizes.astype(np.int64)}


def _evaluated(node: onnx.NodeProto, inputs: dict, opsets) -> dict:
    """{output: value} of ``node`` run on ``inputs`` by ONNX's reference implementation; {} for an op it lacks."""
    from onnx.reference import ReferenceEvaluator

    single = helper.make_model(
        helper.make_graph([node], "fold", [helper.make_tensor_value_info(name, 0, None) for name in inputs],
                          [helper.make_tensor_value_info(name, 0, None) for name in node.output]),
        opset_imports=opsets,
    )  # fmt: skip
    try:
        with np.errstate(divide="raise"):  # an integer division by 0 is numpy's 0, an error in a run
            return dict(zip(node.output, ReferenceEvaluator(single).run(None, inputs)))
    except Exception:  # the reference evaluator lacks some ops; such values just stay unknown
        return {}


def _read_nodes(nodes: list, graph_outputs: set) -> list:
    """``nodes`` without those whose outputs no node reads and the graph does not return (after folding,
    the Shapes and Gathers that only fed sizes), random ones kept."""
    while True:
        read = graph_outputs | {name for node in nodes for name in node.input} | _read_by_subgraphs(nodes)
        kept = [node for node in nodes if node.op_type in _NOT_FOLDED or any(name in read for name in node.output)]
        if len(kept) == len(nodes):
            return nodes
        nodes = kept


def _read_by_subgraphs(nodes) -> set:
    """Names the subgraphs of ``nodes`` (an If's branches, and the Ifs inside them) read."""
    subgraphs = [attribute.g for node in nodes for attribute in node.attribute if attribute.HasField("g")]
    return {name for graph in subgraphs for name in _read_by(graph)}


def _read_by(graph) -> set:
    return {name for node in graph.node for name in node.input} | _read_by_subgraphs(graph.node)


def fold_static_sizes(model: onnx.ModelProto, module_tensors=()) -> list:
    """Replace, in place, each node a run computes from constants and static sizes alone (values of at most
    ``_FOLDED_UP_TO`` elements: shapes and their arithmetic) by Constant nodes, and each If they decide by
    its branch (``_inline_decided_ifs``), until none is left; return the replaced nodes' names.

    ONNX's shape inference follows sizes through a few ops only (not Div, Pow or a Cast from float):
    DINOv2's position embeddings, reshaped to the square root of their count and resized to the image's
    patch grid, had no static size for the rewrites that need one. The graph's inputs declare every size
    but the dynamic ones, so these values are the run's. ``module_tensors`` (the module's parameters and
    buffers) are never read as constants: their values change.
    """
    replaced = []
    while True:
        values = _known_values(model, symbolic_shapes(model), set(module_tensors))
        graph_outputs = {output.name for output in model.graph.output}
        nodes, folded = [], []
        for node in model.graph.node:
            known = node.op_type != "Constant" and all(name in values for name in node.output)
            if not known or any(np.size(values[name]) > _FOLDED_UP_TO or name in graph_outputs for name in node.output):
                nodes.append(node)
                continue
            folded.append(node.name)
            nodes += [helper.make_node("Constant", [], [name], name=f"{node.name}/folded{index}",
                                       value=numpy_helper.from_array(np.asarray(values[name]), name))
                      for index, name in enumerate(node.output)]  # fmt: skip
        del model.graph.node[:]
        model.graph.node.extend(_read_nodes(nodes, graph_outputs))
        done = folded + _inline_decided_ifs(model)
        if not done:
            return replaced
        replaced += done


def opset(model: onnx.ModelProto) -> int:
    return next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def _is_target(node: onnx.NodeProto, only_between, opset_version: int) -> bool:
    """Whether ``rewrite_for_training`` replaces ``node``: an op with a rewrite on a gradient
    path; an inference-mode BatchNormalization anywhere (ONNX Runtime's training optimizer
    breaks it off the path too, see inference_batch_norm)."""
    if node.op_type == "BatchNormalization":
        return not _batch_norm_trains(node, opset_version)
    return node.op_type in REWRITES and (only_between is None or node.name in only_between)


def rewrite_for_training(model: onnx.ModelProto, only_between=None) -> list:
    """Replace, in place, every node whose op type has a rewrite; return the rewritten node names.

    ``only_between`` (a set of node names) limits the rewrite to nodes on a gradient path
    (inference-mode BatchNormalization excepted, see ``_is_target``).
    """
    targets = [node for node in model.graph.node if _is_target(node, only_between, opset(model))]
    rewritten = []
    while targets:  # again for the nodes whose facts (a shape after a rewritten Resize) only a rewrite made known
        symbols, failed = symbolic_shapes(model), {}
        done = replace_nodes(model, REWRITES, targets, static_shapes(model, symbols), _known_values(model), symbols, failed)
        rewritten += done
        if failed and not done:
            raise next(iter(failed.values()))
        targets = [node for node in model.graph.node if node.name in failed]
    return rewritten


def replace_nodes(model: onnx.ModelProto, table: dict, targets, shapes=None, constants=None, symbols=None,
                  failed=None) -> list:  # fmt: skip
    """Replace, in place, each of ``targets`` by what ``table[op_type]`` builds; return their names.

    A table function that returns ``False`` keeps its node; ``shapes``, ``constants`` and
    ``symbols`` go into the :class:`GraphFacts` the functions see. With ``failed`` (a dict), a
    node whose function raises RewriteError is kept and its error recorded there by node name.
    """
    consumers = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    producers = {output: node for node in model.graph.node for output in node.output}
    facts = GraphFacts(opset(model), shapes or {}, constants or {}, producers, consumers, {node.name for node in targets},
                       symbols or {})
    target_ids = {id(node) for node in targets}
    rebuilt, rewritten = [], []
    for node in model.graph.node:
        build = NodeBuilder(node, facts) if id(node) in target_ids else None
        if build is not None and _replaced(table, build, failed):
            rebuilt.extend(build.nodes)
            model.graph.initializer.extend(build.initializers)
            rewritten.append(node.name)
        else:
            rebuilt.append(node)
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
    return rewritten


def _replaced(table: dict, build: NodeBuilder, failed) -> bool:
    """Whether ``table``'s function built a replacement for the node (its RewriteError into ``failed``, if given)."""
    try:
        return table[build.node.op_type](build) is not False
    except RewriteError as error:
        error.node_name = build.node.name
        if failed is None:
            raise
        failed[build.node.name] = error
        return False
