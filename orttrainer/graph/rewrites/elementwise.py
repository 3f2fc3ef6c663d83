"""Elementwise math: Sinh, Cosh, Asinh, Acosh, Atanh and Sign with float32 accuracy in value and gradient where
the textbook formulas cancel or overflow (Taylor series near 0, shifted exponentials, log1p, log(2|x|) far out).
One family because they share the odd-function helpers (``_magnitude``, ``_with_sign``) and the series.
"""

import numpy as np
import onnx

from ._building import compare, log1p, node_output, where


def _magnitude(build, x):
    """(x < 0, |x|) with |x| as a Where, so that its derivative at 0 is 1, not Abs's 0."""
    negative = compare(build, "Less", x, 0.0)
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
    shifted = compare(build, "GreaterOrEqual", a, _SHIFTED_FROM)
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
    near = compare(build, "Less", magnitude, _SERIES_BELOW)
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
    _hyperbolic(build, build.node.input[0], True, node_output(build))


def cosh(build):
    _hyperbolic(build, build.node.input[0], False, node_output(build))


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
    large = compare(build, "GreaterOrEqual", magnitude, _LOGARITHMIC_FROM)
    a = where(build, large, 0.0, magnitude)
    square = build.op("Mul", [a, a])
    root = build.op("Sqrt", [build.op("Add", [square, build.const(1.0)])])
    shift = build.op("Add", [a, build.op("Div", [square, build.op("Add", [root, build.const(1.0)])])])
    logarithmic = _log_twice(build, where(build, large, magnitude, _LOGARITHMIC_FROM))
    _with_sign(build, negative, where(build, large, logarithmic, log1p(build, shift)), node_output(build))


def acosh(build):
    """acosh(x) = log1p(d + sqrt(d) * sqrt(x + 1)) with d = x - 1, exact near 1 (gradient +inf
    at 1, as torch); log(x) + log 2 from x = 4096 on. NaN below 1 as torch; torch's gradient
    there is NaN too on (-1, 1) but finite below -1, where this one is NaN."""
    x = build.node.input[0]
    large = compare(build, "GreaterOrEqual", x, _LOGARITHMIC_FROM)
    near = where(build, large, 2.0, x)
    excess = build.op("Sub", [near, build.const(1.0)])
    root = build.op("Mul", [build.op("Sqrt", [excess]), build.op("Sqrt", [build.op("Add", [near, build.const(1.0)])])])
    logarithmic = _log_twice(build, where(build, large, x, _LOGARITHMIC_FROM))
    where(build, large, logarithmic, log1p(build, build.op("Add", [excess, root])), node_output(build))


def atanh(build):
    """atanh(x) = (log1p(x) - log1p(-x)) / 2: no cancellation near 0 (log((1 + x) / (1 - x))
    was 0 below 6e-8), ±inf at ±1 with gradient +inf, NaN beyond (gradient -1 / (x^2 - 1),
    torch's)."""
    x = build.node.input[0]
    difference = build.op("Sub", [log1p(build, x), log1p(build, build.op("Neg", [x]))])
    build.op("Mul", [difference, build.const(0.5)], node_output(build))


def sign(build):
    """sign(x) = [x > 0] - [x < 0] (NaN gives 0, as torch); its gradient is 0, as torch's.

    A Where that never selects x keeps x on a (zero) gradient path, so that a weight read
    only through sign gets a zero gradient, as in torch, instead of none.
    """
    x = build.node.input[0]
    positive = build.op("Cast", [compare(build, "Greater", x, 0.0)], to=onnx.TensorProto.FLOAT)
    negative = build.op("Cast", [compare(build, "Less", x, 0.0)], to=onnx.TensorProto.FLOAT)
    never = where(build, compare(build, "Less", x, -np.inf), x, 0.0)
    build.op("Add", [build.op("Sub", [positive, negative]), never], node_output(build))
