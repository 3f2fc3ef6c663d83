"""Replace onnxruntime-training CPU kernels in a training graph: slow ones by fast equivalents,
and ones that round differently from torch's by exact ones.

Some kernels of onnxruntime-training 1.19 are scalar, single-threaded loops on the CPU,
several times slower than the same arithmetic spelled with ONNX Runtime's vectorised
elementwise ops (measured in benchmarks/NOTES.md): the softmax cross-entropy loss and its
gradient, the GELU (erf and tanh forms), ReLU, max-pool and layer-norm gradients, and the scatter
of a constant-index Gather's gradient. Each function below emits,
through a :class:`~orttrainer.graph.rewrites._building.NodeBuilder`, the same values with fast ops; values and
gradients are checked against the originals in tests/test_cpu_kernels.py and against torch,
also at boundary values (-inf logits, ignored labels, NaN), in tests/test_boundary_values.py.
Before the gradient is built, ``pool_before_relu`` also moves ReLUs behind the max pools they feed,
so that they and their gradients work on pooled tensors. Only CPU float32 training graphs
are rewritten: other providers have fast kernels of their own.

``use_exact_cpu_kernels`` (also CPU float32 graphs) replaces kernels whose values differ from
torch's beyond rounding (docs/stack_facts.md, "Kernels that differ from torch"): the Sigmoid, the
QuickGelu a SiLU is fused into and its gradient (the same approximate sigmoid), and the Sqrt at +inf.
``centered_layer_norms`` (every CPU graph) keeps the LayerNormalization kernel but feeds it rows whose
mean is 0, where its variance formula is accurate.
"""

import math
from collections import defaultdict

import numpy as np
import onnx
from onnx import numpy_helper

from .rewrites import GraphFacts, NodeBuilder, node_attribute, node_attributes, opset, replace_nodes, shapes_in, static_shapes


def _like(build: NodeBuilder, value: float, tensor: str) -> str:
    """A scalar constant with the element type of ``tensor``."""
    return build.op("CastLike", [build.const(value), tensor])


def _label_positions(build: NodeBuilder, labels: str):
    """(class indices unsqueezed at axis 1, bool mask of counted labels or None).

    Labels equal to ``ignore_index`` count for nothing; they are pointed at class 0 so
    that the gather stays in range, and a Where drops what it picks up (a multiplication
    by 0 turned a -inf log-probability of class 0, a masked logit, into NaN).
    """
    labels = build.op("Cast", [labels], to=onnx.TensorProto.INT64)
    ignore_index = build.attribute("ignore_index")
    if ignore_index is None:
        return build.unsqueeze(labels, [1]), None
    counted = build.op("Not", [build.op("Equal", [labels, build.const(ignore_index, np.int64)])])
    safe = build.op("Where", [counted, labels, build.const(0, np.int64)])
    return build.unsqueeze(safe, [1]), counted


def _counted_only(build: NodeBuilder, values: str, counted) -> str:
    """``values`` where the label counts, 0 where it is ignored (``counted`` None: all count)."""
    return values if counted is None else build.op("Where", [counted, values, _like(build, 0.0, values)])


def _label_count(build: NodeBuilder, labels: str, counted, like: str) -> str:
    """How many labels a "mean" reduction divides by."""
    if counted is not None:
        return build.reduce("ReduceSum", build.op("CastLike", [counted, like]), None, 0)
    return build.op("CastLike", [build.op("Size", [labels]), like])


def softmax_cross_entropy_loss(build: NodeBuilder):
    """SoftmaxCrossEntropyLoss as LogSoftmax + GatherElements (no class weights)."""
    if len(build.node.input) > 2 and build.node.input[2]:
        return False
    logits, labels = build.node.input[:2]
    outputs = list(build.node.output)
    log_prob = build.op("LogSoftmax", [logits], outputs[1] if len(outputs) > 1 and outputs[1] else None, axis=1)
    indices, counted = _label_positions(build, labels)
    picked = _counted_only(build, build.squeeze(build.op("GatherElements", [log_prob, indices], axis=1), [1]), counted)
    reduction = build.attribute("reduction", "mean")
    if reduction != "none":
        picked = build.reduce("ReduceSum", picked, None, 0)
    if reduction == "mean":
        picked = build.op("Div", [picked, _label_count(build, labels, counted, log_prob)])
    build.op("Neg", [picked], outputs[0])
    return True


