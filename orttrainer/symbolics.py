"""ONNX symbolics for torch ops the TorchScript exporter cannot export, or exports unlike torch.

``exporting()`` registers them with torch's exporter for the duration of one export, so
models using these losses and layers export without any change to user code. Each is
written with ops that onnxruntime-training can differentiate, and matches torch's value
and gradient, also at boundary values (tests/test_rewrites.py, tests/test_boundary_values.py).
"""

import contextlib

import numpy as np
import onnx
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import (_type_utils, registration, symbolic_opset9, symbolic_opset10,
                                                        symbolic_opset11, symbolic_opset13, symbolic_opset14,
                                                        symbolic_opset16, symbolic_opset17)
from torch.onnx._internal.torchscript_exporter import utils as exporter_utils

from . import rewrites
from .options import MAX_OPSET, MIN_OPSET

_REDUCTIONS = {0: None, 1: "ReduceMean", 2: "ReduceSum"}
DOMAIN = "orttrainer"  # custom-domain marker nodes, which export.resolve_markers resolves right after export


def _constant(g, value):
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.float32))


def _reduce(g, loss, reduction):
    """torch's reduction enum: 0 none, 1 mean, 2 sum (over every element)."""
    op = _REDUCTIONS[reduction]
    return loss if op is None else g.op(op, loss, keepdims_i=0)


def _attribute_suffix(value) -> str:
    """The exporter's attribute type suffix: f (float, floats), s (str), i (int, bool, ints)."""
    sample = value[0] if isinstance(value, (list, tuple)) and value else value
    return "s" if isinstance(sample, str) else "f" if isinstance(sample, float) else "i"


class _ExportGraph(rewrites.OpEmitter):
    """rewrites' formulas (log1p, first_extreme, detached) emitting into torch's export graph."""

    def __init__(self, g):
        self.g, self.opset = g, g.opset

    def op(self, op_type, inputs, output=None, **attributes):  # torch names the outputs
        suffixed = {f"{name}_{_attribute_suffix(value)}": value for name, value in attributes.items()}
        return self.g.op(op_type, *inputs, **suffixed)

    def const(self, value, dtype=np.float32):
        return self.g.op("Constant", value_t=torch.from_numpy(np.array(value, dtype=dtype)))


def _numpy_dtype(value) -> np.dtype:
    """The element type of an exported value, as numpy's (for constants of the same type)."""
    return torch.empty(0, dtype=_type_utils.JitScalarType.from_value(value).dtype()).numpy().dtype


def detach(g, x):
    """torch's detach, which torch's symbolic drops (inference needs no gradient), as a marker node: export.py
    turns it into an Identity marked ``rewrites.STOP_GRADIENT``, which graph.stop_gradients cuts."""
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
    dtype = _numpy_dtype(x)
    inside = build.op("And", [build.op("GreaterOrEqual", [x, build.const(-lambd, dtype)]),
                              build.op("LessOrEqual", [x, build.const(lambd, dtype)])])  # fmt: skip
    return build.op("Where", [inside, build.const(0.0, dtype), x])


@symbolic_helper.parse_args("v", "f")
def softshrink(g, x, lambd):
    """torch's softshrink: x - lambd above lambd, x + lambd below -lambd, x * 0 between (so NaN stays NaN, as in
    torch's kernel; torch's symbolic added two Wheres of 0, so NaN became 0)."""
    build = _ExportGraph(g)
    dtype = _numpy_dtype(x)
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
    if _numpy_dtype(y) != np.float32 or _numpy_dtype(x) != np.float32:
        return symbolic_opset9.atan2(g, y, x)
    build = _ExportGraph(g)
    y_value, x_value = detach(g, y), detach(g, x)
    size_y, size_x = build.op("Abs", [y_value]), build.op("Abs", [x_value])
    angle = build.op("Atan", [build.op("Div", [size_y, size_x])])
    both_zero = build.op("And", [build.op("Equal", [size_y, build.const(0.0)]), build.op("Equal", [size_x, build.const(0.0)])])
    angle = rewrites.where(build, both_zero, 0.0, angle)
    infinity = build.const(float("inf"), _numpy_dtype(y))  # Equal rather than IsInf, which takes no float16 before opset 20
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


@symbolic_helper.parse_args("v", "i", "i", "i")
def diagonal(g, x, offset, dim1, dim2):
    """torch's diagonal (``torch.diagonal``, ``Tensor.diag`` of a matrix): the diagonal's positions gathered from
    the rows it crosses, appended as the last dimension.

    torch's symbolic multiplied x by an eye mask and summed each row, so an inf or NaN anywhere in a row made its
    diagonal value NaN, and wrote an If for an empty diagonal, which the gradient builder cannot pass.
    """
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        return symbolic_helper._unimplemented("diagonal", "unknown input rank", x)
    dim1, dim2 = dim1 % rank, dim2 % rank
    build = _ExportGraph(g)
    moved = build.op("Transpose", [x], perm=[dim for dim in range(rank) if dim not in (dim1, dim2)] + [dim1, dim2])
    shape = build.op("Shape", [moved])
    rows = build.op("Slice", [shape, build.const([rank - 2], np.int64), build.const([rank - 1], np.int64)])
    columns = build.op("Slice", [shape, build.const([rank - 1], np.int64), build.const([rank], np.int64)])
    first_row, first_column = max(-offset, 0), max(offset, 0)
    length = build.op("Max", [build.op("Min", [build.op("Sub", [rows, build.const([first_row], np.int64)]),
                                               build.op("Sub", [columns, build.const([first_column], np.int64)])]),
                              build.const([0], np.int64)])  # fmt: skip
    crossed = build.op("Slice", [moved, build.const([first_row], np.int64),
                                 build.op("Add", [length, build.const([first_row], np.int64)]), build.const([-2], np.int64)])  # fmt: skip
    scalar_length = symbolic_helper._squeeze_helper(g, length, [0])
    positions = build.op("Range", [build.const(first_column, np.int64),
                                   build.op("Add", [scalar_length, build.const(first_column, np.int64)]), build.const(1, np.int64)])  # fmt: skip
    batch = build.op("Slice", [shape, build.const([0], np.int64), build.const([rank - 2], np.int64)])
    index_shape = build.op("Concat", [batch, length, build.const([1], np.int64)], axis=0)
    indices = build.op("Expand", [symbolic_helper._unsqueeze_helper(g, positions, [1]), index_shape])
    return symbolic_helper._squeeze_helper(g, build.op("GatherElements", [crossed, indices], axis=rank - 1), [rank - 1])


@symbolic_helper.parse_args("v", "i")
def diag(g, x, offset):
    """torch's diag of a matrix (its diagonal, as ``diagonal``), which the exporter has no symbolic for."""
    if symbolic_helper._get_tensor_rank(x) != 2:
        return symbolic_helper._unimplemented("diag", "of a vector (the matrix made from it)", x)
    return diagonal(g, x, offset, 0, 1)


@symbolic_helper.parse_args("v", "f", "f")
def hardtanh(g, x, min_val, max_val):
    """torch's hardtanh (nn.Hardtanh, nn.ReLU6, F.relu6): the Clip torch's symbolic writes, as a marker node.

    Clip's gradient passes at the bounds, as torch's clamp's does; hardtanh's is 0 there. export.py turns
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
    The Softplus op is rewritten for training (rewrites.softplus).
    """
    scaled = x if beta == 1 else g.op("Mul", x, _constant(g, beta))
    curve = g.op("Softplus", scaled)
    if beta != 1:
        curve = g.op("Div", curve, _constant(g, beta))
    return g.op("Where", g.op("Greater", scaled, _constant(g, threshold)), x, curve)


def _log_sigmoid(g, x):
    """log(sigmoid(x)) = -softplus(-x): the Softplus op, which rewrites.softplus trains without
    overflow. Its gradient sigmoid(-x) is torch's log_sigmoid_backward."""
    return g.op("Neg", g.op("Softplus", g.op("Neg", x)))


@symbolic_helper.parse_args("v")
def log_sigmoid(g, x):
    """torch's log_sigmoid (F.logsigmoid, nn.LogSigmoid). torch's own symbolic is Log(Sigmoid(x)):
    -inf from x ~ -88 on (torch: x), and a NaN gradient there."""
    return _log_sigmoid(g, x)


@symbolic_helper.parse_args("v", "v", "v", "v", "i")
def binary_cross_entropy_with_logits(g, x, target, weight, pos_weight, reduction):
    """torch's loss, (1 - t) x - l log_sigmoid(x) with l = (pos_weight - 1) t + 1 (1 without
    pos_weight), times ``weight``. For x >= 0 as torch writes it, (1 - t) x + l softplus(-x); for
    x < 0 as the equal l softplus(x) - pos_weight t x: each form adds terms of one sign where the
    other would cancel, in the value and in the gradient ONNX Runtime derives (l sigmoid(x) -
    pos_weight t, torch's backward). torch's own symbolic takes the logs of sigmoid(x) and
    1 - sigmoid(x): the loss of a logit 17 with target 0 came out 2.5% low, and from |x| ~ 17-88
    on it was inf (NaN gradients) where torch's is about |x|."""
    build = _ExportGraph(g)
    log_weight, positive_weight = build.const(1.0), build.const(1.0)
    if not symbolic_helper._is_none(pos_weight):
        positive_weight = pos_weight
        log_weight = build.op("Add", [build.op("Mul", [build.op("Sub", [pos_weight, build.const(1.0)]), target]), build.const(1.0)])
    torch_form = build.op("Add", [build.op("Mul", [build.op("Sub", [build.const(1.0), target]), x]),
                                  build.op("Mul", [log_weight, build.op("Softplus", [build.op("Neg", [x])])])])  # fmt: skip
    sigmoid_form = build.op("Sub", [build.op("Mul", [log_weight, build.op("Softplus", [x])]),
                                    build.op("Mul", [build.op("Mul", [positive_weight, target]), x])])  # fmt: skip
    loss = build.op("Where", [build.op("Less", [x, build.const(0.0)]), sigmoid_form, torch_form])
    if not symbolic_helper._is_none(weight):
        loss = build.op("Mul", [loss, weight])
    return _reduce(g, loss, reduction)


