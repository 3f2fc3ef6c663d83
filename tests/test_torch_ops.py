"""Small ONNX nodes as torch ops (orttrainer/runtime/torch_ops.py), for the segments a split graph hands to torch whole.

Each op's torch step against ONNX Runtime's kernel for the same node, at edge values (0, -0, tiny,
denormal, huge, FLT_MAX, ±inf, NaN), with broadcasting, size-1 and empty dims: element for element,
but for the sums (ReduceSum, GlobalAveragePool), which may add in another order. Then the planner:
no segment is left that torch could take whole, and a view a torch step hands on reaches a segment
contiguous.
"""

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import zoo
from boundary import edge_values, spread
from onnx import TensorProto, helper

from orttrainer.runtime import session as bound
from orttrainer.runtime import torch_convolutions as split
from orttrainer.runtime import torch_ops

EDGES = edge_values(3.0, -2.5, 0.5)  # 20 values
INTEGERS = np.array([-7, -1, 0, 1, 7, 2**40 + 1], np.int64)
BOOLS = np.array([False, True])


def _column(values):
    return np.asarray(values).reshape(-1, 1)


def _row(values):
    return np.asarray(values).reshape(1, -1)


class Case:
    def __init__(self, op_type, inputs: dict, attributes=None, domain="", sums=False, ident=""):
        self.op_type, self.inputs, self.attributes, self.domain, self.sums = op_type, inputs, attributes or {}, domain, sums
        self.id = f"{op_type}{'-' + ident if ident else ''}"

    def node(self):
        names = [name if value is not None else "" for name, value in self.inputs.items()]
        return helper.make_node(self.op_type, names, ["y"], name=self.op_type, domain=self.domain, **self.attributes)


def _case(op_type, ident="", domain="", sums=False, attributes=None, **inputs):
    return Case(op_type, inputs, attributes, domain, sums, ident)


