"""Every rewrite, symbolic and fast CPU kernel against torch in float64, at boundary values.

Each case builds the training graph the trainer builds (boundary.py: rewrites, ONNX
Runtime's gradient builder, CPU kernels) and compares its output and gradients with torch
autograd in float64 rounded to float32: at 0, ±tiny (1e-30, denormals), ±large (1e4, 1e30,
FLT_MAX, beyond each op's overflow point), ±inf, NaN, ties, kinks and branch switches.

Tolerance: ``boundary.ULPS`` float32 spacings at the expected value's magnitude, plus the
smallest normal float32 (ONNX Runtime may flush denormal results to 0); cases that need
more say why. An element also passes when it equals torch's float32 result, and gradients
at inputs that are NaN themselves are not compared (boundary.check_against_torch says why).
Known, documented differences from torch are left out of the inputs and named where they apply.
"""

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from boundary import (FLOAT32, FLOOR, KINKS, ULPS, check_against_torch, check_trainer_against_torch, edge_values, exported_model,
                      op_types, run_training_graph, single_op_model, spread, torch_reference, upstream_like)  # fmt: skip

from orttrainer.graph import graph_errors, rewrites, training_graph


# op: (attributes, torch function, inputs beyond edge_values())
UNARY = {
    "Softplus": ({}, F.softplus, [*spread(1e-8, 100), -17.0, -20.0, -88.0, -90.0, -104.0, 20.0, 89.0]),
    "Elu": ({"alpha": 0.7}, lambda x: F.elu(x, 0.7), [*spread(1e-8, 100), -1.0, -0.99999994, -1.0000001]),
    "Celu": ({"alpha": 0.5}, lambda x: F.celu(x, 0.5), [*spread(1e-8, 100), -0.5, -0.49999997]),
    "Selu": ({}, F.selu, [*spread(1e-8, 100), -1.0]),
    "HardSigmoid": ({"alpha": 1 / 6}, F.hardsigmoid, [*spread(1e-3, 10), *KINKS]),
    "HardSwish": ({}, F.hardswish, [*spread(1e-3, 10), *KINKS]),
    "Sinh": ({}, torch.sinh, [*spread(1e-8, 100), 0.49999997, 0.5, 43.999996, 44.0, 88.7, 89.0, 89.41, 89.42]),
    "Cosh": ({}, torch.cosh, [*spread(1e-8, 100), 0.49999997, 0.5, 43.999996, 44.0, 88.7, 89.0, 89.41, 89.42]),
    "Asinh": ({}, torch.asinh, [*spread(1e-8, 1e30), 4095.9998, 4096.0, 1.8e19, 1e20]),
    "Sign": ({}, torch.sign, []),
}
# inputs of their own: the domain is [1, inf) or [-1, 1]. Out of the domain torch's value is
# NaN, as here; its gradient is still finite below -1 for acosh (NaN here, see rewrites.elementwise.acosh).
DOMAIN = {
    "Acosh": (torch.acosh, [1.0, 1.0000001, 1.5, 2.0, 4095.9998, 4096.0, 1.8e19, 1e20, 3e38, np.inf, np.nan, 0.5, 0.0,
                            *np.logspace(0, 30, 31)]),
    "Atanh": (torch.atanh, [0.0, -0.0, 1e-30, -1e-30, 1e-40, 1e-8, -1e-8, 0.5, -0.5, 0.99999994, -0.99999994, 1.0, -1.0,
                            2.0, -2.0, np.nan, *np.linspace(-0.999, 0.999, 37)]),
}


def _unary_case(op_type, attributes, function, x, ulps=ULPS, floor=FLOOR, domain=""):
    model = single_op_model(op_type, ["x"], {"x": x}, np.ones_like(x), attributes, domain=domain)
    return check_against_torch(model, lambda x: function(x), {"x": x}, ["x"], np.ones_like(x), ulps, floor)


@pytest.mark.parametrize("op_type", UNARY)
def test_unary_rewrite(op_type):
    attributes, function, extra = UNARY[op_type]
    train = _unary_case(op_type, attributes, function, edge_values(*extra))
    assert op_type not in op_types(train), f"{op_type} was not rewritten"


# ops given torch's gradient formula (defined_gradients.py): the forward stays one node
_UNIT_INTERVAL = [0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 0.99999994, -0.99999994, 1.0, -1.0, 2.0, -2.0, np.nan, np.inf,
                  *np.linspace(-0.999, 0.999, 37)]  # fmt: skip
DEFINED = {
    "Atan": (torch.atan, edge_values(*spread(1e-8, 1e30), 1.8e19, 1e20)),
    "Asin": (torch.asin, np.array(_UNIT_INTERVAL, np.float32)),  # gradient inf at ±1 and NaN outside, as torch's
    "Acos": (torch.acos, np.array(_UNIT_INTERVAL, np.float32)),
}


@pytest.mark.parametrize("op_type", DEFINED)
def test_defined_gradient(op_type):
    function, x = DEFINED[op_type]
    train = _unary_case(op_type, {}, function, x)
    assert any(node.name.startswith(f"{op_type}_Grad/") for node in train.graph.node), f"{op_type}'s gradient is not the definition"


def test_torchs_hard_sigmoid_trains_through_its_gradient_definition():
    """alpha 1/6, beta 1/2: the builder's gradient is the definition's (rewrites.is_torch_hard_sigmoid), the forward
    spelled after the build; other forms are rewritten before it (test_rewrites)."""
    attributes, function, extra = UNARY["HardSigmoid"]
    train = _unary_case("HardSigmoid", attributes, function, edge_values(*extra))
    assert any(node.name.startswith("HardSigmoid_Grad/") for node in train.graph.node)


@pytest.mark.parametrize("op_type", DOMAIN)
def test_rewrite_on_its_domain(op_type):
    function, values = DOMAIN[op_type]
    train = _unary_case(op_type, {}, function, np.array(values, np.float32))
    assert op_type not in op_types(train), f"{op_type} was not rewritten"


def test_sigmoid_tail():
    """ONNX Runtime's CPU Sigmoid clamps near -17.5 (0 at -20); cpu_kernels.exact_sigmoid has torch's
    values and gradients down to where exp underflows."""
    x = edge_values(*spread(1e-8, 120), -17.0, -17.5, -18.0, -20.0, -30.0, -60.0, -87.0, -88.7, -89.0)
    train = _unary_case("Sigmoid", {}, torch.sigmoid, x)
    assert "Exp" in op_types(train), "the Sigmoid was not replaced"


@pytest.mark.parametrize("alpha", [1.0, 1.702])
def test_silu_fused_into_quick_gelu(alpha):
    """ONNX Runtime fuses x * sigmoid(alpha x) (F.silu: alpha 1) into QuickGelu, whose CPU kernel and
    gradient use its approximate sigmoid (0 below about -17.5, ~1e-7 off elsewhere);
    cpu_kernels.exact_quick_gelu(_grad) compute torch's silu and silu_backward."""
    x = edge_values(*spread(1e-8, 120), -17.0, -17.5, -18.0, -20.0, -30.0, -60.0, -87.0, -88.7, -89.0)
    values = {"x": x}
    function = (lambda x: F.silu(x)) if alpha == 1.0 else (lambda x: x * torch.sigmoid(alpha * x))
    upstream = upstream_like(x.shape)
    train = check_against_torch(exported_model(function, values, upstream, ["x"]), function, values, ["x"], upstream)
    assert not {"QuickGelu", "QuickGeluGrad", "Sigmoid"} & op_types(train), op_types(train)


def test_prelu_slope_and_input():
    x = np.stack([edge_values(-1.0, 2.0)] * 6).reshape(2, 3, -1)
    slope = np.array([[0.25], [-0.5], [0.0]], np.float32)
    upstream = upstream_like(x.shape)
    model = single_op_model("PRelu", ["x", "slope"], {"x": x, "slope": slope}, upstream)
    check_against_torch(model, lambda x, slope: F.prelu(x, slope.reshape(-1)), {"x": x, "slope": slope}, ["x", "slope"],
                        upstream)  # fmt: skip


def _slices():
    """Rows with a tie, masked scores (-inf), all -inf, +inf, NaN (first and later), signed zeros."""
    inf, nan = np.inf, np.nan
    return np.array([[1.0, 5.0, 5.0, 2.0], [-inf, -inf, 0.5, -inf], [-inf, -inf, -inf, -inf], [inf, 1.0, inf, -inf],
                     [1.0, nan, 2.0, nan], [nan, 3.0, 1.0, 3.0], [0.0, -0.0, -1.0, -0.0], [7.0, 7.0, 7.0, 7.0]], np.float32)  # fmt: skip


