"""Reductions over an axis: max/min and their indices at NaN, p-norms, variance and standard deviation, distances
(cdist, pairwise_distance, cosine_similarity, vdot), sorting and top-k with NaN, cumulative sums and products, and
differences."""

import numpy as np
import onnx
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import _type_utils, registration, symbolic_opset9

from ...graph import rewrites
from ._graph import DOMAIN, _constant, _dtype, _ExportGraph, _module_scope, _whole_mean, _whole_sum
from .elementwise import detach


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


def _torch_symbolic(name, opset):
    """torch's own symbolic for ``aten::<name>`` at ``opset`` (read from the registry's base functions: orttrainer's
    are registered over them during the export)."""
    functions = registration.registry.get_function_group(f"aten::{name}")._functions._base
    return functions[registration._dispatch_opset_version(opset, functions)]


def _whole_tensor(name, whole):
    """aten::sum / aten::mean: without a dim (``x.sum()``, ``x.mean()``) ``whole`` of x, 0-d as torch's also for an
    empty x, in the ``dtype`` asked for; with one, torch's own symbolic."""

    def symbolic(g, x, *args):
        if len(args) != 1:
            return _torch_symbolic(name, g.opset)(g, x, *args)
        dtype = args[0]
        if not symbolic_helper._is_none(dtype):
            x = g.op("Cast", x, to_i=_type_utils.JitScalarType(symbolic_helper._get_const(dtype, "i", "dtype")).onnx_type())
        return whole(g, symbolic_helper._maybe_cast_reduce_op_input(g, x))

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


# p-norms torch's symbolic writes as one reduction (ReduceL1, ReduceL2, ReduceMax of |x|, ... which rewrites.py trains
# as torch does); any other p is a sum of |x|^p and its root.
_REDUCED_NORMS = (0.0, 1.0, 2.0, float("inf"), float("-inf"))


def _root_with_zero_gradient_at_zero(build, total, exponent, dtype):
    """``total ** exponent`` (a square root, a p-norm's root) whose gradient is 0 where ``total`` is 0, as torch's
    std, norm and cdist backwards mask it: the root's own gradient is infinite there, and times the 0 coming from
    the sum before it, NaN (a padding row's std turned every weight into NaN). The root reads 1 in place of 0,
    through a Where both ways, so no gradient reaches the 0. ``dtype``: ``total``'s."""
    zero = build.op("Equal", [total, build.const(0.0, dtype)])
    safe = build.op("Where", [zero, build.const(1.0, dtype), total])
    root = build.op("Sqrt", [safe]) if exponent == 0.5 else build.op("Pow", [safe, build.const(exponent, dtype)])
    return build.op("Where", [zero, build.const(0.0, dtype), root])


def _p_norm(build, x, order, axes, keepdim, dtype):
    """(sum over ``axes`` of |x|^order)^(1 / order), its gradient 0 at a zero norm (``_root_with_zero_gradient_at_zero``);
    ``dtype``: x's."""
    powered = build.op("Pow", [build.op("Abs", [x]), build.const(order, dtype)])
    total = build.reduce("ReduceSum", powered, axes, int(keepdim))
    return _root_with_zero_gradient_at_zero(build, total, 1.0 / order, dtype)


@symbolic_helper.parse_args("v", "f", "is", "b", "v")
def linalg_vector_norm(g, x, order, dim, keepdim, dtype):
    """torch.linalg.vector_norm (torch.norm, Tensor.norm, F.normalize): torch's symbolic, except a p other than 0, 1,
    2 and ±inf, whose root torch's wrote without torch's zero gradient at a zero norm (``_p_norm``)."""
    if order in _REDUCED_NORMS or not symbolic_helper._is_none(dtype):
        return symbolic_helper._linalg_vector_norm_helper(g, x, order, dim, keepdim, dtype)
    element_type = _dtype(x)
    if symbolic_helper._is_none(dim) or not dim:
        x, dim, keepdim = symbolic_helper._reshape_helper(g, x, [-1]), [0], False
    return _p_norm(_ExportGraph(g), x, order, dim, keepdim, element_type)


def _vector_norm(g, x, order, dim, keepdim):
    """torch.linalg.vector_norm(x, order, dim, keepdim) over one dim, as ``linalg_vector_norm`` writes it."""
    if order in _REDUCED_NORMS:
        return symbolic_helper._linalg_vector_norm_helper(g, x, order, [dim], keepdim, None)
    return _p_norm(_ExportGraph(g), x, order, [dim], keepdim, _dtype(x))


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
    build, dtype = _ExportGraph(g), _dtype(x1)
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