def softmax_cross_entropy_loss_grad(build: NodeBuilder):
    """d logits = (softmax - one_hot(label)) * d loss, per counted label (no class weights).

    The softmax is exp(log_prob); the one-hot subtraction is a scatter of one value per
    label instead of a dense [N, C] one-hot tensor. Ignored labels get 0, also when every
    label is ignored and "mean" divides by a count of 0 (torch's gradient is 0 there).
    Known difference: an ignored row whose log-probabilities are NaN (all its logits -inf,
    or one NaN) gets NaN, not torch's 0, since exp(NaN) * 0 = NaN; a Where over [N, C] to
    drop it doubled this kernel's time (31 -> 70 ms at 2048 x 8192; ONNX Runtime's own: 99).
    """
    if any(build.node.input[3:]):
        return False
    loss_grad, log_prob, labels = build.node.input[:3]
    indices, counted = _label_positions(build, labels)
    reduction = build.attribute("reduction", "mean")
    scale = build.op("CastLike", [loss_grad, log_prob])
    if reduction == "mean":
        scale = build.op("Div", [scale, _label_count(build, labels, counted, log_prob)])
    if counted is not None:
        scale = build.op("Where", [counted, scale, _like(build, 0.0, scale)])
    if counted is not None or reduction == "none":  # one scale per label, broadcast over classes
        scale = build.unsqueeze(scale, [1])
    scaled = build.op("Mul", [build.op("Exp", [log_prob]), scale])
    at_labels = build.op("Sub", [build.op("GatherElements", [scaled, indices], axis=1), scale])
    build.op("ScatterElements", [scaled, indices, at_labels], build.node.output[0], axis=1)
    return True


def _gelu_input(build: NodeBuilder) -> str:
    """The GELU's input: x, plus the bias of the Bias* variants."""
    x = build.node.input[1]
    return build.op("Add", [x, build.node.input[2]]) if len(build.node.input) > 2 and build.node.input[2] else x


def gelu_grad(build: NodeBuilder):
    """GeluGrad / BiasGeluGrad_dX: dy * (Phi(x) + x * phi(x)) for x = input (+ bias).

    Spelled as dy * 0.5 * (1 + erf(x / sqrt 2) + x * exp(log(2 / sqrt(2 pi)) - x^2 / 2)).
    """
    dy, x = build.node.input[0], _gelu_input(build)
    scaled = build.op("Mul", [x, _like(build, 1 / math.sqrt(2), x)])
    erf = build.op("Erf", [scaled])
    exponent = build.op("Sub", [_like(build, math.log(2 / math.sqrt(2 * math.pi)), x), build.op("Mul", [scaled, scaled])])
    twice_derivative = build.op("Sum", [erf, build.op("Mul", [x, build.op("Exp", [exponent])]), _like(build, 1.0, x)])
    build.op("Mul", [build.op("Mul", [dy, twice_derivative]), _like(build, 0.5, x)], build.node.output[0])


def tanh_gelu_grad(build: NodeBuilder):
    """FastGeluGrad / BiasFastGeluGrad_dX, the gradient of GELU's tanh approximation
    0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3), c = sqrt(2 / pi), for x = input (+ bias):
    dy * ((1 + tanh u) / 2 + x (1 - tanh^2 u) / 2 * c (1 + 3 * 0.044715 x^2)), as torch's
    gelu_backward(approximate="tanh") and autograd through the composed formula compute it.

    With s+ = (1 + tanh u) / 2 = 1 / (1 + exp(-2u)) and s- = (1 - tanh u) / 2 = 1 / (1 + exp(2u)),
    that is dy * (s+ + s+ s- x 2c (1 + 3 * 0.044715 x^2)): ONNX Runtime's Exp is accurate to an
    ulp, its Tanh and Sigmoid are not (4 ulps of 1 near saturation, 7e-6 off in the gradient).
    Where x^2 overflows (|x| > 1.8e19) and at ±inf the result is NaN (0 * inf), as in torch's
    float32 kernels; float64 gives 1 and 0 there.
    """
    dy, x = build.node.input[0], _gelu_input(build)
    c, kappa = math.sqrt(2 / math.pi), 0.044715
    square = build.op("Mul", [x, x])

    def polynomial(constant, quadratic):  # constant + quadratic x^2
        return build.op("Add", [build.op("Mul", [square, _like(build, quadratic, x)]), _like(build, constant, x)])

    def logistic(value):  # 1 / (1 + exp(-value))
        return build.op("Reciprocal", [build.op("Add", [build.op("Exp", [value]), _like(build, 1.0, x)])])

    twice_u = build.op("Mul", [x, polynomial(2 * c, 2 * c * kappa)])
    plus, minus = logistic(build.op("Neg", [twice_u])), logistic(twice_u)
    # (s+ s-) x first: 0 where a tail saturates, also for the large |x| whose slope is finite
    tail = build.op("Mul", [build.op("Mul", [build.op("Mul", [plus, minus]), x]), polynomial(2 * c, 6 * c * kappa)])
    build.op("Mul", [dy, build.op("Add", [plus, tail])], build.node.output[0])


