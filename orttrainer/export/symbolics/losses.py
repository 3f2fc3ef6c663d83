"""Losses: torch's formulas for their values and gradients, also where the exporter's overflowed or divided by zero
(binary cross-entropy, cross-entropy with label smoothing and ignored labels, L1/Huber, margin and embedding losses);
the CTC loss as one node that torch's kernel runs (torch_ctc.py)."""

import numpy as np
import onnx
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import _type_utils

from ...graph import rewrites
from ...graph.nodes_for_torch import ATEN_DOMAIN, CTC_LOSS
from ._graph import _constant, _dtype, _ExportGraph, _module_scope, _reduce
from .elementwise import _clamp_min, detach
from .reductions import pairwise_distance


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
def mse_loss(g, x, target, reduction):
    """(x - target)^2 as torch's exporter writes it, reduced as torch reduces it (_reduce): torch's symbolic takes
    the mean with ReduceMean, whose gradient ONNX Runtime refuses for no elements (a scale of 1 / 0)."""
    difference = g.op("Sub", x, target)
    return _reduce(g, g.op("Mul", difference, difference), reduction)


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
    """torch's exp(x) - t x (``log_input``) or x - t log(x + eps); with ``full`` plus its Stirling term
    t log(t) - t + log(2 pi t) / 2 where t > 1 (0 elsewhere), in torch's order of operations."""
    if log_input:
        loss = g.op("Sub", g.op("Exp", x), g.op("Mul", target, x))
    else:
        loss = g.op("Sub", x, g.op("Mul", target, g.op("Log", g.op("Add", x, _constant(g, eps)))))
    if full:
        build = _ExportGraph(g)
        entropy = build.op("Sub", [build.op("Mul", [target, build.op("Log", [target])]), target])
        normalizer = build.op("Mul", [build.const(0.5), build.op("Log", [build.op("Mul", [build.const(2 * np.pi), target])])])
        stirling = build.op("Add", [entropy, normalizer])
        loss = build.op("Add", [loss, rewrites.where(build, build.op("LessOrEqual", [target, build.const(1.0)]), 0.0, stirling)])
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
        target = g.op("Where", ignored, build.const(_TARGET_IGNORED_AT_RUN_TIME, _dtype(target)), target)
        ignore_index = _TARGET_IGNORED_AT_RUN_TIME
    weighted = not symbolic_helper._is_none(weight)
    sizes, rank = symbolic_helper._get_tensor_sizes(scores), symbolic_helper._get_tensor_rank(scores)
    probabilities = target.type().scalarType() in ("Float", "Double", "Half", "BFloat16")
    class_weights = None  # along dim 1, for torch's formulas
    classes = _class_count(g, scores, sizes) if probabilities or label_smoothing else None
    if (probabilities or label_smoothing) and weighted:
        if rank is None:
            raise ValueError(f"cross_entropy with class weights and {'class probabilities' if probabilities else 'label_smoothing'} "
                             f"in module '{_module_scope(g)}': orttrainer exports it for scores of a known rank")  # fmt: skip
        class_weights = symbolic_helper._unsqueeze_helper(g, weight, list(range(1, rank - 1)))
    if probabilities:
        return _cross_entropy_of_probabilities(g, scores, target, class_weights, reduction_name, label_smoothing, classes)
    if not label_smoothing:
        return _loss_over_targets(g, "SoftmaxCrossEntropyLoss", scores, target, weight, reduction_name, ignore_index)
    ignored = _ignored(g, target, ignore_index)
    kept = _kept_weight(g, target, weight, ignored) if reduction_name == "mean" else None  # both terms' divisor
    nll = _loss_over_targets(g, "SoftmaxCrossEntropyLoss", scores, target, weight, reduction_name, ignore_index, kept)
    build = _ExportGraph(g)
    log_probabilities = g.op("LogSoftmax", scores, axis_i=1)
    if weighted:
        log_probabilities = g.op("Mul", log_probabilities, class_weights)
    smooth = g.op("Neg", symbolic_helper._reducesum_helper(g, log_probabilities, axes_i=[1], keepdims_i=0))
    smooth = rewrites.where(build, ignored, 0.0, smooth)
    if reduction_name != "none":
        smooth = symbolic_helper._reducesum_helper(g, smooth, keepdims_i=0)
    if reduction_name == "mean":
        smooth = g.op("Div", smooth, kept)
    # torch's scalars, computed in double and applied in float32
    return g.op("Add", g.op("Mul", nll, _constant(g, 1.0 - label_smoothing)),
                g.op("Mul", smooth, _over_classes(g, label_smoothing, classes)))  # fmt: skip


