"""ONNX symbolics for torch ops the TorchScript exporter cannot export at our opsets.

``register()`` adds them to torch's exporter once (only for ops it has no symbolic for),
so models using these losses and layers export without any change to user code. Each is
written with ops that onnxruntime-training can differentiate, and matches torch's value
and gradient (tests/test_rewrites.py).
"""

import contextlib

import torch
from torch.onnx import symbolic_helper

from .options import MIN_OPSET

_REDUCTIONS = {0: None, 1: "ReduceMean", 2: "ReduceSum"}


def _constant(g, value):
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.float32))


def _reduce(g, loss, reduction):
    """torch's reduction enum: 0 none, 1 mean, 2 sum (over every element)."""
    op = _REDUCTIONS[reduction]
    return loss if op is None else g.op(op, loss, keepdims_i=0)


def _relu(g, x):
    return g.op("Relu", x)


def _abs_difference(g, x, target):
    return g.op("Abs", g.op("Sub", x, target))


def _softplus(g, x):
    """log(1 + exp(x)), stable for large |x|."""
    tail = g.op("Log", g.op("Add", g.op("Exp", g.op("Neg", g.op("Abs", x))), _constant(g, 1.0)))
    return g.op("Add", _relu(g, x), tail)


@symbolic_helper.parse_args("v", "v", "i")
def l1_loss(g, x, target, reduction):
    return _reduce(g, _abs_difference(g, x, target), reduction)


def _quadratic_then_linear(g, distance, knee):
    """0.5 m^2 + knee * (d - m) with m = min(d, knee): the Huber curve, smooth at the knee."""
    clipped = g.op("Sub", distance, _relu(g, g.op("Sub", distance, _constant(g, knee))))
    quadratic = g.op("Mul", g.op("Mul", clipped, clipped), _constant(g, 0.5))
    return g.op("Add", quadratic, g.op("Mul", g.op("Sub", distance, clipped), _constant(g, knee)))


@symbolic_helper.parse_args("v", "v", "i", "f")
def smooth_l1_loss(g, x, target, reduction, beta):
    distance = _abs_difference(g, x, target)
    if beta == 0:
        return _reduce(g, distance, reduction)
    return _reduce(g, g.op("Div", _quadratic_then_linear(g, distance, beta), _constant(g, beta)), reduction)


@symbolic_helper.parse_args("v", "v", "i", "f")
def huber_loss(g, x, target, reduction, delta):
    return _reduce(g, _quadratic_then_linear(g, _abs_difference(g, x, target), delta), reduction)


def _clamped_log(g, x):
    """log(x) clamped below at -100, as torch's binary_cross_entropy does."""
    return g.op("Sub", _relu(g, g.op("Add", g.op("Log", x), _constant(g, 100.0))), _constant(g, 100.0))


@symbolic_helper.parse_args("v", "v", "v", "i")
def binary_cross_entropy(g, probability, target, weight, reduction):
    one = _constant(g, 1.0)
    positive = g.op("Mul", target, _clamped_log(g, probability))
    negative = g.op("Mul", g.op("Sub", one, target), _clamped_log(g, g.op("Sub", one, probability)))
    loss = g.op("Neg", g.op("Add", positive, negative))
    if not symbolic_helper._is_none(weight):
        loss = g.op("Mul", loss, weight)
    return _reduce(g, loss, reduction)


@symbolic_helper.parse_args("v", "v", "i")
def soft_margin_loss(g, x, target, reduction):
    return _reduce(g, _softplus(g, g.op("Neg", g.op("Mul", target, x))), reduction)


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
    """target == 1: x; target == -1: max(0, margin - x) (torch's rule for other values too)."""
    one = _constant(g, 1.0)
    not_positive = g.op("Sub", one, g.op("Cast", g.op("Equal", target, one), to_i=1))
    not_negative = g.op("Sub", one, g.op("Cast", g.op("Equal", target, _constant(g, -1.0)), to_i=1))
    margin_part = g.op("Mul", not_positive, _relu(g, g.op("Sub", _constant(g, margin), x)))
    return _reduce(g, g.op("Add", margin_part, g.op("Mul", not_negative, x)), reduction)


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


def _unary(onnx_op):
    """aten op -> the ONNX op of the same meaning (rewrites.py makes it trainable)."""

    @symbolic_helper.parse_args("v")
    def symbolic(g, x):
        return g.op(onnx_op, x)

    return symbolic


DOMAIN = "orttrainer"  # custom-domain marker nodes export.py removes right after export


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


_SYMBOLICS = {
    "embedding": embedding,
    "sinh": _unary("Sinh"),
    "cosh": _unary("Cosh"),
    "asinh": _unary("Asinh"),
    "acosh": _unary("Acosh"),
    "atanh": _unary("Atanh"),
    "l1_loss": l1_loss,
    "smooth_l1_loss": smooth_l1_loss,
    "huber_loss": huber_loss,
    "binary_cross_entropy": binary_cross_entropy,
    "soft_margin_loss": soft_margin_loss,
    "poisson_nll_loss": poisson_nll_loss,
    "hinge_embedding_loss": hinge_embedding_loss,
    "bilinear": bilinear,
}


@contextlib.contextmanager
def exporting():
    """orttrainer's symbolics registered with torch's TorchScript exporter for one export, then removed."""
    for name, function in _SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(f"aten::{name}", function, MIN_OPSET)
    try:
        yield
    finally:
        for name in _SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(f"aten::{name}", MIN_OPSET)
