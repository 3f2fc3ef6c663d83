"""Layers: normalisations (batch, layer, RMS), scaled dot-product attention, paddings, adaptive average pooling,
feature dropout, bilinear, baddbmm."""

import numpy as np
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import (_type_utils, symbolic_opset9, symbolic_opset11,
                                                       symbolic_opset14, symbolic_opset17)

from ._graph import _constant, _dtype, _ExportGraph, _module_scope


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


@symbolic_helper.parse_args("v", "is", "v", "v")
def rms_norm(g, x, normalized_shape, weight, eps):
    """torch's rms_norm (nn.RMSNorm), which the exporter refuses: x * rsqrt(mean(x * x) + eps) * weight
    over the last ``len(normalized_shape)`` dimensions, eps the dtype's machine epsilon when None, as
    torch's CPU composite computes it (x * rsqrt as x / sqrt: ONNX has no Rsqrt)."""
    build, dtype = _ExportGraph(g), _dtype(x)
    eps = torch.finfo(dtype).eps if symbolic_helper._is_none(eps) else symbolic_helper._get_const(eps, "f", "eps")
    axes = list(range(-len(normalized_shape), 0))
    mean_square = build.reduce("ReduceMean", build.op("Mul", [x, x]), axes, 1)
    root = build.op("Sqrt", [build.op("Add", [mean_square, build.const(eps, dtype)])])
    normalized = build.op("Div", [x, root])
    return normalized if symbolic_helper._is_none(weight) else build.op("Mul", [normalized, weight])


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


def batch_norm(g, x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """torch's batch_norm; without running statistics (``track_running_stats=False``), which torch's
    symbolic exports only for a static batch size, as a BatchNormalization in training mode on
    placeholder statistics: it normalizes by the batch's statistics, as torch does in training and
    in eval (eval_graph.set_inference_mode keeps such a node in training mode)."""
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
    ones = g.op("ConstantOfShape", per_channel, value_t=torch.ones(1, dtype=_dtype(x)))
    mask = g.op("Dropout", ones, _constant(g, p), g.op("Constant", value_t=torch.tensor(True)))
    return g.op("Mul", x, mask)


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
    build, dtype = _ExportGraph(g), _dtype(query)
    # [..., queries, 1]: whether a query's every key is masked
    no_key = g.op("Equal", build.reduce("ReduceMax", attn_mask, [-1], 1), build.const(-np.inf, _dtype(attn_mask)))
    safe_mask = g.op("Where", no_key, build.const(0.0, _dtype(attn_mask)), attn_mask)
    attended = torch_symbolic(g, query, key, value, safe_mask, dropout_p, is_causal, scale, enable_gqa)
    return g.op("Where", no_key, build.const(0.0, dtype), attended)


def baddbmm(g, x, batch1, batch2, beta, alpha):
    """torch's symbolic, except with beta = 0, where torch ignores ``x``: NaN and inf in it do not reach the result."""
    if symbolic_helper._maybe_get_const(beta, "f") != 0:
        return symbolic_opset9.baddbmm(g, x, batch1, batch2, beta, alpha)
    scalar_type = _type_utils.JitScalarType.from_value(x)
    product = g.op("MatMul", batch1, batch2)
    return g.op("Mul", product, g.op("Cast", alpha, to_i=scalar_type.onnx_type()))


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


SYMBOLICS = {
    "baddbmm": baddbmm,
    "layer_norm": layer_norm,
    "batch_norm": batch_norm,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "constant_pad_nd": constant_pad_nd,
    "pad": pad,
    **{f"reflection_pad{dims}d": _padding("reflect") for dims in (1, 2, 3)},
    **{f"replication_pad{dims}d": _padding("edge") for dims in (1, 2, 3)},
    "rms_norm": rms_norm,
    "feature_dropout": feature_dropout,
    **{f"adaptive_avg_pool{dims}d": _adaptive_average_pool(dims) for dims in (1, 2, 3)},
    "bilinear": bilinear,
}