@pytest.mark.parametrize("op_type", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("axes, keepdims, opset", [([1], 0, 17), ([0], 1, 17), ([1], 1, 18), (None, 0, 17)])
def test_reduce_extreme_like_amax(op_type, axes, keepdims, opset):
    """torch.amax/amin: ties share the gradient, slices holding ±inf give no NaN, a slice
    holding NaN gives NaN (value, and gradient to each of its elements, as torch)."""
    x = _slices()
    reference = torch.amax if op_type == "ReduceMax" else torch.amin
    dims = tuple(axes) if axes is not None else tuple(range(x.ndim))
    expected_shape = reference(torch.tensor(x), dim=dims, keepdim=bool(keepdims)).shape
    upstream = upstream_like(expected_shape)
    attributes, inputs, constants = {"keepdims": keepdims}, ["x"], {}
    if axes is not None and opset >= 18:
        inputs, constants = ["x", "axes"], {"axes": np.array(axes, np.int64)}
    elif axes is not None:
        attributes["axes"] = axes
    model = single_op_model(op_type, inputs, {"x": x}, upstream, attributes, opset=opset, constants=constants)
    check_against_torch(model, lambda x: reference(x, dim=dims, keepdim=bool(keepdims)), {"x": x}, ["x"], upstream)


@pytest.mark.parametrize("function", [lambda x: torch.max(x, 1).values, lambda x: torch.min(x, 0, keepdim=True).values,
                                      lambda x: torch.max(x, -1).values + torch.max(x, -1).indices],
                         ids=["max(dim)", "min(dim, keepdim)", "max(dim) with indices"])  # fmt: skip
def test_max_min_with_dim_send_the_gradient_to_the_first_extreme(function):
    """torch.max/min(x, dim): the value at the first extreme (first NaN), which alone gets the gradient."""
    x = _slices()
    upstream = upstream_like(function(torch.tensor(x)).shape)
    model = exported_model(function, {"x": x}, upstream, ["x"])
    check_against_torch(model, function, {"x": x}, ["x"], upstream)


@pytest.mark.parametrize("function", [lambda x: x.gather(1, x.argmax(1, keepdim=True)),
                                      lambda x: x.gather(0, x.argmin(0).unsqueeze(0)),
                                      lambda x: x.reshape(-1).gather(0, x.argmax().reshape(1)),
                                      lambda x: x.reshape(-1).gather(0, x.argmin(keepdim=True).reshape(1)),
                                      lambda x: x[:, 1:2].gather(1, x[:, 1:2].argmax(1, keepdim=True))],
                         ids=["argmax(dim, keepdim)", "argmin(dim)", "argmax()", "argmin(keepdim)", "size-1 axis"])  # fmt: skip
def test_argmax_argmin_pick_the_first_nan_then_the_first_extreme(function):
    """torch.argmax/argmin: the first NaN of a slice holding one (ONNX Runtime's ArgMax skips a NaN
    that does not come first), else the first of tied extremes; the value gathered there alone
    gets the gradient."""
    x = _slices()
    upstream = upstream_like(function(torch.tensor(x)).shape)
    model = exported_model(function, {"x": x}, upstream, ["x"])
    check_against_torch(model, function, {"x": x}, ["x"], upstream)


def _reductions():
    x = np.array([[1.0, -2.0, 0.0], [1e-30, -1e-30, 0.0], [1e19, 2e19, -1e19], [np.inf, 1.0, 2.0], [0.0, -0.0, 0.0]], np.float32)
    return {
        "ReduceSumSquare": (lambda x: (x * x).sum(1), x),
        "ReduceL1": (lambda x: x.abs().sum(1), x),
        "ReduceLogSum": (lambda x: x.sum(1).log(), np.abs(x)),
    }


@pytest.mark.parametrize("op_type", list(_reductions()))
def test_other_reductions(op_type):
    function, x = _reductions()[op_type]
    upstream = upstream_like([x.shape[0]])
    model = single_op_model(op_type, ["x"], {"x": x}, upstream, {"axes": [1], "keepdims": 0})
    check_against_torch(model, function, {"x": x}, ["x"], upstream)


@pytest.mark.parametrize("op_type", ["Sum", "Mean"])
def test_variadic_sum_and_mean_broadcast(op_type):
    values = {"a": np.array([[1.0, np.inf, -1e-30], [2.0, -np.inf, 3e38]], np.float32),
              "b": np.array([0.5, 1.0, 3e38], np.float32), "c": np.array([1e-30], np.float32)}  # fmt: skip
    upstream = upstream_like([2, 3])
    model = single_op_model(op_type, list(values), values, upstream)

    def reference(a, b, c):
        total = a + b + c
        return total if op_type == "Sum" else total / 3

    check_against_torch(model, reference, values, list(values), upstream)


@pytest.mark.parametrize("axis, reverse, exclusive", [(1, 0, 0), (1, 1, 0), (1, 0, 1), (1, 1, 1), (0, 0, 0)])
def test_cumsum_spreads_inf_and_nan_only_forward(axis, reverse, exclusive):
    """inf and NaN reach only later positions; sums as exact as torch's (float64 accumulation: 1e8 + 1 - 1e8 = 1)."""
    x = np.array([[1.0, np.inf, 2.0, np.nan, 3.0, -1e-30, 4.0], [1e8, 1.0, -1e8, 2.0, -np.inf, 0.5, 0.25]], np.float32)
    upstream = upstream_like(x.shape)

    def reference(x):
        flipped = x.flip(axis) if reverse else x
        total = torch.cumsum(flipped, axis)
        if exclusive:
            total = total - flipped  # torch has no exclusive cumsum; equal here away from inf and NaN
        return total.flip(axis) if reverse else total

    model = single_op_model("CumSum", ["x", "axis"], {"x": x}, upstream, {"reverse": reverse, "exclusive": exclusive},
                            constants={"axis": np.array(axis, np.int64)})  # fmt: skip
    finite = np.where(np.isfinite(x), x, 1.0) if exclusive else x  # x - x is NaN at inf: compare exclusive on finite values
    check_against_torch(model, reference, {"x": finite}, ["x"], upstream)


# Sums over repeated indices (rewrites.indexing.scatter_with_reduction, symbolics.indexing.index_add / index_put): rows 0, 2 and 3 of
# the data get 3, 2 and 1 updates, rows 1 and 4 none. Each column is a case: signed zeros, infinities and NaN,
# denormals and tiny values, huge values overflowing, ordinary values. Values sent to one row keep one sign where
# they are huge: the updates are summed before the data is added, so a sum that cancels huge values of opposite
# signs legitimately differs from torch's in-order one by their rounding (rewrites.indexing.scatter_with_reduction).
_MAX = float(FLOAT32.max)
SCATTER_TARGETS = np.array([0, 2, 0, 0, 3, 2], np.int64)
SCATTER_DATA = np.array([[-0.0, 1.0, 1e-40, _MAX, 1.5], [-0.0, np.inf, -1e-40, 1e30, -2.25], [0.0, -np.inf, 1e-30, 1e30, 3.0],
                         [-0.0, np.nan, 0.0, -_MAX, 0.125], [-0.0, 2.0, 1e-30, 1.0, 7.0]], np.float32)
SCATTER_UPDATES = np.array([[-0.0, np.inf, 1e-40, _MAX, 0.5], [-0.0, -np.inf, 1e-40, 1e30, -1.0], [0.0, 1.0, -1e-40, 1e30, 2.75],
                            [-0.0, 2.0, 1e-30, 1.0, 4.0], [-0.0, 3.0, -1e-30, -_MAX, -3.5], [-0.0, np.nan, 1e-40, 1e30, 6.25]],
                           np.float32)  # fmt: skip
SUMS_OVER_INDICES = {
    "index_add": lambda data, updates, targets: data.index_add(0, targets, updates),
    "index_add alpha": lambda data, updates, targets: data.index_add(0, targets, updates, alpha=2.5),
    "index_add dim 1": lambda data, updates, targets: data.T.index_add(1, targets, updates.T),
    "scatter_add": lambda data, updates, targets: data.scatter_add(0, targets[:, None].expand_as(updates), updates),
    "index_put accumulate": lambda data, updates, targets: data.index_put((targets,), updates, accumulate=True),
}  # fmt: skip
# scatter_reduce 'sum' is scatter_add's ScatterElements once the trainer folds the If torch's symbolic wraps it in
# (tests/test_same_as_torch.py trains it). No index_put of an empty index: torch's exporter kills the process
# (SIGFPE, a Reshape of an empty static shape by -1) on it, accumulating or not; the trainer's exports have dynamic
# sizes and reach ONNX Runtime's clear refusal of the empty batch instead.


@pytest.mark.parametrize("function, empty", [(function, False) for function in SUMS_OVER_INDICES]
                         + [(function, True) for function in SUMS_OVER_INDICES if not function.startswith("index_put")])
def test_sums_over_repeated_indices(function, empty):
    values = {"data": SCATTER_DATA, "updates": SCATTER_UPDATES[:0] if empty else SCATTER_UPDATES,
              "targets": SCATTER_TARGETS[:0] if empty else SCATTER_TARGETS}  # fmt: skip
    upstream = upstream_like(SUMS_OVER_INDICES[function](*(torch.tensor(values[name]) for name in values)).shape)
    model = exported_model(SUMS_OVER_INDICES[function], values, upstream, ["data", "updates"])
    check_against_torch(model, SUMS_OVER_INDICES[function], values, ["data", "updates"], upstream)


# Roots whose gradient torch masks to 0 where the root is 0 (symbolics.reductions._root_with_zero_gradient_at_zero): rows that are
# constant (zero variance, zero norm), tiny (a variance that underflows to 0), huge, infinite, NaN, and a size-1 row.
ROOT_ROWS = np.array([[2.0, 2.0, 2.0, 2.0], [0.0, -0.0, 0.0, 0.0], [1e-30, -1e-30, 1e-30, 0.0], [1e20, -1e20, 3e19, 0.0],
                      [1.0, -2.0, 0.5, 3.0], [np.inf, 1.0, 0.0, 2.0], [np.nan, 1.0, 0.0, 2.0], [-1.5, 0.0, 0.0, 0.0]],
                     np.float32)  # fmt: skip
_FINITE_ROWS = [0, 1, 4, 7]  # constant, zero, ordinary, one non-zero: a p-norm's float32 rounding at 1e-30 and 1e20 is its own
ROOTS = {  # name: (function, rows, float32 spacings allowed, absolute floor)
    "std": (lambda x: x.std(-1), ROOT_ROWS, ULPS, FLOOR),
    "std unbiased=False keepdim": (lambda x: x.std(-1, unbiased=False, keepdim=True), ROOT_ROWS, ULPS, FLOOR),
    "std of one element": (lambda x: x[:, :1].std(-1, correction=0), ROOT_ROWS, ULPS, FLOOR),
    # torch's var gradient at a row holding inf is -inf (x - mean times 2 / (n - 1)), here NaN: that row left out
    "var": (lambda x: x.var(-1), ROOT_ROWS[[0, 1, 2, 3, 4, 6, 7]], ULPS, FLOOR),
    # torch's std_mean takes its mean by Welford's updates: NaN for a row holding inf (torch.mean: inf); that row left out
    "std_mean": (lambda x: torch.stack(torch.std_mean(x, -1)), ROOT_ROWS[[0, 1, 2, 3, 4, 6, 7]], ULPS, FLOOR),
    "var_mean": (lambda x: torch.stack(torch.var_mean(x, -1)), ROOT_ROWS[[0, 1, 2, 3, 4, 6, 7]], ULPS, FLOOR),
    "vector_norm ord=3": (lambda x: torch.linalg.vector_norm(x, 3, dim=-1), ROOT_ROWS[_FINITE_ROWS + [5, 6]], ULPS, FLOOR),
    "norm p=1.5 keepdim": (lambda x: x.norm(1.5, dim=-1, keepdim=True), ROOT_ROWS[_FINITE_ROWS + [5, 6]], ULPS, FLOOR),
    # x / |x|_3: its gradient cancels terms of like size, float32 noise of ~1e-7 on both sides
    "normalize p=3": (lambda x: F.normalize(x, p=3.0, dim=-1), ROOT_ROWS[_FINITE_ROWS], 64, 1e-6),
    "cdist p=1": (lambda x: torch.cdist(x[:4], x[4:], p=1.0), ROOT_ROWS, ULPS, FLOOR),
    "cdist p=2": (lambda x: torch.cdist(x[:4], x[4:]), ROOT_ROWS[[0, 1, 0, 4, 0, 4, 7, 1]], 64, FLOOR),
    "cdist p=2 product form": (lambda x: torch.cdist(x[:4], x[4:], compute_mode="use_mm_for_euclid_dist"),
                               ROOT_ROWS[[0, 1, 0, 4, 0, 4, 7, 1]], 64, 1e-6),
    "cdist p=3": (lambda x: torch.cdist(x[:4], x[4:], p=3.0), ROOT_ROWS[[0, 1, 0, 4, 0, 4, 7, 1]], 64, 1e-6),
}  # fmt: skip


@pytest.mark.parametrize("function", ROOTS)
def test_roots_with_torchs_zero_gradient_at_zero(function):
    """Where torch's std, norm and cdist are 0 (a padding row, a point's distance to itself) their gradient is 0; the
    exporter's Sqrt or Pow gave inf there, and NaN times the 0 before it."""
    reference, x, ulps, floor = ROOTS[function]
    upstream = upstream_like(reference(torch.tensor(x)).shape)
    model = exported_model(reference, {"x": x}, upstream, ["x"])
    check_against_torch(model, reference, {"x": x}, ["x"], upstream, ulps, floor)


# Roots, logs and reciprocals of a ReLU's or clamp's output (rewrites.activations.select_before_singular): their gradient is
# infinite at the 0 the mask puts out, where torch's select gives 0 and a mask multiplication NaN.
MASKED_SINGULAR = {
    "sqrt(relu)": lambda x: torch.relu(x).sqrt(),
    "relu ** 0.3": lambda x: torch.relu(x) ** 0.3,
    "log(relu)": lambda x: torch.relu(x).log(),
    "1 / relu": lambda x: 1.0 / torch.relu(x),
    "sqrt(clamp(min=0))": lambda x: x.clamp(min=0.0).sqrt(),
    "sqrt(clamp(-1, 4) + 1)": lambda x: (x.clamp(-1.0, 4.0) + 1.0).sqrt(),
    "sqrt(clamp(0, 4))": lambda x: x.clamp(0.0, 4.0).sqrt(),
    "sqrt(relu6)": lambda x: F.relu6(x).sqrt(),
    "sqrt(hardtanh(0, 5))": lambda x: F.hardtanh(x, 0.0, 5.0).sqrt(),
}


@pytest.mark.parametrize("function", MASKED_SINGULAR)
def test_masked_values_a_root_or_log_reads(function):
    """Without denormals (ONNX Runtime's Sqrt and Log read them as 0; not the mask's doing); Pow's float32 result at
    1e30 is 13 ulps off float64, as ONNX Runtime's kernel computes it. A -0 a clamp lets through reaches the Sqrt
    as -0, whose vectorised kernel returns +0 (torch -0): the gradient there is +inf, torch's -inf; that input is left
    out of the clamps whose range holds 0."""
    passes_zero = function.startswith("sqrt(clamp(") and "-1" not in function
    x = np.array([value for value in edge_values(4.0, 5.0, 6.0, 3.999, 0.25, -0.25, -1.0, 1.0) if abs(value) != 1e-40
                  and not (passes_zero and value == 0 and np.signbit(value))], np.float32)  # fmt: skip
    upstream = np.ones_like(x)
    model = exported_model(MASKED_SINGULAR[function], {"x": x}, upstream, ["x"])
    check_against_torch(model, MASKED_SINGULAR[function], {"x": x}, ["x"], upstream, ulps=16 if "**" in function else ULPS)


# torch's sort and topk rank NaN above +inf (symbolics.reductions._ranked); a stable sort keeps ties in order. Rows: two NaN among
# values, +inf and -inf, ties, a row of NaN only. topk without ties but NaN's (its order of ties is its kernel's).
RANKED_ROWS = np.array([[1.0, np.nan, 3.0, np.nan, 2.0, 0.5], [np.inf, 1.0, np.nan, -np.inf, 0.0, -2.0],
                        [2.0, 2.0, -1.0, 2.0, -1.0, 7.0], [np.nan] * 6], np.float32)  # fmt: skip
RANKED = {
    "sort stable": lambda x: torch.sort(x, dim=1, stable=True).values,
    "sort stable descending": lambda x: torch.sort(x, dim=1, descending=True, stable=True).values,
    "argsort stable as weights": lambda x: x * torch.argsort(x, dim=1, stable=True).to(x.dtype),
    "sort of columns": lambda x: torch.sort(x, dim=0, stable=True).values,
    "topk 3": lambda x: torch.topk(x[:2], 3).values,
    "topk 2 smallest": lambda x: torch.topk(x[:2], 2, largest=False).values,
}


@pytest.mark.parametrize("function", RANKED)
def test_sort_and_topk_rank_nan_as_torch(function):
    upstream = upstream_like(RANKED[function](torch.tensor(RANKED_ROWS)).shape)
    model = exported_model(RANKED[function], {"x": RANKED_ROWS}, upstream, ["x"])
    check_against_torch(model, RANKED[function], {"x": RANKED_ROWS}, ["x"], upstream)


# Gathers by indices computed in the run (cpu_kernels._scattered_gather_gradient: GatherGrad as a scatter that adds):
# rows picked by how many of their values exceed 1 (repeats among them), columns by an argsort.
# The gathered tensor is 2 x, not the weight x itself, whose row gathers train as embeddings (outputs_for_trainer.EmbeddingGradient).
GATHERED = {
    "rows repeated": lambda x: (2 * x)[(x.detach().abs() > 1).sum(1) % x.shape[0]],
    "columns by argsort": lambda x: (2 * x).index_select(1, x.detach().nan_to_num(0.0)[0].argsort()[:3]),
    "rows counted from the end": lambda x: (2 * x)[(x.detach().abs() > 1).sum(1) % x.shape[0] - x.shape[0]],
}


@pytest.mark.parametrize("function", GATHERED)
def test_gathers_by_indices_computed_in_the_run(function):
    x = edge_values(2.0, -3.0, 0.5, 7.0).reshape(3, 7)
    upstream = upstream_like(GATHERED[function](torch.tensor(x)).shape)
    model = exported_model(GATHERED[function], {"x": x}, upstream, ["x"])
    train = check_against_torch(model, GATHERED[function], {"x": x}, ["x"], upstream)
    assert "GatherGrad" not in op_types(train)


# torch.maximum / minimum (rewrites.arithmetic.pairwise_extreme): ties split dy, NaN on either side gives both dy. Pairs of edge
# values, equal ones among them, and a broadcast second input.
PAIRS_A = edge_values(1.0, 2.0, 2.0, np.nan, -np.inf, 3.0)
PAIRS_B = np.concatenate([edge_values()[::-1], np.array([1.0, 2.0, 5.0, 1.0, -np.inf, np.nan], np.float32)])
EXTREMES = {
    "maximum": (lambda a, b: torch.maximum(a, b), {"a": PAIRS_A, "b": PAIRS_B}),
    "minimum": (lambda a, b: torch.minimum(a, b), {"a": PAIRS_A, "b": PAIRS_B}),
    "maximum broadcast": (lambda a, b: torch.maximum(a.reshape(-1, 1), b), {"a": PAIRS_A[:6], "b": PAIRS_B[:5]}),
    "minimum masked where NaN": (lambda a, b: torch.where(torch.isnan(b), 0.0, torch.minimum(a, b)), {"a": PAIRS_A, "b": PAIRS_B}),
}


@pytest.mark.parametrize("function", EXTREMES)
def test_maximum_and_minimum_give_torchs_gradient_at_ties_and_nan(function):
    reference, values = EXTREMES[function]
    upstream = upstream_like(reference(*(torch.tensor(value) for value in values.values())).shape)
    model = exported_model(reference, values, upstream, list(values))
    check_against_torch(model, reference, values, list(values), upstream)


EINSUM = {
    "bi,ij->bj": [(3, 4), (4, 2)],
    "bij,bjk->bik": [(2, 1, 3), (2, 3, 2)],
    "bi,bi->b": [(3, 4), (3, 4)],
    "bi,j->bij": [(3, 1), (2,)],
    "bij->bj": [(2, 3, 4)],
    "td,dnh->tnh": [(3, 4), (4, 2, 2)],
    "td,dnh->tnh (size-1 n)": [(3, 4), (4, 1, 2)],
    "bjk,bjk->b": [(2, 3, 2), (2, 3, 2)],
    "ibh,hnd->ibnd": [(2, 3, 4), (4, 2, 2)],
    "bn,bnij->bij": [(2, 3), (2, 3, 2, 2)],
    "...pd,...qd->...pq": [(2, 3, 4), (2, 2, 4)],
    "...qhd,...khd->...hqk": [(2, 3, 2, 4), (2, 5, 2, 4)],
    "...nd,...ng->...gd (broadcast)": [(1, 3, 4), (2, 3, 2)],
    "...d,d->...": [(2, 3, 4), (4,)],
}


@pytest.mark.parametrize("equation", EINSUM)
@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf and nan"])
def test_einsum(equation, special):
    """Products of a 1e4-sized and a unit factor, and a tiny one; with ``special``, an inf and a NaN in the first
    operand: they reach the outputs and gradients torch's own einsum spreads them to (through its reshapes and bmm)."""
    key = equation.split(" ")[0]
    generator = np.random.default_rng(0)
    values = {f"x{index}": (generator.standard_normal(shape) * (1e4 if index == 0 else 1.0)).astype(np.float32)
              for index, shape in enumerate(EINSUM[equation])}  # fmt: skip
    values["x0"].reshape(-1)[0] = 1e-30
    if special:
        values["x0"].reshape(-1)[1] = np.inf
        values["x0"].reshape(-1)[-1] = np.nan
    equation = key
    expected = torch.einsum(equation, *(torch.tensor(value) for value in values.values()))
    upstream = upstream_like(expected.shape)
    model = single_op_model("Einsum", list(values), values, upstream, {"equation": equation})
    # an output or gradient sums products of 1e4-sized terms: within a few ulps of those terms
    check_against_torch(model, lambda **tensors: torch.einsum(equation, *tensors.values()), values, list(values), upstream,
                        floor=4e-3)  # fmt: skip


@pytest.mark.parametrize("rows", [[[3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]], [[1e-30, -1e-30, 2e-30, 0.0], [1e-40, 0.0, 0.0, 0.0]],
                                  [[1e18, -1e18, 3e18, 0.0], [-1e4, 1e4, 0.0, 1.0]], [[0.0, 1.0, -1.0, 0.5], [1.0, 2.0, 3.0, 4.0]]],
                         ids=["constant", "tiny", "large", "plain"])  # fmt: skip
def test_instance_normalization(rows):
    """Variance 0 and 1e-60 (epsilon decides), 1e36, ordinary; scale and bias trained too."""
    x = np.array(rows, np.float32)[:, None, :]
    values = {"x": x, "scale": np.array([-2.0], np.float32), "bias": np.array([0.5], np.float32)}
    upstream = upstream_like(x.shape)
    model = single_op_model("InstanceNormalization", ["x", "scale", "bias"], values, upstream, {"epsilon": 1e-5})
    reference = lambda x, scale, bias: F.instance_norm(x, weight=scale, bias=bias, eps=1e-5)  # noqa: E731
    floor = _normalization_floor(x, (-1,), upstream, values["scale"])
    check_against_torch(model, reference, values, list(values), upstream, floor=floor)


def _normalization_floor(x, axes, upstream, scale, eps=1e-5):
    """A normalization's gradients are sums that cancel, of terms |upstream * normalized x| (scale's; normalized x
    is below max(2, sqrt(n - 1)) over n values) and |scale * upstream| / std (x's): ULPS float32 spacings of those,
    at the smallest finite variance over ``axes``."""
    x = np.asarray(x, np.float64)
    count = int(np.prod([x.shape[axis] for axis in axes]))
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, left out below
        variances = x.var(axis=axes)
    variance = variances[np.isfinite(variances)].min(initial=np.inf)
    terms = np.abs(scale).max() * upstream.max() * max(2.0, np.sqrt(count - 1), 1 / np.sqrt(variance + eps))
    return ULPS * FLOAT32.eps * terms


@pytest.mark.parametrize("attributes, size", [
    ({"kernel_shape": [2, 2], "strides": [2, 2]}, 4),
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 0}, 4),
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}, 4),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, 6),  # a partial last window
    ({"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 1}, 5),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 0}, 6),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 1}, 6),
])  # fmt: skip
def test_average_pool(attributes, size):
    """ceil_mode: the partial last window divides by what it covers; none starts in the end padding (size 5,
    kernel 2, stride 2, pad 1 makes 3 windows, not 4)."""
    x = np.arange(2 * size * size, dtype=np.float32).reshape(1, 2, size, size) - size * size
    x[0, 0, 0, 0], x[0, 1, -1, -1], x[0, 1, 0, 1] = np.inf, 1e30, 1e-30
    padding = attributes.get("pads", [0])[0]
    reference = lambda x: F.avg_pool2d(x, attributes["kernel_shape"], attributes.get("strides", 1), padding,  # noqa: E731
                                       ceil_mode=bool(attributes.get("ceil_mode", 0)),
                                       count_include_pad=bool(attributes.get("count_include_pad", 0)))  # fmt: skip
    upstream = upstream_like(reference(torch.tensor(x)).shape)
    model = single_op_model("AveragePool", ["x"], {"x": x}, upstream, attributes)
    check_against_torch(model, reference, {"x": x}, ["x"], upstream)