def relu_grad(build: NodeBuilder):
    """ReluGrad: dy * (x > 0 or x is NaN), torch's threshold_backward (dy where not x <= 0)
    for finite dy; ReluGrad gave 0 at x = NaN.

    Known difference: an inf or NaN dy where x <= 0 gives NaN (inf * 0), torch and
    ReluGrad 0; such a dy means the step overflowed already. A Where instead of the
    multiplication made this kernel 2.3x slower (129 vs 56 ms on 4096 x 4096; ReluGrad: 88).
    The 0/1 mask comes from a Where between two scalars: ONNX Runtime's bool Not and bool-to-float
    Cast are scalar loops, 5x slower for the same mask (benchmarks/NOTES.md §18).
    """
    dy, x = build.node.input[:2]
    inactive = build.op("LessOrEqual", [x, _like(build, 0.0, x)])
    active = build.op("Where", [inactive, _like(build, 0.0, dy), _like(build, 1.0, dy)])
    build.op("Mul", [dy, active], build.node.output[0])


def max_pool_grad(build: NodeBuilder):
    """MaxPoolGrad as a scatter-add of dy at the pooled indices into zeros shaped like x.

    The indices of ONNX Runtime's MaxPool are flat over the whole input tensor; the add
    makes overlapping windows sum as MaxPoolGrad does. Needs opset 16 (scatter reduction)
    and the forward MaxPool in the graph for the input's shape.
    """
    dy, indices = build.node.input[:2]
    pool = build.facts.producers.get(indices)
    if build.opset < 16 or pool is None or pool.op_type != "MaxPool":
        return False
    shape = build.op("Shape", [pool.input[0]])
    flat = build.const([-1], np.int64)
    zeros = build.op("Reshape", [build.op("CastLike", [build.op("ConstantOfShape", [shape]), dy]), flat])
    flat_indices, flat_dy = build.op("Reshape", [indices, flat]), build.op("Reshape", [dy, flat])
    scattered = build.op("ScatterElements", [zeros, flat_indices, flat_dy], axis=0, reduction="add")
    build.op("Reshape", [scattered, shape], build.node.output[0])
    return True


WIDE_LAYER_NORM = 512  # values per row from which layer_norm_grad's passes beat ONNX Runtime's kernel


