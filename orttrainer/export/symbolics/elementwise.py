"""Elementwise ops: clamps and the activations written as clamps (hardtanh, relu6), shrinks, thresholds, softplus,
log-sigmoid, atan2, hyperbolic functions, floor division, and detach."""

import numpy as np
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import _type_utils, symbolic_opset9, symbolic_opset10, symbolic_opset11

from ...graph import rewrites
from ._graph import DOMAIN, _constant, _dtype, _ExportGraph


def detach(g, x):
    """torch's detach, which torch's symbolic drops (inference needs no gradient), as a marker node: exported_graph.py
    turns it into an Identity marked ``rewrites.STOP_GRADIENT``, which training_graph.stop_gradients cuts."""
    detached = g.op(f"{DOMAIN}::Detach", x)
    detached.setType(x.type())
    return detached


def _clamp_min(build, x, low):
    """torch's clamp_min: gradient 1 from ``low`` on (at ``low`` too), 0 below; NaN stays NaN, gradient 0."""
    below = rewrites.where(build, build.op("Less", [x, build.const(low)]), low, float("nan"))
    return rewrites.where(build, build.op("GreaterOrEqual", [x, build.const(low)]), x, below)


def clamp(g, x, low, high):
    """torch's clamp (and clamp_min, clamp_max: one bound left out), value and gradient.

    torch's symbolic writes a scalar bound left out as Clip's missing input, which ONNX Runtime
    takes as ±FLT_MAX (docs/stack_facts.md): ±inf came out as ±FLT_MAX. Here it is an infinite
    bound of x's type. A tensor bound is a Where rather than torch's Max / Min, whose gradient
    ONNX Runtime splits between x and a bound equal to it, where torch's goes to x alone; a NaN in
    x or in a bound gives NaN, as in torch.
    """
    scalar_type = _type_utils.JitScalarType.from_value(x, _type_utils.JitScalarType.UNDEFINED)
    if scalar_type == _type_utils.JitScalarType.UNDEFINED or not scalar_type.dtype().is_floating_point:
        return symbolic_opset11.clamp(g, x, low, high)
    bounds = [g.op("Constant", value_t=torch.tensor(infinity, dtype=scalar_type.dtype())) if symbolic_helper._is_none(bound)
              else g.op("Cast", bound, to_i=scalar_type.onnx_type())
              for bound, infinity in ((low, -float("inf")), (high, float("inf")))]  # fmt: skip
    low, high = bounds
    if all(symbolic_helper._get_tensor_rank(bound) == 0 for bound in bounds):
        return g.op("Clip", x, low, high)
    raised = g.op("Where", g.op("Or", g.op("Less", x, low), g.op("IsNaN", low)), low, x)
    return g.op("Where", g.op("Or", g.op("Greater", raised, high), g.op("IsNaN", high)), high, raised)


def clamp_min(g, x, low):
    return clamp(g, x, low, None)


def clamp_max(g, x, high):
    return clamp(g, x, None, high)


@symbolic_helper.parse_args("v", "f")
def hardshrink(g, x, lambd):
    """torch's hardshrink: 0 where -lambd <= x <= lambd, else x (NaN stays NaN and gets the gradient, as in torch's
    kernel; torch's symbolic selected x where x > lambd or x < -lambd, so NaN became 0)."""
    build = _ExportGraph(g)
    dtype = _dtype(x)
    inside = build.op("And", [build.op("GreaterOrEqual", [x, build.const(-lambd, dtype)]),
                              build.op("LessOrEqual", [x, build.const(lambd, dtype)])])  # fmt: skip
    return build.op("Where", [inside, build.const(0.0, dtype), x])