def _with_specials(shape):
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    x.reshape(-1)[:4] = [np.nan, np.inf, -1e-30, -0.0]
    return x


@pytest.mark.parametrize("factor, modes", [(2, ("asymmetric", "floor")), (3, ("asymmetric", "floor")),
                                           (3, ("half_pixel", "round_prefer_ceil")),
                                           (2, ("pytorch_half_pixel", "round_prefer_floor"))])  # fmt: skip
def test_nearest_resize(factor, modes):
    x = _with_specials((1, 2, 2, 3))
    reference = lambda x: F.interpolate(x, scale_factor=factor, mode="nearest")  # noqa: E731
    upstream = upstream_like(reference(torch.tensor(x)).shape)
    attributes = {"mode": "nearest", "coordinate_transformation_mode": modes[0], "nearest_mode": modes[1]}
    scales = np.array([1, 1, factor, factor], np.float32)
    model = single_op_model("Resize", ["x", "", "scales"], {"x": x}, upstream, attributes, constants={"scales": scales})
    train = check_against_torch(model, reference, {"x": x}, ["x"], upstream)
    assert not {"Resize", "GatherGrad"} & op_types(train)


@pytest.mark.parametrize("modes", [("align_corners", "floor"), ("asymmetric", "ceil"), ("asymmetric", "round_prefer_floor")])
def test_nearest_resize_that_does_not_repeat_values_is_refused(modes):
    x = _with_specials((1, 1, 3, 3))
    attributes = {"mode": "nearest", "coordinate_transformation_mode": modes[0], "nearest_mode": modes[1]}
    model = single_op_model("Resize", ["x", "", "scales"], {"x": x}, 1.0, attributes,
                            constants={"scales": np.array([1, 1, 3, 3], np.float32)})  # fmt: skip
    with pytest.raises(graph_errors.GradientBuildError, match="do not repeat each value"):
        training_graph.build_training_graphs(model, ["x"], [], "loss", ["loss", "output"])


# (scales, align_corners, input shape); 5 x 7 by 1.5 is 7 x 10 (ONNX's and torch's floor), not a rounded 8 x 10
RESIZES = [((2, 2), False, (1, 2, 4, 6)), ((1.5, 3), False, (1, 2, 4, 6)), ((0.5, 2), False, (1, 2, 4, 6)),
           ((2, 1.5), True, (1, 2, 4, 6)), ((1.5, 1.5), False, (1, 2, 5, 7))]


@pytest.mark.parametrize("scales, align_corners, shape", RESIZES)
def test_linear_resize(scales, align_corners, shape):
    """Bilinear up- and downsampling: an inf or NaN spreads to its neighbours' outputs only, as in torch.
    (Huge values of opposite signs are not neighbours: their sum cancels, ill-conditioned in any order.)"""
    x = _with_specials(shape)
    x.reshape(-1)[20:24] = [3e38, 1e-40, 5.0, -3e38]
    reference = lambda x: F.interpolate(x, scale_factor=scales, mode="bilinear", align_corners=align_corners)  # noqa: E731
    upstream = upstream_like(reference(torch.tensor(x)).shape)
    transform = "align_corners" if align_corners else "pytorch_half_pixel"
    attributes = {"mode": "linear", "coordinate_transformation_mode": transform}
    constants = {"scales": np.array([1, 1, *scales], np.float32)}
    model = single_op_model("Resize", ["x", "", "scales"], {"x": x}, upstream, attributes, constants=constants)
    train = check_against_torch(model, reference, {"x": x}, ["x"], upstream)
    assert not {"Resize", "GatherGrad"} & op_types(train)


@pytest.mark.parametrize("scales, align_corners, shape", RESIZES)
def test_cubic_resize(scales, align_corners, shape):
    """Bicubic up- and downsampling as torch's upsample_bicubic2d: the four inputs around each source coordinate
    (clamped to the axis, negative coordinates not clamped), Keys' weights with a = -0.75; an inf or NaN spreads
    to the outputs within two inputs of it only. torch's float32 weights round differently (a few ulps: its
    compiler contracts the polynomial; torch's own float32 result is up to ~30 ulps off float64's here), and the
    weights' negative lobes cancel: 64 ulps of the output."""
    x = _with_specials(shape)
    x.reshape(-1)[20:24] = [3e38, 1e-40, 5.0, 7.0]
    reference = lambda x: F.interpolate(x, scale_factor=scales, mode="bicubic", align_corners=align_corners)  # noqa: E731
    upstream = upstream_like(reference(torch.tensor(x)).shape)
    transform = "align_corners" if align_corners else "pytorch_half_pixel"
    attributes = {"mode": "cubic", "coordinate_transformation_mode": transform, "cubic_coeff_a": -0.75}
    constants = {"scales": np.array([1, 1, *scales], np.float32)}
    model = single_op_model("Resize", ["x", "", "scales"], {"x": x}, upstream, attributes, constants=constants)
    train = check_against_torch(model, reference, {"x": x}, ["x"], upstream, ulps=64)
    assert not {"Resize", "GatherGrad"} & op_types(train)


@pytest.mark.parametrize("mode, pads", [("reflect", [0, 0, 2, 1, 0, 0, 1, 3]), ("edge", [0, 0, 3, 0, 0, 0, 2, 2]),
                                        ("edge", [0, 0, -1, 2, 0, 0, 1, -2])])  # fmt: skip
def test_reflect_and_edge_padding(mode, pads):
    """Negative pads crop; the gradient sums over the places a value was copied to."""
    x = _with_specials((1, 2, 4, 5))
    torch_mode = {"reflect": "reflect", "edge": "replicate"}[mode]
    cropped = [max(-pad, 0) for pad in pads]

    def reference(x):
        x = x[:, :, cropped[2] : x.shape[2] - cropped[6], cropped[3] : x.shape[3] - cropped[7]]
        return F.pad(x, [max(pads[3], 0), max(pads[7], 0), max(pads[2], 0), max(pads[6], 0)], mode=torch_mode)

    upstream = upstream_like(reference(torch.tensor(x)).shape)
    model = single_op_model("Pad", ["x", "pads"], {"x": x}, upstream, {"mode": mode},
                            constants={"pads": np.array(pads, np.int64)})  # fmt: skip
    train = check_against_torch(model, reference, {"x": x}, ["x"], upstream)
    assert "Pad" not in {node.name for node in train.graph.node}  # rewritten (a gather gradient may pad)


@pytest.mark.parametrize("starts, ends, axes, steps", [([-1], [-(2**63 - 1)], [3], [-1]), ([3, -1], [0, -10], [2, 3], [-2, -3])])
def test_reversing_slice(starts, ends, axes, steps):
    x = _with_specials((1, 2, 4, 5))

    def reference(x):
        for axis, start, end, step in zip(axes, starts, ends, steps):
            kept = np.arange(x.shape[axis])[slice(start, None if end < -x.shape[axis] else end, step)]
            x = x.index_select(axis, torch.tensor(kept.copy()))
        return x

    upstream = upstream_like(reference(torch.tensor(x)).shape)
    names = ("starts", "ends", "axes", "steps")
    constants = {name: np.array(value, np.int64) for name, value in zip(names, (starts, ends, axes, steps))}
    model = single_op_model("Slice", ["x", "starts", "ends", "axes", "steps"], {"x": x}, upstream, constants=constants)
    train = check_against_torch(model, reference, {"x": x}, ["x"], upstream)
    assert "Slice" not in op_types(train)


@pytest.mark.parametrize("op_type, function", [("ReduceLogSumExp", lambda x: torch.logsumexp(x, dim=1)),
                                               ("ReduceL2", lambda x: torch.linalg.vector_norm(x, dim=1))])  # fmt: skip