CASES = [
    *[_case(op, a=_column(EDGES), b=_row(EDGES)) for op in ("Add", "Sub", "Mul", "Div")],
    *[_case(op, ident="int64", a=_column(INTEGERS), b=_row(INTEGERS)) for op in ("Add", "Sub", "Mul")],
    _case("Div", ident="int64", a=_column(INTEGERS), b=_row([2, -2, 3, -7, 1])),
    _case("Neg", x=EDGES),
    _case("Relu", x=EDGES),
    *[_case(op, a=_column(EDGES), b=_row(EDGES)) for op in ("Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Equal")],
    *[_case(op, a=_column(BOOLS), b=_row(BOOLS)) for op in ("And", "Or")],
    _case("Not", x=BOOLS),
    _case("Where", cond=_column(EDGES > 0), a=_row(EDGES), b=np.float32(7.0)),
    _case("Clip", x=EDGES, low=np.float32(-3.0), high=np.float32(3.0)),
    _case("Clip", ident="crossed-bounds", x=EDGES, low=np.float32(2.0), high=np.float32(-2.0)),
    _case("Clip", ident="low-only", x=EDGES, low=np.float32(1.0)),
    _case("Clip", ident="high-only", x=EDGES, low=None, high=np.float32(1.0)),
    _case("Clip", ident="no-bounds", x=EDGES),
    _case("Cast", ident="bool", attributes={"to": TensorProto.FLOAT}, x=BOOLS),
    _case("Cast", ident="double", attributes={"to": TensorProto.FLOAT},
          x=np.array([1e39, -1e39, 1e-46, 1 + 2.0**-24, 1 + 3 * 2.0**-24, np.nan, -0.0])),
    _case("Cast", ident="int64", attributes={"to": TensorProto.FLOAT}, x=np.array([2**24 + 1, 2**24 + 3, -(2**53) - 1])),
    _case("Cast", ident="to-double", attributes={"to": TensorProto.DOUBLE}, x=EDGES),
    *[_case("Cast", ident=f"float-to-{name}", attributes={"to": to}, x=np.append(EDGES, [1e20, -2.7, 2.7, 3e9, -3e9]))
      for name, to in (("int64", TensorProto.INT64), ("int32", TensorProto.INT32), ("bool", TensorProto.BOOL))],
    _case("Cast", ident="int32-to-int64", attributes={"to": TensorProto.INT64}, x=INTEGERS[:-1].astype(np.int32)),
    _case("Size", x=np.zeros((2, 0, 3), np.float32)),
    _case("Size", ident="scalar", x=np.float32(1.0)),
    _case("Shape", x=np.zeros((2, 1, 0, 3), np.float32)),
    _case("Shape", ident="start-end", attributes={"start": -3, "end": -1}, x=np.zeros((2, 1, 0, 3), np.float32)),
    _case("Shape", ident="clamped", attributes={"start": 1, "end": 9}, x=np.zeros((2, 1, 3), np.float32)),
    _case("Reshape", x=EDGES.reshape(2, 1, -1), shape=np.array([0, -1], np.int64)),
    _case("Reshape", ident="allowzero", attributes={"allowzero": 1}, x=np.zeros((2, 0, 3), np.float32),
          shape=np.array([0, 3, 5], np.int64)),
    _case("Expand", x=_column(EDGES[:4]), shape=np.array([2, 1, 3], np.int64)),
    _case("Expand", ident="shorter-shape", x=_column(EDGES[:4]) * np.ones((1, 3), np.float32), shape=np.array([3], np.int64)),
    _case("Expand", ident="empty", x=np.ones((1, 3), np.float32), shape=np.array([0, 1], np.int64)),
    _case("ReduceSum", sums=True, x=np.stack([EDGES, EDGES[np.isfinite(EDGES)][:20].repeat(2)[:20], spread(1e-3, 10, 10)]),
          axes=np.array([1], np.int64)),
    _case("ReduceSum", ident="keepdims-0-negative-axis", sums=True, attributes={"keepdims": 0},
          x=np.stack([EDGES, np.ones_like(EDGES)]), axes=np.array([-2], np.int64)),
    _case("ReduceSum", ident="empty-axes-noop", attributes={"noop_with_empty_axes": 1}, x=_column(EDGES),
          axes=np.array([], np.int64)),
    _case("ReduceSum", ident="empty-axes-all", sums=True, x=np.arange(12, dtype=np.float32).reshape(3, 4),
          axes=np.array([], np.int64)),
    _case("ReduceSum", ident="no-axes", sums=True, x=np.arange(12, dtype=np.float32).reshape(3, 4)),
    _case("ReduceSum", ident="empty-dim", sums=True, x=np.zeros((2, 0, 3), np.float32), axes=np.array([1], np.int64)),
    _case("Unsqueeze", x=np.zeros((2, 0, 3), np.float32), axes=np.array([-1, 0, 3], np.int64)),
    _case("Unsqueeze", ident="scalar", x=np.float32(2.0), axes=np.array([0], np.int64)),
    _case("Squeeze", x=EDGES.reshape(1, 2, 1, 10, 1), axes=np.array([-1, 0], np.int64)),
    _case("Squeeze", ident="every-size-1", x=np.zeros((1, 0, 1), np.float32)),
    _case("GlobalAveragePool", sums=True, x=np.concatenate([EDGES.reshape(1, 2, 2, 5), np.full((1, 2, 2, 5), 3.0, np.float32)])),
    _case("GlobalAveragePool", ident="1x1", sums=True, x=EDGES.reshape(2, -1, 1, 1)),
    _case("GlobalAveragePool", ident="3d", sums=True, x=np.linspace(-4, 4, 48, dtype=np.float32).reshape(2, 3, 2, 2, 2)),
    _case("Scale", domain="com.microsoft", attributes={"scale_down": 1}, x=np.append(EDGES, 7.0).astype(np.float32),
          scale=np.int64(3)),
    _case("Scale", ident="double-up", domain="com.microsoft", x=np.array([7.0, 1e-300, np.inf]), scale=np.float64(3.0)),
    _case("Transpose", attributes={"perm": [2, 0, 1]}, x=EDGES.reshape(2, 5, 2)),
    _case("Transpose", ident="reversed", x=EDGES.reshape(1, 4, 5)),
    _case("Concat", attributes={"axis": -1}, a=EDGES.reshape(2, 10), b=np.zeros((2, 0), np.float32), c=np.ones((2, 3), np.float32)),
    _case("Sum", a=_column(EDGES), b=_row(EDGES), c=np.float32(1.0)),
    _case("Sum", ident="growing", a=np.float32(1.0), b=_column(EDGES), c=_row(EDGES), d=np.ones((2, 1, 1), np.float32)),
    _case("Identity", x=EDGES),
]
SHAPE_PAIRS = [([2, 3, 5], [3, 1]), ([2, 1, 5], [3, 1]), ([1, 1], [1]), ([32, 16, 1, 1], [32, 16, 1, 1]),
               ([32, 16, 4, 4], [32, 16, 1, 1]), ([1], [2, 3]), ([], [2, 3]), ([2, 0, 3], [1, 3]), ([1, 1, 3], [1, 3])]  # fmt: skip