def _l1_distance(build, x, target):
    """|x - target| with torch's l1_loss gradient sign(x - target): 0 at 0, and 0 at NaN,
    where ONNX Runtime's Abs gives NaN (the loss is NaN either way)."""
    difference = build.op("Sub", [x, target])
    nan = build.op("IsNaN", [difference])
    return rewrites.where(build, nan, float("nan"), build.op("Abs", [rewrites.where(build, nan, 0.0, difference)]))


@symbolic_helper.parse_args("v", "v", "i")
def l1_loss(g, x, target, reduction):
    return _reduce(g, _l1_distance(_ExportGraph(g), x, target), reduction)


def _huber(build, x, target, knee):
    """d^2 / 2 below the knee, knee * (d - knee / 2) from it on, d = |x - target|.

    torch's branches (the knee takes the linear one: gradient ±knee there), each computed
    from its own d (see rewrites.where). One formula d^2/2 - (d - m)^2/2-style, m = min(d, knee),
    made the gradient a difference of knee-sized terms (0 for |d| < 1e-8) and gave
    inf - inf = NaN at d = inf.
    """
    distance = build.op("Abs", [build.op("Sub", [x, target])])
    below = build.op("Less", [distance, build.const(knee)])
    near, far = rewrites.where(build, below, distance, 0.0), rewrites.where(build, below, knee, distance)
    quadratic = build.op("Mul", [build.op("Mul", [near, near]), build.const(0.5)])
    linear = build.op("Mul", [build.op("Sub", [far, build.const(knee / 2)]), build.const(knee)])
    return rewrites.where(build, below, quadratic, linear)


@symbolic_helper.parse_args("v", "v", "i", "f")
def smooth_l1_loss(g, x, target, reduction, beta):
    build = _ExportGraph(g)
    if beta == 0:
        return _reduce(g, _l1_distance(build, x, target), reduction)
    return _reduce(g, build.op("Div", [_huber(build, x, target, beta), build.const(beta)]), reduction)


@symbolic_helper.parse_args("v", "v", "i", "f")
def huber_loss(g, x, target, reduction, delta):
    return _reduce(g, _huber(_ExportGraph(g), x, target, delta), reduction)


_BCE_EPSILON = 1e-12  # torch's binary_cross_entropy_backward divides by max(p (1 - p), this)
_DENORMAL_SCALE = 2.0**24


def _log_with_denormals(build, p):
    """log(p), also for denormal p (ONNX Runtime's Log flushes them: log(1e-45) = -87.3, not -103.3)."""
    denormal = build.op("Less", [p, build.const(np.finfo(np.float32).tiny)])
    scaled = build.op("Mul", [p, rewrites.where(build, denormal, _DENORMAL_SCALE, 1.0)])
    shift = rewrites.where(build, denormal, float(np.log(_DENORMAL_SCALE)), 0.0)
    return build.op("Sub", [build.op("Log", [scaled]), shift])


def _bce_value(build, p, target, clamp):
    """-(t log p + (1 - t) log1p(-p)), each log clamped below at -100 if ``clamp`` (torch's;
    the clamped one is for saturated p, which may be denormal)."""
    logs = [_log_with_denormals(build, p) if clamp else build.op("Log", [p]), rewrites.log1p(build, build.op("Neg", [p]))]
    if clamp:
        logs = [build.op("Max", [log, build.const(-100.0)]) for log in logs]
    positive = build.op("Mul", [target, logs[0]])
    negative = build.op("Mul", [build.op("Sub", [build.const(1.0), target]), logs[1]])
    return build.op("Neg", [build.op("Add", [positive, negative])])


def _bce_saturated(build, p, target):
    """torch's binary cross-entropy where p (1 - p) < 1e-12: its value, but torch's gradient
    (p - t) / 1e-12, not the logarithms' (-1/p, or NaN from 0/0 at p = 0 or 1).

    The gradient is that of G = (s^2 / 2 - (t - p0) s) / 1e-12 with s = p - p0 and p0 the
    nearer of 0 and 1 (|G| stays below |t| + 1); the value is G + (value - G) with the
    bracket detached (``detach``), so it is torch's up to the rounding of that sum.
    """
    nearer = rewrites.where(build, build.op("Greater", [p, build.const(0.5)]), 1.0, 0.0)
    s = build.op("Sub", [p, nearer])
    slope = build.op("Sub", [target, nearer])
    half_square = build.op("Mul", [build.op("Mul", [s, s]), build.const(0.5)])
    surrogate = build.op("Div", [build.op("Sub", [half_square, build.op("Mul", [slope, s])]), build.const(_BCE_EPSILON)])
    value = _bce_value(build, p, target, clamp=True)
    return build.op("Add", [surrogate, detach(build.g, build.op("Sub", [value, surrogate]))])


@symbolic_helper.parse_args("v", "v", "v", "i")
def binary_cross_entropy(g, probability, target, weight, reduction):
    """torch's binary_cross_entropy, value and gradient, at every p in [0, 1].

    Value -(t max(log p, -100) + (1 - t) max(log1p(-p), -100)), log1p as torch's (log(1 - p)
    was 0 below p = 6e-8); gradient (p - t) / max(p (1 - p), 1e-12), which torch uses
    instead of the logarithms' derivative: they differ where p (1 - p) < 1e-12 (saturated
    probabilities, _bce_saturated). For soft targets the gradient -t/p + (1 - t)/(1 - p)
    cancels near p = t, to within an ulp of its terms. p outside [0, 1], which torch
    refuses, gives NaN.
    """
    build = _ExportGraph(g)
    complement = build.op("Mul", [build.op("Sub", [build.const(1.0), probability]), probability])
    saturated = build.op("Less", [complement, build.const(_BCE_EPSILON)])
    inside = _bce_value(build, rewrites.where(build, saturated, 0.5, probability), target, clamp=False)
    edge = _bce_saturated(build, rewrites.where(build, saturated, probability, 0.0), target)
    loss = rewrites.where(build, saturated, edge, inside)
    if not symbolic_helper._is_none(weight):
        loss = g.op("Mul", loss, weight)
    return _reduce(g, loss, reduction)


@symbolic_helper.parse_args("v", "v", "i")
def soft_margin_loss(g, x, target, reduction):
    """log(1 + exp(-target x)) as ONNX Softplus, which the training graph rewrites (stable for
    every -target x: torch's float32 loss overflows to inf, with a NaN gradient, beyond 88.7)."""
    return _reduce(g, g.op("Softplus", g.op("Neg", g.op("Mul", target, x))), reduction)


@symbolic_helper.parse_args("v", "v", "i", "i", "f", "i")
def poisson_nll_loss(g, x, target, log_input, full, eps, reduction):
    if full:
        return symbolic_helper._unimplemented("poisson_nll_loss", "full=True (Stirling term)", x)
    if log_input:
        loss = g.op("Sub", g.op("Exp", x), g.op("Mul", target, x))
    else:
        loss = g.op("Sub", x, g.op("Mul", target, g.op("Log", g.op("Add", x, _constant(g, eps)))))
    return _reduce(g, loss, reduction)


@symbolic_helper.parse_args("v", "v", "f", "i")
def hinge_embedding_loss(g, x, target, margin, reduction):
    """torch's where(target != 1, clamp_min(margin - x, 0), 0) + where(target != -1, x, 0)
    (so x for target 1, the hinge for -1, their sum for other values), with Where: masks
    multiplied in gave 0 * inf = NaN for x = ±inf, and Relu's gradient 0 at x = margin."""
    build = _ExportGraph(g)
    hinge = _clamp_min(build, build.op("Sub", [build.const(margin), x]), 0.0)
    margin_part = rewrites.where(build, build.op("Equal", [target, build.const(1.0)]), 0.0, hinge)
    self_part = rewrites.where(build, build.op("Equal", [target, build.const(-1.0)]), 0.0, x)
    return _reduce(g, build.op("Add", [margin_part, self_part]), reduction)


@symbolic_helper.parse_args("v", "v", "v", "v")
def bilinear(g, x1, x2, weight, bias):
    """y[..., o] = sum_ij x1[..., i] W[o, i, j] x2[..., j] + b[o], as MatMul, Mul and ReduceSum."""
    outputs, left, right = symbolic_helper._get_tensor_sizes(weight)
    flat_weight = g.op("Reshape", g.op("Transpose", weight, perm_i=[1, 0, 2]),
                       g.op("Constant", value_t=torch.tensor([left, outputs * right])))  # fmt: skip
    projected = g.op("MatMul", x1, flat_weight)  # [..., o * j]
    leading = g.op("Slice", g.op("Shape", x1), g.op("Constant", value_t=torch.tensor([0])),
                   g.op("Constant", value_t=torch.tensor([-1])))  # fmt: skip
    split = g.op("Concat", leading, g.op("Constant", value_t=torch.tensor([outputs, right])), axis_i=0)
    paired = g.op("Mul", g.op("Reshape", projected, split), symbolic_helper._unsqueeze_helper(g, x2, [-2]))
    result = symbolic_helper._reducesum_helper(g, paired, axes_i=[-1], keepdims_i=0)
    return result if symbolic_helper._is_none(bias) else g.op("Add", result, bias)


_TARGET_IGNORED_AT_RUN_TIME = -(2**62)  # no class index: stands for an ignore_index known only at run time