@symbolic_helper.parse_args("v", "i", "v")
def cumprod(g, x, dim, dtype=None):
    """torch.cumprod along a dimension of fixed size, which torch's exporter has no form for: a scan of products
    (``rewrites.inclusive_scan``), in float64 for floating types as torch's CPU kernel accumulates and rounded once,
    in int64 for bool and integers (torch's promotion). Each output is the product of exactly the inputs torch's is;
    the Cast back of a floating one is a marker (``rewrites.CUMPROD_PRODUCTS``, exported_graph.resolve_markers) by
    which the gradient is made torch's cumprod_backward after the build (defined_gradients.torch_cumprod_gradients):
    the gradient through the products differs from it where an infinity or NaN meets the other factors.
    ``dtype`` casts first, as torch does."""
    if not symbolic_helper._is_none(dtype):
        x = g.op("Cast", x, to_i=_type_utils.JitScalarType(symbolic_helper._get_const(dtype, "i", "dtype")).onnx_type())
    elif _type_utils.JitScalarType.from_value(x) in _INTEGRAL_TYPES:
        x = g.op("Cast", x, to_i=onnx.TensorProto.INT64)
    rank = symbolic_helper._get_tensor_rank(x)
    if not rank:  # a 0-d tensor is its own product
        return g.op("Identity", x)
    axis = dim % rank
    length = symbolic_helper._get_tensor_dim_size(x, axis)
    if length is None:
        raise ValueError(f"torch.cumprod in module '{_module_scope(g)}' along dimension {dim}, whose size changes with "
                         "the batch: orttrainer writes it for a fixed size; cumulate along a dimension of fixed size, "
                         "or pad that dimension to one size")  # fmt: skip
    if not symbolic_helper._is_fp(x):
        return rewrites.inclusive_scan(_ExportGraph(g), x, axis, rank, length, "Mul", np.int64)
    wide = g.op("Cast", x, to_i=onnx.TensorProto.DOUBLE)
    products = rewrites.inclusive_scan(_ExportGraph(g), wide, axis, rank, length, "Mul", np.float64)
    elem = _type_utils.JitScalarType.from_value(x)
    marked = g.op(f"{DOMAIN}::CumProd", products, to_i=elem.onnx_type(), axis_i=axis, rank_i=rank, length_i=length)
    marked.setType(x.type().with_dtype(elem.dtype()))
    return marked


def dot(g, x, y):
    """torch.dot and torch.vdot of real vectors (spectral_norm's sigma): the sum of their products. torch's exporter
    has no form for vdot and writes dot as a MatMul of two vectors, whose gradient onnxruntime-training cannot
    build. ONNX holds no complex tensors, whose first factor vdot conjugates."""
    return g.op("ReduceSum", g.op("Mul", x, y), _ExportGraph(g).const([0], np.int64), keepdims_i=0)


def mv(g, matrix, vector):
    """torch.mv as a MatMul of the matrix and the vector as one column: onnxruntime-training cannot build the
    gradient of a MatMul of a matrix and a vector (spectral_norm's power iteration and sigma)."""
    build = _ExportGraph(g)
    column = g.op("Unsqueeze", vector, build.const([1], np.int64))
    return g.op("Squeeze", g.op("MatMul", matrix, column), build.const([1], np.int64))


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


_FLOATING_TYPES = {_type_utils.JitScalarType.FLOAT, _type_utils.JitScalarType.DOUBLE}


@symbolic_helper.parse_args("v", "i", "f", "f")
def histc(g, x, bins, low, high):
    """torch.histc, which the exporter has not (transformers' mixture-of-experts load-balancing loss counts each
    expert's tokens with it): how many values of x fall in each of ``bins`` equal bins over [low, high], binned as
    torch's CPU kernel bins them, in x's type: v in bin int((v - low) * bins / (high - low)), ``high`` in the last,
    NaN and values outside the range in none. The counts have no gradient, as torch's."""
    scope, scalar_type = _module_scope(g), _type_utils.JitScalarType.from_value(x)
    if low == high:
        raise ValueError(f"torch.histc in module '{scope}' with min == max ({low:g}) takes its range from the batch's "
                         "values; pass the range as min and max")  # fmt: skip
    if scalar_type not in _FLOATING_TYPES:
        raise ValueError(f"torch.histc in module '{scope}' of a {scalar_type.dtype()} "
                         "tensor: the trainer exports it for float32 and float64 only (torch bins half-precision values "
                         "in its own rounding); count in float32")  # fmt: skip
    build, dtype = _ExportGraph(g), _dtype(x)
    flat = g.op("Reshape", x, build.const([-1], np.int64))
    left, right = (torch.tensor(bound, dtype=dtype) for bound in (low, high))
    inside = g.op("And", g.op("GreaterOrEqual", flat, build.const(left, dtype)),
                  g.op("LessOrEqual", flat, build.const(right, dtype)))  # fmt: skip
    within = g.op("Where", inside, flat, build.const(left, dtype))  # no infinity or NaN reaches the cast
    scaled = g.op("Mul", g.op("Sub", within, build.const(left, dtype)), build.const(bins, dtype))
    position = g.op("Cast", g.op("Div", scaled, build.const(right - left, dtype)), to_i=onnx.TensorProto.INT64)
    last = build.const(bins - 1, np.int64)
    position = g.op("Where", g.op("Greater", position, last), last, position)  # ``high`` itself
    hits = g.op("Equal", build.unsqueeze(position, [1]), build.const(np.arange(bins), np.int64))
    counted = g.op("Cast", g.op("And", hits, build.unsqueeze(inside, [1])), to_i=scalar_type.onnx_type())
    return build.reduce("ReduceSum", counted, [0], keepdims=0)


SYMBOLICS = {
    "linalg_vector_norm": linalg_vector_norm,
    "histc": histc,
    "var": var,
    "var_mean": var_mean,
    "std": std,
    "std_mean": std_mean,
    "cdist": cdist,
    "sort": sort,
    "argsort": argsort,
    "topk": topk,
    "diff": diff,
    "cumsum": cumsum,
    "cumprod": cumprod,
    "dot": dot,
    "vdot": dot,
    "mv": mv,
    "pairwise_distance": pairwise_distance,
    "cosine_similarity": cosine_similarity,
    "max": _extreme("ReduceMax", symbolic_helper._max_helper),
    "min": _extreme("ReduceMin", symbolic_helper._min_helper),
    "argmax": _arg_extreme("ReduceMax"),
    "argmin": _arg_extreme("ReduceMin"),
    "sum": _whole_tensor("sum", _whole_sum),
    "mean": _whole_tensor("mean", _whole_mean),
}