@symbolic_helper.parse_args("v", "v", "v", "i", "i")
def nll_loss(g, log_probabilities, target, weight, reduction, ignore_index):
    """torch's nll_loss (also over extra dimensions): NegativeLogLikelihoodLoss, a mean as torch's (``_loss_over_targets``)."""
    reduction_name = ("none", "mean", "sum")[reduction]
    return _loss_over_targets(g, "NegativeLogLikelihoodLoss", log_probabilities, target, weight, reduction_name, ignore_index)


def _loss_over_targets(g, op_type, scores, target, weight, reduction_name, ignore_index, kept=None):
    """ONNX's ``op_type`` loss of class-index targets, a "mean" taken as torch takes it: the sum divided by the
    weights of the targets kept (``kept``, or ``_kept_weight``: their count without class weights). When they sum to 0
    (every target ignored, or only targets of weight 0) torch's loss is 0 / 0 = NaN, and the gradient of targets of
    weight 0 NaN too; ONNX Runtime's own mean gave 0 and a gradient of 0 there."""
    weights = [] if symbolic_helper._is_none(weight) else [weight]
    summed = "sum" if reduction_name == "mean" else reduction_name
    loss = g.op(op_type, scores, target, *weights, reduction_s=summed, ignore_index_i=ignore_index)
    if reduction_name != "mean":
        return loss
    if kept is None:
        kept = _kept_weight(g, target, weight, _ignored(g, target, ignore_index))
    return g.op("Div", loss, kept)


def _ignored(g, target, ignore_index):
    """Where ``target`` is ``ignore_index``."""
    return g.op("Equal", target, _ExportGraph(g).const(ignore_index, _dtype(target)))


def _kept_weight(g, target, weight, ignored):
    """The sum over targets not ``ignored`` (``_ignored``) of their class weights (their count without class weights)."""
    build = _ExportGraph(g)
    kept = rewrites.where(build, ignored, 0.0, 1.0)
    if not symbolic_helper._is_none(weight):
        kept = g.op("Mul", kept, g.op("Gather", weight, rewrites.where(build, ignored, build.const(0, _dtype(target)), target)))
    return symbolic_helper._reducesum_helper(g, kept, keepdims_i=0)


def _class_count(g, scores, sizes):
    """The number of classes (dim 1 of ``scores``): a Python number where the trace knows it, else a float64 value
    computed in the run (scores reshaped to (-1, classes) under dynamic batch axes)."""
    if sizes and len(sizes) >= 2 and sizes[1] is not None:
        return sizes[1]
    dim = g.op("Gather", g.op("Shape", scores), g.op("Constant", value_t=torch.tensor(1, dtype=torch.int64)))
    return g.op("Cast", dim, to_i=_type_utils.JitScalarType.DOUBLE.onnx_type())


def _over_classes(g, value: float, classes):
    """``value / classes`` computed in double, as a float32 scalar: torch's formulas divide so."""
    if isinstance(classes, int):
        return _constant(g, value / classes)
    quotient = g.op("Div", g.op("Constant", value_t=torch.tensor(value, dtype=torch.float64)), classes)
    return g.op("Cast", quotient, to_i=_type_utils.JitScalarType.FLOAT.onnx_type())


