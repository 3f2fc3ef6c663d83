"""Activations: Softplus, Elu, Celu, Selu, HardSigmoid and PRelu written with ops that have gradient builders,
torch's values and gradients at the kinks (x = 0, the hard sigmoid's bounds) and at ±inf; and Relu or Clip
feeding a square root, log or division, as a select (``select_before_singular``), whose gradient stays 0 where
the mask multiplication of ONNX Runtime's gave inf * 0 = NaN. One family because each is a piecewise function
of one input, built from the same pieces (``_nonpositive_part``, masks, the exponential's tail).
"""

import numpy as np
import onnx

from ._building import RewriteError, compare, is_negative_zero, log1p, mask, node_attribute, node_output, where


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
    build.op("Add", [build.op("Max", [x, build.const(0.0)]), tail], node_output(build))


def _nonpositive_part(build, x):
    """min(x, 0) with derivative 1 for x <= 0, 0 included (Relu's derivative there is 0,
    Min's 1/2), and 0 for x > 0; finite wherever x is not NaN (+inf gives 0).

    FLT_MIN - relu(FLT_MIN - x) is min(x, FLT_MIN), exact for x <= 0, its kink just above 0;
    the mask of x <= 0 drops the values in (0, FLT_MIN].
    """
    tiny = build.const(np.finfo(np.float32).tiny)
    clamped = build.op("Sub", [tiny, build.op("Relu", [build.op("Sub", [tiny, x])])])
    return build.op("Mul", [clamped, mask(build, compare(build, "LessOrEqual", x, 0.0))])


def _expm1_nonpositive(build, z):
    """exp(z) - 1 for z <= 0 (-inf included) to float32 accuracy, value and gradient.

    On [-1, 0] it is 2t / (1 - t) with t = tanh(z / 2): no cancellation near 0, where
    exp(z) - 1 loses every digit (ELU(-1e-30) would be 0), and within about 6 ulp (ONNX
    Runtime's Tanh is within 5). Below -1, exp(z) - 1 has no cancellation and its gradient
    exp(z) stays exact where tanh'(z / 2) = 1 - t^2 would round to 0.
    """
    near = mask(build, compare(build, "GreaterOrEqual", z, -1.0))
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
    _elu_like(build, build.node.input[0], build.attribute("alpha", 1.0), 1.0, node_output(build))


def celu(build):
    alpha = build.attribute("alpha", 1.0)
    _elu_like(build, build.node.input[0], alpha, 1.0 / alpha, node_output(build))


def selu(build):
    alpha = build.attribute("alpha", 1.6732632423543772)
    gamma = build.attribute("gamma", 1.0507009873554805)
    inner = _elu_like(build, build.node.input[0], alpha, 1.0, None)
    build.op("Mul", [inner, build.const(gamma)], node_output(build))


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
    inside = build.op("And", [compare(build, "Greater", x, low), compare(build, "Less", x, high)])
    outside = mask(build, compare(build, "GreaterOrEqual", x, high))
    build.op("Add", [build.op("Mul", [clipped, mask(build, inside)]), outside], node_output(build))


def prelu(build):
    """relu(x) + slope * min(x, 0): gradient slope at x = 0, as torch's (_nonpositive_part);
    the slope is multiplied only by the x <= 0 values, so +inf gives it gradient 0, not
    0 * inf, and the value inf, not inf - inf."""
    x, slope = build.node.input[0], build.node.input[1]
    negative = build.op("Mul", [slope, _nonpositive_part(build, x)])
    build.op("Add", [build.op("Relu", [x]), negative], node_output(build))


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
    at_low = compare(build, "LessOrEqual" if strict else "Less", x, low)  # held at the low bound
    held = where(build, at_low, low, high)
    held = where(build, build.op("Not", [build.op("IsNaN", [x])]), held, float("nan"))
    if 0.0 in (low, high):
        held = where(build, build.op("Not", [is_negative_zero(build, x)]), held, -0.0)
    zero_passes = low < 0.0 < high if strict else low <= 0.0 <= high
    if zero_passes:  # a -0 of x is put out as it is: x in the second branch (no Not: ONNX Runtime swaps the branches)
        at_high = compare(build, "GreaterOrEqual" if strict else "Greater", x, high)
        where(build, build.op("Or", [build.op("Or", [at_low, at_high]), build.op("IsNaN", [x])]), held, x, node_output(build))
        return True
    # a -0 of x is held: the held values in the second branch
    if node.op_type == "Relu":  # NaN passes, as torch's threshold_backward lets it (not x <= 0)
        passes = build.op("Not", [at_low])
    else:
        above, below = ("Greater", "Less") if strict else ("GreaterOrEqual", "LessOrEqual")
        passes = build.op("And", [compare(build, above, x, low), compare(build, below, x, high)])
    where(build, passes, x, held, node_output(build))
    return True