@symbolic_helper.parse_args("v", "f")
def softshrink(g, x, lambd):
    """torch's softshrink: x - lambd above lambd, x + lambd below -lambd, x * 0 between (so NaN stays NaN, as in
    torch's kernel; torch's symbolic added two Wheres of 0, so NaN became 0)."""
    build = _ExportGraph(g)
    dtype = _dtype(x)
    positive, negative = build.const(lambd, dtype), build.const(-lambd, dtype)
    between = build.op("Where", [build.op("Less", [x, negative]), build.op("Add", [x, positive]),
                                 build.op("Mul", [x, build.const(0.0, dtype)])])  # fmt: skip
    return build.op("Where", [build.op("Greater", [x, positive]), build.op("Sub", [x, positive]), between])


def atan2(g, y, x):
    """torch's atan2, value and gradient, for float32.

    torch's symbolic, atan(y / x) moved by ±pi by the signs, gave -pi for atan2(+0, -1) (torch: pi), the
    wrong sign for x = -0, NaN for (0, 0) and (±inf, ±inf), and a NaN gradient wherever x = 0. Here the
    value is IEEE's atan2 from the quadrant of (|x|, |y|) and the sign bits, computed from the detached
    inputs (``detach``), and the gradient is torch's: grad * x * r and -grad * y * r with
    r = 1 / (y * y + x * x), 0 where that sum is 0. It enters through (y - y') * x' r + (x - x') * (-y' r)
    with y', x' the detached inputs: 0 in value (taken as 0 where it is NaN, at infinite inputs), the
    factors constants to the gradient builder.
    """
    if _dtype(y) != torch.float32 or _dtype(x) != torch.float32:
        return symbolic_opset9.atan2(g, y, x)
    build = _ExportGraph(g)
    y_value, x_value = detach(g, y), detach(g, x)
    size_y, size_x = build.op("Abs", [y_value]), build.op("Abs", [x_value])
    angle = build.op("Atan", [build.op("Div", [size_y, size_x])])
    both_zero = build.op("And", [build.op("Equal", [size_y, build.const(0.0)]), build.op("Equal", [size_x, build.const(0.0)])])
    angle = rewrites.where(build, both_zero, 0.0, angle)
    infinity = build.const(float("inf"), _dtype(y))  # Equal rather than IsInf, which takes no float16 before opset 20
    both_infinite = build.op("And", [build.op("Equal", [size_y, infinity]), build.op("Equal", [size_x, infinity])])
    angle = rewrites.where(build, both_infinite, float(np.pi / 4), angle)
    angle = rewrites.where(build, rewrites.sign_bit(build, x_value), build.op("Sub", [build.const(np.pi), angle]), angle)
    value = rewrites.where(build, build.op("Not", [rewrites.sign_bit(build, y_value)]), angle, build.op("Neg", [angle]))
    squares = build.op("Add", [build.op("Mul", [y_value, y_value]), build.op("Mul", [x_value, x_value])])
    reciprocal = rewrites.where(build, build.op("Equal", [squares, build.const(0.0)]), 0.0, build.op("Reciprocal", [squares]))
    along_y = build.op("Mul", [build.op("Sub", [y, y_value]), build.op("Mul", [x_value, reciprocal])])
    along_x = build.op("Mul", [build.op("Sub", [x, x_value]), build.op("Neg", [build.op("Mul", [y_value, reciprocal])])])
    gradient_carrier = build.op("Add", [along_y, along_x])
    carrier = build.op("Add", [rewrites.where(build, build.op("IsNaN", [gradient_carrier]), 0.0, gradient_carrier), build.const(0.0)])
    # value + carrier is value itself but for -0, which + (+0) turns into +0: there -(0 - carrier) (the same gradient)
    return rewrites.where(build, build.op("Not", [rewrites.is_negative_zero(build, value)]), build.op("Add", [value, carrier]),
                          build.op("Neg", [build.op("Sub", [build.const(0.0), carrier])]))  # fmt: skip