def layer_norm_grad(build: NodeBuilder):
    """LayerNormalizationGrad (dy, x, scale, the forward's mean and inverse standard deviation)
    as torch's formula: with x^ = (x - mean) * inv_std and g = dy * scale,
    dx = inv_std * (g - mean(g) - x^ * mean(g * x^)) over the normalized axes,
    d scale = sum(dy * x^) and d bias = sum(dy) over the others (rows of the scale's shape).

    ONNX Runtime's kernel took 3.3 ms on [1024, 512] where these passes take 1.35 (torch's: 0.2),
    but as fast on rows of 256 and faster on narrower ones, where the passes' count costs more than
    the kernel (benchmarks/NOTES.md §33): rows of ``WIDE_LAYER_NORM`` values or more, whose scale's
    shape the graph declares. Needs a negative axis, as the exporter writes it.
    """
    dy, x, scale, mean, inverse_std = build.node.input[:5]
    axis, scale_shape = build.attribute("axis", -1), build.shapes.get(scale)
    if axis >= 0 or not scale_shape or None in scale_shape or math.prod(scale_shape) < WIDE_LAYER_NORM:
        return False
    normalized = list(range(axis, 0))
    normalized_x = build.op("Mul", [build.op("Sub", [x, mean]), inverse_std])
    gradient = build.op("Mul", [dy, scale])
    gradient_mean = build.reduce("ReduceMean", gradient, normalized, 1)
    projection = build.reduce("ReduceMean", build.op("Mul", [gradient, normalized_x]), normalized, 1)
    centered = build.op("Sub", [build.op("Sub", [gradient, gradient_mean]), build.op("Mul", [normalized_x, projection])])
    outputs = list(build.node.output) + [""] * 3
    build.op("Mul", [centered, inverse_std], outputs[0])
    rows = build.op("Concat", [build.const([-1], np.int64), build.op("Shape", [scale])], axis=0)

    def summed_over_rows(value, output):  # x's leading axes, however many (none: one row)
        return build.reduce("ReduceSum", build.op("Reshape", [value, rows]), [0], 0, output)

    if outputs[1]:
        summed_over_rows(build.op("Mul", [dy, normalized_x]), outputs[1])
    if outputs[2]:
        summed_over_rows(dy, outputs[2])
    return True


def _gathering_positions(indices: np.ndarray, length: int) -> np.ndarray:
    """[K, length] table: row k holds, for each position of the gathered axis, the k-th output
    position (ascending) that gathered it, or ``len(indices)`` (a zero slot) where fewer did."""
    positions = np.where(indices < 0, indices + length, indices)
    counts = np.bincount(positions, minlength=length)
    table = np.full((max(int(counts.max()), 1), length), len(indices), np.int64)
    order = np.argsort(positions, kind="stable")
    rank = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    table[rank, positions[order]] = order
    return table


def gather_grad(build: NodeBuilder):
    """GatherGrad of constant 1-d indices (the Gathers of bilinear interpolation and of padding,
    rewrites.py) as gathers: for each input position, the gradients of the K outputs that read it,
    each of K Gathers picking one of them (a zero slot where fewer read it), and their sum.

    GatherGrad scatters under a lock per element: 2.8 ms of the zoo's bilinear U-Net's 7.6 ms step,
    torch's upsample backward 0.2 (benchmarks/NOTES.md §37). The same terms are added (an inf or
    NaN reaches the same positions); their order may differ by an ulp, and a sum of -0 terms is -0
    where the scatter into zeros gave +0. Needs the gathered axis's static length.
    """
    shape, indices, dy = build.node.input[:3]
    if indices not in build.constants:
        return _scattered_gather_gradient(build)
    source = build.facts.producers.get(shape)
    whole_shape = source is not None and source.op_type == "Shape" and node_attributes(source).keys() <= {"start"}
    if not whole_shape or node_attribute(source, "start", 0) != 0:
        return False
    index = build.constants[indices]
    data_shape = build.shapes.get(source.input[0])
    if index.ndim != 1 or not index.size or not data_shape:
        return False
    axis = build.attribute("axis", 0) % len(data_shape)
    length = data_shape[axis]
    if not isinstance(length, int):
        return False
    table = _gathering_positions(index.astype(np.int64), length)
    if (table == len(index)).any():  # a zero slot after the outputs' gradients
        pads = [0] * (2 * len(data_shape))
        pads[len(data_shape) + axis] = 1
        dy = build.op("Pad", [dy, build.const(pads, np.int64)])
    if len(table) == 1:
        build.op("Gather", [dy, build.const(table[0], np.int64)], build.node.output[0], axis=axis)
    else:
        build.op("Sum", [build.op("Gather", [dy, build.const(row, np.int64)], axis=axis) for row in table], build.node.output[0])
    return True