@symbolic_helper.parse_args("v", "v", "v", "i", "v", "f")
def cross_entropy_loss(g, scores, target, weight, reduction, ignore_index, label_smoothing):
    """torch's cross_entropy. Class indices: SoftmaxCrossEntropyLoss, as torch's exporter writes it;
    with ``label_smoothing`` e, torch's formula (cross_entropy_loss_label_smoothing in ATen):
    (1 - e) * nll + e / classes * smooth, smooth = -sum over classes of log_softmax (times the class
    weights), 0 at ignored targets, reduced as torch reduces it (a weighted mean divides by the
    weights of the targets kept). Class probabilities (which the exporter passed to
    SoftmaxCrossEntropyLoss as labels): ``_cross_entropy_of_probabilities``. An ignore_index computed from
    a size (Hugging Face's question answering: ``start_logits.size(1)``) is a tensor in the trace: the
    targets equal to it become ``_TARGET_IGNORED_AT_RUN_TIME``, the constant the loss ignores."""
    reduction_name = ("none", "mean", "sum")[reduction]
    ignore_index = symbolic_helper._maybe_get_const(ignore_index, "i")
    if not isinstance(ignore_index, int):
        build = _ExportGraph(g)
        ignored = g.op("Equal", target, g.op("Cast", ignore_index, to_i=_type_utils.JitScalarType.from_value(target).onnx_type()))
        target = g.op("Where", ignored, build.const(_TARGET_IGNORED_AT_RUN_TIME, _numpy_dtype(target)), target)
        ignore_index = _TARGET_IGNORED_AT_RUN_TIME
    weighted = not symbolic_helper._is_none(weight)
    sizes, rank = symbolic_helper._get_tensor_sizes(scores), symbolic_helper._get_tensor_rank(scores)
    probabilities = target.type().scalarType() in ("Float", "Double", "Half", "BFloat16")
    class_weights = None  # along dim 1, for torch's formulas
    if probabilities or label_smoothing:
        if not sizes or len(sizes) < 2 or sizes[1] is None:
            raise ValueError(f"cross_entropy with {'class probabilities' if probabilities else 'label_smoothing'}: orttrainer "
                             "exports it for scores of a fixed number of classes in dim 1 (a batch), which these are not")  # fmt: skip
        if weighted:
            class_weights = symbolic_helper._unsqueeze_helper(g, weight, list(range(1, rank - 1)))
    if probabilities:
        return _cross_entropy_of_probabilities(g, scores, target, class_weights, reduction_name, label_smoothing, sizes[1])
    nll = g.op("SoftmaxCrossEntropyLoss", scores, target, *([weight] if weighted else []), reduction_s=reduction_name,
               ignore_index_i=ignore_index)  # fmt: skip
    if not label_smoothing:
        return nll
    build = _ExportGraph(g)
    log_probabilities = g.op("LogSoftmax", scores, axis_i=1)
    if weighted:
        log_probabilities = g.op("Mul", log_probabilities, class_weights)
    smooth = g.op("Neg", symbolic_helper._reducesum_helper(g, log_probabilities, axes_i=[1], keepdims_i=0))
    ignored = g.op("Equal", target, build.const(ignore_index, np.int64))
    smooth = rewrites.where(build, ignored, 0.0, smooth)
    if reduction_name != "none":
        smooth = symbolic_helper._reducesum_helper(g, smooth, keepdims_i=0)
    if reduction_name == "mean":
        kept = rewrites.where(build, ignored, 0.0, 1.0)
        if weighted:  # the weight of each kept target
            kept = g.op("Mul", kept, g.op("Gather", weight, rewrites.where(build, ignored, build.const(0, np.int64), target)))
        smooth = g.op("Div", smooth, symbolic_helper._reducesum_helper(g, kept, keepdims_i=0))
    # torch's scalars, computed in double and applied in float32
    return g.op("Add", g.op("Mul", nll, _constant(g, 1.0 - label_smoothing)),
                g.op("Mul", smooth, _constant(g, label_smoothing / sizes[1])))  # fmt: skip


def _cross_entropy_of_probabilities(g, scores, target, class_weights, reduction_name, label_smoothing, classes):
    """torch's cross_entropy_loss_prob_target: -sum over classes of log_softmax * target (* weights), the
    target first smoothed to target * (1 - e) + e / classes; a mean divides by the number of samples
    (elements over classes), whatever the weights."""
    if label_smoothing:
        target = g.op("Add", g.op("Mul", target, _constant(g, 1.0 - label_smoothing)), _constant(g, label_smoothing / classes))
    products = g.op("Mul", g.op("LogSoftmax", scores, axis_i=1), target)
    if class_weights is not None:
        products = g.op("Mul", products, class_weights)
    if reduction_name == "none":
        return g.op("Neg", symbolic_helper._reducesum_helper(g, products, axes_i=[1], keepdims_i=0))
    total = g.op("Neg", symbolic_helper._reducesum_helper(g, products, keepdims_i=0))
    if reduction_name == "sum":
        return total
    samples = g.op("Div", g.op("Cast", g.op("Size", scores), to_i=1), _constant(g, float(classes)))  # 1: float32
    return g.op("Div", total, samples)


def _extreme(onnx_op, torch_symbolic):
    """aten::max / aten::min: with a dim, rewrites.first_extreme (values at the first extreme,
    the first NaN if any, which alone gets the gradient, as in torch); other overloads (whole
    tensor, elementwise) go to torch's own symbolic.

    torch's symbolic exports max(x, dim) as ReduceMax (+ ArgMax, dropped when the indices are
    unused), indistinguishable from amax, whose gradient is shared among ties.
    """

    def symbolic(g, x, dim_or_y=None, keepdim=None):
        if keepdim is None:
            return torch_symbolic(g, x, dim_or_y, keepdim)
        dim = symbolic_helper._get_const(dim_or_y, "i", "dim")
        return rewrites.first_extreme(_ExportGraph(g), x, dim, symbolic_helper._get_const(keepdim, "i", "keepdim"), onnx_op,
                                      floating=symbolic_helper._is_fp(x))  # fmt: skip

    return symbolic


def _arg_extreme(reduce_op):
    """aten::argmax / aten::argmin at the index rewrites.first_extreme_index picks: the first NaN of a slice
    holding one, else the first extreme, as torch. ONNX Runtime's ArgMax and ArgMin skip a NaN unless it
    comes first, and have no CPU kernel for int64 tensors."""

    @symbolic_helper.parse_args("v", "v", "b")
    def symbolic(g, x, dim, keepdim):
        build, floating = _ExportGraph(g), symbolic_helper._is_fp(x)
        if not symbolic_helper._is_none(dim):
            axis = symbolic_helper._get_const(dim, "i", "dim")
            index = rewrites.first_extreme_index(build, x, axis, reduce_op, floating)
            return index if keepdim else build.squeeze(index, [axis])
        flat = g.op("Reshape", x, build.const([-1], np.int64))
        index = rewrites.first_extreme_index(build, flat, 0, reduce_op, floating)
        if not keepdim:  # torch.argmax(x): a 0-d index into the flattened tensor
            return build.squeeze(index, [0])
        return g.op("Reshape", index, build.const([1] * symbolic_helper._get_tensor_rank(x), np.int64))

    return symbolic


def _unary(onnx_op):
    """aten op -> the ONNX op of the same meaning (rewrites.py makes it trainable)."""

    @symbolic_helper.parse_args("v")
    def symbolic(g, x):
        return g.op(onnx_op, x)

    return symbolic


@symbolic_helper.parse_args("v", "v", "i", "b", "v")
def embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse):
    """A Gather; with padding_idx or scale_grad_by_freq, whose indices pass through a marker node.

    torch's own symbolic drops padding_idx (the padding row would train) and refuses
    scale_grad_by_freq. The marker carries both to export.py, which removes it and tells
    the trainer, which applies them to this lookup's gradient (graph.EmbeddingGradient).
    """
    if padding_idx < 0 and not scale_grad_by_freq:
        return g.op("Gather", weight, indices)
    marked = g.op(f"{DOMAIN}::EmbeddingIndices", indices, padding_idx_i=padding_idx, scale_grad_by_freq_i=int(scale_grad_by_freq))
    marked.setType(indices.type())
    return g.op("Gather", weight, marked)


@symbolic_helper.parse_args("v", "is", "v", "v")
def rms_norm(g, x, normalized_shape, weight, eps):
    """torch's rms_norm (nn.RMSNorm), which the exporter refuses: x * rsqrt(mean(x * x) + eps) * weight
    over the last ``len(normalized_shape)`` dimensions, eps the dtype's machine epsilon when None, as
    torch's CPU composite computes it (x * rsqrt as x / sqrt: ONNX has no Rsqrt)."""
    build, dtype = _ExportGraph(g), _numpy_dtype(x)
    eps = np.finfo(dtype).eps if symbolic_helper._is_none(eps) else symbolic_helper._get_const(eps, "f", "eps")
    axes = list(range(-len(normalized_shape), 0))
    mean_square = build.reduce("ReduceMean", build.op("Mul", [x, x]), axes, 1)
    root = build.op("Sqrt", [build.op("Add", [mean_square, build.const(eps, dtype)])])
    normalized = build.op("Div", [x, root])
    return normalized if symbolic_helper._is_none(weight) else build.op("Mul", [normalized, weight])