def _onnx_runtime(node, inputs: dict, outputs, opset=17):
    given = {name: value for name, value in inputs.items() if value is not None}
    graph = helper.make_graph(
        [node], "one-node",
        [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype), None)
         for name, value in given.items()],
        [helper.make_empty_tensor_value_info(name) for name in outputs],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    run = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return run.run(None, {name: np.asarray(value) for name, value in given.items()})


def _torch_step(node, inputs: dict):
    assert torch_ops.runs_on_torch(node)
    values = {name: torch.from_numpy(np.array(value)) for name, value in inputs.items() if value is not None}
    return torch_ops.step(node).run(values)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_each_op_computes_what_onnx_runtime_computes(case):
    (expected,) = _onnx_runtime(case.node(), case.inputs, ["y"])
    actual = _torch_step(case.node(), case.inputs)["y"].numpy()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    if not case.sums:
        assert np.array_equal(actual, expected, equal_nan=True), (actual, expected)
        return
    # a sum in another order: the same infinities and NaNs, finite values within rounding of the magnitudes added
    x = case.inputs["x"]
    magnitudes = _torch_step(case.node(), {**case.inputs, "x": np.abs(np.where(np.isfinite(x), x, 0)).astype(np.float64)})
    with np.errstate(invalid="ignore"):  # inf - inf
        close = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
        close |= np.abs(actual - expected) <= 1e-6 * magnitudes["y"].numpy() + 1e-30
    assert close.all(), (actual, expected)


@pytest.mark.parametrize("a, b", SHAPE_PAIRS, ids=[f"{a}-{b}" for a, b in SHAPE_PAIRS])
def test_broadcast_gradient_args_lists_the_axes_onnx_runtime_lists(a, b):
    node = helper.make_node("BroadcastGradientArgs", ["a", "b"], ["a_axes", "b_axes"], name="args", domain="com.microsoft")
    inputs = {"a": np.array(a, np.int64), "b": np.array(b, np.int64)}
    expected = _onnx_runtime(node, inputs, ["a_axes", "b_axes"])
    actual = _torch_step(node, inputs)
    assert [actual["a_axes"].tolist(), actual["b_axes"].tolist()] == [axes.tolist() for axes in expected]


SPLITS = [
    ("Split", "", {"axis": 1}, {"x": EDGES.reshape(2, 10), "split": np.array([3, 0, 7], np.int64)}, 3),
    ("Split", "", {"axis": 0}, {"x": EDGES.reshape(4, 5)}, 2),
    ("Split", "", {"axis": 0, "num_outputs": 3}, {"x": EDGES}, 3),  # opset 18: parts of 7, 7, 6
    ("SplitTraining", "com.microsoft", {"axis": 0}, {"x": EDGES.reshape(10, 2), "split": np.array([2, 5, 3], np.int64)}, 3),
    ("ConcatTraining", "com.microsoft", {"axis": 0}, {"a": EDGES.reshape(10, 2), "b": np.ones((1, 2), np.float32)}, 2),
]


@pytest.mark.parametrize("op_type, domain, attributes, inputs, outputs", SPLITS, ids=[f"{case[0]}-{index}" for index, case in enumerate(SPLITS)])
def test_several_outputs_are_what_onnx_runtime_writes(op_type, domain, attributes, inputs, outputs):
    names = [f"y{index}" for index in range(outputs)]
    node = helper.make_node(op_type, list(inputs), names, name=op_type, domain=domain, **attributes)
    expected = _onnx_runtime(node, inputs, names, opset=18 if "num_outputs" in attributes else 17)
    actual = _torch_step(node, inputs)
    for name, value in zip(names, expected):
        assert actual[name].shape == value.shape and np.array_equal(actual[name].numpy(), value, equal_nan=True), name


