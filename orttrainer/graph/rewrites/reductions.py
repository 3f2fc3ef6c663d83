"""Reductions: ReduceLogSumExp and ReduceL2 kept from an opset-11 gradient, CumSum as an exact float64 scan (the scan
serves torch.cumprod's symbolic too),
ReduceMax/ReduceMin with torch.amax/amin's gradient and NaN handling, ``first_extreme`` for torch.max(x, dim)
(which symbolics/ exports with it), the other Reduce ops and the variadic Sum and Mean as ops with gradient
builders. One family because each reduces over axes read the same way (``NodeBuilder.reduce_axes``).
"""

import numpy as np
import onnx

from ._building import RewriteError, compare, node_output, where


def reduce_keeping_dims(build):
    """ReduceLogSumExp / ReduceL2 with keepdims=0 as the same op with keepdims=1 and a Squeeze:
    onnxruntime-training's gradients of these emit an opset-11 Unsqueeze for keepdims=0, which an
    opset-13+ graph rejects. keepdims=1 is kept."""
    axes, keepdims = build.reduce_axes()
    if keepdims:
        return False
    x = build.node.input[0]
    axes = list(range(len(build.shape(x)))) if axes is None else axes
    build.squeeze(build.reduce(build.node.op_type, x, axes, 1), axes, node_output(build))


_IDENTITIES = {"Add": 0.0, "Mul": 1.0}  # what a scan of the op lets in at the edge (``inclusive_scan``)


def _shifted(build, x, axis, rank, length, shift, reverse, fill=0.0):
    """x moved ``shift`` places along ``axis``, towards its end (its start if ``reverse``), ``fill`` coming in (a
    constant of x's type)."""
    bounds = ([shift], [length]) if reverse else ([0], [length - shift])
    kept = build.op("Slice", [x, *(build.const(bound, np.int64) for bound in bounds), build.const([axis], np.int64)])
    pads = [0] * (2 * rank)
    pads[axis + (rank if reverse else 0)] = shift
    return build.op("Pad", [kept, build.const(pads, np.int64), fill])


def inclusive_scan(build, x, axis: int, rank: int, length: int, op_type: str, dtype, reverse=False):
    """The running sum (``op_type`` Add) or product (Mul) of x (of numpy ``dtype``) along ``axis`` of static
    ``length``: x combined with
    itself shifted by 1, 2, 4, ... (ceil(log2 n) steps). Each output combines exactly the inputs up to it, once each,
    so an inf or NaN reaches only the positions after it (a triangular MatMul multiplied every input by 0 or 1, and
    inf * 0 = NaN), and a product's gradient is the product of the others, without a division by a zero."""
    fill = build.const(_IDENTITIES[op_type], dtype)
    for step in range(max(length - 1, 0).bit_length()):
        x = build.op(op_type, [x, _shifted(build, x, axis, rank, length, 1 << step, reverse, fill)])
    return x


# The doc_string of the Cast that ends torch.cumprod's scan (symbolics.reductions.cumprod), followed by JSON facts:
# the axis, rank and length; defined_gradients.torch_cumprod_gradients reads them.
CUMPROD_PRODUCTS = "orttrainer: cumprod, torch's gradient "


def _scanned_in_float64(build, x, axis, rank, length, op_type, elem_type, reverse=False):
    """``inclusive_scan`` of x (of ONNX ``elem_type``) in float64, rounded once back to ``elem_type``: torch's CPU
    cumsum and cumprod of float32 accumulate in float64."""
    wide = build.op("Cast", [x], to=onnx.TensorProto.DOUBLE)
    scanned = inclusive_scan(build, wide, axis, rank, length, op_type, np.float64, reverse)
    return build.op("Cast", [scanned], to=elem_type)