def _scattered_gather_gradient(build: NodeBuilder):
    """GatherGrad of indices computed in the run (a mixture of experts' tokens, ``x[indices]``) as one ScatterElements
    adding dy into zeros, in float32 (ONNX Runtime has no float16 CPU kernel for it): the indices flattened to one axis
    and repeated along dy's other axes. GatherGrad scatters under a lock per element (9.4 of NLLB-MoE's ~36 ms
    profiled step, benchmarks/NOTES.md §41). The same terms are added, in index order."""
    shape, indices, dy = build.node.input[:3]
    source = build.facts.producers.get(shape)
    data_shape = build.shapes.get(source.input[0]) if source is not None and source.op_type == "Shape" else None
    if build.opset < 16 or not data_shape or len(build.shapes.get(indices) or [None, None]) != 1:
        return False
    rank = len(data_shape)  # dy's too: 1-d indices take the gathered axis's place
    axis = build.attribute("axis", 0) % rank
    along = build.op("Reshape", [indices, build.const([1] * axis + [-1] + [1] * (rank - axis - 1), np.int64)])
    spread = build.op("Expand", [along, build.op("Shape", [dy])])
    zeros = build.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
    wide = build.op("Cast", [dy], to=onnx.TensorProto.FLOAT)
    summed = build.op("ScatterElements", [zeros, spread, wide], axis=axis, reduction="add")
    build.op("CastLike", [summed, dy], build.node.output[0])
    return True


FAST_CPU_KERNELS = {
    "SoftmaxCrossEntropyLoss": softmax_cross_entropy_loss,
    "SoftmaxCrossEntropyLossGrad": softmax_cross_entropy_loss_grad,
    "GeluGrad": gelu_grad,
    "BiasGeluGrad_dX": gelu_grad,
    "FastGeluGrad": tanh_gelu_grad,
    "BiasFastGeluGrad_dX": tanh_gelu_grad,
    "ReluGrad": relu_grad,
    "MaxPoolGrad": max_pool_grad,
    "LayerNormalizationGrad": layer_norm_grad,
    "GatherGrad": gather_grad,
}


def _one_plus_exp_minus(build: NodeBuilder, z: str) -> str:
    """1 + exp(-z): torch's sigmoid is its reciprocal, its silu z over it."""
    return build.op("Add", [build.op("Exp", [build.op("Neg", [z])]), build.const(1.0)])


def exact_sigmoid(build: NodeBuilder):
    """Sigmoid as torch computes it, 1 / (1 + exp(-x)). ONNX Runtime's CPU kernel approximates it
    with an absolute, not relative, error: 0.8% off at x = -11.8, and it clamps near -17.5 (0 from
    about -20, where torch gives 2e-9), so log(sigmoid(x)) and a BCELoss on it differ by tens and
    their gradients vanish (docs/stack_facts.md). The gradient (SigmoidGrad) reads this output."""
    build.op("Reciprocal", [_one_plus_exp_minus(build, build.node.input[0])], build.node.output[0])


def exact_sqrt(build: NodeBuilder):
    """Sqrt with inf at +inf, as torch's. ONNX Runtime's CPU kernel returns NaN for +inf in its
    vectorised blocks of 4 and 8 values (inf only in the scalar tail), so an RMSNorm whose
    mean square overflows scales by NaN instead of 0 (docs/stack_facts.md). The gradient was
    built before this replacement and reads the output: 0.5 * dy / inf = 0, as in torch."""
    x = build.node.input[0]
    build.op("Where", [build.op("IsInf", [x], detect_negative=0), x, build.op("Sqrt", [x])], build.node.output[0])


def _quick_gelu_input(build: NodeBuilder):
    """(x, alpha x) of a QuickGelu or QuickGeluGrad node: x * sigmoid(alpha x) is its function."""
    x, alpha = build.node.input[-1], build.attribute("alpha", 1.702)
    return x, (x if alpha == 1.0 else build.op("Mul", [x, build.const(alpha)]))


def exact_quick_gelu(build: NodeBuilder):
    """x * sigmoid(alpha x) as torch computes silu, x / (1 + exp(-x)) (alpha 1). ONNX Runtime's
    optimizer fuses a SiLU (x * sigmoid(x)) into QuickGelu, whose CPU kernel has the approximate
    sigmoid (exact_sigmoid): 0 below about -17.5, 1e-7 off elsewhere."""
    x, scaled = _quick_gelu_input(build)
    build.op("Div", [x, _one_plus_exp_minus(build, scaled)], build.node.output[0])