def test_reductions_that_drop_their_axis(op_type, function):
    """keepdims=0, rewritten to keepdims=1 + Squeeze; rows of 0, tiny, huge, inf, -inf and NaN values."""
    x = np.array([[0.0, 0.0, 0.0], [1e-30, -1e-30, 1e-40], [3e38, 3e38, 1.0], [np.inf, 1.0, -2.0],
                  [-np.inf, -np.inf, -np.inf], [np.nan, 1.0, 2.0], [-np.inf, 0.5, -1.0], [-3.0, 7.0, 0.25]], np.float32)
    upstream = upstream_like(function(torch.tensor(x)).shape)
    model = single_op_model(op_type, ["x", "axes"], {"x": x}, upstream, {"keepdims": 0},
                            constants={"axes": np.array([1], np.int64)}, opset=18)  # fmt: skip
    train = check_against_torch(model, function, {"x": x}, ["x"], upstream)
    assert op_type in op_types(train)  # the same kernel, with keepdims=1


def _pixel_unshuffle_onnx(x, block):
    """ONNX SpaceToDepth's channel order: (row offset, column offset, channel)."""
    n, c, h, w = x.shape
    moved = x.reshape(n, c, h // block, block, w // block, block).permute(0, 3, 5, 1, 2, 4)
    return moved.reshape(n, c * block * block, h // block, w // block)


def _depth_to_space_dcr(x, block):
    n, c, h, w = x.shape
    moved = x.reshape(n, block, block, c // block**2, h, w).permute(0, 3, 4, 1, 5, 2)
    return moved.reshape(n, c // block**2, h * block, w * block)


@pytest.mark.parametrize("op_type, mode, shape, reference", [
    ("DepthToSpace", "CRD", (1, 8, 2, 3), lambda x: F.pixel_shuffle(x, 2)),
    ("DepthToSpace", "DCR", (1, 8, 2, 3), lambda x: _depth_to_space_dcr(x, 2)),
    ("SpaceToDepth", None, (1, 2, 4, 6), lambda x: _pixel_unshuffle_onnx(x, 2)),
])  # fmt: skip
def test_depth_and_space_permutations(op_type, mode, shape, reference):
    x = _with_specials(shape)
    upstream = upstream_like(reference(torch.tensor(x)).shape)
    attributes = {"blocksize": 2} | ({"mode": mode} if mode else {})
    model = single_op_model(op_type, ["x"], {"x": x}, upstream, attributes)
    check_against_torch(model, reference, {"x": x}, ["x"], upstream)


@pytest.mark.parametrize("index, axis", [(1, 1), (-1, 1), (0, 0), (-2, 2)])
def test_constant_index_gather(index, axis):
    x = _with_specials((2, 3, 2))
    reference = lambda x: x.select(axis, index)  # noqa: E731
    upstream = upstream_like(reference(torch.tensor(x)).shape)
    model = single_op_model("Gather", ["x", "index"], {"x": x}, upstream, {"axis": axis},
                            constants={"index": np.array(index, np.int64)})  # fmt: skip
    train = check_against_torch(model, reference, {"x": x}, ["x"], upstream)
    assert "Gather" not in op_types(train)


@pytest.mark.parametrize("index, axis, shape", [([2, 0, 2, -1, 2], 1, (2, 4, 3)), ([1, 1, 0], -1, (3, 2, 2)),
                                                ([0, 0], 0, (1, 3, 2)), ([3], 2, (2, 2, 5))])  # fmt: skip
def test_gradient_of_a_constant_index_list_gather(index, axis, shape):
    """cpu_kernels.gather_grad: repeated (tied) and negative indices, positions no output reads, a size-1
    axis; the upstream gradient holds the edge values, so sums of inf and -inf, of FLT_MAX twice, of -0
    and of NaN are checked against torch's index_select backward."""
    x = _with_specials(shape)
    reference = lambda x: x.index_select(axis, torch.tensor(index) % shape[axis])  # noqa: E731
    output_shape = reference(torch.tensor(x)).shape
    upstream = np.resize(edge_values(), output_shape)
    model = single_op_model("Gather", ["x", "index"], {"x": x}, upstream, {"axis": axis},
                            constants={"index": np.array(index, np.int64)})  # fmt: skip
    train = check_against_torch(model, reference, {"x": x}, ["x"], upstream)
    assert "GatherGrad" not in op_types(train)


@pytest.mark.parametrize("opset", [12, 15])
def test_inference_batch_norm_uses_running_statistics(opset):
    """BatchNormalization in inference mode: normalized with the running statistics (never
    trained, never written), torch's gradients for x, scale and bias; variance 0 included."""
    x = np.array([[[1.0, 2.0], [3.0, -1e-30]], [[1e4, -1e4], [np.inf, 0.0]]], np.float32).transpose(1, 0, 2).copy()
    values = {"x": x, "scale": np.array([2.0, -0.5], np.float32), "bias": np.array([0.1, 1.0], np.float32),
              "mean": np.array([0.5, 1e4], np.float32), "var": np.array([0.0, 4.0], np.float32)}  # fmt: skip
    upstream = upstream_like(x.shape)
    attributes = {"epsilon": 1e-5} | ({"training_mode": 0} if opset >= 14 else {})
    model = single_op_model("BatchNormalization", list(values), values, upstream, attributes, opset=opset)
    reference = lambda x, scale, bias, mean, var: F.batch_norm(x, mean, var, scale, bias, False, 0.0, 1e-5)  # noqa: E731
    train = check_against_torch(model, reference, values, ["x", "scale", "bias"], upstream)
    assert not op_types(train) & {"BatchNormalization", "BatchNormInternal"}


# ---------------------------------------------------------------- symbolics (torch export)
def _targets(x, target):
    return np.broadcast_to(np.asarray(target, np.float32), x.shape).copy()


LOSSES = {
    "l1_loss": (lambda x, t: F.l1_loss(x, t, reduction="none"), edge_values(), 0.0),
    "smooth_l1_loss": (lambda x, t: F.smooth_l1_loss(x, t, reduction="none", beta=0.5), edge_values(0.5, -0.5, 0.49999997), 0.0),
    "smooth_l1_loss (beta 0)": (lambda x, t: F.smooth_l1_loss(x, t, reduction="none", beta=0.0), edge_values(), 0.0),
    "huber_loss": (lambda x, t: F.huber_loss(x, t, reduction="none", delta=2.0), edge_values(2.0, -2.0, 1.9999999), 0.0),
    "soft_margin_loss": (lambda x, t: F.soft_margin_loss(x, t, reduction="none"), np.array([0.0, -0.0, *spread(1e-40, 700)],
                                                                                            np.float32), 1.0),
    "soft_margin_loss (target -1)": (lambda x, t: F.soft_margin_loss(x, t, reduction="none"), np.array([*spread(1e-40, 700)],
                                                                                                        np.float32), -1.0),
    "poisson_nll_loss": (lambda x, t: F.poisson_nll_loss(x, t, reduction="none"),
                         np.array([0.0, 1e-30, -1e-30, 1.0, -1e4, 88.0, 89.0, 100.0, -np.inf, np.nan], np.float32), 2.0),
    "poisson_nll_loss (log_input False)": (lambda x, t: F.poisson_nll_loss(x, t, log_input=False, reduction="none"),
                                           np.array([0.0, 1e-30, 1e-8, 1.0, 1e4, 1e30, np.inf, np.nan], np.float32), 2.0),
    "hinge_embedding_loss (target 1)": (lambda x, t: F.hinge_embedding_loss(x, t, margin=1.0, reduction="none"),
                                        edge_values(1.0), 1.0),
    "hinge_embedding_loss (target -1)": (lambda x, t: F.hinge_embedding_loss(x, t, margin=1.0, reduction="none"),
                                         edge_values(1.0, 0.99999994), -1.0),
    "hinge_embedding_loss (target 0.5)": (lambda x, t: F.hinge_embedding_loss(x, t, margin=1.0, reduction="none"),
                                          edge_values(1.0), 0.5),
    "softplus": (lambda x, t: F.softplus(x), edge_values(*spread(1e-8, 100), 20.0, 20.000002), 0.0),
    "softplus (beta 2, threshold 1)": (lambda x, t: F.softplus(x, beta=2.0, threshold=1.0),
                                       edge_values(*spread(1e-4, 100), 0.5, 0.50000006, 0.49999997), 0.0),
    "softplus (beta -1, threshold 5)": (lambda x, t: F.softplus(x, beta=-1.0, threshold=5.0),
                                        edge_values(*spread(1e-4, 100), -5.0, -5.0000005), 0.0),
}


@pytest.mark.parametrize("case", LOSSES)
def test_exported_loss(case):
    function, x, target = LOSSES[case]
    values = {"x": x, "t": _targets(x, target)}
    upstream = np.ones_like(x)
    model = exported_model(function, values, upstream, ["x"])
    check_against_torch(model, function, values, ["x"], upstream)


_LOGITS = edge_values(*spread(1e-3, 200), 17.0, -17.0, 88.0, 89.0, -88.0, -104.0, -110.0)


@pytest.mark.parametrize("target, extra, floor", [(1.0, {}, 1e-9), (0.0, {}, 1e-9), (1.0, {"weight": 0.5}, 1e-9),
                                                  (0.3, {}, 3e-7), (0.3, {"pos_weight": 2.0}, 3e-7)])  # fmt: skip
def test_binary_cross_entropy_with_logits(target, extra, floor):
    """symbolics.losses.binary_cross_entropy_with_logits: torch's loss and gradient over logits from tiny to
    FLT_MAX (the exporter's log(sigmoid) form was inf from |x| ~ 17-88 on, and 2.5% low at 17).
    Left out: x = -inf with a target above 0, inf here (the limit) and NaN in torch (0 * -inf).
    Floors: 1e-9 where the loss is e^x of x < -20, which torch's float32 rounds to 0 and its
    float64 form cancels; 3e-7 for a soft target, whose gradient l sigmoid(x) - pos_weight t
    cancels near x = 0 (torch's float32 is off from float64 by as much)."""
    x = _LOGITS[~(np.isneginf(_LOGITS) & (target > 0))]
    tensor = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
    values = {"x": x, "t": _targets(x, target)}
    function = lambda x, t: F.binary_cross_entropy_with_logits(  # noqa: E731
        x, t, reduction="none", **{key: tensor(value).to(x.dtype) for key, value in extra.items()})
    upstream = upstream_like(x.shape)
    check_against_torch(exported_model(function, values, upstream, ["x"]), function, values, ["x"], upstream, floor=floor)


def test_log_sigmoid():
    """symbolics.elementwise.log_sigmoid: x, not -inf, far below 0 (the exporter wrote Log(Sigmoid(x)))."""
    values = {"x": _LOGITS}
    upstream = upstream_like(_LOGITS.shape)
    check_against_torch(exported_model(F.logsigmoid, values, upstream, ["x"]), F.logsigmoid, values, ["x"], upstream)


def test_l1_loss_gradient_at_nan_is_torchs_zero():
    """torch's l1_loss gradient is sign(x - target): 0 at NaN (a NaN batch leaves the weights finite)."""
    x = np.array([np.nan, 1.0], np.float32)
    values = {"x": x, "t": np.zeros_like(x)}
    model = exported_model(lambda x, t: F.l1_loss(x, t, reduction="sum"), values, 1.0, ["x"])
    np.testing.assert_array_equal(run_training_graph(model, values, ["x"])[0]["x_grad"], [0.0, 1.0])


def test_soft_margin_loss_stays_finite_where_torch_overflows():
    """A documented difference: torch computes log(1 + exp(-t x)), inf (gradient NaN) from
    -t x = 88.7 in float32 and 709.8 in float64; here it is -t x (gradient -t), as in exact arithmetic."""
    x = np.array([-1e3, -1e4, -1e30, -3.4e38, -np.inf], np.float32)
    values = {"x": x, "t": np.ones_like(x)}
    model = exported_model(lambda x, t: F.soft_margin_loss(x, t, reduction="none"), values, np.ones_like(x), ["x"])
    results, _ = run_training_graph(model, values, ["x"])
    np.testing.assert_array_equal(results["output"], -x)
    np.testing.assert_array_equal(results["x_grad"], -np.ones_like(x))


# probabilities: exact 0 and 1, saturated (p (1 - p) < 1e-12), its edge, log1p(-p) territory, interior
PROBABILITIES = np.array([0.0, 1.0, 1e-45, 1e-30, 1e-20, 1e-13, 9.9e-13, 1.01e-12, 1e-8, 1e-6, 0.3, 0.5, 0.9, 0.99999994],
                         np.float32)  # fmt: skip


@pytest.mark.parametrize("target", [1.0, 0.0, 0.25])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_binary_cross_entropy(target, reduction):
    """torch's value (log clamped at -100, log1p(-p)) and torch's gradient (p - t) / max(p (1 - p), 1e-12)."""
    p = PROBABILITIES
    values = {"p": p, "t": _targets(p, target), "w": np.linspace(0.5, 2.0, p.size).astype(np.float32)}
    function = lambda p, t, w: F.binary_cross_entropy(p, t, weight=w, reduction=reduction)  # noqa: E731
    upstream = np.ones(p.shape if reduction == "none" else (), np.float32)
    model = exported_model(function, values, upstream, ["p"])
    # soft targets: -t/p + (1 - t)/(1 - p) cancels near p = t, to an ulp of its terms (up to ~2)
    floor = FLOOR if target in (0.0, 1.0) else 1e-6
    check_against_torch(model, function, values, ["p"], upstream, floor=floor)


def test_bilinear_with_size_one_dimensions():
    generator = np.random.default_rng(1)
    values = {"a": generator.standard_normal((3, 1)).astype(np.float32), "b": generator.standard_normal((3, 2)).astype(np.float32),
              "w": generator.standard_normal((4, 1, 2)).astype(np.float32), "bias": np.array([0, 1e-30, 1e30, -1], np.float32)}  # fmt: skip
    upstream = upstream_like((3, 4))
    function = lambda a, b, w, bias: F.bilinear(a, b, w, bias)  # noqa: E731
    check_against_torch(exported_model(function, values, upstream, list(values)), function, values, list(values), upstream)


@pytest.mark.parametrize("eps", [1e-6, float(np.finfo(np.float32).eps)])
def test_rms_norm(eps):
    """torch's rms_norm (nn.RMSNorm), which the exporter refuses (symbolics.layers.rms_norm), over rows of
    edge values: zeros, tiny, huge (x * x overflows in float32, as in torch's float32 composite), inf, NaN.
    In the row with 3e38 the small entries' gradients are ~2e-38 in float64, NaN in torch's float32
    and 0 here: the floor allows that 0."""
    rows = [[0.0, 0.0, 0.0, 0.0], [1e-30, -1e-30, 1e-40, 0.0], [1.0, -2.0, 3.0, 0.5], [1e30, -1e30, 1.0, 0.0],
            [3e38, 1.0, -1.0, 2.0], [np.inf, 1.0, 0.0, -1.0], [np.nan, 1.0, 2.0, 3.0], [1e19, 1e19, -1e19, 1.0]]
    values = {"x": np.array(rows, np.float32), "weight": np.array([1.0, -0.5, 2.0, 0.0], np.float32)}
    function = lambda x, weight: F.rms_norm(x, (4,), weight, eps)  # noqa: E731
    upstream = upstream_like(values["x"].shape)
    check_against_torch(exported_model(function, values, upstream, ["x", "weight"]), function, values, ["x", "weight"], upstream,
                        floor=1e-37)  # fmt: skip


def test_sqrt_of_inf_is_inf():
    """ONNX Runtime's CPU Sqrt gives NaN for +inf in its vectorised blocks (cpu_kernels.exact_sqrt).
    Not -0: ONNX Runtime's Sqrt (and Where) give +0 there, so its gradient is +inf where torch's is -inf."""
    x = np.array([np.inf, 4.0, np.inf, 0.0, 3e38, 1e-30, -1.0, np.nan, np.inf, 2.0, 1.0, 9.0, np.inf, 16.0, 25.0, 0.5], np.float32)
    train = _unary_case("Sqrt", {}, torch.sqrt, x, floor=0.0)
    assert "IsInf" in op_types(train), "the Sqrt was not replaced"


# pairs of rows: identical, zero and not, opposite, huge, tiny (norm below eps), inf, NaN
_ROW_PAIRS = (np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 3.0], [1e20, 1e20, 1.0, 1.0],
                        [1e-30, -1e-30, 0.0, 1e-30], [np.inf, 1.0, 0.0, 1.0], [np.nan, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], np.float32),
              np.array([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0], [-1.0, 2.0, -0.5, -3.0], [1e20, 1.0, 1e20, 1.0],
                        [2e-30, 1e-30, 1e-30, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3e38, -3e38, 1.0, 0.0]], np.float32))  # fmt: skip


@pytest.mark.parametrize("p, ulps", [(1.0, ULPS), (2.0, ULPS), (3.0, 32), (np.inf, ULPS)])
def test_pairwise_distance(p, ulps):
    """symbolics.reductions.pairwise_distance: the p-norm of x1 - x2 + eps, as torch's (its own symbolic summed
    signed differences for p = 1 and gave a NaN gradient for identical rows). Known differences left
    out: for p = 1 and inf, the gradient of the other elements of a row whose difference holds a NaN
    (torch: 0, here NaN); for p = 3 (Pow, ReduceSum, Pow), ONNX Runtime's Pow is up to ~12 spacings
    off at the identical rows' 1e-6 differences."""
    kept = slice(None) if p in (2.0, 3.0) else [row for row in range(len(_ROW_PAIRS[0])) if row != 7]
    values = {"a": _ROW_PAIRS[0][kept], "b": _ROW_PAIRS[1][kept]}
    function = lambda a, b: F.pairwise_distance(a, b, p=p)  # noqa: E731
    upstream = upstream_like((len(values["a"]),))
    check_against_torch(exported_model(function, values, upstream, ["a", "b"]), function, values, ["a", "b"], upstream, ulps)


_CLAMPS = {
    "min": lambda x: x.clamp(min=0.5),
    "max": lambda x: x.clamp(max=0.5),
    "both": lambda x: x.clamp(-1.0, 0.5),
    "clamp_min": lambda x: torch.clamp_min(x, 0.5),
    "clamp_max": lambda x: torch.clamp_max(x, -1.0),
    "tensor-min": lambda x: x.clamp(min=torch.full_like(x, 0.5)),
    "tensor-both": lambda x: x.clamp(min=torch.full_like(x, -1.0), max=torch.full_like(x, 0.5)),
    "tensor-bounds-with-nan": lambda x: x.clamp(min=torch.where(x > 1e20, float("nan"), -1.0),
                                                max=torch.where(x < -1e20, float("nan"), 0.5)),
}


@pytest.mark.parametrize("case", _CLAMPS)
def test_clamp(case):
    """symbolics.elementwise.clamp: ±inf stay infinite with a scalar bound left out (torch's symbolic left Clip's
    input out, which ONNX Runtime takes as ±FLT_MAX), and x at a tensor bound gets the whole gradient
    (torch's Max / Min split it between x and the bound); inputs at, just inside and just outside the bounds."""
    x = edge_values(0.5, -1.0, 0.49999997, 0.50000006, -0.99999994, -1.0000001)
    function = _CLAMPS[case]
    upstream = upstream_like(x.shape)
    check_against_torch(exported_model(function, {"x": x}, upstream, ["x"]), function, {"x": x}, ["x"], upstream)


_HARD_TANHS = {
    "relu6": lambda x: F.relu6(x),
    "relu6-module-in-place": lambda x: torch.nn.ReLU6(inplace=True)(x * 1.0),
    "hardtanh": lambda x: F.hardtanh(x),
    "hardtanh-module": lambda x: torch.nn.Hardtanh(-2.0, 0.5)(x),
    "hardtanh-in-place": lambda x: F.hardtanh(x * 1.0, inplace=True),
    "relu-then-clamp": lambda x: F.relu(x).clamp(max=0.5),
}


@pytest.mark.parametrize("case", _HARD_TANHS)
def test_hardtanh(case):
    """symbolics.elementwise.hardtanh: the exporter writes hardtanh and relu6 as the Clip it writes for clamp, whose gradient
    passes at the bounds; torch's hardtanh_backward gives 0 there (defined_gradients.zero_gradient_at_bounds).
    A clamp after a ReLU keeps the ReLU's 0 at 0. Inputs at, just below and just above each bound."""
    bounds = np.float32([0.0, 6.0, -1.0, 1.0, -2.0, 0.5])
    x = edge_values(*bounds, *np.nextafter(bounds, np.float32(-np.inf)), *np.nextafter(bounds, np.float32(np.inf)))
    function = _HARD_TANHS[case]
    upstream = upstream_like(x.shape)
    check_against_torch(exported_model(function, {"x": x}, upstream, ["x"]), function, {"x": x}, ["x"], upstream)


@pytest.mark.parametrize("function", [lambda x: F.hardshrink(x, 0.5), lambda x: F.softshrink(x, 0.5)],
                         ids=["hardshrink", "softshrink"])  # fmt: skip
def test_shrink(function):
    """symbolics.elementwise.hardshrink / softshrink: NaN stays NaN (torch's symbolics gave 0); at, inside and outside ±lambd."""
    x = edge_values(0.5, -0.5, 0.49999997, -0.50000006, 0.25, -0.25, 2.0, -2.0)
    upstream = upstream_like(x.shape)
    check_against_torch(exported_model(function, {"x": x}, upstream, ["x"]), function, {"x": x}, ["x"], upstream)


def test_atan2():
    """symbolics.elementwise.atan2 on every pair of edge values and a few ordinary ones: the value is IEEE's (torch's symbolic
    gave -pi for atan2(+0, -1), the wrong sign at x = -0, NaN at (0, 0) and (inf, inf)), the gradient torch's
    (NaN wherever x = 0 before), also at infinite inputs and where y * y + x * x underflows."""
    edges = edge_values(0.5, -2.0, 3.0)
    y, x = (np.repeat(edges, edges.size), np.tile(edges, edges.size))
    values = {"y": y, "x": x}
    upstream = upstream_like(y.shape)
    function = lambda y, x: torch.atan2(y, x)  # noqa: E731
    check_against_torch(exported_model(function, values, upstream, ["y", "x"]), function, values, ["y", "x"], upstream)


_DIAGONALS = {
    "main": ((4, 6), lambda a: torch.diagonal(a)),
    "above": ((4, 6), lambda a: torch.diagonal(a, 2)),
    "below": ((4, 6), lambda a: torch.diagonal(a, -1)),
    "past-the-end": ((5, 3), lambda a: torch.diagonal(a, 4)),  # empty
    "batched-dims-0-2": ((2, 3, 5), lambda a: torch.diagonal(a, 0, 0, 2)),
    "dims-swapped": ((3, 3), lambda a: torch.diagonal(a, -1, 1, 0)),
    "Tensor.diag": ((4, 6), lambda a: a.diag()),
    "diag-above": ((4, 6), lambda a: torch.diag(a, 1)),
}


@pytest.mark.parametrize("case", _DIAGONALS)
def test_diagonal(case):
    """symbolics.indexing.diagonal / diag: the diagonal gathered, so an inf or NaN elsewhere in a row stays out of it
    (torch's symbolic multiplied by an eye mask and summed: NaN), and no If (which the gradient builder cannot pass)."""
    shape, function = _DIAGONALS[case]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[[1, 2]], x.reshape(-1)[-2] = (np.inf, -np.inf), np.nan
    upstream = upstream_like(tuple(function(torch.from_numpy(x)).shape))
    check_against_torch(exported_model(function, {"a": x}, upstream, ["a"]), function, {"a": x}, ["a"], upstream)


_DETACHES = {
    "straight-through": lambda x: x + (torch.round(x * 4.0) / 4.0 - x).detach(),
    "times-itself-detached": lambda x: x * x.detach(),
    "over-its-detached-size": lambda x: x / (x.detach().abs() + 1.0),
}


@pytest.mark.parametrize("case", _DETACHES)
def test_detach(case):
    """symbolics.elementwise.detach: torch's symbolic drops detach, so the gradient went through it (or the build failed on
    the Round of a straight-through estimator); the detached value is rewrites.detached's, on no gradient path."""
    x = edge_values(0.125, 0.375, -0.625, 2.5, 1e20, -3e25)
    function = _DETACHES[case]
    upstream = upstream_like(x.shape)
    check_against_torch(exported_model(function, {"x": x}, upstream, ["x"]), function, {"x": x}, ["x"], upstream)


def test_detached_value_is_every_float32_bit_for_bit():
    """rewrites.detached: ±0, denormals, normals up to FLT_MAX, ±inf come back with their bits; NaN as NaN."""
    bits = np.random.default_rng(0).integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([edge_values(2.0**62, -(2.0**62), 2.0**63, 2.0**-17, 2.0**-97, 2.0**-149), bits.view(np.float32)])
    function = lambda x: torch.stack([x.detach(), x])  # noqa: E731  (x reaches the loss through its second use)
    upstream = upstream_like((2, x.size))
    results, _ = run_training_graph(exported_model(function, {"x": x}, upstream, ["x"]), {"x": x}, ["x"])
    detached = results["output"][0]
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(detached), nan)
    differ = detached[~nan].view(np.uint32) != x[~nan].view(np.uint32)
    assert not differ.any(), f"{int(differ.sum())} values changed, e.g. {x[~nan][differ][:4]} -> {detached[~nan][differ][:4]}"
    np.testing.assert_array_equal(results["x_grad"].reshape(x.shape), upstream[1])  # the second use's only