def batch_norm(g, x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """torch's batch_norm; without running statistics (``track_running_stats=False``), which torch's
    symbolic exports only for a static batch size, as a BatchNormalization in training mode on
    placeholder statistics: it normalizes by the batch's statistics, as torch does in training and
    in eval (graph.set_inference_mode keeps such a node in training mode)."""
    torch_symbolic = symbolic_opset14.batch_norm if g.opset >= 14 else symbolic_opset9.batch_norm
    if not symbolic_helper._is_none(running_mean) and not symbolic_helper._is_none(running_var):
        return torch_symbolic(g, x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
    channels = symbolic_helper._get_tensor_dim_size(x, 1)
    if channels is None and not symbolic_helper._is_none(weight):
        channels = (symbolic_helper._get_tensor_sizes(weight) or [None])[0]
    if channels is None:
        raise ValueError(f"BatchNorm without running statistics in module '{_module_scope(g)}' needs an input whose "
                         "channel dimension (dim 1) has a known size")  # fmt: skip
    # values computed from x, not constants: ONNX Runtime writes the new statistics into these inputs, and
    # would write into a weight (affine=False: a constant of ones) it shared a constant with
    scalar_type = _type_utils.JitScalarType.from_value(x)
    values = g.op("Cast", g.op("Size", x), to_i=scalar_type.onnx_type())
    mean = g.op("Mul", g.op("Constant", value_t=torch.zeros(channels, dtype=scalar_type.dtype())), values)
    variance = g.op("Add", mean, g.op("Constant", value_t=torch.ones(channels, dtype=scalar_type.dtype())))
    for statistic in (mean, variance):
        statistic.setType(x.type().with_sizes([channels]))
    return torch_symbolic(g, x, weight, bias, mean, variance, training, momentum, eps, cudnn_enabled)


def scaled_dot_product_attention(g, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):  # fmt: skip
    """torch's exporter's attention, with torch's safe softmax for query rows whose keys are all masked
    (left padding, a sliding window over padding): torch's output there is 0 and passes no gradient. The
    exporter's Softmax gave NaN that a Where zeroed (bool masks only), but its gradient kept the NaN, which
    reached every weight. Here such rows get a mask of 0 (a finite softmax) and an output of 0 by a Where,
    so their gradient is 0, as torch's."""
    if g.opset < 14:
        return symbolic_helper._unimplemented("scaled_dot_product_attention", "below opset 14 (no Trilu)", query)
    torch_symbolic = symbolic_opset14.scaled_dot_product_attention
    if symbolic_helper._is_none(attn_mask):
        return torch_symbolic(g, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if _type_utils.JitScalarType.from_value(attn_mask) == _type_utils.JitScalarType.BOOL:  # as torch's symbolic turns it
        attn_mask = g.op("Where", attn_mask, _constant(g, [0.0]), _constant(g, [-float("inf")]))
    build, dtype = _ExportGraph(g), _numpy_dtype(query)
    # [..., queries, 1]: whether a query's every key is masked
    no_key = g.op("Equal", build.reduce("ReduceMax", attn_mask, [-1], 1), build.const(-np.inf, _numpy_dtype(attn_mask)))
    safe_mask = g.op("Where", no_key, build.const(0.0, _numpy_dtype(attn_mask)), attn_mask)
    attended = torch_symbolic(g, query, key, value, safe_mask, dropout_p, is_causal, scale, enable_gqa)
    return g.op("Where", no_key, build.const(0.0, dtype), attended)


def _onnx_paddings(g, x, padding):
    """ONNX Pad's pads (every dim's begin, then every end) for torch's ``padding`` (last dim first, begin and end
    pairs) as one constant when both it and x's rank are known. torch's symbolic computes them with a dozen ops,
    which ONNX's shape inference cannot follow (constant folding is off): after EfficientNet's ZeroPad2d every
    size was unknown, and its pooling, which needs them, was refused."""
    pairs, rank = symbolic_helper._maybe_get_const(padding, "is"), symbolic_helper._get_tensor_rank(x)
    if not isinstance(pairs, list) or rank is None or len(pairs) > 2 * rank:
        return symbolic_opset11._prepare_onnx_paddings(g, x, padding)
    begins, ends = [0] * rank, [0] * rank
    for index in range(len(pairs) // 2):
        begins[rank - 1 - index], ends[rank - 1 - index] = pairs[2 * index], pairs[2 * index + 1]
    return _ExportGraph(g).const(begins + ends, np.int64)


def constant_pad_nd(g, x, padding, value=None):
    """torch's constant padding, as torch's symbolic writes it but with constant pads (``_onnx_paddings``)."""
    value = symbolic_helper._if_scalar_type_as(symbolic_helper._maybe_get_scalar(value), x)
    return g.op("Pad", x, _onnx_paddings(g, x, padding), value, mode_s="constant")


def _padding(mode):
    """torch's reflection or replication padding (``mode``: ONNX's name), with constant pads (``_onnx_paddings``)."""
    return lambda g, x, padding: g.op("Pad", x, _onnx_paddings(g, x, padding), mode_s=mode)


_PAD_MODES = {"reflect": "reflect", "replicate": "edge"}  # torch's padding mode: ONNX Pad's


def pad(g, x, padding, mode, value):
    """torch's F.pad: each mode as its own symbolic here (constant pads); circular as torch's symbolic writes it."""
    name = symbolic_helper._parse_arg(mode, "s")
    if name in _PAD_MODES:
        return _padding(_PAD_MODES[name])(g, x, padding)
    if name == "constant":
        return constant_pad_nd(g, x, padding, value)
    return symbolic_opset11.pad(g, x, padding, mode, value)


_INTEGRAL_TYPES = {_type_utils.JitScalarType.BOOL, _type_utils.JitScalarType.UINT8, _type_utils.JitScalarType.INT8,
                   _type_utils.JitScalarType.INT16, _type_utils.JitScalarType.INT}  # fmt: skip


@symbolic_helper.parse_args("v", "i", "v")
def cumsum(g, x, dim, dtype=None):
    """torch's cumsum: in ``dtype`` when one is given, else in x's type, bool and integers as int64 (torch's
    promotion). torch's symbolic dropped a dtype given as a constant and wrote a CumSum of bool, which ONNX
    has not (transformers' packed-sequence check sums a comparison)."""
    if not symbolic_helper._is_none(dtype):
        x = g.op("Cast", x, to_i=_type_utils.JitScalarType(symbolic_helper._get_const(dtype, "i", "dtype")).onnx_type())
    elif _type_utils.JitScalarType.from_value(x) in _INTEGRAL_TYPES:
        x = g.op("Cast", x, to_i=onnx.TensorProto.INT64)
    return g.op("CumSum", x, _ExportGraph(g).const(dim, np.int64))


@symbolic_helper.parse_args("v", "i", "i", "v", "v")
def diff(g, x, n, dim, prepend, append):
    """torch.diff, which the exporter refuses (transformers' packed-sequence check runs it on position ids):
    ``prepend`` and ``append`` concatenated along ``dim``, then ``n`` times x[1:] - x[:-1] there."""
    build = _ExportGraph(g)
    parts = [part for part in (prepend, x, append) if not symbolic_helper._is_none(part)]
    x = g.op("Concat", *parts, axis_i=dim) if len(parts) > 1 else x
    axes = build.const([dim], np.int64)
    for _ in range(n):
        later = g.op("Slice", x, build.const([1], np.int64), build.const([np.iinfo(np.int64).max], np.int64), axes)
        earlier = g.op("Slice", x, build.const([0], np.int64), build.const([-1], np.int64), axes)
        x = g.op("Sub", later, earlier)
    return x


@symbolic_helper.parse_args("v", "f", "b")
def feature_dropout(g, x, p, train):
    """torch's channel dropout (nn.Dropout1d/2d/3d) in training, which the exporter refuses: a
    Dropout of ones shaped [N, C, 1, ...] (each channel kept with probability 1 - p and scaled
    by 1 / (1 - p)) times x. ONNX Runtime draws the mask, as it does for nn.Dropout; the trainer
    turns it off for the first-step check like every Dropout."""
    if not train or p == 0:
        return x
    if p == 1:
        return g.op("Mul", x, _constant(g, 0.0))  # torch: input * 0
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None or rank < 2:
        raise ValueError(f"channel dropout in module '{_module_scope(g)}' needs an input of known rank >= 2 "
                         "(batch, channels, ...)")  # fmt: skip
    build = _ExportGraph(g)
    batch_and_channels = build.op("Slice", [build.op("Shape", [x]), build.const([0], np.int64), build.const([2], np.int64)])
    per_channel = build.op("Concat", [batch_and_channels, build.const([1] * (rank - 2), np.int64)], axis=0)
    ones = g.op("ConstantOfShape", per_channel, value_t=torch.from_numpy(np.ones(1, _numpy_dtype(x))))
    mask = g.op("Dropout", ones, _constant(g, p), g.op("Constant", value_t=torch.tensor(True)))
    return g.op("Mul", x, mask)


@symbolic_helper.parse_args("v", "f", "f")
def threshold(g, x, threshold, value):
    """torch's threshold (nn.Threshold): ``value`` where x <= threshold, else x (NaN stays NaN and
    gets the gradient, as in torch's kernel). The exporter refuses a non-zero threshold or value."""
    if threshold == 0 and value == 0:
        return g.op("Relu", x)
    build = _ExportGraph(g)
    return rewrites.where(build, build.op("LessOrEqual", [x, build.const(threshold, _numpy_dtype(x))]),
                          build.const(value, _numpy_dtype(x)), x)  # fmt: skip


@symbolic_helper.parse_args("v", "i")
def channel_shuffle(g, x, groups):
    """torch's channel_shuffle (nn.ChannelShuffle): channels viewed as [groups, C / groups],
    transposed, flattened back. A permutation, so exact; the exporter has no symbolic for it."""
    build = _ExportGraph(g)
    shape = build.op("Shape", [x])
    channels = build.op("Slice", [shape, build.const([1], np.int64), build.const([2], np.int64)])
    grouped = build.op("Concat", [build.op("Slice", [shape, build.const([0], np.int64), build.const([1], np.int64)]),
                                  build.const([groups], np.int64), build.op("Div", [channels, build.const([groups], np.int64)]),
                                  build.const([-1], np.int64)], axis=0)  # fmt: skip
    swapped = build.op("Transpose", [build.op("Reshape", [x, grouped])], perm=[0, 2, 1, 3])
    return build.op("Reshape", [swapped, shape])


# p-norms torch's symbolic writes as one reduction (ReduceL1, ReduceL2, ReduceMax of |x|, ... which rewrites.py trains
# as torch does); any other p is a sum of |x|^p and its root.
_REDUCED_NORMS = (0.0, 1.0, 2.0, float("inf"), float("-inf"))


def _root_with_zero_gradient_at_zero(build, total, exponent, dtype):
    """``total ** exponent`` (a square root, a p-norm's root) whose gradient is 0 where ``total`` is 0, as torch's
    std, norm and cdist backwards mask it: the root's own gradient is infinite there, and times the 0 coming from
    the sum before it, NaN (a padding row's std turned every weight into NaN). The root reads 1 in place of 0,
    through a Where both ways, so no gradient reaches the 0. ``dtype``: ``total``'s, as numpy's."""
    zero = build.op("Equal", [total, build.const(0.0, dtype)])
    safe = build.op("Where", [zero, build.const(1.0, dtype), total])
    root = build.op("Sqrt", [safe]) if exponent == 0.5 else build.op("Pow", [safe, build.const(exponent, dtype)])
    return build.op("Where", [zero, build.const(0.0, dtype), root])


def _p_norm(build, x, order, axes, keepdim, dtype):
    """(sum over ``axes`` of |x|^order)^(1 / order), its gradient 0 at a zero norm (``_root_with_zero_gradient_at_zero``);
    ``dtype``: x's, as numpy's."""
    powered = build.op("Pow", [build.op("Abs", [x]), build.const(order, dtype)])
    total = build.reduce("ReduceSum", powered, axes, int(keepdim))
    return _root_with_zero_gradient_at_zero(build, total, 1.0 / order, dtype)


@symbolic_helper.parse_args("v", "f", "is", "b", "v")
def linalg_vector_norm(g, x, order, dim, keepdim, dtype):
    """torch.linalg.vector_norm (torch.norm, Tensor.norm, F.normalize): torch's symbolic, except a p other than 0, 1,
    2 and ±inf, whose root torch's wrote without torch's zero gradient at a zero norm (``_p_norm``)."""
    if order in _REDUCED_NORMS or not symbolic_helper._is_none(dtype):
        return symbolic_helper._linalg_vector_norm_helper(g, x, order, dim, keepdim, dtype)
    element_type = _numpy_dtype(x)
    if symbolic_helper._is_none(dim) or not dim:
        x, dim, keepdim = symbolic_helper._reshape_helper(g, x, [-1]), [0], False
    return _p_norm(_ExportGraph(g), x, order, dim, keepdim, element_type)


def _vector_norm(g, x, order, dim, keepdim):
    """torch.linalg.vector_norm(x, order, dim, keepdim) over one dim, as ``linalg_vector_norm`` writes it."""
    if order in _REDUCED_NORMS:
        return symbolic_helper._linalg_vector_norm_helper(g, x, order, [dim], keepdim, None)
    return _p_norm(_ExportGraph(g), x, order, [dim], keepdim, _numpy_dtype(x))


def _moments(g, x, args, root):
    """(variance or, with ``root``, standard deviation; mean) of torch.var_mean / std_mean's arguments, computed in
    float64 as torch's CPU kernels accumulate them (in float32 the squares of 1e20 overflowed and of 1e-30 vanished),
    then rounded to x's type. The root has torch's gradient 0 where the deviation is 0 (a constant row: padding, the
    Annotated Transformer's LayerNorm ``(x - mean) / (x.std() + eps)``), where torch's symbolic gave NaN."""
    element_type = _type_utils.JitScalarType.from_value(x).onnx_type()
    wide = g.op("Cast", x, to_i=onnx.TensorProto.DOUBLE)
    wide.setType(x.type().with_dtype(torch.float64))
    variance, mean = symbolic_opset9.var_mean(g, wide, *args)
    if root:
        variance = _root_with_zero_gradient_at_zero(_ExportGraph(g), variance, 0.5, np.float64)
    return tuple(g.op("Cast", value, to_i=element_type) for value in (variance, mean))


def var(g, x, *args):
    return _moments(g, x, args, root=False)[0]


def var_mean(g, x, *args):
    return _moments(g, x, args, root=False)


def std(g, x, *args):
    return _moments(g, x, args, root=True)[0]


def std_mean(g, x, *args):
    return _moments(g, x, args, root=True)


# torch.cdist's compute_mode: 0 (None) takes the matrix-product form for p = 2 when either side has more than 25 rows
_CDIST_ALWAYS_PRODUCT, _CDIST_NEVER_PRODUCT, _CDIST_PRODUCT_ROWS = 1, 2, 25


@symbolic_helper.parse_args("v", "v", "f", "v")
def cdist(g, x1, x2, p, compute_mode):
    """torch.cdist, in the form torch computes it: for p = 2 with more than 25 rows on either side (or compute_mode
    'use_mm_for_euclid_dist') torch's _euclidean_dist, one matrix product of [-2 x1, |x1|^2, 1] and [x2, 1, |x2|^2];
    otherwise the p-norm of every difference. Both with torch's gradient 0 at distance 0. torch's symbolic summed
    signed differences for p = 1 and gave NaN gradients at distance 0. The row counts decide, so they must be
    static unless compute_mode says which form."""
    mode = symbolic_helper._maybe_get_const(compute_mode, "i")
    mode = 0 if symbolic_helper._is_none(compute_mode) else mode
    rows = [symbolic_helper._get_tensor_dim_size(x, -2) for x in (x1, x2)]
    build, dtype = _ExportGraph(g), _numpy_dtype(x1)
    if p == 2 and mode == 0 and None in rows:
        raise ValueError(f"cdist in module '{_module_scope(g)}' over a number of rows that changes with the batch: torch "
                         f"computes it by a matrix product above {_CDIST_PRODUCT_ROWS} rows and by differences below, "
                         "which round differently; pass compute_mode='use_mm_for_euclid_dist' or "
                         "'donot_use_mm_for_euclid_dist' to torch.cdist")  # fmt: skip
    if p == 2 and (mode == _CDIST_ALWAYS_PRODUCT or (mode != _CDIST_NEVER_PRODUCT and max(rows) > _CDIST_PRODUCT_ROWS)):
        return _euclidean_distances(build, x1, x2, dtype)
    if not p >= 1 or p == float("inf"):
        raise ValueError(f"cdist in module '{_module_scope(g)}' with p={p}: orttrainer trains p >= 1 finite")
    differences = build.op("Sub", [build.unsqueeze(x1, [-2]), build.unsqueeze(x2, [-3])])
    if p == 1:
        return build.reduce("ReduceSum", build.op("Abs", [differences]), [-1], 0)
    if p == 2:
        squares = build.op("Pow", [differences, build.const(2.0, dtype)])  # a Mul reading them twice broke the builder
        total = build.reduce("ReduceSum", squares, [-1], 0)
        return _root_with_zero_gradient_at_zero(build, total, 0.5, dtype)
    return _p_norm(build, differences, p, [-1], False, dtype)


def _euclidean_distances(build, x1, x2, dtype):
    """torch's _euclidean_dist: sqrt(clamp_min(-2 x1 @ x2^T + |x1|^2 + |x2|^2, 0)). torch adds the squared norms
    inside its product (as two more columns); here after it, which rounds alike up to the order of the sum (with
    the columns, ONNX Runtime's gradient builder failed on a duplicate name)."""
    rank = symbolic_helper._get_tensor_rank(x2)
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    products = build.op("MatMul", [build.op("Mul", [x1, build.const(-2.0, dtype)]), build.op("Transpose", [x2], perm=swap)])
    squared = [build.reduce("ReduceSum", build.op("Pow", [x, build.const(2.0, dtype)]), [-1], 1) for x in (x1, x2)]
    total = build.op("Add", [build.op("Add", [products, squared[0]]), build.op("Transpose", [squared[1]], perm=swap)])
    return _root_with_zero_gradient_at_zero(build, build.op("Max", [total, build.const(0.0, dtype)]), 0.5, dtype)


def floor_divide(g, x, divisor):
    """``x // divisor`` rounds down, as torch does; torch's symbolic truncated towards 0 ("deprecated behavior",
    its comment says), so -3 // 2 was -1, not -2 (relative positions, window indices)."""
    return symbolic_opset10._floor_divide(g, x, divisor)  # orttrainer exports at opset 12 or more


def baddbmm(g, x, batch1, batch2, beta, alpha):
    """torch's symbolic, except with beta = 0, where torch ignores ``x``: NaN and inf in it do not reach the result."""
    if symbolic_helper._maybe_get_const(beta, "f") != 0:
        return symbolic_opset9.baddbmm(g, x, batch1, batch2, beta, alpha)
    scalar_type = _type_utils.JitScalarType.from_value(x)
    product = g.op("MatMul", batch1, batch2)
    return g.op("Mul", product, g.op("Cast", alpha, to_i=scalar_type.onnx_type()))


@symbolic_helper.parse_args("v", "v", "f", "f", "b")
def pairwise_distance(g, x1, x2, p, eps, keepdim):
    """torch's pairwise_distance (nn.PairwiseDistance, also inside triplet losses): the p-norm of
    x1 - x2 + eps over the last dimension. torch's own symbolic computes
    (sum of (x1 - x2)^p)^(1 / (p + eps)): no absolute value (p = 1 summed signed differences),
    and eps in the exponent (identical rows gave 0 and a NaN gradient where torch gives
    eps * sqrt(size) and a finite one)."""
    return _vector_norm(g, g.op("Add", g.op("Sub", x1, x2), _constant(g, eps)), p, -1, keepdim)


@symbolic_helper.parse_args("v", "v", "i", "f")
def cosine_similarity(g, x1, x2, dim, eps):
    """torch's cosine_similarity: sum over ``dim`` of (x1 / |x1|) * (x2 / |x2|), each norm
    clamped to at least eps for the value only (torch clamps it in place under no_grad, so the
    gradient is the unclamped norm's). torch's own symbolic divides sum(x1 * x2) by
    max(sqrt(|x1|^2 |x2|^2), eps): a NaN gradient for a zero vector (torch: finite) and an
    overflow from |x| ~ 1e19 on (torch normalises first)."""
    build = _ExportGraph(g)

    def normalised(x):
        norm = _vector_norm(g, x, 2.0, dim, True)
        raised = build.op("Max", [build.op("Sub", [build.const(eps), norm]), build.const(0.0)])  # what the clamp adds: 0 from eps on, also at inf
        clamped = build.op("Add", [norm, detach(g, raised)])
        return build.op("Div", [x, clamped])

    return build.reduce("ReduceSum", build.op("Mul", [normalised(x1), normalised(x2)]), [dim], 0)


def _minimum(build, a, b):
    """torch.min(a, b) elementwise: NaN if either is; at a tie each gets half the gradient."""
    smaller = build.op("Where", [build.op("IsNaN", [b]), b, build.op("Where", [build.op("Less", [b, a]), b, a])])
    halves = build.op("Add", [build.op("Mul", [a, build.const(0.5)]), build.op("Mul", [b, build.const(0.5)])])
    return build.op("Where", [build.op("Equal", [a, b]), halves, smaller])


@symbolic_helper.parse_args("v", "v", "v", "f", "f", "f", "b", "i")
def triplet_margin_loss(g, anchor, positive, negative, margin, p, eps, swap, reduction):
    """torch's clamp_min(margin + d(anchor, positive) - d(anchor, negative), 0), d its
    pairwise_distance (with ``swap``, d(anchor, negative) is the smaller of it and
    d(positive, negative)). The exporter has no symbolic for it."""
    build = _ExportGraph(g)
    positive_distance = pairwise_distance(g, anchor, positive, p, eps, False)
    negative_distance = pairwise_distance(g, anchor, negative, p, eps, False)
    if swap:
        negative_distance = _minimum(build, negative_distance, pairwise_distance(g, positive, negative, p, eps, False))
    hinge = build.op("Sub", [build.op("Add", [build.const(margin), positive_distance]), negative_distance])
    return _reduce(g, _clamp_min(build, hinge, 0.0), reduction)


@symbolic_helper.parse_args("v", "v", "v", "f", "i")
def margin_ranking_loss(g, x1, x2, target, margin, reduction):
    """torch's clamp_min(-target * (x1 - x2) + margin, 0). The exporter has no symbolic for it."""
    build = _ExportGraph(g)
    hinge = build.op("Add", [build.op("Mul", [build.op("Neg", [target]), build.op("Sub", [x1, x2])]), build.const(margin)])
    return _reduce(g, _clamp_min(build, hinge, 0.0), reduction)


_COSINE_EPSILON = 1e-12  # ATen's cosine_embedding_loss


@symbolic_helper.parse_args("v", "v", "v", "f", "i")
def cosine_embedding_loss(g, x1, x2, target, margin, reduction):
    """torch's formula: cos = sum(x1 x2) / sqrt((sum(x1^2) + 1e-12) (sum(x2^2) + 1e-12)) over the
    last dimension of a batch (the only one of a vector); 1 - cos where target is 1,
    clamp_min(cos - margin, 0) where it is -1, 0 elsewhere. The exporter has no symbolic for it."""
    build = _ExportGraph(g)
    dim = 1 if symbolic_helper._get_tensor_rank(x1) == 2 else 0

    def summed_product(a, b):
        return build.reduce("ReduceSum", build.op("Mul", [a, b]), [dim], 0)

    squares = [build.op("Add", [summed_product(x, x), build.const(_COSINE_EPSILON)]) for x in (x1, x2)]
    cosine = build.op("Div", [summed_product(x1, x2), build.op("Sqrt", [build.op("Mul", squares)])])
    target = build.op("Cast", [target], to=onnx.TensorProto.FLOAT)
    distance = build.op("Sub", [build.const(1.0), cosine])
    similar = rewrites.where(build, build.op("Equal", [target, build.const(1.0)]), distance, 0.0)
    apart = _clamp_min(build, build.op("Sub", [cosine, build.const(margin)]), 0.0)
    dissimilar = rewrites.where(build, build.op("Equal", [target, build.const(-1.0)]), apart, 0.0)
    return _reduce(g, build.op("Add", [similar, dissimilar]), reduction)


_BAG_MODES = ("sum", "mean", "max")


def _module_scope(g) -> str:
    """The name of the module whose node is being exported ('bag' from torch's scope name
    'torch.nn.modules.sparse.EmbeddingBag::bag')."""
    return g.original_node.scopeName().rsplit("/", 1)[-1].split("::")[-1] or "?"


@symbolic_helper.parse_args("v", "v", "v", "i", "i", "i", "v", "i", "i")
def embedding_bag(g, weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
                  padding_idx):  # fmt: skip
    """torch's embedding_bag without a Loop: the bags laid out as rows of a [bags, longest bag]
    index matrix, each row a bag's positions in ``indices``, the positions past its end (and the
    entries equal to ``padding_idx``) masked out; then a sum, mean or max over the rows' embeddings.

    torch's own symbolic writes a Loop over the bags, which onnxruntime-training cannot
    differentiate. Masked entries take 0 (sum, mean) or -inf (max) through a Where, so an inf
    or NaN embedding reaches only the bags that hold it, as in torch. mean divides the sum by
    the bag's size, an empty bag being 0 (size 1), as torch's kernel does. max follows torch's
    kernel, a running ``if value > current``: the bag's first entry if it is NaN, else the first
    of the largest values, NaN skipped; that entry alone gets the gradient.
    """
    if scale_grad_by_freq:
        raise ValueError(f"nn.EmbeddingBag '{_module_scope(g)}' with scale_grad_by_freq=True: orttrainer does not "
                         "train it (only nn.Embedding's); set scale_grad_by_freq=False")  # fmt: skip
    build, dtype = _ExportGraph(g), _numpy_dtype(weight)
    rows, valid, positions = _bags(build, weight, indices, offsets, include_last_offset, padding_idx)
    kept = build.unsqueeze(valid, [2])  # [bags, longest, 1]
    if not symbolic_helper._is_none(per_sample_weights):  # mode "sum" (torch refuses the others)
        return _weighted_sum(build, rows, kept, positions, per_sample_weights, dtype), None, None, None
    if _BAG_MODES[mode] == "max":
        empty = build.op("Equal", [build.reduce("ReduceMax", rewrites.mask(build, valid), [1], 1), build.const(0.0)])
        return build.op("Where", [empty, build.const(0, dtype), _first_running_max(build, rows, kept, dtype)]), None, None, None
    total = build.reduce("ReduceSum", build.op("Where", [kept, rows, build.const(0, dtype)]), [1], 0)
    if _BAG_MODES[mode] == "mean":
        sizes = build.reduce("ReduceSum", build.op("Where", [valid, build.const(1, dtype), build.const(0, dtype)]), [1], 1)
        total = build.op("Div", [total, build.op("Max", [sizes, build.const(1, dtype)])])
    return total, None, None, None


def _bags(build, weight, indices, offsets, include_last_offset, padding_idx):
    """([bags, longest bag, dim] embeddings of each bag's entries in order, [bags, longest bag]
    bool: which of them belong to the bag, [bags, longest bag] their positions in ``indices``
    (``len(indices)`` past a bag's end)). At least one column, so that an empty bag has an
    entry to take max over."""
    offsets, count = build.op("Cast", [offsets], to=onnx.TensorProto.INT64), build.op("Shape", [indices])
    if include_last_offset:  # torch's kernel ends the last bag at the end of ``indices``, whatever the last offset says
        offsets = build.op("Slice", [offsets, build.const([0], np.int64), build.const([-1], np.int64)])
    following = build.op("Slice", [offsets, build.const([1], np.int64), build.const([2**62], np.int64)])
    starts, ends = offsets, build.op("Concat", [following, count], axis=0)
    lengths = build.op("Sub", [ends, starts])
    longest = build.op("Max", [build.reduce("ReduceMax", lengths, [0], 0), build.const(1, np.int64)])
    steps = build.unsqueeze(build.op("Range", [build.const(0, np.int64), longest, build.const(1, np.int64)]), [0])
    valid = build.op("Less", [steps, build.unsqueeze(lengths, [1])])
    positions = build.op("Where", [valid, build.op("Add", [build.unsqueeze(starts, [1]), steps]), count])
    padded = build.op("Concat", [build.op("Cast", [indices], to=onnx.TensorProto.INT64), build.const([0], np.int64)], axis=0)
    words = build.op("Gather", [padded, positions])  # past a bag's end: position `count`, word 0
    if padding_idx is not None and padding_idx >= 0:
        valid = build.op("And", [valid, build.op("Not", [build.op("Equal", [words, build.const(padding_idx, np.int64)])])])
    return build.op("Gather", [weight, words]), valid, positions


def _weighted_sum(build, rows, kept, positions, per_sample_weights, dtype):
    """[bags, dim]: each bag's sum of its embeddings times their per-sample weights, in float64.
    torch's kernel adds each product with a fused multiply-add, which does not overflow where
    the product alone would (2 * FLT_MAX next to -inf is -inf there); float64 products do not
    overflow either, and round to what torch's float32 sums round to."""
    double = onnx.TensorProto.DOUBLE
    padded = build.op("Concat", [per_sample_weights, build.const([0], dtype)], axis=0)
    weights = build.unsqueeze(build.op("Cast", [build.op("Gather", [padded, positions])], to=double), [2])
    products = build.op("Mul", [build.op("Cast", [rows], to=double), weights])
    total = build.reduce("ReduceSum", build.op("Where", [kept, products, build.const(0, np.float64)]), [1], 0)
    return build.op("Cast", [total], to=onnx.helper.np_dtype_to_tensor_dtype(dtype))


def _first_running_max(build, rows, kept, dtype):
    """[bags, dim]: what torch's max bag computes, ``current = value if value > current`` over
    the bag's entries from its first: the first entry if it is NaN (nothing is greater than
    NaN), else the first of the largest, NaN entries never taken. Gathered from ``rows``, so
    that entry alone gets the gradient."""
    shape = build.op("Shape", [rows])
    first = build.op("ArgMax", [build.op("Expand", [rewrites.mask(build, kept), shape])], axis=1, keepdims=1)
    nan = build.op("IsNaN", [rows])
    candidates = build.op("Where", [build.op("Or", [build.op("Not", [kept]), nan]), build.const(-np.inf, dtype), rows])
    largest = build.reduce("ReduceMax", candidates, [1], 1)
    ties = build.op("And", [build.op("Equal", [candidates, largest]), kept])
    first_tie = build.op("ArgMax", [rewrites.mask(build, ties)], axis=1, keepdims=1)
    first_is_nan = build.op("IsNaN", [build.op("GatherElements", [rows, first], axis=1)])
    chosen = build.op("Where", [first_is_nan, first, first_tie])
    return build.squeeze(build.op("GatherElements", [rows, chosen], axis=1), [1])


def _from_the_end_wrapped(g, index, size):
    """torch's negative index counts from the end: ``index + size`` where it is below 0."""
    negative = g.op("Less", index, g.op("Constant", value_t=torch.tensor(0, dtype=torch.int64)))
    return g.op("Where", negative, g.op("Add", index, size), index)


def index(g, self, indices):
    """``tensor[i, j]`` with integer index tensors: torch's symbolic, with negative indices first
    turned into their positive equivalent (its flattened-index formula is wrong for them)."""
    if not symbolic_helper._is_packed_list(indices):
        return symbolic_opset11.index(g, self, indices)
    listed = symbolic_helper._unpack_list(indices)
    shape = g.op("Shape", self)
    wrapped = []
    for dim, entry in enumerate(listed):
        integer = not symbolic_helper._is_none(entry) and entry.type().scalarType() not in ("Bool", "Byte")
        size = g.op("Gather", shape, g.op("Constant", value_t=torch.tensor([dim], dtype=torch.int64)), axis_i=0)
        wrapped.append(_from_the_end_wrapped(g, g.op("Cast", entry, to_i=7), size) if integer else entry)
    return symbolic_opset11.index(g, self, g.op("prim::ListConstruct", *wrapped))


def _adaptive_average_pool(dims: int):
    """aten::adaptive_avg_pool{1,2,3}d to sizes that do not divide the input's: torch's exporter refuses them. Each
    output is the mean of the window torch's kernel gives it (floor(i * length / size) to ceil((i + 1) * length /
    size) on each axis), taken over the whole window at once as torch sums it: a ReduceMean of a Slice per output,
    concatenated. Divisible sizes, and inputs of unknown sizes, get torch's symbolic (one AveragePool, or its error)."""
    torch_symbolic = getattr(symbolic_opset9, f"adaptive_avg_pool{dims}d")

    def symbolic(g, x, output_size):
        sizes = symbolic_helper._get_tensor_sizes(x) or []
        wanted = symbolic_helper._maybe_get_const(output_size, "is")
        if len(sizes) != dims + 2 or None in sizes[2:] or not isinstance(wanted, (list, tuple)):
            return torch_symbolic(g, x, output_size)
        lengths = sizes[2:]
        if all(length % size == 0 for length, size in zip(lengths, wanted)):
            return torch_symbolic(g, x, output_size)
        windows = [[(index * length // size, -(-(index + 1) * length // size)) for index in range(size)]
                   for length, size in zip(lengths, wanted)]  # fmt: skip
        return _window_means(_ExportGraph(g), x, windows, [])

    return symbolic


def _window_means(build, x, windows, chosen):
    """The means of x over every combination of ``windows`` (per spatial axis, (start, end) pairs) after the
    ``chosen`` ones for the leading axes, laid out as a grid along those axes."""
    if len(chosen) == len(windows):
        axes = list(range(2, 2 + len(windows)))
        starts, ends = ([window[side] for window in chosen] for side in (0, 1))
        part = build.op("Slice", [x, build.const(starts, np.int64), build.const(ends, np.int64), build.const(axes, np.int64)])
        return build.reduce("ReduceMean", part, axes, 1)
    cells = [_window_means(build, x, windows, chosen + [window]) for window in windows[len(chosen)]]
    return cells[0] if len(cells) == 1 else build.op("Concat", cells, axis=2 + len(chosen))


def repeat_interleave(g, self, repeats, dim=None, output_size=None):
    """torch's symbolic, on a constant of its own for ``dim``: torch's adds the rank to a negative dim in place, in
    the tensor of the trace's constant, which the trace shares with every later use of the same number (Cohere's
    rotary ``repeat_interleave(freqs, 2, dim=-1)`` on a rank-3 tensor turned the -1 of a later ``torch.stack`` into
    2, and a softmax over dim=-1 would have run over another axis)."""
    if not symbolic_helper._is_none(dim) and symbolic_helper._is_constant(dim):
        dim = g.op("Constant", value_t=torch.tensor(symbolic_helper._get_const(dim, "i", "dim")))
    torch_symbolic = symbolic_opset13.repeat_interleave if g.opset >= 13 else symbolic_opset9.repeat_interleave
    return torch_symbolic(g, self, repeats, dim, output_size)


def layer_norm(g, x, normalized_shape, weight, bias, eps, cudnn_enable):
    """torch's symbolic, also for a normalized_shape the trace computed from x's sizes (``F.layer_norm(h,
    (h.shape[-1],))``), which torch's requires as constants: torch itself requires it to equal x's last sizes, so
    those are taken when the export knows them."""
    torch_symbolic = symbolic_opset17.layer_norm if g.opset >= 17 else symbolic_opset9.layer_norm
    if not symbolic_helper._is_constant(normalized_shape) and symbolic_helper._is_packed_list(normalized_shape):
        count = len(symbolic_helper._unpack_list(normalized_shape))
        sizes = (symbolic_helper._get_tensor_sizes(x) or [None])[-count:]
        if count and None not in sizes:
            normalized_shape = g.op("Constant", value_t=torch.tensor(sizes, dtype=torch.int64))
    return torch_symbolic(g, x, normalized_shape, weight, bias, eps, cudnn_enable)


def one_hot(g, x, num_classes):
    """torch's symbolic, refused for num_classes=-1: torch then takes the number of classes from the batch's largest
    value, which the graph would keep from the first batch (ONNX Runtime failed on a depth of -1)."""
    if symbolic_helper._maybe_get_const(num_classes, "i") == -1:
        raise ValueError(f"F.one_hot in module '{_module_scope(g)}' without num_classes takes the number of classes from "
                         "the batch's largest value; pass num_classes")  # fmt: skip
    return symbolic_opset9.one_hot(g, x, num_classes)


def split(g, x, split_size_or_sizes, dim, _outputs=None):
    """torch's symbolic, except ``x.split(k, dim)`` along a dimension whose size changes with the batch: torch's took
    the size to be k times the number of parts, so a last part shorter than k failed in ONNX Runtime ("Sum of sizes in
    'split'"). Here the parts are Slices, the last one to the end."""
    torch_symbolic = symbolic_opset13.split if g.opset >= 13 else symbolic_opset11.split
    axis = symbolic_helper._maybe_get_const(dim, "i")
    dynamic = isinstance(axis, int) and symbolic_helper._get_tensor_dim_size(x, axis) is None
    if not (dynamic and _outputs and symbolic_helper._is_constant(split_size_or_sizes)):
        return torch_symbolic(g, x, split_size_or_sizes, dim, _outputs)
    if symbolic_helper._node_get(split_size_or_sizes.node(), "value").dim() > 0:  # sizes given: torch's is right
        return torch_symbolic(g, x, split_size_or_sizes, dim, _outputs)
    size, build = symbolic_helper._get_const(split_size_or_sizes, "i", "split_size"), _ExportGraph(g)
    bounds = [part * size for part in range(_outputs)] + [2**63 - 1]
    return [build.op("Slice", [x, build.const([start], np.int64), build.const([end], np.int64), build.const([axis], np.int64)])
            for start, end in zip(bounds, bounds[1:])]  # fmt: skip


def _sort_arguments(args):
    """(dim, descending) of aten::sort / argsort, whose ``stable`` overload takes (stable, dim, descending): torch's
    symbolic read those as (dim, descending, out) and refused an "Out parameter"."""
    if len(args) == 3:  # stable: ONNX Runtime's TopK keeps tied values in their order, as torch's stable sort does
        args = args[1:]
    dim, descending = (symbolic_helper._get_const(value, "i", name) for value, name in zip(args, ("dim", "descending")))
    return dim, descending


def _ranked(g, x, dim, rank):
    """(values, indices) of ``rank(keys)`` (a TopK over ``dim``) where the keys order x as torch's sort and topk do:
    NaN above +inf above every finite value. ONNX Runtime's TopK kept one of two NaN in a top-k and put NaN first
    in an ascending one. The keys are float64, NaN as +inf and +inf as 1e300; the values are gathered from x (NaN
    kept), which gives them GatherElements' gradient."""
    if not symbolic_helper._is_fp(x):
        return rank(x)
    build = _ExportGraph(g)
    wide = g.op("Cast", x, to_i=onnx.TensorProto.DOUBLE)
    keys = build.op("Where", [build.op("Equal", [wide, build.const(np.inf, np.float64)]), build.const(1e300, np.float64), wide])
    keys = build.op("Where", [build.op("IsNaN", [x]), build.const(np.inf, np.float64), keys])
    _, indices = rank(keys)
    return build.op("GatherElements", [x, indices], axis=dim), indices


def sort(g, x, *args):
    dim, descending = _sort_arguments(args)
    return _ranked(g, x, dim, lambda keys: symbolic_helper._sort_helper(g, keys, dim, descending=descending))


def argsort(g, x, *args):
    return sort(g, x, *args)[1]


@symbolic_helper.parse_args("v", "v", "i", "i", "i", "none")
def topk(g, x, k, dim, largest, sorted, out=None):
    """torch.topk, NaN ranked as torch ranks it (``_ranked``); tied values in index order (torch's order for ties is
    its kernel's, unspecified)."""
    return _ranked(g, x, dim, lambda keys: symbolic_helper._topk_helper(g, keys, k, dim, largest=largest, sorted=sorted))


# ScatterElements and ScatterND add the values sent to one place (reduction='add') from this opset on; before
# it a scatter keeps one of them, where torch adds them all.
_ADDING_SCATTER_OPSET = 16


def _refuse_before_adding_scatters(g, call: str) -> None:
    if g.opset < _ADDING_SCATTER_OPSET:
        raise ValueError(f"{call} in module '{_module_scope(g)}' adds up the values of repeated indices, which an ONNX "
                         f"scatter does from opset {_ADDING_SCATTER_OPSET} on; this export is at opset {g.opset}: set "
                         f"ORTTrainerOptions({{'_internal_use': {{'onnx_opset_version': {_ADDING_SCATTER_OPSET}}}}}) "
                         "or higher")  # fmt: skip


def scatter_add(g, self, dim, index, source):
    """torch's symbolic from opset 16 on (a ScatterElements adding into ``self``); refused below, where it
    scatters into zeros and keeps one value per repeated index."""
    _refuse_before_adding_scatters(g, "scatter_add")
    return symbolic_opset16.scatter_add(g, self, dim, index, source)


@symbolic_helper.parse_args("v", "i", "v", "v", "v")
def index_add(g, self, dim, index, source, alpha=None):
    """torch.index_add: every slice of ``source`` added at its index, repeated indices included, in one
    ScatterElements adding into ``self``. torch's symbolic scatters into zeros without reduction, which keeps
    one slice per repeated index (its warning says so)."""
    _refuse_before_adding_scatters(g, "index_add")
    rank = symbolic_helper._get_tensor_rank(self)
    if rank is None or symbolic_helper._get_tensor_rank(source) != rank:
        raise ValueError(f"index_add in module '{_module_scope(g)}' needs a tensor and a source of the same known rank")
    dim %= max(rank, 1)
    if not symbolic_helper._is_none(alpha) and symbolic_helper._maybe_get_const(alpha, "f") != 1:
        scalar_type = _type_utils.JitScalarType.from_value(source)
        source = g.op("Mul", source, g.op("Cast", alpha, to_i=scalar_type.onnx_type()))
    along_dim = [1] * dim + [-1] + [1] * (rank - dim - 1)
    index = g.op("Reshape", index, g.op("Constant", value_t=torch.tensor(along_dim, dtype=torch.int64)))
    index = g.op("Expand", index, g.op("Shape", source))
    return g.op("ScatterElements", self, index, source, axis_i=dim, reduction_s="add")


def _broadcast_mask(self, indices, values):
    """The mask of ``self[mask] = values`` when ``values`` is one value per selected element's position (broadcast
    to every selected element: Wav2Vec2's ``hidden_states[mask_time_indices] = self.masked_spec_embed``), else None."""
    listed = symbolic_helper._unpack_list(indices) if symbolic_helper._is_packed_list(indices) else [indices]
    if len(listed) != 1 or not symbolic_helper._is_bool(listed[0]):
        return None
    ranks = [symbolic_helper._get_tensor_rank(value) for value in (self, listed[0], values)]
    if None in ranks:
        return None
    data_rank, mask_rank, values_rank = ranks
    per_position = 0 < values_rank <= data_rank - mask_rank
    return listed[0] if per_position else None


def index_put(g, self, indices, values, accumulate=False):
    """torch's symbolic, except:

    - ``accumulate=True`` with integer indices: one ScatterND adding into ``self``, repeated indices included.
      torch's scatters into zeros without reduction, which keeps one value per repeated index. A boolean mask
      (each element at most once) is placed into -0 zeros, the identity of +, and added;
    - a boolean mask whose values broadcast to every selected element (``_broadcast_mask``): a Where.
      torch's passed them to a masked_scatter, which takes one value per selected element, and ONNX Runtime
      failed on the shapes."""
    if symbolic_helper._parse_arg(accumulate, "b"):
        return _accumulated(g, self, indices, values)
    mask = _broadcast_mask(self, indices, values)
    if mask is None:
        return symbolic_opset11.index_put(g, self, indices, values, accumulate)
    mask_rank, data_rank = symbolic_helper._get_tensor_rank(mask), symbolic_helper._get_tensor_rank(self)
    mask = symbolic_helper._unsqueeze_helper(g, mask, list(range(mask_rank, data_rank)))
    scalar_type = _type_utils.JitScalarType.from_value(self)
    return g.op("Where", mask, g.op("Cast", values, to_i=scalar_type.onnx_type()), self)


def _accumulated(g, self, indices, values):
    """``self.index_put(indices, values, accumulate=True)`` (see ``index_put``)."""
    scalar_type = _type_utils.JitScalarType.from_value(self)
    zeros = g.op("ConstantOfShape", g.op("Shape", self), value_t=torch.tensor([-0.0], dtype=scalar_type.dtype()))
    placed = index_put(g, zeros, indices, values, False)
    if placed.node().kind() != "onnx::ScatterND":
        return g.op("Add", self, placed)
    _refuse_before_adding_scatters(g, "index_put with accumulate=True")
    return g.op("ScatterND", self, placed.node().inputsAt(1), placed.node().inputsAt(2), reduction_s="add")


_SYMBOLICS = {
    "index": index,
    "index_put": index_put,
    "index_add": index_add,
    "scatter_add": scatter_add,
    "repeat_interleave": repeat_interleave,
    "linalg_vector_norm": linalg_vector_norm,
    "var": var,
    "var_mean": var_mean,
    "std": std,
    "std_mean": std_mean,
    "cdist": cdist,
    "floor_divide": floor_divide,
    "floordiv": floor_divide,
    "baddbmm": baddbmm,
    "layer_norm": layer_norm,
    "one_hot": one_hot,
    "split": split,
    "sort": sort,
    "argsort": argsort,
    "topk": topk,
    "batch_norm": batch_norm,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "diff": diff,
    "cumsum": cumsum,
    "constant_pad_nd": constant_pad_nd,
    "pad": pad,
    **{f"reflection_pad{dims}d": _padding("reflect") for dims in (1, 2, 3)},
    **{f"replication_pad{dims}d": _padding("edge") for dims in (1, 2, 3)},
    "embedding": embedding,
    "embedding_bag": embedding_bag,
    "rms_norm": rms_norm,
    "feature_dropout": feature_dropout,
    "threshold": threshold,
    "channel_shuffle": channel_shuffle,
    "pairwise_distance": pairwise_distance,
    "cosine_similarity": cosine_similarity,
    "softplus": softplus,
    "clamp": clamp,
    "clamp_min": clamp_min,
    "clamp_max": clamp_max,
    "hardtanh": hardtanh,
    "detach": detach,
    "diagonal": diagonal,
    "diag": diag,
    "atan2": atan2,
    "hardshrink": hardshrink,
    "softshrink": softshrink,
    "relu6": relu6,
    **{f"adaptive_avg_pool{dims}d": _adaptive_average_pool(dims) for dims in (1, 2, 3)},
    "max": _extreme("ReduceMax", symbolic_helper._max_helper),
    "min": _extreme("ReduceMin", symbolic_helper._min_helper),
    "argmax": _arg_extreme("ReduceMax"),
    "argmin": _arg_extreme("ReduceMin"),
    "sinh": _unary("Sinh"),
    "cosh": _unary("Cosh"),
    "asinh": _unary("Asinh"),
    "acosh": _unary("Acosh"),
    "atanh": _unary("Atanh"),
    "l1_loss": l1_loss,
    "smooth_l1_loss": smooth_l1_loss,
    "huber_loss": huber_loss,
    "binary_cross_entropy": binary_cross_entropy,
    "binary_cross_entropy_with_logits": binary_cross_entropy_with_logits,
    "log_sigmoid": log_sigmoid,
    "soft_margin_loss": soft_margin_loss,
    "poisson_nll_loss": poisson_nll_loss,
    "hinge_embedding_loss": hinge_embedding_loss,
    "triplet_margin_loss": triplet_margin_loss,
    "margin_ranking_loss": margin_ranking_loss,
    "cosine_embedding_loss": cosine_embedding_loss,
    "bilinear": bilinear,
    "cross_entropy_loss": cross_entropy_loss,
}


_OPSETS = range(MIN_OPSET, MAX_OPSET + 1)


def _custom_symbolics() -> dict:
    """{aten op: {opset: custom symbolic}} for orttrainer's ops as torch's registry holds them
    now (None: no entry at all). Reads the registry's private state: torch's public API can
    register and unregister custom symbolics, but not list them."""
    exporter_utils._trigger_symbolic_function_registration()  # torch's own symbolics, otherwise added at the first export
    saved = {}
    for name in _SYMBOLICS:
        group = registration.registry.get_function_group(f"aten::{name}")
        saved[name] = None if group is None else dict(group._functions._overrides)
    return saved


def _restore(saved: dict) -> None:
    """Put back the custom symbolics ``_custom_symbolics`` saved for the opsets orttrainer registered."""
    for name, overrides in saved.items():
        if overrides is None:
            registration.registry._registry.pop(f"aten::{name}", None)  # the entry orttrainer created
            continue
        group = registration.registry.get_function_group(f"aten::{name}")
        for version in _OPSETS:
            if version in overrides:
                group.add_custom(overrides[version], version)
            else:
                group.remove_custom(version)


@contextlib.contextmanager
def exporting():
    """orttrainer's symbolics registered with torch's TorchScript exporter for the exports in
    this block; afterwards torch's registry is as it was.

    orttrainer's symbolic wins over one the user registered for the same aten op, during
    this block only: the trainer's graph has to compute what torch computes (a user's
    symbolic is written for inference elsewhere, e.g. an op of another runtime). The user's
    is registered again on exit. They are registered at every opset orttrainer exports at,
    so that neither torch's symbolics for a later opset nor a user's shadow them.
    """
    saved = _custom_symbolics()
    for name, function in _SYMBOLICS.items():
        for version in _OPSETS:
            torch.onnx.register_custom_op_symbolic(f"aten::{name}", function, version)
    try:
        yield
    finally:
        _restore(saved)