def exact_quick_gelu_grad(build: NodeBuilder):
    """QuickGelu's gradient (dy, x) as torch's silu_backward: dy * s * (1 + alpha x (1 - s)), s = sigmoid(alpha x)."""
    _, scaled = _quick_gelu_input(build)
    sigmoid = build.op("Reciprocal", [_one_plus_exp_minus(build, scaled)])
    slope = build.op("Add", [build.const(1.0), build.op("Mul", [scaled, build.op("Sub", [build.const(1.0), sigmoid])])])
    build.op("Mul", [build.op("Mul", [build.node.input[0], sigmoid]), slope], build.node.output[0])


_ABOVE_ANY_FLOAT = 1e300  # a float64 beyond every float32, below the largest float64
_NAN_KEY = 1e301  # NaN's keys start above every other key
_NAN_KEY_STEP = 1e290  # apart by more than float64's spacing there (2e285) for an image of up to 1e11 elements


def exact_max_pool(build: NodeBuilder):
    """MaxPool as torch's max_pool{1,2,3}d: a window holding NaN gives NaN, one of -inf only -inf,
    and the index is always one inside the window.

    ONNX Runtime's CPU kernel starts each window at the lowest float and keeps only greater values:
    it skips NaN (NaN and 1 give 1), and a window of values <= -FLT_MAX only (-inf, a NaN-only
    window) gives -FLT_MAX and an index outside it, where its MaxPoolGrad writes out of bounds and
    ``max_pool_grad``'s scatter to another element. Here the pool runs on float64 keys in torch's
    order, every one above the lowest float64: ±inf as ±1e300, NaN above them all, a later NaN (in
    row-major order) above an earlier one, as torch lets every NaN it meets win; its index picks the
    value from x. Row-major indices only.
    """
    if build.attribute("storage_order", 0) != 0:
        return False
    x = build.node.input[0]
    wide = build.op("Cast", [x], to=onnx.TensorProto.DOUBLE)
    bounded = build.op("Clip", [wide, build.const(-_ABOVE_ANY_FLOAT, np.float64), build.const(_ABOVE_ANY_FLOAT, np.float64)])
    # a window lies in one image and channel: positions over the spatial axes, which ONNX Runtime folds where they are static
    spatial = build.op("Slice", [build.op("Shape", [x]), build.const([2], np.int64), build.const([np.iinfo(np.int64).max], np.int64)])
    count = build.reduce("ReduceProd", spatial, None, keepdims=0)
    positions = build.op("Cast", [build.op("Range", [build.const(0, np.int64), count, build.const(1, np.int64)])], to=onnx.TensorProto.DOUBLE)
    nan_keys = build.op("Add", [build.op("Mul", [positions, build.const(_NAN_KEY_STEP, np.float64)]), build.const(_NAN_KEY, np.float64)])
    keys = build.op("Where", [build.op("IsNaN", [x]), build.op("Reshape", [nan_keys, spatial]), bounded])
    outputs = list(build.node.output) + [""]
    indices = outputs[1] or build.fresh_name()
    attributes = node_attributes(build.node)
    build.nodes.append(onnx.helper.make_node("MaxPool", [keys], [build.fresh_name(), indices], name=build.fresh_name(),
                                             **attributes))  # fmt: skip
    flat = build.const([-1], np.int64)
    picked = build.op("GatherElements", [build.op("Reshape", [x, flat]), build.op("Reshape", [indices, flat])], axis=0)
    build.op("Reshape", [picked, build.op("Shape", [indices])], outputs[0])
    return True


EXACT_CPU_KERNELS = {"Sigmoid": exact_sigmoid, "Sqrt": exact_sqrt, "QuickGelu": exact_quick_gelu,
                     "QuickGeluGrad": exact_quick_gelu_grad, "MaxPool": exact_max_pool}  # fmt: skip


def pool_before_relu(model: onnx.ModelProto) -> int:
    """Swap, in place, Relu -> MaxPool into MaxPool -> Relu; return how many were swapped.

    Both give the same values (ReLU is monotone) and the same gradients: where the window
    maximum is positive both route dy to its first maximum, elsewhere both give zero. After
    the swap the ReLU and its gradient touch the pooled tensor, a quarter of the size for
    2x2 pooling. Only a Relu whose output feeds nothing but the MaxPool is swapped.
    """
    readers = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            readers[name].append(node)
    graph_outputs = {output.name for output in model.graph.output}
    nodes = list(model.graph.node)
    swapped = 0
    for relu in [node for node in nodes if node.op_type == "Relu"]:
        activation = relu.output[0]
        pool = readers[activation][0] if len(readers[activation]) == 1 else None
        if pool is None or pool.op_type != "MaxPool" or activation in graph_outputs:
            continue
        pooled = f"{pool.output[0]}_before_relu"
        pool.input[0], relu.output[0], pool.output[0], relu.input[0] = relu.input[0], pool.output[0], pooled, pooled
        nodes.remove(pool)
        nodes.insert(nodes.index(relu), pool)
        swapped += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return swapped