def cumprod_gradient(build, x, products, gradient, axis: int, rank: int, length: int, elem_type: int):
    """torch's cumprod_backward (without double backward) of ``products`` = cumprod(x) along ``axis`` of static
    ``length``, given their ``gradient``, in x's ONNX ``elem_type``, in torch's order of operations so that infinities
    and NaNs land where torch's do. z is each row's first zero (its end if none): before it, the reversed running
    sum of products * gradient up to z, divided by x; at it, the running products of x after it up to the next
    zero, times the gradient there, summed, times the product before z; after it 0. Of one element, the gradient."""
    if length == 1:
        return gradient
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    zero, one = build.const(0.0, dtype), build.const(1.0, dtype)
    is_zero = build.op("Equal", [x, zero])
    zeros_so_far = inclusive_scan(build, build.op("Cast", [is_zero], to=onnx.TensorProto.INT64), axis, rank, length,
                                  "Add", np.int64)  # fmt: skip
    before = build.op("Equal", [zeros_so_far, build.const(0, np.int64)])
    from_first = build.op("Equal", [zeros_so_far, build.const(1, np.int64)])
    weighted = build.op("Where", [before, build.op("Mul", [products, gradient]), zero])
    sums = _scanned_in_float64(build, weighted, axis, rank, length, "Add", elem_type, reverse=True)
    until_first = build.op("Div", [sums, x])
    after_first = build.op("Where", [build.op("And", [from_first, build.op("Not", [is_zero])]), x, one])
    running = _scanned_in_float64(build, after_first, axis, rank, length, "Mul", elem_type)
    summed = build.reduce("ReduceSum", build.op("Mul", [running, build.op("Where", [from_first, gradient, zero])]),
                          [axis], 1)  # fmt: skip
    at_first = build.op("Mul", [summed, _shifted(build, products, axis, rank, length, 1, False, one)])
    first_zero = build.op("And", [from_first, is_zero])
    return build.op("Where", [before, until_first, build.op("Where", [first_zero, at_first, zero])])


def cumsum(build):
    """CumSum along a static axis as an exact scan in float64 (``inclusive_scan``).

    torch accumulates a float32 cumsum in float64 on the CPU (1e8 + 1 - 1e8 = 1), so
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
        total = _shifted(build, total, axis, rank, length, 1, reverse, build.const(0.0, np.float64))
    total = inclusive_scan(build, total, axis, rank, length, "Add", np.float64, reverse)
    build.op("Cast", [total], node_output(build), to=onnx.TensorProto.FLOAT)  # rewrites run before any float16 conversion


def _extreme_positions(build, x, axes, op_type):
    """(ties, nan, has_nan), all bool and shaped like x or its slices with kept dims: where x
    equals its slice's ReduceMax/ReduceMin, where x is NaN, whether the slice holds a NaN.

    torch's max/min/amax/amin return NaN for a slice holding one; ONNX Runtime's ReduceMax
    and ArgMax skip a NaN unless it comes first, so NaN is handled explicitly.
    """
    nan = build.op("IsNaN", [x])
    any_nan = build.reduce("ReduceMax", build.op("Cast", [nan], to=onnx.TensorProto.FLOAT), axes, 1)
    has_nan = compare(build, "Greater", any_nan, 0.0)
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
    build.reduce("ReduceSum", shares, axes, keepdims, node_output(build))


def reduce_sum_square(build):
    axes, keepdims = build.reduce_axes()
    x = build.node.input[0]
    build.reduce("ReduceSum", build.op("Mul", [x, x]), axes, keepdims, node_output(build))


def reduce_l1(build):
    axes, keepdims = build.reduce_axes()
    build.reduce("ReduceSum", build.op("Abs", [build.node.input[0]]), axes, keepdims, node_output(build))


def reduce_log_sum(build):
    axes, keepdims = build.reduce_axes()
    build.op("Log", [build.reduce("ReduceSum", build.node.input[0], axes, keepdims)], node_output(build))


def variadic_sum(build):
    total = build.node.input[0]
    for index, name in enumerate(build.node.input[1:], 2):
        total = build.op("Add", [total, name], node_output(build) if index == len(build.node.input) else None)
    if len(build.node.input) == 1:
        build.op("Identity", [total], node_output(build))


def variadic_mean(build):
    total = build.node.input[0]
    for name in build.node.input[1:]:
        total = build.op("Add", [total, name])
    build.op("Mul", [total, build.const(1.0 / len(build.node.input))], node_output(build))