@symbolic_helper.parse_args("v", "f", "f")
def hardtanh(g, x, min_val, max_val):
    """torch's hardtanh (nn.Hardtanh, nn.ReLU6, F.relu6): the Clip torch's symbolic writes, as a marker node.

    Clip's gradient passes at the bounds, as torch's clamp's does; hardtanh's is 0 there. exported_graph.py turns
    the marker into that Clip, marked for ``defined_gradients.zero_gradient_at_bounds``.
    """
    dtype = _type_utils.JitScalarType.from_value(x, _type_utils.JitScalarType.FLOAT).dtype()
    bounds = [g.op("Constant", value_t=torch.tensor(bound, dtype=dtype)) for bound in (min_val, max_val)]
    clipped = g.op(f"{DOMAIN}::HardTanh", x, *bounds)
    clipped.setType(x.type())
    return clipped


def relu6(g, x):
    return hardtanh(g, x, 0.0, 6.0)


@symbolic_helper.parse_args("v", "f", "f")
def softplus(g, x, beta, threshold):
    """torch's softplus: x where beta * x > threshold, else log(1 + exp(beta * x)) / beta.

    torch's own symbolic drops ``threshold`` (ONNX's Softplus has none): with a small one,
    every x beyond threshold / beta got the curve's value and gradient instead of x and 1.
    The Softplus op is rewritten for training (rewrites.activations.softplus).
    """
    scaled = x if beta == 1 else g.op("Mul", x, _constant(g, beta))
    curve = g.op("Softplus", scaled)
    if beta != 1:
        curve = g.op("Div", curve, _constant(g, beta))
    return g.op("Where", g.op("Greater", scaled, _constant(g, threshold)), x, curve)


@symbolic_helper.parse_args("v", "f", "f")
def threshold(g, x, threshold, value):
    """torch's threshold (nn.Threshold): ``value`` where x <= threshold, else x (NaN stays NaN and
    gets the gradient, as in torch's kernel). The exporter refuses a non-zero threshold or value."""
    if threshold == 0 and value == 0:
        return g.op("Relu", x)
    build = _ExportGraph(g)
    return rewrites.where(build, build.op("LessOrEqual", [x, build.const(threshold, _dtype(x))]),
                          build.const(value, _dtype(x)), x)  # fmt: skip


def _log_sigmoid(g, x):
    """log(sigmoid(x)) = -softplus(-x): the Softplus op, which rewrites.activations.softplus trains without
    overflow. Its gradient sigmoid(-x) is torch's log_sigmoid_backward."""
    return g.op("Neg", g.op("Softplus", g.op("Neg", x)))


@symbolic_helper.parse_args("v")
def log_sigmoid(g, x):
    """torch's log_sigmoid (F.logsigmoid, nn.LogSigmoid). torch's own symbolic is Log(Sigmoid(x)):
    -inf from x ~ -88 on (torch: x), and a NaN gradient there."""
    return _log_sigmoid(g, x)


def _unary(onnx_op):
    """aten op -> the ONNX op of the same meaning (rewrites.py makes it trainable)."""

    @symbolic_helper.parse_args("v")
    def symbolic(g, x):
        return g.op(onnx_op, x)

    return symbolic


def floor_divide(g, x, divisor):
    """``x // divisor`` rounds down, as torch does; torch's symbolic truncated towards 0 ("deprecated behavior",
    its comment says), so -3 // 2 was -1, not -2 (relative positions, window indices)."""
    return symbolic_opset10._floor_divide(g, x, divisor)  # orttrainer exports at opset 12 or more


SYMBOLICS = {
    "floor_divide": floor_divide,
    "floordiv": floor_divide,
    "threshold": threshold,
    "softplus": softplus,
    "clamp": clamp,
    "clamp_min": clamp_min,
    "clamp_max": clamp_max,
    "hardtanh": hardtanh,
    "detach": detach,
    "atan2": atan2,
    "hardshrink": hardshrink,
    "softshrink": softshrink,
    "relu6": relu6,
    "sinh": _unary("Sinh"),
    "cosh": _unary("Cosh"),
    "asinh": _unary("Asinh"),
    "acosh": _unary("Acosh"),
    "atanh": _unary("Atanh"),
    "log_sigmoid": log_sigmoid,
}