def centered_layer_norms(model: onnx.ModelProto) -> list:
    """Give, in place, every LayerNormalization its input minus the mean over the normalized axes, and the gradient
    node that reads the same input and statistics the same shifted tensor; return the names of the nodes.

    ONNX Runtime's CPU kernel takes the variance as E[x^2] - mean^2 in float32, which cancels where a row's mean is
    large against its spread: rows of mean 100 and spread 1 came out 1e-3 off torch, of mean 1234 0.07 off (a constant
    row can give NaN), where torch's kernel stays accurate (docs/stack_facts.md). A layer norm is the same function of
    its input shifted along the normalized axes, so its value and gradient stay torch's while the kernel sees a mean
    near 0. Two passes more per layer norm; forwards with a negative axis, as the exporter writes them.
    """
    facts = GraphFacts(opset(model), {}, {}, {}, {}, set())
    rebuilt, shifted, centered = [], {}, []
    for node in model.graph.node:
        axis = node_attribute(node, "axis", -1)
        if node.op_type == "LayerNormalization" and axis < 0:
            build, x = NodeBuilder(node, facts), node.input[0]
            node.input[0] = build.op("Sub", [x, build.reduce("ReduceMean", x, list(range(axis, 0)), 1)])
            rebuilt += build.nodes
            model.graph.initializer.extend(build.initializers)
            shifted[(x, node.output[1] if len(node.output) > 1 else "")] = node.input[0]
            centered.append(node.name)
        rebuilt.append(node)
    for node in rebuilt:  # (dy, x, scale, mean, inverse std): the forward's input with its statistics
        if node.op_type == "LayerNormalizationGrad" and (node.input[1], node.input[3]) in shifted:
            node.input[1] = shifted[(node.input[1], node.input[3])]
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
    return centered


def use_fast_cpu_kernels(model: onnx.ModelProto, keep_op_types=(), built_from: onnx.ModelProto = None) -> list:
    """Replace, in place, every node :data:`FAST_CPU_KERNELS` knows, but those of ``keep_op_types``
    (which torch's kernels will run); return their names. ``built_from``, the forward graph a
    training graph's gradient was built from, gives ``gather_grad`` the gathered tensors' shapes
    (ONNX's inference stops at the training graph's contrib ops); without it GatherGrads stay.

    Graphs older than opset 15 (no CastLike) are left as they are.
    """
    if opset(model) < 15:
        return []
    targets = [node for node in model.graph.node if node.op_type in FAST_CPU_KERNELS and node.op_type not in keep_op_types]
    declared = shapes_in(model.graph.input)  # the weights' shapes among them
    declared.update({initializer.name: list(initializer.dims) for initializer in model.graph.initializer})
    initializers = {initializer.name: initializer for initializer in model.graph.initializer}
    gather_indices = {node.input[1] for node in targets if node.op_type == "GatherGrad" and node.input[1] in initializers}
    if any(node.op_type == "GatherGrad" for node in targets) and built_from is not None:
        declared = {**static_shapes(built_from), **declared}
    constants = {name: numpy_helper.to_array(initializers[name]) for name in gather_indices}
    return replace_nodes(model, FAST_CPU_KERNELS, targets, shapes=declared, constants=constants)


def use_exact_cpu_kernels(model: onnx.ModelProto, keep_op_types=()) -> list:
    """Replace, in place, every node :data:`EXACT_CPU_KERNELS` knows, but those of ``keep_op_types``
    (which torch's kernels will run); return their names."""
    targets = [node for node in model.graph.node
               if node.op_type in EXACT_CPU_KERNELS and node.op_type not in keep_op_types
               and node.domain in ("", "ai.onnx", "com.microsoft")]  # fmt: skip
    return replace_nodes(model, EXACT_CPU_KERNELS, targets)