def test_cosine_similarity():
    """symbolics.reductions.cosine_similarity: each row over its norm clamped to eps for the value only, as torch's
    (its own symbolic gave a NaN gradient for a zero vector and overflowed from |x| ~ 1e19). Gradients
    that cancel to 0 (identical or opposite rows) keep rounding noise of ~1e-7 of their terms, in torch
    too: hence the floor."""
    values = {"a": _ROW_PAIRS[0], "b": _ROW_PAIRS[1]}
    function = lambda a, b: F.cosine_similarity(a, b, dim=1)  # noqa: E731
    upstream = upstream_like((len(_ROW_PAIRS[0]),))
    check_against_torch(exported_model(function, values, upstream, ["a", "b"]), function, values, ["a", "b"], upstream, floor=1e-6)


@pytest.mark.parametrize("swap", [False, True])
def test_triplet_margin_loss(swap):
    """symbolics.losses.triplet_margin_loss over the row pairs above as anchor and positive, the positive's
    rows reversed as negative (one equal to its anchor): with ``swap``, the identical anchor and
    positive of row 0 tie the two negative distances (half the gradient each, as in torch). Row 3's
    two distances' gradients cancel to ~1e-7 (rounding noise, in torch's float32 too): the floor."""
    anchor, positive = _ROW_PAIRS
    values = {"anchor": anchor, "positive": positive, "negative": positive[::-1].copy()}
    values["negative"][0] = [1.0, 2.0, 3.0, 4.5]  # a tie inside the margin, so the tied distances get gradients
    values["negative"][1] = anchor[1]
    function = lambda anchor, positive, negative: F.triplet_margin_loss(  # noqa: E731
        anchor, positive, negative, margin=1.0, swap=swap, reduction="none")
    upstream = upstream_like((len(anchor),))
    trainable = list(values)
    check_against_torch(exported_model(function, values, upstream, trainable), function, values, trainable, upstream, floor=1e-6)


def test_margin_ranking_loss():
    x1 = edge_values(1.0, 0.5)
    values = {"x1": x1, "x2": np.roll(x1, 3), "y": np.where(np.arange(x1.size) % 3 == 0, -1.0, 1.0).astype(np.float32)}
    values["x2"][-1] = x1[-1] - 0.5  # y = 1, margin 0.5: the hinge exactly at 0
    values["y"][-1] = 1.0
    function = lambda x1, x2, y: F.margin_ranking_loss(x1, x2, y, margin=0.5, reduction="none")  # noqa: E731
    upstream = upstream_like(x1.shape)
    check_against_torch(exported_model(function, values, upstream, ["x1", "x2"]), function, values, ["x1", "x2"], upstream)