def _cross_entropy_of_probabilities(g, scores, target, class_weights, reduction_name, label_smoothing, classes):
    """torch's cross_entropy_loss_prob_target: -sum over classes of log_softmax * target (* weights), the
    target first smoothed to target * (1 - e) + e / classes; a mean divides by the number of samples
    (elements over classes), whatever the weights. ``classes``: ``_class_count``."""
    if label_smoothing:
        target = g.op("Add", g.op("Mul", target, _constant(g, 1.0 - label_smoothing)), _over_classes(g, label_smoothing, classes))
    products = g.op("Mul", g.op("LogSoftmax", scores, axis_i=1), target)
    if class_weights is not None:
        products = g.op("Mul", products, class_weights)
    if reduction_name == "none":
        return g.op("Neg", symbolic_helper._reducesum_helper(g, products, axes_i=[1], keepdims_i=0))
    total = g.op("Neg", symbolic_helper._reducesum_helper(g, products, keepdims_i=0))
    if reduction_name == "sum":
        return total
    if isinstance(classes, int):
        samples = g.op("Div", g.op("Cast", g.op("Size", scores), to_i=1), _constant(g, float(classes)))  # 1: float32
    else:  # 11: double
        samples = g.op("Cast", g.op("Div", g.op("Cast", g.op("Size", scores), to_i=11), classes), to_i=1)
    return g.op("Div", total, samples)


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


def _lengths(g, lengths):
    """A CTC loss's input or target lengths as a tensor: as given, or a list of Python numbers (``ctc_loss``'s
    IntList overload) as a constant, or one of traced sizes as their concatenation."""
    if symbolic_helper._is_tensor(lengths):
        return lengths
    listed = symbolic_helper._maybe_get_const(lengths, "is")
    if not symbolic_helper._is_value(listed):
        return g.op("Constant", value_t=torch.tensor(listed, dtype=torch.int64))
    sizes = [symbolic_helper._unsqueeze_helper(g, size, [0]) for size in symbolic_helper._unpack_list(lengths)]
    return g.op("Concat", *sizes, axis_i=0)


@symbolic_helper.parse_args("v", "v", "v", "v", "i", "i", "b")
def ctc_loss(g, log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    """One ATen node (operator ``CTC_LOSS``) whose inputs are ``torch.ctc_loss``'s arguments, blank,
    reduction and zero_infinity as constant scalars: torch's kernel computes it (torch_ctc.py). The loss has
    log_probs' type: a scalar, or with ``reduction`` none one value per sequence (none for unbatched log_probs)."""
    build = _ExportGraph(g)
    scalars = [build.const(blank, np.int64), build.const(reduction, np.int64), build.const(zero_infinity, np.bool_)]
    loss = g.op(f"{ATEN_DOMAIN}::ATen", log_probs, targets, _lengths(g, input_lengths), _lengths(g, target_lengths), *scalars,
                operator_s=CTC_LOSS)  # fmt: skip
    rank = symbolic_helper._get_tensor_rank(log_probs)
    if reduction == 0 and rank is None:
        raise ValueError(f"ctc_loss with reduction='none' in module '{_module_scope(g)}': orttrainer exports it for "
                         "log_probs of a known rank")  # fmt: skip
    loss.setType(log_probs.type().with_sizes([None] * (rank - 2 if reduction == 0 else 0)))
    return loss


SYMBOLICS = {
    "mse_loss": mse_loss,
    "l1_loss": l1_loss,
    "smooth_l1_loss": smooth_l1_loss,
    "huber_loss": huber_loss,
    "binary_cross_entropy": binary_cross_entropy,
    "binary_cross_entropy_with_logits": binary_cross_entropy_with_logits,
    "soft_margin_loss": soft_margin_loss,
    "poisson_nll_loss": poisson_nll_loss,
    "hinge_embedding_loss": hinge_embedding_loss,
    "triplet_margin_loss": triplet_margin_loss,
    "margin_ranking_loss": margin_ranking_loss,
    "cosine_embedding_loss": cosine_embedding_loss,
    "cross_entropy_loss": cross_entropy_loss,
    "nll_loss": nll_loss,
    "nll_loss2d": nll_loss,
    "nll_loss_nd": nll_loss,
    "ctc_loss": ctc_loss,
}