def test_shapes_that_do_not_broadcast_name_the_node():
    node = helper.make_node("BroadcastGradientArgs", ["a", "b"], ["a_axes", "b_axes"], name="Mul_Grad/args", domain="com.microsoft")
    with pytest.raises(ValueError, match=r"'Mul_Grad/args': shapes \[2, 3\] and \[4, 3\] do not broadcast"):
        _torch_step(node, {"a": np.array([2, 3], np.int64), "b": np.array([4, 3], np.int64)})


def test_squeezing_an_axis_of_another_size_names_the_node():
    node = helper.make_node("Squeeze", ["x", "axes"], ["y"], name="head/Squeeze")
    with pytest.raises(ValueError, match=r"'head/Squeeze': axes \[1\] of shape \[1, 3\] are not all of size 1"):
        _torch_step(node, {"x": np.zeros((1, 3), np.float32), "axes": np.array([1], np.int64)})


def test_every_op_has_a_case_and_forms_that_differ_stay_with_onnx_runtime():
    tested = {case.op_type for case in CASES} | {"BroadcastGradientArgs"} | {case[0] for case in SPLITS}
    assert tested == set(torch_ops._FUNCTIONS) | set(torch_ops._STEPS) | set(torch_ops._MICROSOFT_STEPS)
    assert not torch_ops.runs_on_torch(helper.make_node("Cast", ["x"], ["y"], to=TensorProto.UINT8))
    assert not torch_ops.runs_on_torch(helper.make_node("Clip", ["x"], ["y"], min=-1.0, max=1.0))  # opset 6
    assert not torch_ops.runs_on_torch(helper.make_node("Relu", ["x"], ["y"], domain="custom"))
    assert not torch_ops.runs_on_torch(helper.make_node("Softmax", ["x"], ["y"]))


def test_squeeze_excitation_segments_go_to_torch_whole_and_no_all_small_segment_is_left():
    torch.manual_seed(0)
    from parity import cpu_options

    from orttrainer import ORTTrainer, optim

    trainer = ORTTrainer(zoo.MobileNetV3(), None, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy,
                         options=cpu_options({"utils": {"convolution_kernels": "torch"}}))  # fmt: skip
    trainer.train_step(*zoo.image_batch(4, generator=torch.Generator().manual_seed(0)))
    session = trainer._train_session
    nodes = session._model.graph.node
    pools = [node.name for node in nodes if "/excite/" in node.name
             and node.op_type in ("GlobalAveragePool", "Scale", "Expand", "BroadcastGradientArgs", "Relu")]  # fmt: skip
    assert pools and set(pools) <= session.on_torch
    for step in session._steps:
        if isinstance(step, split._Segment):
            assert not all(map(torch_ops.runs_on_torch, step.nodes)), [node.op_type for node in step.nodes]


def test_a_view_a_torch_step_hands_on_reaches_a_segment_contiguous():
    """conv -> Expand (a stride-0 view, on torch between two convolutions) -> conv, and the segment after reads the view."""
    conv = dict(kernel_shape=[1, 1])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", **conv),
             helper.make_node("Expand", ["c", "shape"], ["e"], name="expand"),
             helper.make_node("Conv", ["e", "w"], ["d"], name="conv2", **conv),
             helper.make_node("Softmax", ["d"], ["s"], name="softmax"),
             helper.make_node("Add", ["s", "e"], ["y"], name="add")]  # fmt: skip
    shape = onnx.numpy_helper.from_array(np.array([1, 2, 3, 5], np.int64), "shape")
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("x", "w")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    def open_session(segment, all_threads=True):
        return bound.TorchBoundSession(segment, torch.device("cpu"), [("CPUExecutionProvider", {})],
                                       bound.session_options(threads=1))  # fmt: skip

    session = split.SplitSession(onnx.ModelProto.FromString(model.SerializeToString()), open_session)
    assert "expand" in session.on_torch and "softmax" not in session.on_torch
    x, w = torch.randn(1, 2, 1, 5), torch.randn(2, 2, 1, 1)
    session.bind_input("x", x)
    session.bind_input("w", w)
    session.allocate_outputs(["y"])
    (y,) = session.run()
    expanded = torch.conv2d(x, w).expand(1, 2, 3, 5)
    torch.testing.assert_close(y, torch.softmax(torch.conv2d(expanded, w), -1) + expanded)