def test_cosine_embedding_loss():
    """torch's formula with its 1e-12 in the denominator: zero vectors, huge, tiny, inf and NaN rows,
    targets 1 and -1 (margin 0.2: cos - margin at and around the kink)."""
    a, b = _ROW_PAIRS
    values = {"a": a, "b": b, "y": np.array([1, -1, 1, -1, 1, -1, 1, -1, -1], np.float32)}
    function = lambda a, b, y: F.cosine_embedding_loss(a, b, y, margin=0.2, reduction="none")  # noqa: E731
    upstream = upstream_like((len(a),))
    check_against_torch(exported_model(function, values, upstream, ["a", "b"]), function, values, ["a", "b"], upstream, floor=1e-6)


@pytest.mark.parametrize("threshold, value", [(0.5, -2.0), (-1.0, 20.0), (0.0, 0.0)])
def test_threshold(threshold, value):
    """symbolics.elementwise.threshold (nn.Threshold; the exporter refuses a non-zero threshold or value): value
    where x <= threshold, at the threshold too, and no gradient there; NaN passes with its gradient."""
    x = edge_values(threshold, np.nextafter(np.float32(threshold), np.float32(1)), np.nextafter(np.float32(threshold), np.float32(-1)))
    values = {"x": x}
    function = lambda x: F.threshold(x, threshold, value)  # noqa: E731
    upstream = upstream_like(x.shape)
    check_against_torch(exported_model(function, values, upstream, ["x"]), function, values, ["x"], upstream)


def test_channel_shuffle():
    """symbolics.indexing.channel_shuffle: torch's permutation of the channels, values (inf, NaN) and gradients."""
    x = np.resize(edge_values(), (2, 6, 2, 2)).astype(np.float32)
    values = {"x": x}
    function = lambda x: F.channel_shuffle(x, 3)  # noqa: E731
    upstream = upstream_like(x.shape)
    check_against_torch(exported_model(function, values, upstream, ["x"]), function, values, ["x"], upstream)


def _bag_weight():
    """Embedding rows of edge values, each row a rotation of them (a bag adds or compares inf with
    -inf, NaN with numbers, huge with huge); row 5 repeats row 1 (ties); row 6 is all -inf."""
    values = edge_values(2.0, 2.0)
    rows = [np.roll(values, 3 * row) for row in range(5)]
    return np.stack(rows + [rows[1], np.full_like(values, -np.inf)]).astype(np.float32)


# indices, offsets: bags [0, 1, 5], [] (empty), [2, 2, 6], [3], [4, 0, 5, 1, 3]; with padding_idx 2 the third is [6]
BAG_INDICES, BAG_OFFSETS = np.array([0, 1, 5, 2, 2, 6, 3, 4, 0, 5, 1, 3]), np.array([0, 3, 3, 6, 7])
BAGS = {
    "sum": dict(mode="sum"),
    "mean": dict(mode="mean"),
    "max": dict(mode="max"),
    "max, NaN first": dict(mode="max", first_nan=True),
    "mean, padding_idx": dict(mode="mean", padding_idx=2),
    "max, padding_idx": dict(mode="max", padding_idx=2),
    "sum, per_sample_weights": dict(mode="sum", per_sample_weights=True),
    "sum, include_last_offset": dict(mode="sum", include_last_offset=True),
}


@pytest.mark.parametrize("case", BAGS)
def test_embedding_bag(case):
    """F.embedding_bag (nn.EmbeddingBag) exported without a Loop (symbolics.indexing.embedding_bag): each bag's
    value and the gradient of every row, an empty bag's 0 included; max as torch's kernel takes it
    (the first of the largest, NaN only when it comes first) and its gradient to that entry only."""
    options = dict(BAGS[case])
    weight = _bag_weight()
    if options.pop("first_nan", False):
        weight = np.roll(weight, 1, axis=1)  # edge_values ends with NaN, now the first column
    values = {"weight": weight, "indices": BAG_INDICES, "offsets": BAG_OFFSETS}
    if options.pop("per_sample_weights", False):
        values["per_sample_weights"] = np.array([1.0, -0.0, 2.0, np.inf, 0.0, -1e-30, np.nan, 1e30, -3.0, 0.5, 1.0, 7.0],
                                                np.float32)  # fmt: skip
    bags = len(BAG_OFFSETS) - (1 if options.get("include_last_offset") else 0)
    function = lambda weight, indices, offsets, per_sample_weights=None: F.embedding_bag(  # noqa: E731
        indices, weight, offsets, per_sample_weights=per_sample_weights, **options)
    upstream = upstream_like((bags, weight.shape[1]))
    trainable = [name for name in values if name not in ("indices", "offsets")]
    train = check_against_torch(exported_model(function, values, upstream, trainable), function, values, trainable, upstream)
    assert "Loop" not in op_types(train)


# ---------------------------------------------------------------- fast CPU kernels
def _masked_logits():
    inf = np.inf
    return np.array([[0.0, -inf, 1.0], [-inf, 2.0, -inf], [-inf, 0.0, 1e4], [1e-30, 0.0, -1e-30], [-inf, -inf, 5.0]], np.float32)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("labels", [[2, 1, 0, 1, 2], [-1, 1, -1, 0, 2], [-1, -1, -1, -1, -1]], ids=["all counted", "ignored", "all ignored"])
def test_softmax_cross_entropy(reduction, labels):
    """-inf logits (masked classes, also at class 0 of ignored rows), ignored rows, all ignored."""
    logits, labels = _masked_logits(), np.array(labels, np.int64)
    function = lambda x, labels: F.cross_entropy(x, labels, ignore_index=-1, reduction=reduction)  # noqa: E731
    upstream = upstream_like(function(torch.tensor(logits), torch.tensor(labels)).shape)
    model = single_op_model("SoftmaxCrossEntropyLoss", ["x", "labels"], {"x": logits}, upstream,
                            {"reduction": reduction, "ignore_index": -1}, constants={"labels": labels})  # fmt: skip
    train = check_against_torch(model, lambda x: function(x, torch.tensor(labels)), {"x": logits}, ["x"], upstream)
    assert not op_types(train) & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"}


def test_relu_gradient_kernel():
    """ReluGrad replaced: 0 where x <= 0 (0 included, as torch), dy elsewhere."""
    train = _unary_case("Relu", {}, F.relu, edge_values())
    assert "ReluGrad" not in op_types(train)


def test_relu_gradient_kernel_passes_the_gradient_at_nan():
    """torch's threshold_backward passes the gradient where not x <= 0, NaN included (ReluGrad gave 0)."""
    x = np.full(64, np.nan, np.float32)
    results, train = run_training_graph(single_op_model("Relu", ["x"], {"x": x}, 2.0), {"x": x}, ["x"])
    _, torch_gradients = torch_reference(lambda x: F.relu(x), {"x": x}, 2.0, ["x"], torch.float32)
    np.testing.assert_array_equal(results["x_grad"], torch_gradients["x"])
    assert "ReluGrad" not in op_types(train)


def test_gelu_gradient_kernel():
    """GeluGrad replaced. x Phi(x) and Phi(x) + x phi(x) cancel for x << 0 (Phi = (1 + erf)/2),
    in torch's float32 kernel as in ONNX Runtime's: an absolute 1e-6 is allowed. ±inf are
    left out: torch's float32 value and gradient are NaN there, float64's inf and NaN."""
    x = edge_values(*spread(1e-8, 30))
    train = _unary_case("Gelu", {}, F.gelu, x[np.isfinite(x) | np.isnan(x)], floor=1e-6, domain="com.microsoft")
    assert "GeluGrad" not in op_types(train)


def test_tanh_gelu_gradient_kernel():
    """FastGeluGrad (GPT-2's tanh GELU) replaced; torch's gelu(approximate="tanh") in float64.
    As for the erf GELU, the two terms cancel for x << 0: an absolute 1e-6 is allowed. Where x^2
    overflows float32 (|x| > 1.8e19) and at ±inf the gradient is NaN, as torch's float32 one
    (0 * inf; float64 has 1 and 0 there): an element equal to torch's float32 result passes."""
    x = edge_values(*spread(1e-8, 30), 1e19, -1e19, 1e20, -1e20)
    train = _unary_case("FastGelu", {}, lambda x: F.gelu(x, approximate="tanh"), x, floor=1e-6, domain="com.microsoft")
    assert "FastGeluGrad" not in op_types(train)


@pytest.mark.parametrize("kernel, stride, pads", [(2, 2, 0), (3, 1, 1), (3, 2, 1)])
@pytest.mark.parametrize("relu_first", [False, True])
def test_max_pool_gradient(kernel, stride, pads, relu_first):
    """MaxPoolGrad as a scatter (and ReLU -> MaxPool swapped): ties go to the first maximum,
    overlapping windows add up, -inf windows."""
    x = np.array([[1.0, 1.0, 0.0, -1.0, 2.0], [-np.inf, -np.inf, 0.0, 0.0, 2.0], [3.0, -1e-30, 1e-30, 0.0, -0.0],
                  [5.0, 5.0, 5.0, 5.0, 1e30], [-2.0, -3.0, -np.inf, -1.0, -1.0]], np.float32).reshape(1, 1, 5, 5)  # fmt: skip
    function = lambda x: F.max_pool2d(F.relu(x) if relu_first else x, kernel, stride, pads)  # noqa: E731
    upstream = upstream_like(function(torch.tensor(x)).shape)
    attributes = {"kernel_shape": [kernel, kernel], "strides": [stride, stride], "pads": [pads] * 4}
    model = single_op_model("MaxPool", ["x"], {"x": x}, upstream, attributes, before=["Relu"] if relu_first else [])
    train = check_against_torch(model, function, {"x": x}, ["x"], upstream)
    assert "MaxPoolGrad" not in op_types(train)


_FLT_MAX = float(FLOAT32.max)
# 2x2 windows (kernel 2, stride 2): NaN with finite values; -inf only; inf before NaN; -FLT_MAX among
# -inf; a tie; -inf, inf and NaN. No window of kernel 3 (stride 1 or 2, padding 1) holds two NaN.
_NAN_AND_INFINITE_WINDOWS = np.array([[np.nan, 1, -np.inf, -np.inf, np.inf, np.nan], [2, 3, -np.inf, -np.inf, 0, 0],
                                      [-np.inf, -_FLT_MAX, 5, 5, -np.inf, np.inf],
                                      [-_FLT_MAX, -np.inf, 5, -1, np.nan, -np.inf]], np.float32).reshape(1, 1, 4, 6)  # fmt: skip


@pytest.mark.parametrize("kernel, stride, pads", [(2, 2, 0), (3, 1, 1), (3, 2, 1)])
@pytest.mark.parametrize("relu_first", [False, True])
def test_max_pool_at_nan_and_infinite_windows(kernel, stride, pads, relu_first):
    """cpu_kernels.exact_max_pool: a window holding NaN gives NaN and its index, one of -inf only
    -inf, -FLT_MAX beats -inf; ONNX Runtime's kernel gave 1 for NaN and 1, and -FLT_MAX with an
    index outside the window for -inf only."""
    x = _NAN_AND_INFINITE_WINDOWS
    function = lambda x: F.max_pool2d(F.relu(x) if relu_first else x, kernel, stride, pads)  # noqa: E731
    upstream = upstream_like(function(torch.tensor(x)).shape)
    attributes = {"kernel_shape": [kernel, kernel], "strides": [stride, stride], "pads": [pads] * 4}
    model = single_op_model("MaxPool", ["x"], {"x": x}, upstream, attributes, before=["Relu"] if relu_first else [])
    check_against_torch(model, function, {"x": x}, ["x"], upstream)


@pytest.mark.parametrize("kernel, stride, pads", [(2, 2, 0), (3, 1, 1), (3, 2, 1)])
def test_max_pool_window_of_several_nan(kernel, stride, pads):
    """Of several NaN in a window the last, in row-major order, takes the gradient, as in torch;
    NaN-only windows, NaN beside inf, and overlapping windows sharing some of their NaN, in planes
    (images, channels) of other patterns."""
    x = np.full((2, 3, 4, 5), np.nan, np.float32)
    x[0, 0, 1, 3], x[0, 0, 2, 1], x[0, 0, 3, 4], x[0, 0, 0, 2] = 7.0, np.inf, -np.inf, 1.0
    x[1:, 1:] = np.where(np.random.default_rng(0).random((1, 2, 4, 5)) < 0.5, np.nan, np.arange(40.0).reshape(1, 2, 4, 5))
    function = lambda x: F.max_pool2d(x, kernel, stride, pads)  # noqa: E731
    upstream = upstream_like(function(torch.tensor(x)).shape)
    attributes = {"kernel_shape": [kernel, kernel], "strides": [stride, stride], "pads": [pads] * 4}
    model = single_op_model("MaxPool", ["x"], {"x": x}, upstream, attributes)
    results, _ = run_training_graph(model, {"x": x}, ["x"])
    expected, gradients = torch_reference(function, {"x": x}, upstream, ["x"])
    np.testing.assert_array_equal(results["output"], expected)
    np.testing.assert_array_equal(results["x_grad"], gradients["x"])  # at the NaN too, which check_against_torch skips


@pytest.mark.parametrize("probabilities", [False, True], ids=["class-indices", "class-probabilities"])
@pytest.mark.parametrize("reduction, weighted", [("none", False), ("mean", True), ("sum", True)])
def test_cross_entropy_with_label_smoothing_at_edge_values(reduction, weighted, probabilities):
    """symbolics.losses.cross_entropy_loss: torch's label smoothing formulas, a row per edge value (and a
    kink's neighbour) among ordinary scores; with class indices one target ignored in the weighted
    cases, with class probabilities (soft labels) rows of a softmax."""
    rows = np.array([[value, 0.5, -1.0, 2.0, 0.0] for value in edge_values(*KINKS)], np.float32)
    targets = np.arange(len(rows)) % 5
    ignore_index = -100
    if weighted:
        targets[1] = ignore_index
    if probabilities:
        targets = torch.softmax(torch.randn(rows.shape, generator=torch.Generator().manual_seed(0)), 1).numpy()
    values = {"x": rows, "t": targets if probabilities else targets.astype(np.int64),
              "w": np.array([0.5, 1.0, 2.0, 1.5, 0.7], np.float32)}  # fmt: skip

    def function(x, t, w):
        return F.cross_entropy(x, t, weight=w if weighted else None, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=0.1)  # fmt: skip

    upstream = upstream_like((len(rows),)) if reduction == "none" else 1.0
    model = exported_model(function, values, upstream, ["x"])
    assert "LogSoftmax" in op_types(model)
    # a gradient is a difference of terms up to the largest weight: float32 rounding of those terms (torch's
    # own float32 result is 56 float32 spacings from float64's at x = -3.0000002), not of the result
    check_against_torch(model, function, values, ["x"], upstream, floor=1e-7)


