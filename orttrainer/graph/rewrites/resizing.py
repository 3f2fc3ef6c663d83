"""Resizing: Resize (ONNX Runtime has no CPU kernel for ResizeGrad) as torch's upsampling computes it, nearest by
whole-number factors as Reshape + Expand, linear and cubic as Gathers of constant indices weighted by constant
taps. One family because both read the Resize's scales or sizes and coordinate transformation the same way.
"""

import numpy as np

from ._building import RewriteError, node_output
from .indexing import gathered


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
    build.op("Reshape", [grown, build.const(merged, np.int64)], node_output(build))


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
        terms = [build.op("Mul", [gathered(build, resized, axis, index), build.const(weight.reshape(along))]) for index, weight in taps]
        for term in terms[1:-1]:  # added left to right, as torch's kernel does (Sum has no gradient builder)
            terms[0] = build.op("Add", [terms[0], term])
        resized = build.op("Add", [terms[0], terms[-1]], node_output(build) if axis == axes[-1] else None)
    if not axes:
        build.op("Identity", [x], node_output(build))