@pytest.mark.parametrize("loss", [F.cross_entropy, lambda x, *args, **kwargs: F.nll_loss(F.log_softmax(x, 1), *args, **kwargs)],
                         ids=["cross_entropy", "nll_loss of log_softmax"])  # fmt: skip
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class-weights"])
@pytest.mark.parametrize("targets", [[0, 1, 3, 2, -100], [-100] * 5, [2, -100, 2, 2, -100]],
                         ids=["ordinary", "all ignored", "only weight-0 classes"])  # fmt: skip
def test_losses_over_class_indices_when_the_kept_weights_sum_to_zero(loss, reduction, weighted, targets):
    """symbolics.losses._loss_over_targets: a mean divides by the weights of the targets kept, so a batch of ignored
    targets only, or of targets whose class weight is 0 only, gives torch's 0 / 0 = NaN, and NaN gradients at the
    targets of weight 0 (ONNX Runtime's own mean gave 0 and gradients of 0); -inf, huge and tied scores in the rows."""
    inf = np.inf
    rows = np.array([[0.0, -inf, 1.0, 2.0], [1e30, 0.0, -1e30, 1.0], [-0.0, 1e-30, 0.5, -2.0], [3.0, 3.0, 3.0, 3.0],
                     [-inf, 0.0, 1.0, 5.0]], np.float32)  # fmt: skip
    values = {"x": rows, "t": np.array(targets, np.int64), "w": np.array([1.0, 2.0, 0.0, 0.5], np.float32)}

    def function(x, t, w):
        return loss(x, t, weight=w if weighted else None, reduction=reduction)

    upstream = upstream_like((len(rows),)) if reduction == "none" else 1.0
    model = exported_model(function, values, upstream, ["x"])
    check_against_torch(model, function, values, ["x"], upstream)


@pytest.mark.parametrize("third", [False, True], ids=["two quotients", "and a third term"])
def test_sum_of_quotients_by_constants(third):
    """a / 2 + b / 3 (+ relu(c)): ONNX Runtime's training optimizer fused it into a ScaledSum, which has no CPU kernel
    (refused), multiplies by 1/3 where torch divides by 3, and with a third term read relu's input instead of its
    output; rewrites.arithmetic.sum_of_quotients keeps the Add apart, bit for bit."""
    a = edge_values(3.0, 1.0 / 3.0, 7.0)
    values = {"a": a, "b": a[::-1].copy()}
    if third:
        values["c"] = np.linspace(-2.0, 2.0, len(a)).astype(np.float32)

    def function(a, b, c=None):
        total = a / 2.0 + b / 3.0
        return -(total if c is None else total + torch.relu(c))  # the sum not an output, as the fusion needs

    upstream = upstream_like(a.shape)
    model = exported_model(function, values, upstream, list(values))
    train = check_against_torch(model, function, values, list(values), upstream, ulps=0)
    assert "ScaledSum" not in op_types(train)


def _rows_for_layer_norm(width):
    """Rows of ``width`` values: ordinary, shifted by 100 and by 1234 (a large mean against a spread of 1), constant
    (1234, 0), huge (1e30 spread), and holding inf and NaN."""
    generator = np.random.default_rng(0)
    ordinary = generator.standard_normal((3, width)).astype(np.float32)
    rows = [ordinary[0], ordinary[1] + 100.0, ordinary[2] + 1234.0, np.full(width, 1234.0), np.zeros(width),
            ordinary[0] * 1e30, np.where(np.arange(width) == 1, np.inf, ordinary[1]),
            np.where(np.arange(width) == 2, np.nan, ordinary[2])]  # fmt: skip
    return np.array(rows, np.float32)


@pytest.mark.parametrize("width, normalized", [(16, 1), (8, 2)], ids=["rows of 16", "two axes"])
def test_layer_norm_of_rows_with_a_large_mean(width, normalized):
    """cpu_kernels.centered_layer_norms: ONNX Runtime's CPU kernel takes the variance as E[x^2] - mean^2 in float32
    (rows of mean 1234 came out 0.07 off torch); the kernel now sees the rows minus their mean. Value and gradients
    of x, weight and bias against float64 torch, within 256 float32 spacings: a constant row's gradient is 1/sqrt(eps)
    = 316 times a difference of terms of ~1 (dy * weight minus its mean), rounded; torch's own float32 gradients are
    1% off there and 0.16% off on the row of mean 1234."""
    x = _rows_for_layer_norm(width * 2 if normalized == 2 else width)
    if normalized == 2:
        x = x.reshape(len(x), 2, width)
    shape = x.shape[-normalized:]
    generator = np.random.default_rng(1)
    values = {"x": x, "weight": generator.uniform(0.5, 1.5, shape).astype(np.float32),
              "bias": generator.standard_normal(shape).astype(np.float32)}  # fmt: skip

    def function(x, weight, bias):
        return F.layer_norm(x, shape, weight, bias)

    upstream = upstream_like(x.shape)
    train = check_against_torch(exported_model(function, values, upstream, list(values)), function, values, list(values),
                                upstream, ulps=256)  # fmt: skip
    assert "LayerNormalization" in op_types(train)


@pytest.mark.parametrize("n, dim, ends", [(1, 1, False), (2, 0, False), (1, 1, True)])
def test_diff(n, dim, ends):
    """torch.diff, which the exporter refused (symbolics.reductions.diff): n differences along dim, prepend and append
    concatenated first; inf - inf gives NaN where torch's does."""
    x = _with_specials((4, 5))
    values = {"x": x, "before": np.full((4, 1), -3.0, np.float32), "after": np.full((4, 2), np.inf, np.float32)}
    function = lambda x, before, after: torch.diff(x, n, dim, *((before, after) if ends else ()))  # noqa: E731
    upstream = upstream_like(function(**{name: torch.tensor(value) for name, value in values.items()}).shape)
    check_against_torch(exported_model(function, values, upstream, ["x"]), function, values, ["x"], upstream)


def test_cumsum_in_the_dtype_asked_for_and_of_bools_as_int64():
    """torch's symbolic dropped a constant dtype (a float32 sum where torch sums in float64: 1e8 + 1 - 1e8
    is 0 in float32) and wrote a CumSum of bool, which ONNX has not (symbolics.reductions.cumsum)."""
    x = np.array([[1e8, 1.0, -1e8, 0.5], [3.0, -0.0, np.inf, 1.0]], np.float32)

    def function(x):
        counts = (x > 0.75).cumsum(1)  # int64 in torch
        return x.cumsum(1, dtype=torch.float64).float() + counts.float()

    values, upstream = {"x": x}, upstream_like(x.shape)
    check_against_torch(exported_model(function, values, upstream, ["x"]), function, values, ["x"], upstream)


def _float_neighbours(values, dtype):
    """``values`` and the next representable value of ``dtype`` on either side of each."""
    values = torch.tensor(values, dtype=dtype)
    return torch.cat([values, torch.nextafter(values, values + 1), torch.nextafter(values, values - 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins, low, high", [(4, 0, 4), (4, 0, 3), (7, -1.3, 2.9), (5, 0.1, 0.7), (3, -1e-30, 1e-30),
                                             (1, -5, 5)])  # fmt: skip
def test_histc_counts_as_torch_at_the_bin_edges(dtype, bins, low, high):
    """torch.histc, which the exporter has not (symbolics.reductions.histc; transformers' load-balancing loss counts
    each expert's tokens with it): counts equal torch's in the same dtype at every bin edge and either float neighbour
    of it (where torch's arithmetic, not the edge, decides), at min and max, ±0, ±tiny, ±huge, ±inf and NaN (in no bin),
    and for an empty tensor."""
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float64).tolist()
    specials = [0.0, -0.0, 1e-30, -1e-30, 1e-40, 1e30, -1e30, 3e38, -3e38, np.inf, -np.inf, np.nan]
    spread_in = torch.linspace(low - 0.1 * (high - low), high + 0.1 * (high - low), 301, dtype=dtype)
    x = torch.cat([_float_neighbours(edges + specials, dtype), spread_in]).numpy()
    for values in (x, x[:0]):
        function = lambda x: torch.histc(x, bins=bins, min=low, max=high)  # noqa: E731
        model = exported_model(function, {"x": values}, np.ones(bins, np.float32), [])
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        counts = session.run(["output"], {})[0]
        expected = function(torch.from_numpy(values)).numpy()
        assert counts.dtype == expected.dtype and (counts == expected).all(), f"{counts} != torch's {expected}"


@pytest.mark.parametrize("dtype, low, high, message", [
    (torch.float32, 0, 0, r"torch.histc in module '.*' with min == max \(0\) takes its range from the batch's values"),
    (torch.float16, 0, 4, r"torch.histc in module '.*' of a torch.float16 tensor: .* float32 and float64 only"),
])  # fmt: skip
def test_histc_refused_where_it_would_differ(dtype, low, high, message):
    """A range from the batch's values (torch's for min == max) and half-precision counts are refused by name."""
    values = {"x": torch.arange(6, dtype=dtype).numpy()}
    with pytest.raises(ValueError, match=message):
        exported_model(lambda x: torch.histc(x, bins=4, min=low, max=high), values, np.ones(4, np.float32), [])


# ---------------------------------------------------------------- through the public API (ORTTrainer)
def _attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# 7 queries, 4 keys of dimension 2 (scale 1/sqrt(2)): keys 0 and 1 tie; queries 2 and 5 score ±7e17 (a tie between
# huge scores; the opposite, which key 3 takes alone); key 2's value is ±1e30, seen by query 3 only, as its one key;
# queries 1 and 4 see no key.
_QUERIES = np.array([[[1.0, 0.0], [0.5, 0.5], [1e18, 0.0], [3.0, -2.0], [0.0, 0.0], [-1e18, 1.0], [2.0, -1.0]]], np.float32)
_KEYS = np.array([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 1e-30]]], np.float32)
_VALUES = np.array([[[1.0, -2.0], [3.0, 0.5], [1e30, -1e30], [-1.0, 1e-30]]], np.float32)
_SEEN = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1], [0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 0, 1], [1, 0, 0, 1]], bool)


def _float_mask():
    """_SEEN as 0 and -inf, with finite entries among them: 0.5 and -1e4, 1e30 (that key takes query 5), -FLT_MAX
    (Hugging Face's masked key: query 6 then sees key 3 only)."""
    mask = np.where(_SEEN, 0.0, -np.inf).astype(np.float32)
    mask[0, 1], mask[0, 3], mask[5, 1], mask[6, 0] = 0.5, -1e4, 1e30, -FLOAT32.max
    return mask


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_attention_at_edge_scores_and_rows_that_see_no_key(mask):
    """symbolics.layers.scaled_dot_product_attention in the trainer: a query that sees no key (a bool mask all False, a float
    mask all -inf) gets 0 and no gradient, as from torch's safe softmax; ties, huge scores, a lone key, masks mixing
    -inf with finite values. The float mask is a weight (a learned bias): its gradient is compared too. Where a query's
    scores' gradients cancel (the tie at ±7e17: 0 in float64) ONNX Runtime leaves 3.5e-8 of terms of ~1: the floor."""
    batch, weights = {"q": _QUERIES, "k": _KEYS, "v": _VALUES}, {}
    if mask == "bool":
        batch["mask"] = _SEEN
    else:
        weights["mask"] = _float_mask()
    check_trainer_against_torch(_attention, [batch], weights, ["q", "k", "v"], floor=1e-6)


def test_attention_over_one_key():
    """Sequences of one query and one key (batch 4, 2 heads; scores up to 6e35): the key seen (mask 0), not seen
    (-inf: output 0, no gradient), and at -FLT_MAX (Hugging Face's masked key, which torch attends to when it is the
    only one; a score below -1e31 would take the sum beyond -FLT_MAX, see the next test)."""
    q = np.array([[[1e18, 0.0, 0.0]], [[-0.0, 1e-30, 2.0]], [[0.5, 1.0, 2.0]], [[1e30, -1e30, 0.0]],
                  [[1e18, 1.0, 0.0]], [[3.0, -1.0, 0.25]], [[0.0, 0.0, 0.0]], [[7.0, 7.0, 7.0]]], np.float32).reshape(4, 2, 1, 3)
    k = np.array([[[1e18, 1.0, 0.0]], [[3.0, 0.5, -1.0]], [[1.0, 1.0, 1.0]], [[0.0, 0.0, 1e-30]],
                  [[1e18, 0.0, 0.0]], [[1.0, 1.0, 1.0]], [[2.0, -2.0, 0.0]], [[1e-30, 0.0, -1.0]]], np.float32).reshape(4, 2, 1, 3)
    v = np.resize(np.array([1e30, -1e30, 3e38, -0.0, 1e-30, 2.0, -7.0], np.float32), (4, 2, 1, 3))
    mask = np.array([0.0, -np.inf, -FLOAT32.max, -np.inf], np.float32).reshape(4, 1, 1, 1)
    check_trainer_against_torch(_attention, [{"q": q, "k": k, "v": v}], {"mask": mask}, ["q", "k", "v"])


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="NaN where torch's safe softmax gives 0 (head 0: q.k = -inf; "
                                                              "head 1: q.k = -1e40, -inf in float32, where torch's float32 "
                                                              "gives 0, float64 6 and 7), and 0 where torch gives NaN (head 2: "
                                                              "no key, v holds inf: torch's 0 * inf)")  # fmt: skip
def test_attention_rows_whose_scores_are_all_minus_inf_or_whose_values_are_not_finite():
    """Known differences, left (symbolics.layers.scaled_dot_product_attention would compute the scores itself, on every
    attention's scores, to remove them): torch's safe softmax looks at the scores (q.k + mask), the symbolic at the
    mask only, so a row whose every score is -inf under a finite mask (an inf input; q.k beyond -FLT_MAX in float32,
    also -FLT_MAX, Hugging Face's masked value, plus a score below -1e31) is NaN here, and its gradients; and torch
    multiplies a row that sees no key, 0, by the values (NaN where they hold inf or NaN), where the symbolic puts 0."""
    q = np.array([[[[np.inf, 0.0]], [[1e20, 1.0]], [[0.5, 0.5]]]], np.float32)
    k = np.array([[[[-1.0, 0.0]], [[-1e20, 0.0]], [[0.0, 1.0]]]], np.float32)
    v = np.array([[[[2.0, 3.0]], [[6.0, 7.0]], [[np.inf, 1.0]]]], np.float32)
    mask = np.array([0.0, 0.0, -np.inf], np.float32).reshape(1, 3, 1, 1)
    check_trainer_against_torch(_attention, [{"q": q, "k": k, "v": v}], {"mask": mask}, ["q", "k", "v"])


def _batch_statistics_norm(x, weight, bias):
    """nn.BatchNorm2d(track_running_stats=False) in training and in eval: the batch's statistics."""
    return F.batch_norm(x, None, None, weight, bias, True, 0.1, 1e-5)


# x [batch, 2 channels, height, width]; each case's channels alike in variance (the floor follows the smallest)
_BATCH_STATISTICS = {
    "constant": [[[[3.0, 3.0, 3.0]], [[0.0, 0.0, 0.0]]], [[[3.0, 3.0, 3.0]], [[0.0, 0.0, 0.0]]]],
    "tiny": [[[[1e-30, -1e-30, 1e-40]], [[0.0, 2e-30, 0.0]]], [[[0.0, 3e-30, -0.0]], [[-1e-40, 0.0, 1e-30]]]],
    "huge": [[[[1e18, -1e18, 3e18]], [[-2e18, 0.0, 1e18]]], [[[1e19, -1e19, 0.0]], [[1e30, 0.0, -1e18]]]],
    "ordinary": [[[[1.0, -2.0, 0.5]], [[4.0, 0.25, -0.0]]], [[[3.0, 1.0, -1.5]], [[2.0, 7.0, -3.0]]]],
    "inf and NaN": [[[[np.inf, 1.0, 2.0]], [[np.nan, 0.0, 1.0]]], [[[0.0, 1.0, -1.0]], [[1.0, 2.0, 3.0]]]],
    "batch of one": [[[[1.0, 2.0, 4.0], [0.5, -1.0, 3.0]], [[5.0, 5.0, 5.0], [5.0, 5.0, 5.0]]]],
    "beyond FLT_MAX": [[[[2e38, 2e38, -1.0]], [[-2e18, 0.0, 1e18]]], [[[2e38, 1.0, 0.0]], [[3e38, 0.0, -3e38]]]],
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="ONNX Runtime's BatchNormalization accumulates in float32 (docs/stack_facts.md): "
                        "channel 0 sums 6e38, NaN values where torch's are finite (float64 -1.5 and 2.5, float32 0.5); "
                        "channel 1 squares 3e38, weight gradient 0 (float64 -0.433, float32 NaN)")) if case == "beyond FLT_MAX"
                                  else case for case in _BATCH_STATISTICS])  # fmt: skip
def test_batch_norm_without_running_statistics(case, tmp_path):
    """symbolics.layers.batch_norm without running statistics: normalized by the batch's statistics in train_step, in
    eval_step (eval_graph.set_inference_mode keeps it in training mode) and in the model save_as_onnx writes (spelled out);
    variance 0 and 1e-60 (epsilon decides), 1e36 and beyond, inf and NaN (NaN over their channel, as torch's), one
    image of 2x3; the weight and bias's gradients too."""
    x = np.array(_BATCH_STATISTICS[case], np.float32)
    weights = {"weight": np.array([-2.0, 0.5], np.float32), "bias": np.array([0.5, -1.0], np.float32)}
    floor = _normalization_floor(x, (0, 2, 3), upstream_like(x.shape), weights["weight"])
    check_trainer_against_torch(_batch_statistics_norm, [{"x": x}], weights, ["x"], floor=floor, saved_to=tmp_path)


def _pool_input(shape):
    """_with_specials; and in the last row and column, the partial windows': NaN, -inf, and 3e38 twice (a window's sum
    overflows float32, torch's float32 one too)."""
    x = _with_specials(shape)
    x[0, 0, -1, -1], x[0, -1, -1, 0] = np.nan, -np.inf
    x[0, -1, -1, -1], x[0, -1, 0, -1] = 3e38, 3e38
    return x


@pytest.mark.parametrize("shape, kernel, stride, padding, count_include_pad", [
    ((1, 2, 4, 4), 3, 2, 0, True),  # partial last windows
    ((1, 2, 4, 4), 3, 2, 1, True),
    ((1, 2, 4, 4), 3, 2, 1, False),
    ((1, 2, 5, 5), 2, 2, 1, True),  # no window starts in the end padding: 3 windows, not 4
    ((1, 2, 4, 4), 2, 3, 1, True),  # likewise 2, not 3 (ONNX Runtime's kernel makes 3 whatever count_include_pad)
    ((1, 2, 4, 4), 2, 3, 1, False),
    ((1, 2, 4, 4), (5, 2), (4, 3), (2, 1), True),  # a kernel longer than the input, clipped
    ((1, 2, 4, 4), 6, 6, 0, True),  # a window beyond the input: the whole input
    ((2, 2, 1, 1), 2, 2, 0, True),  # one value
    ((2, 2, 1, 1), 3, 2, 1, True),
    ((2, 2, 1, 1), 3, 2, 1, False),
])  # fmt: skip
def test_average_pool_with_ceil_mode(shape, kernel, stride, padding, count_include_pad, tmp_path):
    """rewrites.torch_pools (AvgPool2d(ceil_mode=True)): torch's values in train_step, eval_step and the saved
    model (whose output declares torch's size), and its gradient (each window over what it covers of the input, and
    with count_include_pad of its padding), with NaN, ±inf, huge and tiny values in the partial windows. ONNX Runtime's
    kernel divided a partial window by the whole kernel, and made a window starting in the end padding, which torch
    does not: over 4x4, kernel 2, stride 3, padding 1, its eval_step gave 3x3 values (their mean 2.78 where torch's is
    6.25) and the saved model declared 3x3 outputs."""
    function = lambda x: F.avg_pool2d(x, kernel, stride, padding, ceil_mode=True, count_include_pad=count_include_pad)  # noqa: E731
    check_trainer_against_torch(function, [{"x": _pool_input(shape)}], {}, ["x"], saved_to=tmp_path)


def _split_and_squeeze(parts):
    """A Linear's output split in ``parts``-wide pieces along its last dimension, each squeezed there (squeeze(-1)
    applies to a piece of 1 only). Its input is gated by cosine_similarity(x, x) (1, or 0 for a row of zeros), whose
    size orttrainer's symbolic leaves unknown to the exporter, as BERT's layers leave its hidden states' (the zoo's
    question answering): the exporter then writes each squeeze as an If on the piece's size."""

    def function(x, weight, bias):
        gate = F.cosine_similarity(x, x, dim=-1).unsqueeze(-1)
        first, second = F.linear(x * gate, weight, bias).split(parts, dim=-1)
        first, second = first.squeeze(-1), second.squeeze(-1)
        return (first - 2.0 * second) if first.dim() == second.dim() else first * second.unsqueeze(-1)

    return function


_SEQUENCES = [(1, 1), (3, 5), (1, 5), (3, 1), (2, 1), (1, 1)]  # (batch, length): one trainer takes them in turn


@pytest.mark.parametrize("outputs, parts", [(2, 1), (4, 2), (3, 2)], ids=["squeezed", "kept", "uneven split"])
def test_ifs_decided_by_shape_inference_at_every_batch_shape(outputs, parts, monkeypatch):
    """rewrites.fold_static_sizes: Hugging Face's question-answering split(1, -1) and squeeze(-1) (the If takes its
    squeeze), pieces of 2 (the If keeps them), and an uneven split, 3 into 2 and 1 (refused before: torch's symbolic
    wrote a Split whose pieces' sizes shape inference did not follow; symbolics.indexing.split writes Slices). One trainer takes batches of size 1 and 3 and lengths 1 and 5 in
    turn: each value and gradient is torch's (the inlined branch is the one every batch takes: a piece's size is the
    split's, whatever the batch's). Values are multiples of 1/8, a row of zeros among them; the gate is 1 within an
    ulp, so the weight's gradient, a sum of terms up to ~2 that cancel, carries ~1e-7 of them (torch's float32 too:
    0.04687506 for 0.046875): the floor."""
    function = _split_and_squeeze(parts)
    generator = np.random.default_rng(0)
    weights = {"weight": (generator.integers(-8, 8, (outputs, 4)) / 8).astype(np.float32),
               "bias": np.linspace(-1.0, 1.0, outputs).astype(np.float32)}  # fmt: skip
    batches = [{"x": (generator.integers(-8, 8, (size, length, 4)) / 8).astype(np.float32)} for size, length in _SEQUENCES]
    batches[1]["x"][1, 2] = 0.0
    replaced = []
    fold = rewrites.fold_static_sizes
    monkeypatch.setattr(rewrites, "fold_static_sizes", lambda model, tensors: replaced.extend(fold(model, tensors)))
    check_trainer_against_torch(function, batches, weights, floor=1e-6)
    assert {name for name in replaced if "If" in name} == {"/model/If", "/model/If_1"}, replaced  # in every export


def test_ifs_that_shape_inference_cannot_decide_are_refused_at_every_batch_shape():
    """squeeze(0) of the batch dimension: its If, which a batch of 1 takes one way and others the other, stays and is
    refused by name, whichever batch size comes first."""
    function, weights = (lambda x, weight: F.linear(x, weight).squeeze(0)), {"weight": np.ones((3, 4), np.float32)}
    for first in (1, 3):
        with pytest.raises(graph_errors.GradientBuildError, match=r"If \(node '/model/If'\): control flow"):
            check_trainer_against_torch(function, [{"x": np.ones((first, 5, 4), np.float32)}], weights)


@pytest.mark.parametrize("dims, size", [(1, (3,)), (2, (2, 3)), (2, (3, 1)), (2, (4, 6)), (3, (2, 3, 2))],
                         ids=["1d-3", "2d-2x3", "2d-3x1", "2d-4x6 (overlapping windows)", "3d-2x3x2"])  # fmt: skip
def test_adaptive_average_pool_to_sizes_that_do_not_divide(dims, size):
    """symbolics.layers._adaptive_average_pool (torch's exporter refuses these sizes): each output averages torch's window,
    so an inf or NaN reaches only the windows that hold it, overlapping ones included; FLT_MAX overflows as torch's.
    No huge values of opposite signs: where 1e30 and -1e30 share a window with small ones, what survives their
    cancellation depends on the order of summation (torch's kernel 0.083, ONNX Runtime's 0, float64 833)."""
    spatial = {1: (5,), 2: (5, 4), 3: (3, 5, 3)}[dims]
    edges = [0.0, -0.0, 1e-30, -1e-30, 1e-40, 1.0, 2.5, 1e4, 1e30, float(FLOAT32.max), np.inf, np.nan, -7.0, 1e-3, -np.inf]
    values = np.resize(np.array(edges, np.float32), (1, 2, *spatial))
    function = getattr(F, f"adaptive_avg_pool{dims}d")

    def pooled(x):
        return function(x, size)

    upstream = upstream_like(pooled(torch.tensor(values)).shape)
    model = exported_model(pooled, {"x": values}, upstream, ["x"])
    check_against_torch(model, pooled, {"x": values}, ["x"], upstream)


@pytest.mark.parametrize("case", ["grouped 1-d", "grouped 3-d", "same, dilated", "same, grouped 1-d"])
def test_rewritten_convolutions_at_edge_values(case):
    """rewrites.convolutions.grouped_convolution (a grouped 1-d Conv as 2-d over a unit axis, a 3-d one per group) and
    rewrites.explicit_convolution_pads (auto_pad written out): values and the gradients of input and weight as
    torch's, at 0, -0, tiny, ±inf and NaN. No huge finite values, and positive weights: what survives a
    cancellation inside a window depends on the order of summation (12 float32 spacings of the result apart with
    weights of both signs), which differs between torch's kernels and ONNX Runtime's."""
    edges = [0.0, -0.0, 1e-30, -1e-30, 1e-40, 1.0, -1.0, 2.5, -7.0, np.inf, -np.inf, np.nan, 0.5]
    spatial, function = {
        "grouped 1-d": ((7,), lambda x, w: F.conv1d(x, w, stride=2, padding=1, groups=2)),
        "grouped 3-d": ((3, 4, 3), lambda x, w: F.conv3d(x, w, padding=1, groups=2)),
        "same, dilated": ((5, 6), lambda x, w: F.conv2d(x, w, padding="same", dilation=2)),
        "same, grouped 1-d": ((6,), lambda x, w: F.conv1d(x, w, padding="same", groups=4)),
    }[case]  # fmt: skip
    groups = {"grouped 1-d": 2, "grouped 3-d": 2, "same, dilated": 1, "same, grouped 1-d": 4}[case]
    values = {"x": np.resize(np.array(edges, np.float32), (1, 4, *spatial)),
              "w": np.random.default_rng(0).uniform(0.5, 1.5, (4, 4 // groups, *[2] * len(spatial))).astype(np.float32)}  # fmt: skip
    upstream = upstream_like(function(*(torch.tensor(v) for v in values.values())).shape)
    model = exported_model(function, values, upstream, ["x", "w"])
    check_against_torch(model, function, values, ["x", "w"], upstream)
